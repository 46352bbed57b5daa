"""Start the ranks of one run on this machine, or find that torchrun already did.

``kvlab run`` outside torchrun starts ``world_size`` processes of ``python -m kvlab.worker``
with the environment torchrun would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*),
watches them, and when one fails gives the others ``grace_s`` to finish reporting before
stopping them, so that no rank is left hanging. Under torchrun (gpt-fast's
``maybe_init_dist`` idea) every process is already a rank and runs the worker directly.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(run_dir: Path, world_size: int, grace_s: float = 30.0, extra_env: dict | None = None,
                 names: list[str] | None = None) -> int:
    """Run the worker on ``world_size`` local processes; returns 0, or the first failing rank's exit code.

    After the first failure the others get ``grace_s`` to report, and 5 s more once rank 0 has
    reported (exit 0 or 1: what is left can only add part files); then they are stopped. Every
    rank that died (an exit code other than 0, 1, 2) or had to be stopped is named on stderr.
    """
    port = free_port()
    names = names or [f"rank {r}" for r in range(world_size)]
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "kvlab.worker", str(run_dir)], env=env))
    first, deadline, stopped = None, None, []
    try:
        while True:
            codes = [p.poll() for p in procs]
            for r, c in enumerate(codes):
                if c not in (None, 0) and first is None:
                    first, deadline = r, time.time() + grace_s
            if all(c is not None for c in codes):
                break
            if first is not None and codes[0] in (0, 1):
                deadline = min(deadline, time.time() + 5.0)
            if deadline is not None and time.time() > deadline:
                stopped = [r for r, p in enumerate(procs) if p.poll() is None]
                for r in stopped:
                    procs[r].send_signal(signal.SIGTERM)
                for r in stopped:
                    try:
                        procs[r].wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        procs[r].kill()
                        procs[r].wait()
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        raise
    for r, p in enumerate(procs):
        if r in stopped:
            print(f"kvlab: rank {r} ({names[r]}) was still running after rank {first} ({names[first]}) failed; "
                  f"stopped it", file=sys.stderr)
        elif p.returncode not in (0, 1, 2):
            print(f"kvlab: rank {r} ({names[r]}) died: {_describe(p.returncode)}", file=sys.stderr)
    if first is None:
        return 0
    code = procs[first].returncode
    return code if code > 0 else 1


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 3:
        return "exit code 3 (killed by fault injection: fault.kill_rank)"
    return f"exit code {code}"
