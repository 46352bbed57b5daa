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


def launch_local(run_dir: Path, world_size: int, grace_s: float = 30.0, extra_env: dict | None = None) -> int:
    """Run the worker on ``world_size`` local processes; returns 0, or the first failing rank's exit code."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "kvlab.worker", str(run_dir)], env=env))
    first_failure, deadline = 0, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            for c in codes:
                if c not in (None, 0) and not first_failure:
                    first_failure, deadline = c, time.time() + grace_s
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.time() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                for p in procs:
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.kill()
        raise
    if first_failure:
        return first_failure if first_failure > 0 else 1
    return 0
