"""Runs end cleanly whatever happens to them: interrupted (SIGINT, SIGTERM, to the parent or the whole
group), a rank killed, two runs pointed at one directory, a setup larger than the machine, values
no group checks (non-finite, zero or negative rates, keys added with ``+``, deleted with ``~``,
errors under ``-m``, run directories that cannot be written). Through the real ``kvlab`` in its own
process group: the exit code, exactly one line on stderr, no traceback, no process left behind."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import E2E, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kvlab.cli.commands import check_overrides
from kvlab.config.schema import build, compose
from kvlab.core import figures
from kvlab.core.errors import ConfigError
from kvlab.results import rundir
from kvlab.sizing import budget

QUIET = ["logger=quiet"]


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _no_process_left(pgid: int, within_s: float = 10.0) -> None:
    deadline = time.time() + within_s
    while _group(pgid) and time.time() < deadline:
        time.sleep(0.2)
    left = _group(pgid)
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left in the run's group: {left}"


def _start(argv: list[str], cwd: Path) -> subprocess.Popen:
    """``argv`` (``kvlab_cli.argv(...)``) started in its own process group, as a shell job would be."""
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _refused(argv: list[str], cwd: Path, *fragments: str, timeout: float = 120) -> str:
    p = _start(argv, cwd)
    _, err = p.communicate(timeout=timeout)
    _no_process_left(p.pid)
    assert p.returncode == 2, err
    line = _one_line(err)
    assert line.startswith("kvlab: error: "), line
    for f in fragments:
        assert f in line, (f, line)
    return line


# -- values no single group checks ---------------------------------------------------------------


def _numeric_leaves(cfg) -> list[str]:
    out = []
    for key in ("model", "ctx", "gen", "transfer", "workload", "cache", "fault", "cost"):
        for k, v in cfg[key].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(f"{key}.{k}")
    return out


def test_every_number_is_checked_for_finite_zero_and_negative():
    """Each numeric field of every group, set to inf, nan, 0 and -1: a ConfigError naming that field, or a
    setup that builds; never another exception (the cost group's rates included)."""
    base = compose(QUIET + ["cost=h200"])
    for c, v in {"alpha_us": 15.0, "copy_gbps": 4210.0, "copy_efficiency": 0.9, "copy_gbps_per_cta": 88.0,
                 "host_us": 0.0, "devices": 0}.items():  # None (the profile's) is not a number to vary
        OmegaConf.update(base, f"cost.{c}", v)
    leaves = _numeric_leaves(base)
    assert len(leaves) > 30, leaves
    for key in leaves:
        for value in (math.inf, -math.inf, math.nan, 0, -1):
            cfg = base.copy()
            is_int = isinstance(OmegaConf.select(base, key), int)
            if is_int and isinstance(value, float):
                continue  # the schema refuses a float for an integer field at composition
            OmegaConf.update(cfg, key, value)
            try:
                build(cfg)
            except ConfigError as e:
                assert key in str(e), (key, value, str(e))  # itself, or the field it pairs with and names it
                assert "\n" not in str(e)
            else:
                assert isinstance(value, int), (key, value, "a non-finite number passed")
    for key, bad in (("cost.copy_gbps", 0), ("cost.alpha_us", -5), ("cost.link_gbps", [100, 0, 300, 400])):
        assert check_overrides(QUIET + [f"{key}={bad}".replace(" ", "")]).startswith(f"{key}="), key


@pytest.mark.parametrize("overrides,fragments", [
    (["transfer.slot_mib=inf"], ["transfer.slot_mib=inf", "finite"]),
    (["transfer.timeout_s=inf"], ["transfer.timeout_s=inf", "finite"]),
    (["transfer.layer_compute_ms=nan"], ["transfer.layer_compute_ms=nan", "finite"]),
    (["fault.stall_s=inf"], ["fault.stall_s=inf", "finite"]),
    (["cost.link_gbps=[200,inf]"], ["cost.link_gbps[1]=inf", "finite"]),
    (["+new.key=1"], ["new.key=1", "no such key"]),
    (["+transfer.speed=3"], ["transfer.speed=3", "no such key", "slot_mib"]),
    (["~model"], ["model=<deleted by ~model>", "set model="]),
    (["cost.copy_gbps=0"], ["cost.copy_gbps=0", "> 0"]),
    (["cost.alpha_us=-5"], ["cost.alpha_us=-5", ">= 0"]),
], ids=["slot-inf", "timeout-inf", "layer-compute-nan", "stall-inf", "link-inf", "plus-new-key", "plus-group-key",
        "delete-model", "copy-rate-zero", "alpha-negative"])
def test_values_in_process(overrides, fragments):
    msg = check_overrides(overrides)
    assert msg and "\n" not in msg
    for f in fragments:
        assert f in msg, (f, msg)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "plan"])
@pytest.mark.parametrize("overrides,fragment", [
    (["transfer.slot_mib=inf"], "transfer.slot_mib=inf"),
    (["fault.stall_s=inf"], "fault.stall_s=inf"),
    (["cost.copy_gbps=0"], "cost.copy_gbps=0"),
    (["cost.alpha_us=-5"], "cost.alpha_us=-5"),
    (["+new.key=1"], "new.key=1"),
    (["~model"], "~model"),
    (["-m", "ctx.tp=1,4"], "ctx.tp=4"),
    (["-m", "transfer.timeout_s=inf"], "transfer.timeout_s=inf"),
], ids=["slot-inf", "stall-inf", "copy-rate-zero", "alpha-negative", "plus-new-key", "delete-model",
        "multirun-bad-job", "multirun-inf"])
