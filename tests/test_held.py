"""What a process makes in a shared place and removes itself (kvlab.core.held): held by an flock while its maker
lives, so the next run removes what a killed one left, and never a live one's. The pool files' side of it:
tests/test_shm_checks.py. And the port for rank 0's store, held by the launcher from its pick to the store's bind."""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvlab.cli.launch import SCRATCH_PREFIX, reserve_port
from kvlab.core import held

HOLD = ("import sys, time; from kvlab.core import held; print(held.make_held_dir(sys.argv[1], sys.argv[2])[0], "
        "flush=True); time.sleep(60)")


def _holder(directory: Path) -> tuple[subprocess.Popen, Path]:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), SCRATCH_PREFIX], stdout=subprocess.PIPE,
                         text=True)
    return p, Path(p.stdout.readline().strip())


def test_a_held_directory_is_removed_only_once_its_maker_is_gone(tmp_path):
    live, made = _holder(tmp_path)
    try:
        assert made.parent == tmp_path and made.name.startswith(SCRATCH_PREFIX) and made.is_dir()
        assert oct(made.stat().st_mode & 0o777) == "0o700"
        (made / "wandb-media").mkdir()  # what a rank leaves in its TMPDIR
        left = tmp_path / f"{SCRATCH_PREFIX}left"  # held by no one: its maker is gone
        (left / "deep").mkdir(parents=True)
        (left / "deep" / "f").write_bytes(b"x")
        (tmp_path / f".{SCRATCH_PREFIX}being-made").mkdir()  # hidden and younger than a minute
        (tmp_path / "someone-else").mkdir()
        (tmp_path / "kvlab-ranks-a1b_x9zq").mkdir()  # an older kvlab's, held by no lock: maybe a live run's
        assert held.unheld(str(tmp_path), SCRATCH_PREFIX) == [left.name]  # names it, removes nothing
        assert held.unheld(str(tmp_path), SCRATCH_PREFIX, grace_s=0) == [f".{SCRATCH_PREFIX}being-made", left.name]
        assert held.sweep(str(tmp_path), SCRATCH_PREFIX) == [left.name]
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".{SCRATCH_PREFIX}being-made", "kvlab-ranks-a1b_x9zq",
                                                              made.name, "someone-else"]
    finally:
        live.kill()
        live.wait()
    assert held.sweep(str(tmp_path), SCRATCH_PREFIX) == [made.name]
    old = time.time() - held.HIDDEN_GRACE_S - 1
    os.utime(tmp_path / f".{SCRATCH_PREFIX}being-made", (old, old))
    assert held.sweep(str(tmp_path), SCRATCH_PREFIX) == [f".{SCRATCH_PREFIX}being-made"]
    assert held.sweep(str(tmp_path / "none"), SCRATCH_PREFIX) == []  # no such directory: nothing to remove


@pytest.mark.slow
def test_the_next_launch_removes_the_scratch_a_killed_launcher_left(tmp_path, kvlab_cli):
    """A launcher killed with SIGKILL removes nothing: its ranks die with it (PR_SET_PDEATHSIG), and their
    TMPDIR stays until the next launch on the machine."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    p = subprocess.Popen(kvlab_cli.argv("run", f"hydra.run.dir={tmp_path / 'killed'}", "logger=quiet",
                                        "workload.requests=400", "transfer.slot_mib=1"),
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while len(psutil.Process(p.pid).children()) < 3:
            assert time.time() < deadline and p.poll() is None, "the ranks did not start"
            time.sleep(0.1)
        ranks = psutil.Process(p.pid).children()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    psutil.wait_procs(ranks, timeout=60)
    left = [d.name for d in scratch.iterdir()]
    assert len(left) == 1 and left[0].startswith(SCRATCH_PREFIX), left
    done = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'next'}", "logger=quiet", "workload.requests=1",
                     env={"TMPDIR": str(scratch)}, timeout=240)
    assert done.returncode == 0, done.stderr
    assert list(scratch.iterdir()) == []  # the left one, and its own


def test_a_reserved_port_goes_to_no_bind_to_port_0_and_the_store_binds_it():
    """kvlab.cli.launch.reserve_port: a port found free and closed again comes back from the kernel's binds to
    port 0 (another run's launcher, any run's gloo listeners; 7 times in 60,000 binds on a 2-core CI machine) in
    the seconds before rank 0's store binds it; a reserved one does not, and the store still binds it beside the
    reservation."""
    import torch.distributed as dist

    with reserve_port() as reserved:
        port = reserved.getsockname()[1]
        for _ in range(40_000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                assert s.getsockname()[1] != port
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout)
        client.set("rank1", "here")
        assert store.get("rank1") == b"here"
        del client, store
