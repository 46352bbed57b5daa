"""scripts/ipc_bench.py's reading of a run: which requests moved while another's prefill ran (on one GPU its kernels
take turns with the copies), and the steady ratios over the requests with none beside them."""
from __future__ import annotations

import pytest
from conftest import script_module

ipc_bench = script_module("ipc_bench")


def row(prefill, moving):
    (p0, p1), (m0, m1) = prefill, moving
    return {"prefill_start_s": p0, "prefill_end_s": p1, "first_chunk_s": m0, "last_chunk_s": m1}


def test_a_request_is_beside_a_prefill_only_where_another_requests_overlaps_its_flight():
    rows = [row((0.0, 1.0), (1.0, 1.5)),  # request 1's prefill starts inside its flight
            row((1.2, 2.2), (2.2, 2.6)),  # request 2's starts before it landed
            row((2.5, 3.5), (3.5, 3.9)),  # request 3's starts as it lands: a shared instant is no overlap
            row((3.9, 4.0), (4.0, 4.2)),  # its own prefill is not beside it
            {"prefill_start_s": 5.0, "prefill_end_s": None, "first_chunk_s": None, "last_chunk_s": None}]  # failed
    assert ipc_bench.beside_prefill(rows) == [True, True, False, False, False]
    rows[3]["prefill_start_s"] = 3.8
    assert ipc_bench.beside_prefill(rows) == [True, True, True, False, False]


def test_the_steady_ratios_over_requests_alone_leave_out_each_runs_first():
    def reqs(*pairs):
        return {"requests": [{"gbps": g, "beside_prefill": b} for g, b in pairs]}

    r = {"copy_gbps": 100.0, "bytes": 1, "repeats": [
        reqs((10.0, False), (50.0, True), (90.0, False), (94.0, False)),  # its first, alone, is the warm-up
        reqs((20.0, True), (60.0, True), (92.0, False), (30.0, True)),
        reqs((5.0, False), (91.0, False), (40.0, True), (93.0, False)),
    ]}
    ipc_bench.steady(r)
    assert (r["alone_median"], r["alone_min"], r["alone_max"]) == pytest.approx((0.92, 0.90, 0.94))
    assert (r["alone_n"], r["steady_n"]) == (5, 9)
    # the steady ratio, per run the median of its requests after the first, over the runs: all of them
    assert (r["ratio_median"], r["ratio_min"], r["ratio_max"]) == pytest.approx((0.90, 0.60, 0.91))


def test_a_run_of_an_earlier_bench_without_the_flag_gives_no_alone_figure():
    r = {"copy_gbps": 100.0, "bytes": 1, "repeats": [{"requests": [{"gbps": 10.0}, {"gbps": 80.0}]}]}
    ipc_bench.steady(r)
    assert r["ratio_median"] == pytest.approx(0.8) and "alone_median" not in r
