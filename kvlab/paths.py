"""Where the repository's top-level ``conf/``, ``kernels/`` and ``traces/`` are: next to the package in a
checkout (editable install), under ``share/kvlab`` of the environment when installed from a wheel."""
from __future__ import annotations

import sys
from pathlib import Path


def shipped(name: str) -> Path:
    here = Path(__file__).resolve().parent.parent / name
    return here if here.is_dir() else Path(sys.prefix) / "share" / "kvlab" / name


CONF_DIR = shipped("conf")
KERNELS_DIR = shipped("kernels")
TRACES_DIR = shipped("traces")
