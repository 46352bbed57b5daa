"""Where the repository's top-level ``conf/``, ``kernels/`` and ``traces/`` are, found through the package.

``kvlab/_data`` holds a symlink to each top-level directory, so the same path serves a checkout (editable install)
and a wheel, which carries the files themselves under ``kvlab/_data`` (``[tool.setuptools.package-data]``)."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def shipped(name: str) -> Path:
    inside = _PACKAGE / "_data" / name
    # resolved so that a checkout names conf/ itself; a checkout made without symlinks (git's core.symlinks=false)
    # has a small file there instead of the directory
    return inside.resolve() if inside.is_dir() else _PACKAGE.parent / name


CONF_DIR = shipped("conf")
KERNELS_DIR = shipped("kernels")
TRACES_DIR = shipped("traces")
