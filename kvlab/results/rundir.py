"""One run per run directory: a lock taken before anything is written there.

The lock is ``<run_dir>/run.lock``, held with ``flock`` by the process that owns the run (the
``kvlab`` parent, or rank 0 under torchrun) and holding that process's pid, host and the
time it was taken. ``flock`` goes away with its process however it ends, so a lock file left by a run that
died is taken over (and said so on stderr); a live holder is refused with one line naming
``hydra.run.dir``. Workers never read a file another run could replace: the parent hands them
its resolved config in the environment (``CONFIG_ENV``).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from kvlab.core.errors import ConfigError
from kvlab.core.paths import NO_ROOM, room_fix, unwritable

LOCK_NAME = "run.lock"
# what a command writes into its directory before its own results: Hydra's record of the job (.hydra/, the log:
# about 8 KiB), the lock and config.yaml; with less free, Hydra's own write failed with its 10-line error
START_BYTES = 64 << 10
CONFIG_ENV = "KVLAB_CONFIG_YAML"  # the resolved config of this run, handed to its workers
_held: dict[Path, int] = {}  # run dir -> fd of its lock, in this process (re-entrant)


NAME_MAX, PATH_MAX = 255, 4096  # bytes of one name and of a whole path, as Linux takes them


def shown(path) -> str:
    """A path as a line shows it: a very long one cut, its length said."""
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}...({len(text)} characters)"


def check_name_length(path: Path, field: str) -> None:
    """ConfigError naming ``field`` for a path no system call takes (checked before any is made: on such a
    path even asking whether it exists raises)."""
    longest = max((len(part.encode()) for part in Path(path).parts), default=0)
    if longest > NAME_MAX:
        raise ConfigError(field, shown(path), f"has a {longest}-byte name; a file or directory name is at most "
                          f"{NAME_MAX} bytes, use a shorter one")
    if len(str(Path(path).absolute()).encode()) > PATH_MAX:
        raise ConfigError(field, shown(path), f"is longer than {PATH_MAX} bytes as an absolute path; use a shorter "
                          "path")


def ensure_writable(run_dir: Path, field: str = "hydra.run.dir") -> Path:
    """Create ``run_dir`` (and parents) and prove a file can be written there; ConfigError otherwise."""
    run_dir = Path(run_dir)
    if str(run_dir).strip() == "":
        raise ConfigError(field, "''", "an empty path; give a directory, e.g. hydra.run.dir=outputs/my_run")
    check_name_length(run_dir, field)
    why = unwritable(run_dir)
    if why:
        raise ConfigError(field, run_dir, f"cannot create or write the run directory ({why}); "
                          f"{room_fix(field) if why in NO_ROOM else 'use a writable directory path'}")
    free = shutil.disk_usage(run_dir).free
    if free < START_BYTES:
        raise ConfigError(field, run_dir, f"has {free:,} bytes free on its file system, fewer than the "
                          f"{START_BYTES:,} a command needs there to start; {room_fix(field)}")
    return run_dir


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}


def acquire(run_dir: Path, field: str = "hydra.run.dir") -> None:
    """Take the run directory's lock for this process (a no-op if it already holds it)."""
    run_dir = ensure_writable(run_dir, field).resolve()
    if run_dir in _held:
        return
    path = run_dir / LOCK_NAME
    for _ in range(20):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            h = _holder(fd)
            os.close(fd)
            since = time.strftime("%H:%M:%S", time.localtime(h["time"])) if "time" in h else "?"
            raise ConfigError(field, run_dir, f"another run (pid {h.get('pid', '?')} on {h.get('host', '?')}, "
                              f"since {since}) is using this directory; wait for it or give another "
                              "hydra.run.dir") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the previous holder removed the file between our open and our lock: retry
            os.close(fd)
            continue
        old = _holder(fd)
        if old.get("pid"):
            print(f"kvlab: {run_dir / LOCK_NAME} was left by run pid {old['pid']} on {old.get('host', '?')}, "
                  "which is no longer running; taking it over", file=sys.stderr)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(me).encode())
            os.fsync(fd)
        except OSError as e:  # the file system filled up since the probe: no empty lock left behind
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            why = e.strerror or type(e).__name__
            raise ConfigError(field, run_dir, f"cannot write its lock file {LOCK_NAME} ({why}); "
                              f"{room_fix(field) if why in NO_ROOM else 'use a writable directory path'}") from None
        _held[run_dir] = fd
        return
    raise ConfigError(field, run_dir, "its lock file keeps changing hands; give another hydra.run.dir")


def release(run_dir: Path) -> None:
    run_dir = Path(run_dir).resolve()
    fd = _held.pop(run_dir, None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.unlink(run_dir / LOCK_NAME)  # under our lock: whoever opened it meanwhile retries on a new file
    os.close(fd)


@contextlib.contextmanager
def hold(run_dir: Path, field: str = "hydra.run.dir"):
    """The lock for the duration of a block; re-entrant: an inner hold of a held directory does nothing."""
    run_dir = Path(run_dir)
    mine = run_dir.resolve() not in _held if run_dir.exists() else True
    acquire(run_dir, field)
    try:
        yield run_dir
    finally:
        if mine:
            release(run_dir)


def sweep_dir(run_dir: Path) -> Path | None:
    """The sweep directory a job's run directory lies in (Hydra writes its ``multirun.yaml`` there before the
    first job), or None for a run of its own."""
    parent = Path(run_dir).resolve().parent
    return parent if (parent / "multirun.yaml").exists() else None


def say_once(run_dir: Path, key: str, line: str) -> bool:
    """Print ``kvlab: line`` on stderr, once per sweep (every job of a sweep would say the same: the first one
    that gets here does, marked by a file under the sweep directory), always for a run of its own. Returns
    whether it printed."""
    sweep = sweep_dir(run_dir)
    if sweep is not None:
        marks = sweep / ".said"
        try:
            marks.mkdir(exist_ok=True)
            os.close(os.open(marks / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        except OSError:  # a sweep directory that takes no marks: say it, as a run of its own would
            pass
    print(f"kvlab: {line}", file=sys.stderr, flush=True)
    return True
