"""Start the ranks of one run on this machine, or find that torchrun already did.

``kvlab run`` outside torchrun starts ``world_size`` processes of ``python -m kvlab.cli.worker``
with the environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
watches them, and when one fails gives the others ``grace_s`` to finish reporting before
stopping them, so that no rank is left hanging. The ranks' temporary directory (``TMPDIR``) is one made for the
run and removed with it: a rank ends with ``os._exit`` (kvlab.cli.worker), which skips the clean-up that
libraries leave to the interpreter's exit (wandb's staging directories, three per run). Under torchrun (gpt-fast's
``maybe_init_dist`` idea) every process is already a rank and runs the worker directly.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.core import held

# the ranks' TMPDIR, one per launch (kvlab.core.held). Not the "kvlab-ranks-" of kvlab before 2026-12-05, which
# did not hold it: a live run of that kvlab on the machine would look left and be swept
SCRATCH_PREFIX = "kvlab-scratch-"

# How long the others get, once a frozen rank is killed, to end by themselves before they are stopped. It
# was killed only after ``frozen_s`` (the transfer timeout) without a sign of life, so a rank whose own
# deadline runs on it is giving up already, and one blocked joining it (a rendezvous, a process group's
# creation) would sit out the whole ``death_grace_s`` on top of that timeout for nothing
FROZEN_NUDGE_S = 2.0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 and never listening, for a store to bind after it (rank 0's
    TCPStore, torchrun's c10d rendezvous); its port is ``.getsockname()[1]``. While it is open, the kernel hands
    that port to no other bind to port 0 (another run's launcher, a gloo listener of any run), which it does to
    a port found free and closed again, in the seconds before rank 0 binds it. The store's own bind succeeds
    beside it: both set SO_REUSEADDR, and this one never listens. Close it once the ranks have ended."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
    except OSError:
        s.close()
        raise
    return s


@dataclass
class Outcome:
    """How the ranks of one local run ended: ``code`` is 0, the first failing rank's exit code, or
    128 + the signal that interrupted the run (``interrupted`` names it)."""

    code: int
    interrupted: int | None = None
    died: list[int] = field(default_factory=list)  # ranks that ended without reporting (signal, exit 3, ...)


def _died(code: int | None) -> bool:
    """Ended without reporting: a signal, fault injection's exit 3, a crash (0, 1, 2: it reported)."""
    return code is not None and code not in (0, 1, 2)


