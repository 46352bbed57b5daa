"""What a process makes in a shared place and removes itself before it ends: a ctx rank's pool files in
/dev/shm (kvlab.transports.ipc), the launcher's scratch directory for its ranks (kvlab.cli.launch).

A process that is killed (SIGKILL, the OOM killer) removes nothing, so each such entry is held: its maker
keeps an flock on it for as long as it lives, and the kernel drops the lock with the process however it
ends. An entry that no process holds was left by one that died, and the next run's ``sweep`` removes it.
An entry appears under its own name already locked (made under a hidden name, locked, then renamed), so a
sweep never takes a live one for left; a hidden name counts as left only once it is ``HIDDEN_GRACE_S`` old.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator

HIDDEN_GRACE_S = 60.0


def create_locked(path: str, nbytes: int) -> int:
    """A new file of ``nbytes`` at ``path``, held by this process for as long as it keeps the returned
    descriptor open."""
    hidden = _hidden(path)
    fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, nbytes)
    os.rename(hidden, path)
    return fd


def make_held_dir(directory: str, prefix: str) -> tuple[str, int]:
    """A new directory ``prefix<unique>`` in ``directory`` (mode 0700, as ``tempfile.mkdtemp``'s), held by this
    process for as long as it keeps the returned descriptor open; (its path, that descriptor)."""
    path = os.path.join(directory, f"{prefix}{uuid.uuid4().hex[:12]}")
    hidden = _hidden(path)
    os.mkdir(hidden, 0o700)
    fd = os.open(hidden, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(hidden, path)
    except OSError:
        os.close(fd)
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    return path, fd


def unheld(directory: str, prefix: str, grace_s: float = HIDDEN_GRACE_S) -> list[str]:
    """The names of the entries of ``directory`` named ``prefix...`` (or hidden, ``.prefix...``, once ``grace_s``
    old) that no process holds: what a process that died left there. Removes nothing."""
    return [name for name, _ in _left(directory, prefix, grace_s)]


def sweep(directory: str, prefix: str) -> list[str]:
    """Remove the entries ``unheld`` names; returns their names."""
    gone = []
    for name, path in _left(directory, prefix, HIDDEN_GRACE_S):
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            gone.append(name)
        except OSError:
            pass
    return gone


def _left(directory: str, prefix: str, grace_s: float) -> Iterator[tuple[str, str]]:
    """(name, path) of each entry no process holds, locked by this process until the caller asks for the next: no
    other sweep takes it meanwhile."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.lstrip(".").startswith(prefix))
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if name.startswith(".") and time.time() - os.fstat(fd).st_mtime < grace_s:
                continue  # being made: its maker locks and renames it next
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # held: its maker lives
            yield name, path
        finally:
            os.close(fd)


def _hidden(path: str) -> str:
    return os.path.join(os.path.dirname(path), "." + os.path.basename(path))
