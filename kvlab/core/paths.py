"""Where the repository's top-level ``conf/``, ``kernels/`` and ``traces/`` are, found through the package.

``kvlab/_data`` holds a symlink to each top-level directory, so the same path serves a checkout (editable install)
and a wheel, which carries the files themselves under ``kvlab/_data`` (``[tool.setuptools.package-data]``)."""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # kvlab/, above kvlab/core/


def shipped(name: str) -> Path:
    inside = _PACKAGE / "_data" / name
    # resolved so that a checkout names conf/ itself; a checkout made without symlinks (git's core.symlinks=false)
    # has a small file there instead of the directory
    return inside.resolve() if inside.is_dir() else _PACKAGE.parent / name


CONF_DIR = shipped("conf")
# a user's own group files (cost profiles ``kvlab sim calibrate`` fits: cost/NAME.yaml), found by conf/config.yaml's
# and conf/sim.yaml's hydra.searchpath; never the package's conf/, which a wheel keeps in site-packages
USER_CONF_ENV = "XDG_CONFIG_HOME"


def user_conf_dir() -> Path:
    """``$XDG_CONFIG_HOME/kvlab`` (``~/.config/kvlab`` without it), as the configs' ``hydra.searchpath`` names it."""
    import os

    base = os.environ.get(USER_CONF_ENV) or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvlab"
KERNELS_DIR = shipped("kernels")
TRACES_DIR = shipped("traces")


def provenance() -> dict:
    """What a published figure needs beside it: the commit of the checkout kvlab runs from (with ``+dirty`` when
    it has uncommitted changes; None from a wheel), the host, its load average when the run ended, and the
    versions of what moved the bytes."""
    import importlib.metadata
    import os
    import platform
    import socket
    import subprocess

    commit = None
    if (_PACKAGE.parent / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(_PACKAGE.parent), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, timeout=5)
            dirty = subprocess.run(["git", "-C", str(_PACKAGE.parent), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5)
            if head.returncode == 0:
                commit = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
        except (OSError, subprocess.SubprocessError):  # no git here: the commit is unknown, not an error
            pass
    versions = {"python": platform.python_version()}
    for dist in ("kvlab", "torch", "nixl-cu13", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13",
                 "transformers", "cuda-core"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"commit": commit, "host": socket.gethostname(), "load_avg": list(os.getloadavg()), "versions": versions}


def unwritable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (made with its parents first), or None where one can: the one
    probe behind every place kvlab writes (run directories, caches), so each names itself when it fails."""
    import os

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if isinstance(e, (FileExistsError, NotADirectoryError)) or (directory.exists() and not directory.is_dir()):
            return "a file is in the way"
        return e.strerror or type(e).__name__
    return None
