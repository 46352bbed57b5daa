"""No wait cycle between ranks, whatever the run: requests, concurrency, slots, both sides' TP/PP/DP,
strategies, transports and arrival processes drawn at random, each a real run (real processes,
gloo), every request verified well inside its timeout, and the measured marks in the order a
first-come-first-served prefill allows (kvlab.rank.prefiller).

The fixed examples are runs that once waited for their timeout and failed every request: a window
of chunks in flight against the barrier that ends a request's prefill on every ctx TP peer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kvlab.api import run_transfer
from kvlab.config.schema import build, compose
from kvlab.core.errors import ConfigError

TIMEOUT_S = 60  # a run that waits this long has deadlocked; a healthy one ends in seconds
BASE = ["logger=quiet", "transfer.baseline=false", f"transfer.timeout_s={TIMEOUT_S}"]
SIDES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (3, 1, 1)]  # (tp, pp, dp), at most 3 ranks a side


@st.composite
def runs(draw) -> list[str]:
    ctx, gen = draw(st.sampled_from(SIDES)), draw(st.sampled_from(SIDES))
    model = draw(st.sampled_from(["tiny_gqa", "tiny_mla", "tiny_dsa", "tiny_swa"]))
    arrival = draw(st.sampled_from(["burst", "poisson"]))
    over = [f"model={model}", f"transfer={draw(st.sampled_from(['chunked', 'layerwise', 'zerocopy', 'naive']))}",
            f"transport={draw(st.sampled_from(['p2p', 'ipc']))}",
            f"ctx.tp={ctx[0]}", f"ctx.pp={ctx[1]}", f"ctx.dp={ctx[2]}",
            f"gen.tp={gen[0]}", f"gen.pp={gen[1]}", f"gen.dp={gen[2]}",
            f"workload.requests={draw(st.integers(2, 10))}", f"workload.concurrency={draw(st.integers(1, 10))}",
            f"workload.isl={draw(st.sampled_from([512, 2048, 4096]))}",
            f"transfer.slots={draw(st.integers(1, 4))}", f"transfer.slot_mib={draw(st.sampled_from([0.25, 1, 4]))}",
            f"workload.arrival={arrival}", f"prefill.layer_ms={draw(st.sampled_from([0, 1, 5]))}"]
    if arrival == "poisson":
        over.append(f"workload.rate={draw(st.sampled_from([20, 100]))}")
    # context parallelism where a side has one rank: CP ranks end a prefill together, DCP ranks share heads
    if ctx == (1, 1, 1) and draw(st.booleans()):
        over += ["ctx.cp=2", f"ctx.cp_scheme={draw(st.sampled_from(['contiguous', 'load_balanced']))}"]
    if gen == (1, 1, 1) and draw(st.booleans()):
        over += ["gen.dcp=2", f"gen.dcp_interleave={draw(st.sampled_from([1, 16]))}"]
    return over


def _valid(over: list[str]) -> bool:
    try:
        build(compose([*BASE, *over]))
    except ConfigError:
        return False
    return True


def check_run(over: list[str], tmp: Path) -> None:
    summary = run_transfer([*BASE, *over], tmp)
    assert summary["verified"], (over, summary["errors"][:3])
    rows = [json.loads(x) for x in (tmp / "results.jsonl").read_text().splitlines()]
    assert rows and all(r["verified"] for r in rows), over
    # first come first served per ctx rank, measured: a rank starts a request's prefill only after it ended
    # the one before (in arrival order), and never before the request arrived
    for f in sorted((tmp / "parts").glob("rank*.json")):
        part = json.loads(f.read_text())
        if part["side"] != "ctx":
            continue
        ps = sorted((p for p in part["parts"] if p["prefill_start"] is not None), key=lambda p: p["prefill_start"])
        for p in ps:
            assert p["prefill_start"] >= p["arrival"] - 1e-6 and p["prefill_end"] > p["prefill_start"], (over, p)
        for a, b in zip(ps, ps[1:]):
            assert b["prefill_start"] >= a["prefill_end"] - 1e-6, (over, a["request"], b["request"])
            assert (a["arrival"], a["request"]) <= (b["arrival"], b["request"]), over


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(over=runs())
@example(over=["workload.requests=8", "workload.concurrency=8"])
@example(over=["workload.requests=8", "workload.concurrency=8", "transfer=layerwise"])
@example(over=["model=tiny_gqa", "workload.arrival=poisson", "workload.rate=40", "workload.requests=12",
               "prefill.layer_ms=10"])
@example(over=["transport=ipc", "ctx.tp=1", "ctx.pp=2", "gen.tp=3", "workload.requests=5",  # a gen rank held
               "workload.concurrency=9", "workload.isl=2048", "transfer.slots=1", "transfer.slot_mib=1",  # its ack of
               "workload.arrival=poisson", "prefill.layer_ms=0", "workload.rate=100"])  # a pull while it waited
@example(over=["transfer=layerwise", "ctx.tp=1", "ctx.pp=2", "gen.tp=1", "workload.requests=8",  # a stage's share
               "workload.concurrency=1", "workload.isl=2048", "transfer.slots=1", "transfer.slot_mib=1",  # ends before
               "workload.arrival=poisson", "prefill.layer_ms=1", "workload.rate=100"])  # the model's last layer
@example(over=["transfer=layerwise", "ctx.tp=1", "ctx.cp=2", "ctx.cp_scheme=load_balanced", "gen.tp=1",  # CP ranks
               "gen.dcp=2", "gen.dcp_interleave=16", "workload.requests=8", "workload.concurrency=8",  # end each
               "transfer.slots=1", "transfer.slot_mib=0.25", "prefill.layer_ms=1"])  # prefill together
def test_every_run_completes(over, tmp_path_factory):
    assume(_valid(over))
    check_run(over, tmp_path_factory.mktemp("run"))


def test_the_deadlocked_default_completes(tmp_path):
    """The default model and sides (ctx TP2 -> gen TP1) with every request in flight at once."""
    check_run(["workload.requests=8", "workload.concurrency=8"], tmp_path)
