"""``transport=ipc`` on CPUs: gen ranks map the ctx ranks' pools in shared memory and pull every chunk's
runs straight into their own pools. Every strategy and cache kind, mismatched sides, no staging, block
tables that travel, a dead or stalled ctx rank ending the run within the deadline, flipped bytes caught
and located, and no shared-memory file left behind."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import E2E, LOST_TO_CTX1, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.api import run_transfer
from kvlab.config.schema import build, compose
from kvlab.config.workload import make_requests, plan_run
from kvlab.core.errors import ConfigError
from kvlab.memory.fill import locate
from kvlab.model.plan import plan
from kvlab.model.state import CacheState

QUIET = ["logger=quiet", "transport=ipc"]
TIMEOUT_S = 4

CASES = [
    ("gqa-tp2-tp1-chunked", ["transfer=chunked", "transfer.slot_mib=0.25", "workload.isl=2000"]),
    ("gqa-tp1-tp3-naive", ["parallel=tp1_to_tp2", "gen.tp=3", "transfer=naive", "workload.isl=1000"]),
    ("gqa-tp3-tp2-layerwise-layout", ["ctx.tp=3", "gen.tp=2", "transfer=layerwise", "transfer.layer_compute_ms=1",
                                      "gen.layout=layer_major", "gen.tokens_per_block=64", "transfer.slot_mib=0.1",
                                      "workload.isl=1500"]),
    ("gqa-pp2-tp2-zerocopy-fragmented", ["parallel=pp2_to_tp2", "transfer=zerocopy", "cache.fragmentation=0.5",
                                         "workload.isl=3000"]),
    ("mla-pp2-pp3-zerocopy", ["model=tiny_mla", "ctx.tp=1", "ctx.pp=2", "gen.tp=1", "gen.pp=3",
                              "model.num_layers=5", "transfer=zerocopy", "workload.isl=1500"]),
    ("dsa-tp1-tp2-gen-dp2", ["model=tiny_dsa", "ctx.tp=1", "gen.tp=2", "gen.dp=2", "transfer=chunked",
                             "workload.isl=1200", "ctx.tokens_per_block=16", "gen.tokens_per_block=64",
                             "transfer.slot_mib=0.3"]),
    ("swa-tp1-dp2-tp2-layerwise", ["model=tiny_swa", "ctx.tp=1", "ctx.dp=2", "gen.tp=2", "transfer=layerwise",
                                   "transfer.layer_compute_ms=1", "workload.isl=777", "gen.layout=layer_major"]),
]


def _rows(run_dir: Path) -> dict[int, dict]:
    check_figures(run_dir)
    return {r["request"]: r for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())}


@pytest.mark.slow
@settings(max_examples=3, **E2E)
@given(case=st.sampled_from(CASES))
def test_pulled_and_verified(case, tmp_path_factory, own_shm):
    overrides, tmp_path = case[1], tmp_path_factory.mktemp("ipc")
    summary = run_transfer([*overrides, *QUIET, f"transport.shm_dir={own_shm}"], tmp_path)
    assert summary["verified"], summary
    assert summary["failed_requests"] == [] and summary["errors"] == []
    assert summary["transport"] == "ipc"
    assert summary["peak_staging_bytes"] == 0
    setup = build(compose(overrides + QUIET))
    rows = _rows(tmp_path)
    assert len(rows) == setup.workload.requests
    for req in make_requests(setup):  # every request moved exactly what its gen ranks must hold
        assert rows[req.id]["bytes"] == sum(s.nbytes for s in plan(setup.model, setup.ctx, setup.gen, req))
        assert rows[req.id]["in_place_chunks"] == rows[req.id]["chunks"]  # no chunk went through a buffer
    assert list(own_shm.iterdir()) == []  # every shared-memory file was unlinked


def test_bad_input_names_the_transport(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"^transport=ipc: 6 ranks span several nodes .* use transport=p2p"):
        build(compose(QUIET))
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match=r"^fault.flip_rank=0: with transport=ipc the gen rank copies"):
        build(compose(QUIET + ["fault.flip_rank=0", "fault.flip_at=[3]"]))
    with pytest.raises(ConfigError, match=r"^transport.foo=1: transport=ipc has no such option"):
        build(compose(QUIET + ["+transport.foo=1"]))


@pytest.mark.slow
def test_dead_ctx_rank_ends_the_run_within_the_deadline(tmp_path, kvlab_cli, own_shm):
    run_dir = tmp_path / "run"
    # every wait has the deadline transfer.timeout_s, so the run ends; the subprocess timeout only guards
    # against a hang (shared cores make wall time a poor assertion)
    p = kvlab_cli("run", f"hydra.run.dir={run_dir}", *QUIET, f"transport.shm_dir={own_shm}", "transfer.slot_mib=0.5",
                  "workload.requests=6",
                  f"transfer.timeout_s={TIMEOUT_S}", "fault.kill_rank=1", "fault.kill_at_chunk=24", timeout=600)
    assert p.returncode == 3, p.stderr
    assert "rank 1 (ctx1) died: exit code 3" in p.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    failed = summary["failed_requests"]
    # ctx1's chunk 24 belongs to request 3 or 2; readiness is published once per layer group, so chunks of
    # that request whose group ctx1 published before dying may still be pulled, but request 4's never is
    assert {4, 5} <= set(failed) <= {2, 3, 4, 5}
    rows = _rows(run_dir)
    assert rows[0]["verified"] and rows[1]["verified"]
    # gen0 may give up on ctx0 too: ctx0 waits for its tensor-parallel peer ctx1 to end each prefill
    for rid in failed:  # named with the rank that gave up on them and why, or as never delivered
        assert re.match(LOST_TO_CTX1, rows[rid]["error"]), rows[rid]["error"]
    gen = json.loads((run_dir / "parts" / "rank2.json").read_text())
    # the gen rank gave up on ctx1 waiting for its next request's block table or its data
    assert re.search(r"(ready on the ctx rank|the block table from the ctx rank) not within 4 s", gen["errors"][0])
    # ctx1, or ctx0 held up waiting for its peer ctx1, and then the dead ctx1 is named
    assert re.search(r"with ctx1|with ctx0: .*; ctx1 \(rank 1\) had died", gen["errors"][0]), gen["errors"]
    assert gen["held_blocks"] == 0
    assert list(own_shm.iterdir()) == []  # unlinked at the handshake: a dead ctx rank leaves no file behind


@pytest.mark.slow
def test_stalled_ctx_rank_is_left_behind_and_the_run_ends(tmp_path, kvlab_cli):
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path}", *QUIET, "transfer.slot_mib=0.5", "workload.requests=6",
                  f"transfer.timeout_s={TIMEOUT_S}", "fault.stall_rank=1", "fault.stall_at_chunk=24",
                  "fault.stall_s=300", timeout=600)
    assert p.returncode == 1, p.stderr
    assert "rank 1 (ctx1) was still running after rank" in p.stderr and "stopped it" in p.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    rows = _rows(tmp_path)
    assert rows[0]["verified"] and rows[1]["verified"]
    assert any(re.search(r"(ready on the ctx rank|the block table from the ctx rank) not within 4 s", e)
               for e in summary["errors"]), summary["errors"]
    stalled = json.loads((tmp_path / "parts" / "rank1.json").read_text())
    assert stalled["errors"] == ["ctx1: stopped by SIGTERM"]


@pytest.mark.slow
def test_flips_in_the_copy_are_caught_and_located(tmp_path):
    overrides = ["model=tiny_dsa", "ctx.tp=1", "gen.tp=2", "transfer=zerocopy", "transfer.slot_mib=0.1",
                 "workload.isl=1000"] + QUIET
    setup = build(compose(overrides))
    order = plan_run(setup).order
    mine = [c for c in order if c.dst == 1]  # gen1, world rank 2
    starts = [sum(c.nbytes for c in mine[:i]) for i in range(len(mine))]
    picks, used = [], set()
    for pool in ("mla", "indexer"):
        i, c = next((i, c) for i, c in enumerate(mine) if c.rect.pool == pool and c.request not in used)
        used.add(c.request)
        picks.append((i, c, c.nbytes // 2 + 3))
    flips = [starts[i] + j for i, _, j in picks]
    summary = run_transfer(overrides + ["fault.flip_rank=2", f"fault.flip_at={flips}"], tmp_path)
    assert not summary["verified"] and summary["errors"] == []
    assert summary["failed_requests"] == sorted(c.request for _, c, _ in picks)
    rows = _rows(tmp_path)
    for _, c, j in picks:
        at = locate(CacheState(setup.model, setup.gen, c.dst).pool(c.rect.pool), c.rect, j)
        assert rows[c.request]["error"].startswith(
            f"request {c.request}: 1 wrong bytes from ctx{c.src}, first at pool {at['pool']} layer {at['layer']} "
            f"component {at['component']} head {at['head']} token {at['token']} byte {at['byte']} (block ")


GPU = ["logger=quiet", "transport=ipc", "device=cuda", "kernels=cuda", "workload.requests=3", "workload.concurrency=2"]


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overrides", [
    ["model=tiny_gqa", "parallel=same", "transfer=chunked"],
    ["model=tiny_gqa", "ctx.tp=1", "gen.tp=2", "transfer=zerocopy", "gen.layout=layer_major",
     "gen.tokens_per_block=64"],
    ["model=tiny_mla", "ctx.tp=2", "gen.tp=1", "transfer=layerwise", "transfer.layer_compute_ms=1"],
    ["model=tiny_dsa", "ctx.tp=1", "gen.tp=2", "transfer=naive", "cache.fragmentation=0.5"],
    ["model=tiny_swa", "ctx.tp=2", "gen.tp=1", "transfer=chunked", "transfer.slot_mib=0.05"],
], ids=["gqa-same-chunked", "gqa-tp1-tp2-zerocopy-layout", "mla-tp2-tp1-layerwise", "dsa-tp1-tp2-naive",
        "swa-tp2-tp1-chunked"])
def test_cuda_ipc_verified(overrides, tmp_path):
    """Every rank on whatever GPUs there are (one is enough: ipc has no one-rank-per-GPU rule)."""
    summary = run_transfer(GPU + overrides + ["workload.isl=5000"], tmp_path)
    assert summary["verified"], summary
    assert summary["peak_staging_bytes"] == 0 and summary["transport"] == "ipc"
    assert summary["kernels"] == "cuda"


def test_cost_model_charges_a_pull_one_copy_and_no_staging():
    from kvlab.sizing.cost import predict

    common = ["cost=h200", "model=llama3_8b", "ctx.tp=1", "gen.tp=1", "workload.isl=32768", "workload.requests=2",
              "transfer.slot_mib=256"]
    push, pull = (predict(build(compose(common + [f"transport={t}"]))) for t in ("p2p", "ipc"))
    assert pull.total_bytes == push.total_bytes and pull.messages == push.messages
    assert pull.extra_bytes == 0 < push.extra_bytes
    assert pull.requests[0].pack_s == 0 < push.requests[0].pack_s
    # one copy on the device (no pack, no link) beats pack + NVLink message + unpack
    assert pull.seconds < push.seconds


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fault", [["fault.kill_rank=1", "fault.kill_at_chunk=24"],
                                   ["fault.stall_rank=1", "fault.stall_at_chunk=24", "fault.stall_s=300"]],
                         ids=["killed", "stalled"])
def test_cuda_ctx_rank_lost_ends_the_run(fault, tmp_path, kvlab_cli):
    """On GPUs the copies wait on the device for the ctx rank's counter: a ctx rank that dies or stalls
    before writing it must still fail its requests within the deadline, and the gen rank's stream must
    drain (its waits released) so that the run ends instead of hanging on a wait that never ends."""
    p = kvlab_cli("run", f"hydra.run.dir={tmp_path}", *GPU[:4], "transfer.slot_mib=0.5", "workload.requests=6",
                  f"transfer.timeout_s={TIMEOUT_S}", *fault, timeout=150)
    assert p.returncode in (1, 3), p.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["verified"] and summary["silent_ranks"] == [1]
    rows = _rows(tmp_path)
    assert rows[0]["verified"] and rows[1]["verified"]
    assert {4, 5} <= set(summary["failed_requests"]) <= {2, 3, 4, 5}
    gen = json.loads((tmp_path / "parts" / "rank2.json").read_text())
    # ctx1, or ctx0 held up waiting for its tensor-parallel peer ctx1 to end a prefill
    assert gen["errors"] and re.search(r"ctx[01]", gen["errors"][0]), gen["errors"]
    assert gen["held_blocks"] == 0
