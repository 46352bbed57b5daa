"""Where the repository's top-level ``conf/``, ``kernels/`` and ``traces/`` are, found through the package.

``kvlab/_data`` holds a symlink to each top-level directory, so the same path serves a checkout (editable install)
and a wheel, which carries the files themselves under ``kvlab/_data`` (``[tool.setuptools.package-data]``)."""
from __future__ import annotations

import contextlib
import errno
import os
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
    base = os.environ.get(USER_CONF_ENV) or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvlab"
KERNELS_DIR = shipped("kernels")
TRACES_DIR = shipped("traces")


def provenance() -> dict:
    """What a published figure needs beside it: the commit of the checkout kvlab runs from (with ``+dirty`` when
    it has uncommitted changes; None from a wheel), the host, its load average when the run ended, and the
    versions of what moved the bytes."""
    import importlib.metadata
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


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the file system is full, or the user's quota on it is spent
NO_ROOM = frozenset(os.strerror(code) for code in _NO_ROOM)  # unwritable's reasons for them


def room_fix(field: str) -> str:
    """What would work where a place kvlab writes has no room left."""
    return f"free some space on its file system, or give a directory elsewhere: {field}=DIR"


def unwritable(directory: Path) -> str | None:
    """Why no file can be created in ``directory`` (made with its parents first), or None where one can: the one
    probe behind every place kvlab writes (run directories, caches), so each names itself when it fails. A full
    file system gives one of ``NO_ROOM``."""
    directory = Path(directory)
    probe = directory / f".write_probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"\0")  # one byte: an empty file takes no block, so a full file system still makes one
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        if isinstance(e, (FileExistsError, NotADirectoryError)) or (directory.exists() and not directory.is_dir()):
            return "a file is in the way"
        return e.strerror or type(e).__name__
    return None


def write_whole(path: Path, data: str | bytes, field: str = "hydra.run.dir", root: Path | None = None) -> None:
    """Write ``path`` whole or not at all: a temporary file of this process's own beside it, renamed over it, so
    that a reader, an interrupted run or a full disk never leaves half a file (a summary cut mid-figure), and
    processes writing the same file at once (gen ranks keeping one reference) each rename a whole one. A file
    system without room is a ConfigError naming ``field`` as the directory ``root`` it sets (``path``'s own by
    default) and the file (one line, exit 2), the file as it was before (or none) left in place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # hidden: no reader's glob (parts/rank*.json) takes it
    try:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _refuse(e, path, field, root)


def append_line(path: Path, line: str, field: str = "hydra.run.dir", root: Path | None = None) -> None:
    """Add one whole line to ``path`` (created if missing), on disk when this returns: what a run measured stays
    there if it is interrupted later (``kvlab link``'s sizes). A line the file system had no room for is taken
    back, so that a reader never meets half of one; the error is ``write_whole``'s."""
    path = Path(path)
    data = (line if line.endswith("\n") else line + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
        _refuse(e, path, field, root)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:  # a short write only where the file system ran out: the next one says why
                view = view[os.write(fd, view):]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            _refuse(e, path, field, root)
    finally:
        os.close(fd)


def _refuse(e: OSError, path: Path, field: str, root: Path | None):
    """``e``, met writing ``path``, as the one line saying what would work, where one does; else ``e`` itself."""
    from kvlab.core.errors import ConfigError

    root = path.parent if root is None else Path(root)
    name = path.relative_to(root) if path.is_relative_to(root) else path.name
    if e.errno in _NO_ROOM:
        raise ConfigError(field, root, f"no room to write {name} ({e.strerror}); {room_fix(field)}") from None
    if e.errno == errno.EFBIG:  # Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE fails instead of killing
        raise ConfigError(field, root, f"cannot write {name} ({e.strerror}): it is larger than this process's "
                          "file-size limit; raise the limit (ulimit -f unlimited)") from None
    raise e