def test_values_through_the_cli(command, overrides, fragment, tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    _refused(kvlab_cli.argv(command, f"hydra.run.dir={run_dir}", *QUIET, *overrides), tmp_path, fragment)
    assert not run_dir.exists() and not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["run", "plan"])
def test_run_dir_that_cannot_be_written(command, tmp_path, kvlab_cli):
    (tmp_path / "afile").write_text("")
    _refused(kvlab_cli.argv(command, f"hydra.run.dir={tmp_path / 'afile'}", *QUIET), tmp_path, "hydra.run.dir=",
             "afile", "a file is in the way")
    _refused(kvlab_cli.argv(command, f"hydra.run.dir={tmp_path / 'afile' / 'below'}", *QUIET), tmp_path,
             "hydra.run.dir=")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        _refused(kvlab_cli.argv(command, f"hydra.run.dir={ro / 'run'}", *QUIET), tmp_path, "hydra.run.dir=",
                 "Permission denied")


# -- one run per directory ---------------------------------------------------------------------


def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    run_dir = tmp_path / "run"
    rundir.acquire(run_dir)
    try:
        code = (f"from kvlab.results import rundir\nfrom kvlab.core.errors import ConfigError\n"
                f"try:\n    rundir.acquire({str(run_dir)!r})\nexcept ConfigError as e:\n    print(e)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert f"hydra.run.dir={run_dir.resolve()}" in out and f"pid {os.getpid()}" in out, out
    finally:
        rundir.release(run_dir)
    assert not (run_dir / rundir.LOCK_NAME).exists()
    # a holder that died without releasing: its file stays, its flock does not
    dead = subprocess.run([sys.executable, "-c", f"import os\nfrom kvlab.results import rundir\n"
                                                 f"rundir.acquire({str(run_dir)!r})\nos._exit(0)"], timeout=60)
    assert dead.returncode == 0 and (run_dir / rundir.LOCK_NAME).exists()
    p = subprocess.run([sys.executable, "-c", f"from kvlab.results import rundir\nrundir.acquire({str(run_dir)!r})"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "no longer running; taking it over" in _one_line(p.stderr)


@pytest.mark.slow
def test_second_run_in_a_held_directory_is_refused_before_writing(tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    rundir.acquire(run_dir)  # a live run holds it
    try:
        line = _refused(kvlab_cli.argv("run", f"hydra.run.dir={run_dir}", *QUIET), tmp_path,
                        f"hydra.run.dir={run_dir.resolve()}", f"pid {os.getpid()}", "another run")
        assert "give another hydra.run.dir" in line
        assert sorted(p.name for p in run_dir.iterdir()) == [rundir.LOCK_NAME]  # Hydra wrote nothing either
    finally:
        rundir.release(run_dir)


def test_workers_read_the_config_their_launcher_handed_them(tmp_path, monkeypatch):
    from kvlab.cli.worker import load_config

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(compose(["workload.isl=111"]), resolve=True))
    mine = OmegaConf.to_yaml(compose(["workload.isl=222"]), resolve=True)
    monkeypatch.setenv(rundir.CONFIG_ENV, mine)
    assert load_config(tmp_path).workload.isl == 222  # not the file another run may have replaced
    monkeypatch.delenv(rundir.CONFIG_ENV)
    assert load_config(tmp_path).workload.isl == 111


def test_part_files_are_written_through_a_temp_file_of_their_own(tmp_path):
    from kvlab.results.records import PartFile, read_part, write_part

    write_part(tmp_path, PartFile(rank=2, side="gen", side_rank=0, failures={1: "x"}))
    assert read_part(tmp_path, 2).failures == {1: "x"}
    assert [p.name for p in (tmp_path / "parts").iterdir()] == ["rank2.json"]


def test_union_of_wire_intervals_read_back_from_json():
    assert figures.union([(0.0, 1.0), [0.5, 2.0], (3.0, 4.0)]) == pytest.approx(3.0)


# -- a budget before allocation -----------------------------------------------------------------


# values inside every field's bound (kvlab.core.bounds refuses the larger ones first, by type) that a 24 GiB
# machine cannot hold: the budget, not the bound, must name them
@pytest.mark.parametrize("overrides,field", [
    (["workload.isl=16777216"], "workload.isl=16777216"),
    (["transfer.slots=4096"], "transfer.slots=4096"),
    (["transfer.slot_mib=65536"], "transfer.slot_mib=65536"),
    (["model=llama3_8b", "ctx.tokens_per_block=65536"], "ctx.tokens_per_block=65536"),
    (["model=llama3_70b", "workload.isl=131072", "workload.requests=8"], "workload.isl=131072"),
    (["workload.requests=16777216"], "workload.requests=16777216"),
    (["cache.capacity_tokens=16777216"], "cache.capacity_tokens=16777216"),
    (["model=llama3_8b", "transfer=naive", "workload.isl=262144"], "workload.isl=262144"),
], ids=["huge-prompt", "many-slots", "huge-slot", "huge-block", "llama70b-128k", "huge-request-count",
        "huge-capacity", "naive-buffers"])
def test_budget_names_the_field_and_what_fits(overrides, field, monkeypatch):
    monkeypatch.setattr(budget, "host_available", lambda: 24 << 30)  # the figures of a 24 GiB machine
    import kvlab.memory.cache
    import kvlab.sizing.preflight

    def refuse(*a, **k):
        raise AssertionError("built or allocated before the budget was checked")

    monkeypatch.setattr(kvlab.memory.cache.PagedCache, "__init__", refuse)
    monkeypatch.setattr(kvlab.sizing.preflight, "plan_run", refuse)
    msg = check_overrides(QUIET + overrides, memory=True)  # nothing the size of the workload built (refuse)
    assert msg and msg.startswith(field), msg
    assert "available" in msg and "\n" not in msg
    assert re.search(r"(at most \d+ \w+|<= [\d.e+-]+) fits?\b", msg), msg  # and a value that fits


def test_budget_fits_what_runs_and_bounds_what_the_ranks_hold(monkeypatch):
    monkeypatch.setattr(budget, "host_available", lambda: 24 << 30)
    assert check_overrides(QUIET, memory=True) is None
    setup = build(compose(QUIET))
    b = budget.estimate(setup)
    # the cache of every rank as PagedCache sizes it, from the plan of every request: never above the bound
    from kvlab.config.workload import plan_run
    from kvlab.model.state import CacheState
    from kvlab.sizing.preflight import preflight

    run = plan_run(setup)
    requests, order = run.requests, run.order
    for w, need in enumerate(b.ranks):
        side, r = setup.side_of(w)
        blocks = preflight(setup, run, w)
        real = sum(p.pool_bytes(blocks[p.name] + setup.cache.spare_blocks) for p in CacheState(
            setup.model, side, r).pools())
        assert real <= need.cache <= 2 * real + (1 << 20)
        assert need.staging == setup.transfer.slots * setup.transfer.slot_bytes
    assert b.chunks_per_request >= max(sum(1 for c in order if c.request == q.id) for q in requests)


@pytest.mark.parametrize("gen_tp", [1, 2])
def test_budget_counts_what_the_decode_check_keeps_on_a_gen_rank(gen_tp):
    """check=decode keeps the heads a gen rank holds of each of its requests' reference planes, and its received
    share, on the rank's device through the transfer loop (kvlab.rank.decode_check): the budget holds them on
    the gen ranks of each DP group, for that group's requests only, and nothing on the ctx ranks."""
    setup = build(compose(QUIET + ["model=tiny_gqa", "check=decode", "gen.dp=2", f"gen.tp={gen_tp}",
                                   "workload.isl=256", "workload.requests=3"]))
    b = budget.estimate(setup, gpus=1)
    m = setup.model
    whole = budget.planes_bytes(m, 256)
    assert whole == 2 * 2 * m.num_layers * m.kv_heads * m.head_dim * 256  # K and V, bf16
    for r in b.ranks:
        side, rank = setup.side_of(r.world_rank)
        if side.name == "ctx":
            assert r.check == 0
            continue
        mine = 2 if setup.gen.coord(rank).dp == 0 else 1  # requests 0 and 2, and 1
        assert r.check == mine * 2 * whole // gen_tp  # its heads of the planes, and its share
        assert "check" in r.on(r.memory)


def test_budget_on_gpus_counts_the_ranks_that_share_one():
    """What the ranks check on their GPU (no GPU needed: the free memory is given): ctx0 and ctx1 share
    cuda:0 when 3 ranks run on 2 GPUs (kvlab.config.devices.gpu_index); a rank of another host counts alone."""
    setup = build(compose(QUIET + ["model=llama3_8b", "workload.isl=131072", "workload.requests=1"]))
    b = budget.estimate(setup, gpus=2)
    assert [r.memory for r in b.ranks] == ["cuda:0", "cuda:0", "cuda:1"]
    assert b.need("host") == {k: sum(r.parts()[k] for r in b.ranks) for k in ("plan", "process")}
    ctx = sum(b.ranks[0].on("cuda:0").values())
    assert budget.device_problem(setup, 0, 2, 4 * ctx, 3) is None
    field, value, hint = budget.device_problem(setup, 0, 2, ctx, 3)  # room for one of the two ctx ranks
    assert (field, value) == ("workload.isl", 131072) and "ctx0 + ctx1 need" in hint and "cuda:0" in hint
    assert budget.device_problem(setup, 0, 2, int(1.5 * ctx), 1) is None  # torchrun across hosts: alone


@pytest.mark.parametrize("many", ["ctx.tp=64", "gen.tp=64", "ctx.cp=64", "gen.dcp=64"])
def test_more_processes_than_the_host_can_run_are_named_as_such(monkeypatch, many):
    """Ranks whose memory apart from the sizes (process, temporaries, staging) is already more than the host
    has: the field that makes them many is refused, not the prompt length (no prompt length would fit)."""
    monkeypatch.setattr(budget, "host_available", lambda: 20 << 30)
    msg = check_overrides(QUIET + ["model=llama3_8b", many], memory=True)
    setup = build(compose(QUIET + ["model=llama3_8b", many]))
    assert msg and "\n" not in msg and msg.startswith(f"{many}: {setup.world_size} ranks need "), msg
    fit = re.search(rf"{setup.world_size} processes cannot run here: each needs ([\d.]+) (\w+) whatever the sizes, "
                    rf"so at most (\d+) fit .*; lower {many.split('=')[0]}$", msg)
    assert fit and 0 < int(fit[3]) < setup.world_size, msg


@pytest.mark.parametrize("workload", [["workload.isl=128"], ["workload=mooncake", "workload.time_scale=0.01"]])
def test_requests_whose_planning_alone_takes_minutes_are_refused_with_an_estimate(monkeypatch, workload):
    monkeypatch.setattr(budget, "host_available", lambda: 1 << 50)  # the plan's time, not its memory
    msg = check_overrides(QUIET + workload + ["workload.requests=1000000"], memory=True)
    n = 300 if "workload=mooncake" in workload else 1000000  # a trace serves its rows at most
    m = re.fullmatch(rf"workload\.requests=1000000: planning {n} requests \(up to (\d+) chunks each\) would take "
                     r"about (\d+) min in every rank before the first transfer; at most (\d+) plan within 60 s: "
                     r"lower workload\.requests", msg or "")
    if n == 300:  # a short trace plans in no time, however many requests are asked for
        assert msg is None, msg
        return
    assert m and int(m[2]) >= 1, msg
    fits = int(m[3])
    assert check_overrides(QUIET + workload + [f"workload.requests={fits}"], memory=True) is None
    assert check_overrides(QUIET + workload + [f"workload.requests={fits + 1}"], memory=True).startswith(
        f"workload.requests={fits + 1}: planning")


def test_a_run_directory_without_room_for_what_the_run_writes_is_one_line_before_any_rank(tmp_path, monkeypatch,
                                                                                          capsys):
    from types import SimpleNamespace as ns

    from kvlab.cli import commands as cli
    from kvlab.cli import launch

    run_dir, real = tmp_path / "run", budget.shutil.disk_usage
    setup = build(compose(QUIET + ["workload.requests=400"]))
    need = budget.run_dir_bytes(setup)
    free = {"bytes": need // 2}
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: ns(free=free["bytes"]) if str(run_dir) in str(p)
                        else real(p))
    monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(SystemExit) as e:
        cli.main(["run", f"hydra.run.dir={run_dir}", *QUIET, "workload.requests=400"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    m = re.fullmatch(rf"kvlab: error: hydra\.run\.dir={re.escape(str(run_dir))}: the run writes up to [\d.]+ MiB "
                     r"there \(400 requests\), [\d.]+ MiB free; free some space on its file system, or give a "
                     r"directory elsewhere: hydra\.run\.dir=DIR, or lower workload\.requests \(at most (\d+) fit\)\n",
                     err)
    assert m and 0 < int(m[1]) < 400, err
    fits = build(compose(QUIET + [f"workload.requests={m[1]}"]))
    assert budget.run_dir_bytes(fits) <= free["bytes"] < budget.run_dir_bytes(setup)
    assert not (run_dir / "parts").exists() and not (run_dir / "summary.json").exists()
    free["bytes"] = need
    budget.check_run_dir(setup, run_dir)  # exactly enough


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB file system of its own (tmpfs), to be filled: mounting one needs root, as CI and the dev machine
    run; elsewhere the test is skipped, and the file-size limit's test below covers the writers."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(disk: Path) -> None:
    """Write into ``disk`` until its file system has no byte left."""
    # unbuffered: a buffered file kept what a partial write left over and raised ENOSPC again on closing
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    for n in range(64):  # the pages a partial last write could not take, in files of a byte each
        try:
            (disk / f"filler{n}").write_bytes(b"\0")
        except OSError:
            break


ROOM_FIX = "free some space on its file system, or give a directory elsewhere: hydra.run.dir=DIR"


def _no_half_file(run_dir: Path) -> None:
    """Nothing half-written: no summary, and no temporary file of a write that failed."""
    assert not (run_dir / "summary.json").exists()
    assert not [q for q in run_dir.rglob("*.tmp")], list(run_dir.rglob("*"))


@pytest.mark.parametrize("command", ["run", "sim", "link"])
def test_a_full_disk_at_start_is_one_line(command, small_disk, kvlab_cli):
    _fill(small_disk)
    run_dir = small_disk / "run"
    line = _refused(kvlab_cli.argv(command, f"hydra.run.dir={run_dir}", *QUIET), small_disk.parent)
    assert line == f"kvlab: error: hydra.run.dir={run_dir}: cannot create or write the run directory (No space " \
                   f"left on device); {ROOM_FIX}"
    assert not (run_dir / rundir.LOCK_NAME).exists()


def test_a_full_disk_while_keeping_a_decode_reference_is_one_line(small_disk, monkeypatch):
    """A gen rank keeps the reference it computed in the decode cache (check=decode): a file system full since the
    run's start-up probe is one line naming the file and the variable that moves the cache, not torch.save's
    error from inside its zip writer, and no half reference is left for the next run to load."""
    pytest.importorskip("transformers")
    from kvlab.rank import decode_check, hf_models

    cache = small_disk / "decode"
    monkeypatch.setenv(decode_check.CACHE_ENV, str(cache))
    s = build(compose(["check=decode", "ctx.tp=1", "gen.tp=1", "workload.isl=16", "check.tokens=2"]))  # probes it
    ids = hf_models.prompt(s.check, s.model, 0, 16)
    _fill(small_disk)
    with pytest.raises(ConfigError) as e:
        decode_check.reference(s.model, s.check, ids)
    name = f"{decode_check.reference_key(s.model, s.check, ids)}.pt"
    assert str(e.value) == f"KVLAB_DECODE_CACHE={cache}: no room to write {name} (No space left on device); free " \
                           "some space on its file system, or give a directory elsewhere: KVLAB_DECODE_CACHE=DIR"
    assert not list(cache.iterdir())


def test_a_line_without_room_is_one_line_and_leaves_the_lines_before(small_disk):
    """kvlab link adds each size to link.jsonl as it is measured: the disk filling up in between keeps those."""
    from kvlab.core.paths import append_line

    path = small_disk / "link.jsonl"
    append_line(path, '{"size": 65536}')
    _fill(small_disk)
    with pytest.raises(ConfigError) as e:
        append_line(path, '{"size": 262144}' + " " * 65536)
    assert str(e.value) == f"hydra.run.dir={small_disk}: no room to write link.jsonl (No space left on device); " \
                           f"{ROOM_FIX}"
    assert path.read_text() == '{"size": 65536}\n'


@pytest.mark.slow
def test_a_disk_filling_up_during_the_run_is_one_line(small_disk, kvlab_cli):
    """Full once the ranks run: each rank's part, then the summary, find no room (63 lines of ENOSPC tracebacks
    from the ranks before, and no summary)."""
    run_dir = small_disk / "run"
    p = _start(kvlab_cli.argv("run", f"hydra.run.dir={run_dir}", *QUIET), small_disk.parent)
    _workers(p.pid, 3)
    _fill(small_disk)
    _, err = p.communicate(timeout=120)
    _no_process_left(p.pid)
    assert p.returncode == 2, err
    line = _one_line(err)
    file = line.removeprefix(f"kvlab: error: hydra.run.dir={run_dir}: no room to write ").removesuffix(
        f" (No space left on device); {ROOM_FIX}")
    assert re.fullmatch(r"parts/rank\d\.json|results\.jsonl|timeline\.jsonl|summary\.json", file), line
    _no_half_file(run_dir)
    assert not (run_dir / rundir.LOCK_NAME).exists()


def _rank_pids(parent: int, n: int, timeout: float = 120.0) -> dict[int, int]:
    """World rank -> pid of the ``n`` ranks the launcher ``parent`` started (their environment names both)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = {}
        for d in Path("/proc").glob("[0-9]*"):
            try:
                env = dict(e.split(b"=", 1) for e in (d / "environ").read_bytes().split(b"\0") if b"=" in e)
            except (OSError, ValueError):
                continue
            if env.get(b"KVLAB_PARENT") == str(parent).encode() and b"RANK" in env:
                out[int(env[b"RANK"])] = int(d.name)
        if len(out) >= n:
            return out
        time.sleep(0.05)
    raise AssertionError("the ranks did not start")


@pytest.mark.slow
def test_parts_only_the_other_ranks_cannot_write_end_the_run_with_one_line(tmp_path, kvlab_cli):
    """Rank 0's part written, the others' refused (each rank's own file-size limit: the run directory had room for
    rank 0's alone): rank 0 waited out its silence (transfer.timeout_s + 5) for parts that would not come, then
    merged a summary of unverified requests, and stderr had a line per silent rank and one per refusal. Now the
    refusal reaches rank 0 through the store at once, and the run ends as a full disk does: one line, exit 2."""
    import resource

    run_dir = tmp_path / "run"
    p = _start(kvlab_cli.argv("run", f"hydra.run.dir={run_dir}", *QUIET, "transfer.timeout_s=30"), tmp_path)
    ranks = _rank_pids(p.pid, 3)
    for r in (1, 2):  # set while they import torch, seconds before they write anything
        resource.prlimit(ranks[r], resource.RLIMIT_FSIZE, (1024, 1024))
    _, err = p.communicate(timeout=240)
    _no_process_left(p.pid)
    assert p.returncode == 2, err
    assert re.fullmatch(rf"kvlab: error: hydra.run.dir={run_dir}: cannot write parts/rank[12].json \(File too "
                        r"large\): it is larger than this process's file-size limit; raise the limit \(ulimit -f "
                        r"unlimited\)", _one_line(err)), err
    _no_half_file(run_dir)
    assert not list((run_dir / "parts").glob("*.refused")) and not (run_dir / rundir.LOCK_NAME).exists()


def test_a_file_past_the_file_size_limit_is_one_line(tmp_path, kvlab_cli):
    """The writers' failure without root: RLIMIT_FSIZE (EFBIG, Python ignoring SIGXFSZ) at the sim's requests.jsonl
    (tens of KiB; Hydra's own records of the job take 4 KiB each at most)."""
    import resource

    run_dir = tmp_path / "sim"
    p = subprocess.Popen(kvlab_cli.argv("sim", f"hydra.run.dir={run_dir}"), cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192)))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    assert _one_line(err) == f"kvlab: error: hydra.run.dir={run_dir}: cannot write requests.jsonl (File too large): " \
                             "it is larger than this process's file-size limit; raise the limit (ulimit -f unlimited)"
    _no_half_file(run_dir)
    assert not (run_dir / "requests.jsonl").exists()


@pytest.mark.slow
def test_plan_prints_the_budget_and_run_refuses_it(tmp_path, kvlab_cli):
    big = ["model=llama3_70b", "workload.isl=131072", "workload.requests=8"]
    p = _start(kvlab_cli.argv("plan", f"hydra.run.dir={tmp_path / 'plan'}", *QUIET, *big), tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and not err.strip(), err
    assert "memory per rank" in out and "kvlab run would stop here: workload.isl=131072" in out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["memory"]["fits"] is False and plan["memory"]["need"]["host"] > 400 << 30
    _refused(kvlab_cli.argv("run", f"hydra.run.dir={tmp_path / 'run'}", *QUIET, *big), tmp_path, "workload.isl=131072")
    assert not (tmp_path / "run").exists()


# -- interruption and dead ranks -----------------------------------------------------------------

LONG = ["workload.requests=400", "transfer.slot_mib=1"]  # minutes of transfers on a 2-core machine
# a run that is still transferring whenever the signal comes, however fast the machine: ctx0 stalls at its
# third chunk for longer than the test waits, and its peers wait as long for it
STALLED = [*LONG, "fault.stall_rank=0", "fault.stall_at_chunk=2", "fault.stall_s=600", "transfer.timeout_s=600"]


def _workers(pgid: int, n: int, timeout: float = 120.0, every_s: float = 0.2) -> list[int]:
    """Pids of the run's ranks once all ``n`` have started (the launcher's children)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = sorted(pid for pid in _group(pgid) if pid != pgid)
        if len(kids) >= n:
            return kids
        time.sleep(every_s)
    raise AssertionError("the ranks did not start")


def _interrupted(run_dir: Path, sig: str) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] == sig and not summary["verified"]
    rows = {r["request"]: r for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}
    assert len(rows) == summary["requests"] == 400
    check_figures(run_dir)
    assert summary["completed_requests"] == [q for q, r in sorted(rows.items()) if r["verified"]]
    assert set(summary["failed_requests"]) == set(rows) - set(summary["completed_requests"])
    assert sorted(p.name for p in (run_dir / "parts").glob("rank*.json")) == ["rank0.json", "rank1.json",
                                                                              "rank2.json"]
    return summary


@pytest.mark.slow
@settings(max_examples=2, **E2E)  # Ctrl-C and one drawn (tests/fuzz/test_signals.py draws the moment too)
@given(how=st.sampled_from([(signal.SIGINT, "group"), (signal.SIGTERM, "group"), (signal.SIGTERM, "parent"),
                            (signal.SIGINT, "parent")]))
def test_interrupted_run_stops_every_rank_and_merges_what_it_has(how, tmp_path_factory, kvlab_cli):
    sig, target = how
    tmp_path = tmp_path_factory.mktemp("interrupted")
    run_dir = tmp_path / "run"
    p = _start(kvlab_cli.argv("run", f"hydra.run.dir={run_dir}", *QUIET, *STALLED), tmp_path)
    _workers(p.pid, 3)
    time.sleep(25)  # into the transfers (the ranks take seconds to import and join on a busy machine)
    if target == "group":
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    _, err = p.communicate(timeout=120)  # a rank that kept waiting would hold the launcher past this
    _no_process_left(p.pid)
    assert p.returncode == 128 + sig
    line = _one_line(err)
    assert line.startswith(f"kvlab: interrupted by {signal.Signals(sig).name}: ") and "summary in" in line, line
    _interrupted(run_dir, signal.Signals(sig).name)
    assert not (run_dir / rundir.LOCK_NAME).exists()


@pytest.mark.slow
def test_interrupt_before_the_ranks_start_is_one_line(tmp_path, kvlab_cli):
    p = _start(kvlab_cli.argv("run", f"hydra.run.dir={tmp_path / 'run'}", *QUIET), tmp_path)
    time.sleep(1.0)  # composing and checking
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=60)
    _no_process_left(p.pid)
    assert p.returncode == 130
    assert _one_line(err).startswith("kvlab: interrupted by SIGINT")


def _handling_signals(pid: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` catches SIGTERM (Python alone does not): the command has started and set its
    own handlers (kvlab.core.interrupt.as_exit). Until it has exec'd, the child has this process's handlers and
    command line: its own command line is read first, so the status read after it is the command's."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if Path(f"/proc/{pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes():
            time.sleep(0.005)
            continue
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError("the command never set its signal handlers")


@pytest.mark.parametrize("moment", ["starting", "ending"])
def test_sim_interrupted_is_one_line_or_nothing_once_done(moment, tmp_path, kvlab_cli):
    """Ctrl-C to kvlab sim while it composes and checks its jobs (seconds of Hydra: a KeyboardInterrupt traceback
    there) is one line, exit 130; once its results are written (the last line printed) it is one line saying
    where they are, or, in Python's teardown (a quarter of a second with torch loaded), nothing: exit 0, not
    130 without a word."""
    run_dir = tmp_path / "sim"
    p = _start(kvlab_cli.argv("sim", f"hydra.run.dir={run_dir}"), tmp_path)
    if moment == "starting":
        _handling_signals(p.pid)
    else:
        for line in p.stdout:
            if line.startswith("results in"):
                break
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    _no_process_left(p.pid)
    assert "Traceback" not in err, err
    if moment == "starting":
        assert p.returncode == 130, err
        assert _one_line(err) == "kvlab: interrupted by SIGINT before the simulation started; nothing was " \
                                 "simulated or written"
        assert not (run_dir / "summary.json").exists()
    else:
        assert (p.returncode, err) == (0, "") or p.returncode == 130 and _one_line(err) == \
            f"kvlab: interrupted by SIGINT as the simulation ended; its results are in {run_dir}", err
        assert json.loads((run_dir / "summary.json").read_text())["requests"] > 0
    assert not (run_dir / rundir.LOCK_NAME).exists()


def _a_line_in(path: Path, p: subprocess.Popen, timeout: float = 300.0) -> None:
    """Wait until ``path`` holds a whole line, while ``p`` runs (its ranks start in seconds, tens under load)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return
        assert p.poll() is None, p.communicate()[1]
        time.sleep(0.05)
    raise AssertionError(f"no line in {path} within {timeout:g} s")


def test_sim_calibrate_interrupted_is_one_line(tmp_path, kvlab_cli):
    """Ctrl-C to kvlab sim calibrate while it reads a run's records (a KeyboardInterrupt traceback before). The
    records are a FIFO, so that the signal comes while calibrate waits on it, whatever the machine's load."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("")  # read only after the records
    os.mkfifo(run / "results.jsonl")
    out = tmp_path / "mine.yaml"
    p = _start(kvlab_cli.argv("sim", "calibrate", str(run), "--out", str(out)), tmp_path)
    deadline, writer = time.time() + 120, None
    while writer is None:  # opening the FIFO's other end succeeds once calibrate has opened it to read
        assert p.poll() is None and time.time() < deadline, p.communicate()
        try:
            writer = os.open(run / "results.jsonl", os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            assert e.errno == errno.ENXIO, e
            time.sleep(0.05)
    try:
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        os.close(writer)
    _no_process_left(p.pid)
    assert p.returncode == 130, err
    assert _one_line(err) == "kvlab: interrupted by SIGINT while calibrating; no profile was written"
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["ranks starting", "sizes measured"])
def test_link_interrupted_is_one_line_that_keeps_the_sizes_measured(moment, tmp_path, kvlab_cli):
    """Ctrl-C reaches the ranks too (the whole group), the moment they exist, then the launcher's SIGTERM. A rank
    whose interpreter was starting died of the first in its site import ("Fatal Python error", 9 of 10 tries);
    one past it, in its first imports, printed an "Exception ignored ... signal wakeup fd" traceback for the
    second. Once a size is measured its line is in link.jsonl, and the line says so: the curve was written only
    at its end, so a Ctrl-C during the largest sizes said "0 of 6" and kept none. The repeats make each later
    size long enough to be still measuring when the signal comes."""
    from kvlab.core.link_spec import LinkSpec
    from kvlab.results import records

    run_dir = tmp_path / "link"
    p = _start(kvlab_cli.argv("link", f"hydra.run.dir={run_dir}", "link.repeats=50"), tmp_path)
    if moment == "ranks starting":
        _workers(p.pid, 3, every_s=0.005)
    else:
        _a_line_in(run_dir / records.LINK, p)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    _no_process_left(p.pid)
    assert p.returncode == 130, err
    said = re.fullmatch(r"kvlab: interrupted by SIGINT: (\d) of (\d+) message sizes measured(, in \S+)?",
                        _one_line(err))
    assert said, err
    kept = [x.size for x in records.read_link(run_dir)]
    sizes = LinkSpec().sizes("cpu")
    assert (int(said[1]), int(said[2])) == (len(kept), len(sizes)) and kept == sizes[:len(kept)], (err, kept)
    assert said[3] == (f", in {run_dir / records.LINK}" if kept else None), err
    assert moment == "ranks starting" or 0 < len(kept) < len(sizes), kept  # some sizes, and before the last
    assert not (run_dir / rundir.LOCK_NAME).exists()


# put in the ranks by Python's site (PYTHONPATH): the rank sends itself SIGINT at the named moment of its end, so
# that the signal lands there every time instead of once in many Ctrl-Cs
_SIGNAL_AT = """
import os, signal

def _hook(at):
    from kvlab.core import interrupt

    end, ended = interrupt.AtOnce.end, []

    def end_then_signal(self):
        live = self.fds is not None
        end(self)
        ended.extend([1] * live)
        if live and len(ended) == at:
            os.kill(os.getpid(), signal.SIGINT)

    interrupt.AtOnce.end = end_then_signal

if os.environ.get("KVLAB_PARENT") is not None:
    _hook(int(os.environ["SIGNAL_AT_END"]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("at", [1, 2], ids=["handlers-handed-over", "last-clean-up"])
def test_a_signal_as_a_rank_hands_over_or_ends_is_no_traceback(at, tmp_path, kvlab_cli):
    """A rank's start-up guard (kvlab.core.interrupt.AtOnce) ends twice in a kvlab link rank: when the rank's own
    handlers take over from the interpreter's start (``ready``), and in its last clean-up. A SIGINT that landed
    just after either raised Stopped outside the code that catches it: a traceback on the run's stderr (once seen
    from ``signal.signal``, which first runs the handler of a signal that came). Only the ranks get the signal
    here, so the launcher goes on as if nothing came: the one that lands after the work is done changes nothing,
    the other ends the ranks as while they start, each saying so in its part."""
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_SIGNAL_AT)
    path = os.pathsep.join([str(tmp_path / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])])
    run_dir = tmp_path / "link"
    p = kvlab_cli("link", f"hydra.run.dir={run_dir}", "link.max_bytes=65536", "link.repeats=1", cwd=tmp_path,
                  env={"PYTHONPATH": path, "SIGNAL_AT_END": str(at)})
    assert "Traceback" not in p.stderr, p.stderr
    if at == 2:
        assert (p.returncode, p.stderr) == (0, ""), p.stderr
    else:
        from kvlab.results.records import read_part

        for r in range(3):  # the start's handlers, still there, ended it (the stop came from outside the run)
            assert read_part(run_dir, r).errors == [f"rank {r}: stopped by SIGINT while starting"], r


@pytest.mark.parametrize("lost", ["swallowed", "turned into another error"])
def test_a_signal_lost_inside_a_library_still_ends_the_block(lost, capsys):
    """torch imports numpy under ``try``: Ctrl-C at that moment raised inside the import and was swallowed
    there (the run went on to the end), or broke numpy's half-loaded C extension (an ImportError)."""
    from kvlab.core import interrupt

    with pytest.raises(SystemExit) as e, interrupt.as_exit("before any rank started"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, within moments
        except BaseException:
            if lost == "turned into another error":
                raise ImportError("cannot load module more than once per process") from None
        assert lost == "swallowed"
    assert e.value.code == 130
    assert capsys.readouterr().err == "kvlab: interrupted by SIGINT before any rank started\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # and the handlers are put back


@pytest.mark.parametrize("handler", ["as_exit's", "ignored"])
def test_a_signal_during_the_held_import_waits_for_its_end(handler, tmp_path, monkeypatch, capsys):
    """A Ctrl-C while the parent imported torch raised inside torch's C start-up and aborted ``kvlab run``
    (SIGABRT, no line; the signals fuzzer drew it at 1.0 s on a loaded machine). ``import_held`` lets the import
    finish and then raises the signal as the block's one line; a signal ignored before (nohup) stays ignored."""
    from kvlab.core import interrupt

    (tmp_path / "kvlab_slow_start.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.5)  # a handler that raises would raise here, mid-import\n"
        "LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvlab_slow_start", raising=False)
    handlers = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    try:
        if handler == "ignored":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            interrupt.import_held("kvlab_slow_start")
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        else:
            with pytest.raises(SystemExit) as e, interrupt.as_exit("before any rank started"):
                interrupt.import_held("kvlab_slow_start")
                raise AssertionError("the block went on after the signal")
            assert e.value.code == 130
            assert capsys.readouterr().err == "kvlab: interrupted by SIGINT before any rank started\n"
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert sys.modules["kvlab_slow_start"].LOADED  # the import ran to its end
    interrupt.import_held("kvlab_slow_start")  # loaded: nothing happens, the handlers stay
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("nested", [True, False], ids=["in another block", "alone"])
@pytest.mark.parametrize("where", ["entering __exit__", "inside __exit__"])
def test_a_signal_as_the_block_is_left_is_still_its_one_line(where, nested, capsys, monkeypatch):
    """A signal whose handler runs at ``__exit__``'s first instruction raises before ``__exit__`` can take it,
    out of the ``with`` statement (CI saw it once in kvlab sim: a traceback, the line, then "Exception ignored
    in: <generator object as_exit>"); ``outermost`` makes it the block's one line and exit code."""
    from kvlab.core import interrupt

    handlers = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    leave = interrupt.as_exit.__exit__

    left = []

    def late(self, *ended):  # the inner block's end; the outer's is the real one
        left.append(self)
        if len(left) > 1:
            return leave(self, *ended)
        if where == "entering __exit__":
            signal.raise_signal(signal.SIGINT)  # its handler runs before the real __exit__ is called
            return leave(self, *ended)
        try:
            return leave(self, *ended)
        finally:
            signal.raise_signal(signal.SIGINT)  # after the handlers were put back: the outer block's

    monkeypatch.setattr(interrupt.as_exit, "__exit__", late)

    def command():
        with interrupt.as_exit("before any rank started") if nested else contextlib.nullcontext():
            with interrupt.as_exit("as the simulation ended"):
                pass

    try:
        with pytest.raises(SystemExit) as e:
            interrupt.outermost(command)
        after = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert e.value.code == 130
    assert after == handlers  # a later Ctrl-C in this process is not ignored
    # the block the signal came in; after the last block was left, a Ctrl-C is the bare line
    said = (" as the simulation ended" if where == "entering __exit__" else
            " before any rank started" if nested else "")
    assert capsys.readouterr().err == f"kvlab: interrupted by SIGINT{said}\n"
    interrupt.check_pending()  # nothing is left noted for a later launch in this process (a test worker's)


@pytest.mark.slow
def test_killed_parent_takes_its_ranks_along(tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    p = _start(kvlab_cli.argv("run", f"hydra.run.dir={run_dir}", *QUIET, *LONG), tmp_path)
    _workers(p.pid, 3)
    time.sleep(10)
    p.kill()
    p.communicate(timeout=30)
    _no_process_left(p.pid, within_s=30)  # PR_SET_PDEATHSIG: each rank writes its part and leaves
    assert sorted(f.name for f in (run_dir / "parts").glob("rank*.json")) == ["rank0.json", "rank1.json",
                                                                              "rank2.json"]
    for part in (run_dir / "parts").glob("rank*.json"):  # each says why it stopped, whatever phase it was in
        errors = json.loads(part.read_text())["errors"]
        assert errors and f"(its launcher, pid {p.pid}, died)" in errors[0], errors
    summary = run_dir / "summary.json"  # rank 0 merges once it got into its transfers
    if summary.exists():
        assert json.loads(summary.read_text())["interrupted"] == f"SIGTERM (its launcher, pid {p.pid}, died)"


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1], ids=["ctx1"])  # gen0 and the others: tests/fuzz/test_signals.py draws them
def test_rank_killed_with_sigkill_ends_the_run_in_seconds(victim, tmp_path, kvlab_cli):
    """The launcher sees the death at once; rank 0 does not wait out transfer.timeout_s + 5 (65 s)."""
    run_dir = tmp_path / "run"
    p = _start(kvlab_cli.argv("run", f"hydra.run.dir={run_dir}", *QUIET, *STALLED), tmp_path)
    ranks = _workers(p.pid, 3)
    time.sleep(25)
    os.kill(ranks[victim], signal.SIGKILL)
    _, err = p.communicate(timeout=120)  # a rank that kept waiting would hold the launcher past this
    _no_process_left(p.pid)
    assert p.returncode not in (0, 2) and "Traceback" not in err
    name = {1: "ctx1", 2: "gen0"}[victim]
    assert f"rank {victim} ({name}) died: killed by SIGKILL" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["silent_ranks"] == [victim] and not summary["verified"], (summary, err)
    assert summary["errors"][0] == f"{name} (rank {victim}) sent no report: its process ended (the launcher saw it)"


@pytest.mark.slow
def test_a_rank_told_to_stop_while_joining_ends_at_once(tmp_path, kvlab_cli):
    """Two ranks of a three-rank job wait in the rendezvous for a third that never comes, a wait that ends
    only at its own timeout (here 300 s) in C++, where Python's signal handlers cannot run: SIGTERM must
    end a rank within moments all the same, with its part file saying so, whatever phase of its start-up
    it was in (slow imports included)."""
    from kvlab.cli.launch import reserve_port
    from kvlab.results.records import read_part

    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(compose(["transfer.timeout_s=300", *QUIET]),
                                                            resolve=True))
    reserved = reserve_port()
    port = reserved.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "kvlab.cli.worker", str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in (0, 1)]
    try:
        time.sleep(15)  # past the imports on an idle machine: both wait for rank 2
        for p in procs:
            assert p.poll() is None, p.communicate()
        procs[1].send_signal(signal.SIGTERM)
        procs[1].wait(timeout=60)  # far inside the rendezvous' 300 s
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        reserved.close()
    for r in (0, 1):
        part = read_part(tmp_path, r)
        assert part is not None and len(part.errors) == 1, part
        assert re.fullmatch(rf"rank {r}: stopped by SIGTERM (while starting|before its transfers)", part.errors[0])
