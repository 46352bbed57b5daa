"""Output streams that may be gone: ``kvlab run >&-``, ``> /dev/full``, a pipe whose reader left.

What kvlab prints is a copy of what it writes to the run directory, so a stream that cannot take it does not
fail a run that verified: ``guard()`` (first thing in every process) puts /dev/null behind a closed stdout or
stderr, so that no file the process opens later takes its number and receives its prints, and wraps both
streams so that a write or flush that fails is dropped instead of raising from the last table or the
interpreter's final flush (tracebacks from each rank, and exit code 1 for a verified run).
"""
from __future__ import annotations

import os
import sys


class Guarded:
    """A text stream whose failed writes are dropped (and counted), everything else the stream's own."""

    def __init__(self, stream):
        self._stream, self.dropped = stream, 0

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):  # ENOSPC, EPIPE, EBADF, or the stream closed under it
            self.dropped += 1
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self.dropped += 1

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _reopen_closed(fd: int) -> None:
    try:
        os.fstat(fd)
    except OSError:  # closed by the shell: /dev/null takes its number, so no later file does
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)


def guard() -> None:
    """Make stdout and stderr safe to write for the rest of this process (idempotent)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        _reopen_closed(fd)
        stream = getattr(sys, name)
        if stream is None:  # Python found the descriptor closed at start-up
            stream = open(fd, "w", closefd=False, buffering=1)
        if not isinstance(stream, Guarded):
            setattr(sys, name, Guarded(stream))
