"""Soak: 240 requests with lognormal prompt lengths up to 128k tokens, 32 at a time, through a
staging pool 50x smaller than what is in flight. Every request verified, staging flat, no request
starved (the measured order is the round-robin order, and its bounds hold), every byte landed once.
How steady the throughput is gets printed, not asserted: speed is the benchmarks' business."""
from __future__ import annotations

import json
import time

import pytest
from conftest import check_figures

from kvlab.api import run_transfer
from kvlab.config.schema import build, compose
from kvlab.config.workload import plan_run

CONCURRENCY, SLOTS, SLOT = 32, 4, 65536
# one layer, one kv head of 8: 32 B per token, so a 128k-token prompt is 4 MiB; seed 1 draws one
SOAK = ["model=tiny_gqa", "model.num_layers=1", "model.kv_heads=1", "model.head_dim=8", "parallel=same",
        "workload=lognormal", "workload.requests=240", f"workload.concurrency={CONCURRENCY}", "workload.seed=1",
        "transfer=chunked", f"transfer.slot_mib={SLOT / 2**20}", f"transfer.slots={SLOTS}", "logger=quiet"]


@pytest.mark.slow
def test_soak(tmp_path):
    setup = build(compose(SOAK))
    run = plan_run(setup)
    requests, order = run.requests, run.order
    t0 = time.time()
    summary = run_transfer(SOAK, tmp_path)
    wall = time.time() - t0  # reported below; how fast is the benchmarks' business (scripts/)

    # all of it, verified, and nothing else
    assert summary["verified"] and summary["failed_requests"] == [] and summary["errors"] == []
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["request"] for r in rows] == list(range(240)) and all(r["verified"] for r in rows)
    check_figures(tmp_path)
    assert summary["isl_max"] == 131072
    assert summary["total_bytes"] == sum(r.isl for r in requests) * 32

    # staging is the pool configured at start, far below the bytes of the requests in flight at once
    assert summary["peak_staging_bytes"] == summary["peak_extra_device_bytes"] == SLOTS * SLOT
    isl = sorted((r.isl for r in requests), reverse=True)
    assert sum(isl[:CONCURRENCY]) * 32 > 50 * SLOTS * SLOT

    # fairness, measured. Admission is FIFO: requests start in id order.
    start = [r["start"] for r in rows]
    end = [r["end"] for r in rows]
    assert all(a < b for a, b in zip(start, start[1:]))
    # Completion follows the round-robin order of the plan exactly (each rank serves the global order)
    first, last = {}, {}
    for pos, c in enumerate(order):
        first.setdefault(c.request, pos)
        last[c.request] = pos
    assert sorted(range(240), key=lambda r: end[r]) == sorted(range(240), key=lambda r: last[r])
    # and its bounds hold in time: a later request overtakes an earlier one only if it is not larger,
    # and while a request is open at most concurrency-1 other chunks go per chunk of its own
    chunks = [r["chunks"] for r in rows]
    for r in range(240):
        for s in range(r + 1, 240):
            if end[s] < end[r]:
                assert chunks[s] <= chunks[r], (r, s)
        inside = sum(chunks[s] for s in range(240) if s != r and start[s] >= start[r] and end[s] <= end[r])
        assert inside <= (CONCURRENCY - 1) * (chunks[r] - 1), (r, inside, chunks[r])

    # bytes received per third of the run, from the gen rank's chunk completions (reported below)
    gen = json.loads((tmp_path / "parts" / "rank1.json").read_text())
    nbytes = {}
    for c in order:
        nbytes.setdefault(c.request, []).append(c.nbytes)
    done = sorted((w[1], n) for p in gen["parts"] for w, n in zip(p["wire"], nbytes[p["request"]]))
    assert sum(n for _, n in done) == summary["total_bytes"]
    t_first, t_last = done[0][0], done[-1][0]
    third = (t_last - t_first) / 3
    rates = [sum(n for t, n in done if t_first + k * third <= t < t_first + (k + 1) * third + (k == 2)) / third
             for k in range(3)]
    print(f"soak: 240 requests, {summary['total_bytes'] / 2**20:.1f} MiB, {len(order)} chunks, wall {wall:.1f} s, "
          f"span {summary['makespan_s']:.1f} s, thirds {[round(r / 2**20, 1) for r in rates]} MiB/s, "
          f"staging {summary['peak_staging_bytes']} B, cache {summary['cache_bytes']} B")