def launch_local(run_dir: Path, world_size: int, grace_s: float = 30.0, extra_env: dict | None = None,
                 names: list[str] | None = None, death_grace_s: float = 3.0, stop_wait_s: float = 20.0,
                 config_yaml: str | None = None, frozen_s: float | None = None) -> Outcome:
    """Run the worker on ``world_size`` local processes and wait for them.

    After the first failure the others get ``grace_s`` to report, and 5 s more once rank 0 has
    reported (exit 0 or 1: what is left can only add part files). A rank that died (a signal, an exit
    code other than 0, 1, 2) is marked dead in the run directory at once (kvlab.results.records), so that rank
    0 does not wait for its part, and a rank that has not written its part ``death_grace_s`` later is
    told to stop (it is stuck on a peer that is gone). SIGINT or SIGTERM to this process (or to its
    whole process group) stops every rank: each writes its part file and leaves; a rank still running
    ``stop_wait_s`` later is killed. The ranks die with this process in any case (``PR_SET_PDEATHSIG``).
    A rank frozen (stopped by a signal: its sockets stay open, so no peer sees it go) for ``frozen_s`` seconds
    is killed and treated as dead, in any phase: its peers may be blocked on it in a call without a deadline
    (a process group's creation on rank 0's store), so those still running ``FROZEN_NUDGE_S`` later are told
    to stop as after a death. Every rank that died or had to be stopped is named on
    stderr, except after an interruption (the caller says it in one line).
    """
    from kvlab.core.interrupt import SIGNALS, check_pending, start_rank
    from kvlab.results import records

    check_pending()  # a Ctrl-C taken while composing, and lost there, starts no rank

    reserved = reserve_port()
    port = reserved.getsockname()[1]
    names = names or [f"rank {r}" for r in range(world_size)]
    procs = []
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)

    # the ranks' TMPDIR, in the caller's; gone with the ranks (where it cannot be made, the ranks use the caller's).
    # Held (kvlab.core.held): a launcher killed with SIGKILL leaves it, and the next launch removes it
    base = tempfile.gettempdir()
    held.sweep(base, SCRATCH_PREFIX)
    try:
        scratch_dir, scratch_fd = held.make_held_dir(base, SCRATCH_PREFIX)
        scratch = {"TMPDIR": scratch_dir}
    except OSError:
        scratch, scratch_fd = {}, -1
    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), KVLAB_PARENT=str(os.getpid()),
                       # c10d's retry warnings while peers are being stopped are noise, not news
                       TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                       **scratch, **(extra_env or {}))
            if config_yaml is not None:
                from kvlab.results.rundir import CONFIG_ENV

                env[CONFIG_ENV] = config_yaml
            procs.append(subprocess.Popen([sys.executable, "-m", "kvlab.cli.worker", str(run_dir)], env=env,
                                          preexec_fn=functools.partial(start_rank, os.getpid())))
        first, deadline, stopped, died, told, nudge_at, exit_at = None, None, [], [], None, None, None
        frozen_killed: list[int] = []
        frozen_since: dict[int, float] = {}
        while True:
            codes = [p.poll() for p in procs]
            now = time.time()
            for r, c in enumerate(codes):
                if frozen_s is None or c is not None or told is not None or not _stopped(procs[r].pid):
                    frozen_since.pop(r, None)
                elif now - frozen_since.setdefault(r, now) > frozen_s:
                    frozen_killed.append(r)  # reported as frozen, not as a death by SIGKILL
                    procs[r].kill()
                    procs[r].wait()
                    codes[r] = procs[r].returncode
                    frozen_since.pop(r)
            for r, c in enumerate(codes):
                if c not in (None, 0) and first is None:
                    first, deadline = r, now + grace_s
                if _died(c) and r not in died:
                    died.append(r)
                    records.mark_dead(run_dir, r)  # rank 0 stops waiting for its part
                    nudge_at = now + (FROZEN_NUDGE_S if r in frozen_killed else death_grace_s)
            if all(c is not None for c in codes):
                break
            if first is not None and codes[0] in (0, 1):
                deadline = min(deadline, now + 5.0)
            if any(c is not None for c in codes):
                # others reported and left (ended or failed): a frozen rank (SIGSTOP: its sockets stay open,
                # nobody sees it die) cannot report anything, and goes at once
                exit_at = exit_at if exit_at is not None else now
                if any(c is None and _stopped(procs[r].pid) for r, c in enumerate(codes)):
                    last = exit_at + death_grace_s
                    deadline = last if deadline is None else min(deadline, last)
            if nudge_at is not None and now > nudge_at and told is None:
                # a rank without a part file yet is stuck on a peer that is gone or has given up: stop it
                # (it writes its part). The others that reported go too: a send blocked in C++ on a peer
                # that no longer receives returns (and lets its rank see the signal) only once that
                # peer's process has closed its sockets
                nudge_at = None
                for r, p in enumerate(procs):
                    if p.poll() is None and (r != 0 or not records.part_path(run_dir, r).exists()):
                        p.send_signal(signal.SIGTERM)
            if signals and told is None:
                told = now  # stop every rank (the group may have had the signal already: the same)
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
            if len(signals) > 1 or (told is not None and now > told + stop_wait_s):
                for p in procs:  # asked twice, or not stopping: no more waiting
                    if p.poll() is None:
                        p.kill()
            if told is None and deadline is not None and now > deadline:
                stopped = [r for r, p in enumerate(procs) if p.poll() is None]
                for r in stopped:  # a frozen rank would not see a SIGTERM until it is resumed
                    if _stopped(procs[r].pid):
                        frozen_killed.append(r)
                        died.append(r)  # it reported nothing: the launcher's merge stands in for it
                        records.mark_dead(run_dir, r)
                        procs[r].kill()
                    else:
                        procs[r].send_signal(signal.SIGTERM)
                for r in stopped:
                    try:
                        procs[r].wait(timeout=stop_wait_s)
                    except subprocess.TimeoutExpired:
                        procs[r].kill()
                        procs[r].wait()
                break
            time.sleep(0.05)
    finally:
        for p in procs:  # whatever happened here, no rank outlives the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        if signals:  # a rank killed while stuck joining the others (C++ retries through signals) left no part
            for r, p in enumerate(procs):
                if p.returncode == -signal.SIGKILL and not records.part_path(run_dir, r).exists():
                    records.write_part(run_dir, records.PartFile(rank=r, side="", side_rank=-1, errors=[
                        f"rank {r}: killed {stop_wait_s:g} s after it was told to stop (stuck joining the others)"]))
        for s, h in previous.items():
            signal.signal(s, h)
        if scratch:
            shutil.rmtree(scratch["TMPDIR"], ignore_errors=True)
            os.close(scratch_fd)
        reserved.close()
    if signals:
        return Outcome(128 + signals[0], signals[0], died)
    for r, p in enumerate(procs):
        if r in frozen_killed:
            print(f"kvlab: rank {r} ({names[r]}) was frozen (stopped by a signal, its connections open)"
                  f"{f' for {frozen_s:g} s' if first == r else ' while the others ended'}; killed it", file=sys.stderr)
            if not records.part_path(run_dir, r).exists():
                records.write_part(run_dir, records.PartFile(rank=r, side="", side_rank=-1, errors=[
                    f"rank {r}: frozen (stopped by a signal); killed by the launcher"]))
        elif r in stopped and first is None:
            print(f"kvlab: rank {r} ({names[r]}) was still running when a frozen rank was killed; stopped it",
                  file=sys.stderr)
        elif r in stopped:
            print(f"kvlab: rank {r} ({names[r]}) was still running after rank {first} ({names[first]}) failed; "
                  f"stopped it", file=sys.stderr)
        elif p.returncode not in (0, 1, 2):
            print(f"kvlab: rank {r} ({names[r]}) died: {_describe(p.returncode)}", file=sys.stderr)
    if first is None:
        return Outcome(1, None, died) if stopped else Outcome(0)
    code = procs[first].returncode
    return Outcome(code if code > 0 else 1, None, died)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): Linux's /proc state T or t."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 3:
        return "exit code 3 (killed by fault injection: fault.kill_rank, or a sender dying mid-chunk: " \
               "fault.transfer=torn_chunk)"
    return f"exit code {code}"
