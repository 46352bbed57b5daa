"""transport=ipc's pools in shared memory, checked up front: /dev/shm without room for them or that cannot be
written stops the run in one line before any rank starts (a pool that does not fit dies of SIGBUS at its first
write); pool files a dead creator left are removed by the next run, named in one line, and never a live one's."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as ns
from unittest import mock

import pytest

from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError
from kvlab.sizing import budget
from kvlab.transports import ipc

QUIET = ["logger=quiet"]
HOLD = ("import sys, time; from kvlab.transports import ipc; ipc.create_locked(sys.argv[1], 4096); "
        "print('made', flush=True); time.sleep(float(sys.argv[2]))")


def _made(path: Path, live_s: float) -> subprocess.Popen:
    """A process that creates a pool file as a ctx rank does and lives ``live_s`` seconds."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(live_s)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "made\n"
    return p


def test_pools_that_do_not_fit_in_shared_memory_are_one_line():
    setup = build(compose([*QUIET, "transport=ipc", "workload.isl=8192"]))
    need = sum(r.cache for r in budget.estimate(setup).ranks if r.name.startswith("ctx"))
    with mock.patch.object(budget.shutil, "disk_usage", return_value=ns(free=need // 3)):
        with pytest.raises(ConfigError) as e:
            budget.check_host(setup)
    line = str(e.value)
    assert re.fullmatch(rf"workload\.isl=8192: transport=ipc keeps the ctx pools in {ipc.SHM_DIR}: they need "
                        r"[\d.]+ \w+, [\d.]+ \w+ free there; prompts of at most \d+ tokens fit.*, or use "
                        r"transport=p2p", line), line
    with mock.patch.object(budget.shutil, "disk_usage", return_value=ns(free=need)):
        budget.check_host(setup)  # exactly enough
    budget.check_host(build(compose([*QUIET, "transport=p2p", "workload.isl=8192"])))  # no files: not asked


def test_read_only_shared_memory_is_one_line():
    setup = build(compose([*QUIET, "transport=ipc"]))
    with mock.patch.object(budget.os, "statvfs", return_value=ns(f_flag=os.ST_RDONLY)):
        with pytest.raises(ConfigError, match=rf"^transport=ipc: transport=ipc keeps the ctx pools in "
                                              rf"{re.escape(ipc.SHM_DIR)}, which cannot be written here"):
            budget.check_host(setup)


def test_sweep_removes_what_dead_creators_left_and_nothing_else(tmp_path):
    live = _made(tmp_path / "kvlab-ipc-live-ctx0-kv", 60)
    try:
        _made(tmp_path / "kvlab-ipc-dead-ctx1-kv", 0).wait()
        (tmp_path / "kvlab-ipc-unlocked-ctx0-kv").write_bytes(b"x")  # no lock: its creator is gone
        (tmp_path / "someone-else").write_bytes(b"x")
        (tmp_path / ".kvlab-ipc-being-made-ctx0-kv").write_bytes(b"x")  # a hidden name younger than a minute
        assert ipc.sweep(str(tmp_path)) == ["kvlab-ipc-dead-ctx1-kv", "kvlab-ipc-unlocked-ctx0-kv"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".kvlab-ipc-being-made-ctx0-kv",
                                                              "kvlab-ipc-live-ctx0-kv", "someone-else"]
    finally:
        live.kill()
        live.wait()
    assert ipc.sweep(str(tmp_path)) == ["kvlab-ipc-live-ctx0-kv"]  # its creator is gone now


def test_a_shm_dir_that_is_not_a_directory_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^transport\.shm_dir=.*: must be an existing directory"):
        build(compose([*QUIET, "transport=ipc", f"transport.shm_dir={tmp_path / 'none'}"]))


@pytest.mark.slow
def test_the_next_run_removes_a_dead_creators_pool_files_and_names_them(tmp_path, kvlab_cli):
    shm = tmp_path / "shm"  # a directory of its own: no other run on the machine sweeps it meanwhile
    shm.mkdir()
    left = shm / "kvlab-ipc-0123-ctx0-kv"
    _made(left, 0).wait()  # as a ctx rank killed between creating its pools and the gen ranks mapping them
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'run'}", *QUIET, "transport=ipc", f"transport.shm_dir={shm}",
                  "workload.requests=1", timeout=240)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stderr.splitlines() if left.name in x]  # by whichever ctx rank came first
    assert len(lines) == 1 and re.fullmatch(rf"kvlab: ctx[01] removed 1 shared-memory pool file a dead run left in "
                                            rf"{re.escape(str(shm))}: {left.name}", lines[0]), p.stderr
    assert list(shm.iterdir()) == []  # and the run's own files went once the gen rank had mapped them
