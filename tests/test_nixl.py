"""transport=nixl and its reference: raw NIXL WRITEs between processes over UCX (DRAM on CPUs)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_faults import CORRUPTION, FAULTY, HANG_S, TIMEOUT_S
from test_faults import _gave_up_in_time as gave_up_in_time
from test_faults import test_flipped_bytes_are_caught_and_located as flips_caught

pytest.importorskip("nixl_cu13", reason='the nixl extra is not installed (pip install -e ".[nixl]")')

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("writers", [1, 2])
def test_raw_write_one_and_many_descriptors_verified(writers, tmp_path):
    """The benchmark's reference itself: the bytes land where the shuffled descriptors say, on the target."""
    out = tmp_path / "raw.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "nixl_raw.py"), "--mib", "1", "--descs", "1", "64",
                    "--writers", str(writers), "--out", str(out)], check=True, timeout=240)
    report = json.loads(out.read_text())
    assert report["nixl"] and report["ucx"]
    rows = report["cases"]
    assert [(r["bytes"], r["descriptors"], r["piece_bytes"]) for r in rows] == [
        (1 << 20, writers, (1 << 20) // writers), (1 << 20, 64, 1 << 14)]
    assert all(r["verified"] and r["seconds"] > 0 for r in rows), rows


# -- transport=nixl end to end ---------------------------------------------------------------------
NIXL = ["logger=quiet", "transport=nixl"]
# (id, overrides): every strategy in both modes, GQA, MLA (mismatched TP), DSA (indexer), sliding
# windows, PP mismatch and fragmented block tables
CASES = [
    ("gqa-tp2-tp1-chunked", ["transfer=chunked", "transfer.slot_mib=0.25"]),
    ("mla-tp2-tp1-layerwise", ["model=tiny_mla", "transfer=layerwise", "workload.isl=2000", "transfer.slot_mib=0.5"]),
    ("dsa-tp1-tp2-zerocopy", ["model=tiny_dsa", "ctx.tp=1", "gen.tp=2", "transfer=zerocopy", "workload.isl=1200",
                              "transfer.slot_mib=0.3"]),
    ("gqa-tp1-tp3-naive", ["parallel=tp1_to_tp2", "gen.tp=3", "transfer=naive", "workload.isl=1000"]),
    ("swa-pp2-tp2-fragmented", ["model=tiny_swa", "parallel=pp2_to_tp2", "cache.fragmentation=0.7",
                                "workload.isl=1500", "transfer.slot_mib=0.1", "workload.concurrency=3"]),
]
MODES = ["staged", "direct"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [pytest.param(c[1], id=c[0]) for c in CASES])
def test_nixl_end_to_end_verified(overrides, mode, tmp_path):
    from kvlab.api import run_transfer
    from kvlab.config import build, compose
    from kvlab.plan import plan
    from kvlab.workload import make_requests

    summary = run_transfer(overrides + NIXL + [f"transport.mode={mode}"], tmp_path)
    assert summary["verified"], summary
    assert summary["failed_requests"] == [] and summary["errors"] == []
    setup = build(compose(overrides + NIXL))
    rows = _rows(tmp_path)
    assert len(rows) == setup.workload.requests == summary["requests"]
    for req, row in zip(make_requests(setup), rows):
        assert row["bytes"] == sum(s.nbytes for s in plan(setup.model, setup.ctx, setup.gen, req))
        assert row["verified"]
        if mode == "staged":  # one WRITE of one descriptor per chunk
            assert row["descriptors"] == row["chunks"]
        else:  # one descriptor per run (merged where contiguous on both sides), nothing staged on the gen side
            assert row["descriptors"] > row["chunks"] and row["in_place_chunks"] == row["chunks"]
    if mode == "direct":
        assert summary["peak_staging_bytes"] == 0


@pytest.mark.slow
def test_direct_merges_runs_that_continue_on_both_sides(tmp_path):
    """Identical layouts and consecutive blocks: every chunk's runs continue each other in both pools,
    so each chunk is one descriptor; fragmented block tables break them up."""
    from kvlab.api import run_transfer

    same = NIXL + ["transport.mode=direct", "parallel=same", "transfer=zerocopy", "workload.requests=1",
                   "workload.isl=2048", "transfer.slot_mib=0.5"]
    run_transfer(same, tmp_path / "a")
    (row,) = _rows(tmp_path / "a")
    assert row["verified"] and row["descriptors"] == row["chunks"] > 1
    run_transfer(same + ["cache.fragmentation=1.0"], tmp_path / "b")
    (frag,) = _rows(tmp_path / "b")
    assert frag["verified"] and frag["descriptors"] > frag["chunks"]


def test_coalesce_merges_only_runs_contiguous_on_both_sides():
    from kvlab.transports.nixl import coalesce

    src = np.array([0, 10, 20, 100, 110], dtype=np.int64)
    dst = np.array([500, 510, 600, 610, 620], dtype=np.int64)
    length = np.array([10, 10, 10, 10, 10], dtype=np.int64)
    s, d, n = coalesce(src, dst, length)
    # 0-1 continue on both sides; 1-2 only on the ctx side; 2-3 only on the gen side; 3-4 on both
    assert s.tolist() == [0, 20, 100] and d.tolist() == [500, 600, 610] and n.tolist() == [20, 10, 20]


# -- failures --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_killed_rank_ends_the_nixl_run_with_its_requests_named(mode, tmp_path, kvlab_cli):
    run_dir = tmp_path / "run"
    # ctx1 dies as it is about to start its 25th chunk: requests 0 and 1 are through, 2 and 3 in flight
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *NIXL, f"transport.mode={mode}", *FAULTY, "fault.kill_rank=1",
                  "fault.kill_at_chunk=24", timeout=HANG_S)
    assert p.returncode == 3, p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    assert summary["failed_requests"] == [2, 3, 4, 5]
    rows = {r["request"]: r for r in _rows(run_dir)}
    assert rows[0]["verified"] and rows[1]["verified"]
    for rid in (2, 3, 4, 5):
        assert re.match(r"(gen0|ctx0): (aborted after )?request \d+ chunk \d+ with (ctx1|gen0): "
                        r"|gen0 received \d+ of 14 chunks \(run stopped: ctx1 \(rank 1\) sent no report",
                        rows[rid]["error"]), rows[rid]["error"]
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    # the gen rank gives up on ctx1: UCX reports the disconnect, or the deadline passes
    assert re.fullmatch(rf"gen0: request \d+ chunk \d+ with ctx1: (not done within {TIMEOUT_S} s or peer gone|"
                        r"(notification|WRITE) failed: NIXL_ERR_REMOTE_DISCONNECT)", gen["errors"][0]), gen["errors"]
    gave_up_in_time(run_dir, [0, 2])
    for r in (0, 2):  # the survivors freed the failed requests' blocks
        assert json.loads((run_dir / "parts" / f"rank{r}.json").read_text())["held_blocks"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [c[0] for c in CORRUPTION])
def test_flipped_bytes_are_caught_and_located(case, mode, tmp_path):
    """Staged: flipped in the slot (or a copy of an in-place chunk) as over p2p. Direct: a flip on the ctx
    rank goes out of a staging copy (the pool stays intact for the other gen ranks), a flip on the gen
    rank lands in its pool, where the runs put the byte."""
    _, overrides, flip_rank, want = next(c for c in CORRUPTION if c[0] == case)
    flips_caught(overrides + NIXL + [f"transport.mode={mode}"], flip_rank, want, tmp_path)


def test_without_the_extra_transport_nixl_is_one_line_naming_it(tmp_path, kvlab_cli):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for mod in ("nixl", "nixl_cu13"):  # shadow the installed package
        (blocked / f"{mod}.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocked), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path / 'run'}", *NIXL, env=env)
    assert p.returncode == 2
    assert p.stderr.strip() == ('kvlab: error: transport=nixl: the NIXL package is not installed; '
                                'pip install -e ".[nixl]"'), p.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_mode_is_one_line():
    from kvlab.config import build, compose
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^transport.mode=pull: use direct .* or staged"):
        build(compose(NIXL + ["transport.mode=pull"]))


# -- one GPU: every rank on it, VRAM registered, UCX between the processes (cuda_ipc) ---------------
GPU = ["logger=quiet", "transport=nixl", "device=cuda", "kernels=cuda", "workload.requests=3",
       "workload.concurrency=2", "workload.isl=3000", "transfer.slot_mib=0.25", "cache.fragmentation=0.3"]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overrides", [["transfer=chunked", "ctx.tp=2", "gen.tp=1"],
                                       ["model=tiny_dsa", "transfer=layerwise", "ctx.tp=1", "gen.tp=2"]],
                         ids=["gqa-tp2-tp1-chunked", "dsa-tp1-tp2-layerwise"])
def test_nixl_on_one_gpu_verified(overrides, mode, tmp_path):
    from kvlab.api import run_transfer

    s = run_transfer(GPU + overrides + [f"transport.mode={mode}"], tmp_path)
    assert s["verified"] and s["kernels"] == "cuda", s
    if mode == "staged":  # nothing but the slots during transfers
        assert s["peak_extra_device_bytes"] <= s["peak_staging_bytes"] + (1 << 20), s
