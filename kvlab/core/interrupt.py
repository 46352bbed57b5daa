"""Ctrl-C and SIGTERM as a way to end a run, not a crash: one line on stderr, exit code 128 + signal.

The ``kvlab`` parent turns either signal into ``Interrupted`` while it composes and checks
(nothing to clean up yet), in ``as_exit`` blocks under one ``outermost`` (a signal that slips out of a block
as it is left is still its line); while ranks run, the launcher (kvlab.cli.launch) takes the signals
over, stops the ranks and merges what they wrote. A rank turns its first signal into
``kvlab.rank.executor.Stopped`` (kvlab.rank.runner) and ignores later ones, so that writing its part
file is not cut short; before it has set that up, a signal just ends it (``quiet_until_ready``).
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
PR_SET_PDEATHSIG = 1
_starting = None  # quiet_until_ready's AtOnce, until ready()


class Interrupted(BaseException):
    """A signal asked the parent to stop; BaseException, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def code(self) -> int:
        return 128 + self.signum


def ignore(signum, frame) -> None:
    """Instead of SIG_IGN once a signal is being handled: Python raises "ignored due to race condition"
    for a signal that arrived meanwhile when its handler has become SIG_IGN."""


def name(signum: int) -> str:
    return signal.Signals(signum).name


_pending: list[int] = []  # signals as_exit's handler took, kept in case what it raised was swallowed
_process_ends = [False]  # set by ends_with_command


def ends_with_command() -> None:
    """This process ends when its command does (kvlab's own command line, not a caller's ``main([...])``
    in-process): the command's last ``as_exit`` block may leave the signals ignored behind it."""
    _process_ends[0] = True


def _raise_it(signum, frame):
    for s in SIGNALS:
        signal.signal(s, ignore)  # one is enough
    _pending.append(signum)
    _taken_in[:] = [b.what for b in _open[-1:]] or [""]
    raise Interrupted(signum)


def _say(signum: int, what: str | Callable[[], str]) -> None:
    said = what() if callable(what) else what
    print(f"kvlab: interrupted by {name(signum)}{' ' + said if said else ''}", file=sys.stderr)


_open: list[as_exit] = []  # each as_exit block entered and not yet left, outermost first
_taken_in: list[str | Callable[[], str]] = []  # the ``what`` of the innermost open block when the signal came


class as_exit:
    """Within the block, SIGINT/SIGTERM end the process with one line and exit code 128 + signal.

    ``what`` says what was kept, and where, at the moment of the signal (a callable is asked then).
    The handler raises where the main thread happens to be, which may be inside a library's import
    that catches it (torch imports numpy under ``try``) or fails differently for it (a C extension half
    loaded): a signal that came is remembered, and the block ends as interrupted however it ends,
    at the latest at ``check_pending`` (the launcher's, before any rank starts) or at its own end.

    A class and not a generator: a signal whose handler runs at the first instruction of ``__exit__`` raises
    before ``__exit__`` can take it, out of the ``with`` statement. A generator's block then stayed suspended,
    and closing it at teardown printed the line after the traceback and an "Exception ignored" one. Such an
    ``Interrupted`` reaches ``outermost``, which says this block's line and puts back the handlers the
    outermost block left so found.

    ``last``: the command's last step. Once it has ended, however it ended, a signal can change nothing the
    command wrote, and in a process that ends with the command the signals are then ignored: Python's
    teardown (a quarter of a second with torch loaded) puts their default action back, and a Ctrl-C there
    ended a command that had done its work with exit 130 and not a word (or a KeyboardInterrupt traceback
    from releasing the run directory)."""

    def __init__(self, what: str | Callable[[], str] = "", last: bool = False):
        self.what = what
        self.last = last
        self.previous: dict = {}
        self.depth = 0

    def __enter__(self) -> as_exit:
        _pending.clear()
        _taken_in.clear()
        self.depth = len(_open)
        _open.append(self)
        self.previous = {s: signal.signal(s, _raise_it) for s in SIGNALS}
        return self

    def __exit__(self, typ, value, tb) -> bool:
        said = False
        try:
            signum = _signal_of(value)
            if signum is None:
                return False  # no signal: whatever ended the block goes on as it was
            _say(signum, _taken_in[0] if _taken_in else self.what)
            said = True
            raise SystemExit(128 + signum) from None
        finally:
            _pending.clear()
            if said:
                _taken_in.clear()
            self.put_back(ignored=self.last and _process_ends[0])
            del _open[self.depth:]

    def put_back(self, ignored: bool = False) -> None:
        """The handlers this block found (SIG_IGN instead, ``ignored``)."""
        for s, h in self.previous.items():
            signal.signal(s, signal.SIG_IGN if ignored else h)


def _signal_of(ended: BaseException | None) -> int | None:
    """The signal that ended a block: the one its handler took (what it raised may have been swallowed or
    turned into another error), or one that escaped an inner block's end, or a Ctrl-C as KeyboardInterrupt."""
    if _pending:
        return _pending[0]
    if isinstance(ended, Interrupted):
        return ended.signum
    return signal.SIGINT if isinstance(ended, KeyboardInterrupt) else None


