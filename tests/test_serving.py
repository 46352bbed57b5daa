"""The serving timeline end to end on CPU: requests arrive on the configured timeline, each ctx DP
group prefills them first come first served, a layer's chunks leave only once the prefill wrote
that layer, and the figures (queue, TTFT, exposed transfer, percentiles) add up."""
from __future__ import annotations

import json

import pytest
from conftest import check_figures

from kvlab.api import run_transfer
from kvlab.config.devices import pair_backend
from kvlab.config.schema import build, compose
from kvlab.config.workload import interleave, plan_run, serve_order
from kvlab.model.schedule import Chunk

LAYER_MS = 5.0
BASE = ["logger=quiet", "transfer=layerwise", "workload.arrival=poisson", "workload.rate=40",
        "workload.requests=6", "workload.isl_list=[300,700,64]", "workload.concurrency=3", "ctx.dp=2", "ctx.tp=1",
        f"prefill.layer_ms={LAYER_MS}", "transfer.slot_mib=0.05", "transfer.slots=2"]


def test_order_follows_the_timeline():
    setup = build(compose(BASE))
    plan = plan_run(setup)
    order, times = plan.order, plan.times
    ready = [times[c.request].layer_end[c.ready_layer] for c in order]
    # each chunk is, of those ready when the link frees, the first in round-robin order
    schedules = {}
    for c in order:
        schedules.setdefault(c.request, []).append(c)
    rr = {id(c): i for i, c in enumerate(interleave([sorted(v, key=lambda c: c.seq) for _, v in
                                                     sorted(schedules.items())], 3))}
    link = setup.cost.rates(pair_backend(setup))
    now, waited = 0.0, 0
    for i, c in enumerate(order):
        waited += ready[i] > now
        now = max(now, ready[i])
        assert all(rr[id(d)] > rr[id(c)] for j, d in enumerate(order[i + 1:], i + 1) if ready[j] <= now), i
        now += link.message_s(c.nbytes)
    assert waited > 1  # this timeline has gaps: the order is not plain round-robin
    assert len({(c.request, c.seq, c.src, c.dst) for c in order}) == len(order)
    # equal readiness keeps the round-robin order: a burst of equal prompts alternates between requests
    a, b = [Chunk(0, i, 0, 0, None, 1, 0) for i in range(3)], [Chunk(1, i, 0, 0, None, 1, 0) for i in range(3)]
    assert [c.request for c in serve_order([a, b], 2, lambda c: 0.0, lambda c: 1.0)] == [0, 1, 0, 1, 0, 1]
    # a request whose prefill ends later goes after the one ready now, until it is ready itself
    later = {0: 0.0, 1: 2.5}
    order = serve_order([a, b], 2, lambda c: later[c.request], lambda c: 1.0)
    assert [(c.request, c.seq) for c in order] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    order = serve_order([a, b], 2, lambda c: later[c.request] / 10, lambda c: 1.0)  # ready by the 2nd slot
    assert [c.request for c in order] == [0, 1, 0, 1, 0, 1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("served")
    summary = run_transfer(BASE, run_dir)
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    ctx = [json.loads((run_dir / "parts" / f"rank{r}.json").read_text()) for r in (0, 1)]
    check_figures(run_dir)
    return summary, rows, ctx


@pytest.mark.slow
def test_timeline_figures(served):
    summary, rows, ctx = served
    assert summary["verified"] and len(rows) == 6
    setup = build(compose(BASE))
    plan = plan_run(setup)
    requests, times = plan.requests, plan.times
    eps = 1e-6
    for r, req in zip(rows, requests):
        t = times[req.id]
        assert r["arrival_s"] == pytest.approx(req.arrival_s, abs=1e-6)
        # measured when they happen: never before the timeline's, later when the host was busy
        assert r["prefill_start_s"] >= t.start - eps
        assert r["queue_s"] == pytest.approx(r["prefill_start_s"] - r["arrival_s"])
        assert r["prefill_end_s"] >= t.end - eps  # never earlier than the timeline, later if writing was slow
        assert r["arrival_s"] <= r["prefill_start_s"] <= r["first_chunk_s"] <= r["last_chunk_s"]
        assert r["ttft_s"] == pytest.approx(r["last_chunk_s"] - r["arrival_s"])
        assert r["transfer_s"] == pytest.approx(r["last_chunk_s"] - r["first_chunk_s"])
        assert r["exposed_s"] == pytest.approx(max(0.0, r["last_chunk_s"] - r["prefill_end_s"]))
        assert r["ttft_s"] >= 4 * LAYER_MS / 1e3 - eps  # at least the prefill of its 4 layers
    # FIFO per ctx DP group: a group's next prefill starts after the previous one's timeline end
    for g in (0, 1):
        mine = sorted((times[q.id] for q in requests if q.ctx_dp == g), key=lambda t: t.start)
        assert all(b.start >= a.end - eps for a, b in zip(mine, mine[1:]))
        assert any(b.queue > 0 for b in mine[1:]) or all(b.arrival >= a.end for a, b in zip(mine, mine[1:]))
    # percentiles over the rows
    ttft = sorted(r["ttft_s"] for r in rows)
    stats = summary["serving"]["ttft_s"]
    assert stats["n"] == 6 and ttft[0] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= ttft[-1]
    assert summary["serving"]["exposed_s"]["p99"] <= max(r["exposed_s"] for r in rows) + eps


@pytest.mark.slow
def test_no_chunk_leaves_before_its_layer_is_written(served):
    _, _, ctx = served
    seen = 0
    for part in ctx:
        for p in part["parts"]:
            ready = {int(k): v for k, v in p["layer_ready"].items()}
            # a layer's chunks complete after it was written (posted after, so done after)
            for layer, done in p["layer_done"].items():
                assert done >= ready[int(layer)]
                seen += 1
    assert seen > 0


@pytest.mark.slow
def test_a_layer_never_written_is_caught(tmp_path):
    """What a chunk that left before its layer was computed carries: the bytes the blocks held before.
    Verification names the layer."""
    summary = run_transfer_or_failure([*BASE, "fault.unwritten_layer=2"], tmp_path)
    assert not summary["verified"]
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert all(not r["verified"] for r in rows)
    check_figures(tmp_path)
    assert all(" layer 2 " in r["error"] for r in rows), [r["error"] for r in rows]


def run_transfer_or_failure(overrides, run_dir):
    try:
        return run_transfer(overrides, run_dir)
    except RuntimeError:
        return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
def test_kvlab_run_replays_the_mooncake_sample(tmp_path, kvlab_cli):
    """The command line on CPU: the real trace's arrivals and prompts, per-request TTFT and exposed
    transfer percentiles printed, every request verified."""
    from kvlab.core import traces

    run_dir = tmp_path / "run"
    p = kvlab_cli("run", "workload=mooncake", "transfer=layerwise", "workload.requests=6", "logger=quiet",
                  f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    assert "trace arrivals" in out and "TTFT" in out and "exposed transfer" in out
    assert all(q in out for q in ("mean", "std", "p50", "p90", "p99", "6 completed, 0 failed", "request throughput"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["verified"] and summary["arrival"] == "trace"
    for f in ("ttft_s", "exposed_s", "queue_s", "transfer_s"):
        assert summary["serving"][f]["n"] == 6
    check_figures(run_dir)
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    t = traces.read("mooncake_conversation_300.jsonl")[:6]
    assert [r["isl"] for r in rows] == [x.input_tokens for x in t]
    assert [r["osl"] for r in rows] == [x.output_tokens for x in t]  # carried for a decode model, not decoded
    assert [r["arrival_s"] for r in rows] == pytest.approx([x.arrival_s * 0.1 for x in t], abs=1e-6)