def outermost(command: Callable[[], object]) -> object:
    """Run the process's own command: an ``Interrupted`` that escaped an ``as_exit`` block as it was being left
    is that block's one line and exit code, and a Ctrl-C outside every block is one line, not a traceback."""
    try:
        return command()
    except (Interrupted, KeyboardInterrupt) as e:
        signum = _signal_of(e)
        _say(signum, _taken_in[0] if _taken_in else "")
        raise SystemExit(128 + signum) from None
    finally:
        # a signal that escaped a block as it was left is still noted, and that block's handlers (``ignore``
        # after the first signal) are still set: in a process that goes on (a test worker, a notebook), the
        # next launch's check_pending would raise it again and later signals would be ignored
        if _open and not _process_ends[0]:
            _open[0].put_back()
        _pending.clear()
        _open.clear()
        _taken_in.clear()


def import_held(module: str) -> None:
    """Import ``module`` with SIGINT and SIGTERM held: a signal that comes meanwhile is noted, and raised as
    ``Interrupted`` once the import is done (inside an ``as_exit`` block, that block's line).

    For torch, the parent's first heavy import: ``as_exit``'s handler raises where the main thread is, and a
    Ctrl-C in the first second of ``kvlab run`` raised inside torch's C initialisation, which aborted the process
    (SIGABRT, no line) instead of failing the import. A signal ignored here (SIG_IGN, as under ``nohup``) stays
    ignored. Already imported: nothing happens."""
    if module in sys.modules:
        return
    came: list[int] = []
    held = [s for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, lambda signum, frame: came.append(signum)) for s in held}
    try:
        importlib.import_module(module)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if came:
        raise Interrupted(came[0])


def check_pending() -> None:
    """Raise the signal ``as_exit`` took, if one came and what it raised was lost on the way."""
    if _pending:
        raise Interrupted(_pending[0])


def quiet_until_ready(last_words) -> None:
    """A rank before its handlers are set (imports, config): a signal ends it at once, without a
    traceback, after ``last_words(signal name)`` (which leaves a part file that says so)."""
    def leave(signum, frame):
        try:
            last_words(name(signum))
        finally:
            os._exit(128 + signum)

    for s in SIGNALS:
        signal.signal(s, leave)
    global _starting
    _starting = AtOnce(last_words)  # a signal during a slow import in C: the handler above would wait for it
    _starting.start()


def ready() -> None:
    """The rank's own handlers take over from ``quiet_until_ready``'s."""
    global _starting
    if _starting is not None:
        _starting.end()
        _starting = None


def start_rank(parent: int) -> None:
    """In a rank the local launcher starts, before exec: SIGINT ignored, which Python keeps when it starts with
    it so, until the rank sets its own handlers (``quiet_until_ready``, its first step). A Ctrl-C to the group
    in the rank's first tenth of a second (the interpreter importing site, the worker its first modules) raised
    KeyboardInterrupt there: "Fatal Python error: init_import_site" and a traceback on the run's stderr. The
    launcher takes that Ctrl-C itself and stops every rank with SIGTERM. Then ``die_with_parent``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """In a child before exec: SIGTERM when the parent (pid ``parent``) dies, however it dies (Linux
    prctl), so that no rank outlives the launcher; if the parent is already gone, now."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own stop is all there is
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class AtOnce:
    """A rank's start-up (joining, handshake, link reference, the barrier before the clock) blocks in
    collectives that return only at their own timeout, and Python runs a signal's handler only when the
    call returns: a rank told to stop there would sit out the whole ``transfer.timeout_s``. Between
    ``start`` and ``end``, a thread woken by the signal itself (``signal.set_wakeup_fd``, written by the C
    handler whatever the main thread is doing) ends the rank within moments, after ``last_words(signal
    name)`` and every ``cleanups`` entry (what would outlive the process: files)."""

    def __init__(self, last_words):
        self.last_words = last_words
        self.cleanups: list = []
        self.active = threading.Event()
        self.fds: tuple[int, int] | None = None
        self.previous = -1

    def start(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        self.fds = (r, w)
        self.previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self.active.set()
        threading.Thread(target=self._watch, args=(r,), name="stop-at-once", daemon=True).start()

    def _watch(self, r: int) -> None:
        while (data := os.read(r, 1)) and data[0] not in SIGNALS:  # a signal's number; b"": end() closed it
            pass
        if not data or not self.active.is_set():
            os.close(r)
            return
        # r stays open until the process ends: a second signal (Ctrl-C to the group, then the launcher's
        # SIGTERM) is written to the pipe by the C handler, and a closed reader made that an "Exception
        # ignored when trying to write to the signal wakeup fd" traceback per signal on the rank's stderr
        try:
            for clean in self.cleanups:
                with contextlib.suppress(Exception):
                    clean()
            self.last_words(name(data[0]))
        finally:
            os._exit(1)  # what a rank stopped before its transfers returns (kvlab.rank.runner)

    def end(self) -> None:
        """From here the transfer loop sees signals itself (it returns to Python between its polls)."""
        if self.fds is None:
            return
        self.active.clear()
        signal.set_wakeup_fd(self.previous)
        os.close(self.fds[1])
        self.fds = None
