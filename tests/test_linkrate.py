"""The link's speed in every run (kvlab.rank.linkrate), and fill/verification kept off the measured loop."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvlab.api import run_transfer
from kvlab.config.schema import TransferSpec, build, compose
from kvlab.config.workload import plan_run
from kvlab.memory.staging import SlotPool
from kvlab.rank import linkrate
from kvlab.results.records import Link, from_dict, to_dict

QUIET = ["logger=quiet"]
SMALL = ["workload.isl=1024", "transfer.slot_mib=0.25"]


def test_messages_are_the_runs_largest_chunk_between_its_own_pairs():
    setup = build(compose(["ctx.tp=3", "gen.tp=2", "workload.isl=700", "transfer.slot_mib=0.05"]))
    order = plan_run(setup).order
    nbytes, n, pairs = linkrate.messages(order)
    assert nbytes == max(c.nbytes for c in order) <= setup.transfer.slot_bytes
    assert pairs == sorted({(c.src, c.dst) for c in order}) and len(pairs) == 4  # 3 -> 2: ctx1 feeds both
    assert linkrate.MIN_MESSAGES <= n <= linkrate.MAX_MESSAGES


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("chunk", [1000, 240 << 10, 16 << 20, 1 << 30])
def test_a_repeat_times_enough_bytes_that_its_fixed_costs_weigh_little(device, chunk):
    """Many small messages where a few would last about as long as leaving the barrier; few of the largest."""
    n = linkrate.messages([_chunk(0, 0, 0, chunk)], device)[1]
    assert linkrate.MIN_MESSAGES <= n <= linkrate.MAX_MESSAGES
    assert n * chunk >= linkrate.REPEAT_BYTES[device] or n == linkrate.MAX_MESSAGES


def _chunk(request: int, src: int, dst: int, nbytes: int):
    from kvlab.model.layout import Rect
    from kvlab.model.schedule import Chunk

    return Chunk(request=request, seq=0, src=src, dst=dst, rect=Rect("kv", 0, 1, 0, 1, 0, 1, 1), nbytes=nbytes,
                 ready_layer=0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_copy_reference_copies_each_gen_ranks_bytes_in_pieces_and_whole(device):
    mib = 1 << 20
    # gen0 gets request 0 in 3 pieces of 5 MiB and 1 MiB, request 1 in one piece; gen1 nothing
    order = [_chunk(0, 0, 0, 5 * mib), _chunk(0, 1, 0, 5 * mib), _chunk(0, 0, 0, 1 * mib), _chunk(1, 0, 0, 2 * mib)]
    plan = linkrate.copy_plan(order, 0, device)
    assert linkrate.copy_plan(order, 1, device) is None
    assert plan.piece == 5 * mib and plan.whole == 11 * mib  # the largest request, in one copy
    for whole in (False, True):
        spans = plan.spans(whole)
        assert sum(n for _, n in spans) == plan.regions * plan.whole  # both forms copy the same bytes
        assert all(n <= (plan.whole if whole else plan.piece) for _, n in spans)
        ends = sorted((o, o + n) for o, n in spans)
        assert all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[0][0] == 0  # side by side, no overlap
    assert plan.regions * plan.whole <= linkrate.COPY_BYTES[device]
    assert plan.pieces <= linkrate.MAX_MESSAGES or plan.passes == 1
    # enough bytes per repeat, unless another pass would exceed the copies a repeat may make
    per_pass = plan.pieces // plan.passes
    assert plan.nbytes >= linkrate.COPY_REPEAT_BYTES[device] or plan.pieces + per_pass > linkrate.MAX_MESSAGES
    # a request larger than the buffers' bound is copied as a whole of that bound
    big = linkrate.copy_plan([_chunk(0, 0, 0, 4 * mib)] * 200, 0, device)
    assert big.whole == linkrate.COPY_BYTES[device] and big.regions == 1


def test_copies_are_timed_and_land():
    src = torch.arange(4096, dtype=torch.int64).view(torch.uint8)
    dst = torch.zeros_like(src)
    assert linkrate.copies_s(linkrate.views(src, dst, [(0, 10000), (10000, src.numel() - 10000)]), passes=2) > 0
    assert torch.equal(src, dst)


def test_median_and_range_of_the_repeats_and_the_faster_form_of_each():
    total = 10**9
    link = linkrate.summarize("copy", 1 << 20, 100, total, [[1.0, 0.5], [0.4, 2.0], [0.8, 0.8]],
                              ("pieces", "whole"), 1 << 24)
    assert link.repeats == 3 and link.bytes == total
    assert link.seconds == 0.5 and link.gbps == pytest.approx(2.0)  # per repeat the faster: 0.5, 0.4, 0.8
    assert (link.gbps_min, link.gbps_max) == (pytest.approx(1.25), pytest.approx(2.5))
    assert sorted(link.samples) == [pytest.approx(1.25), pytest.approx(2.0), pytest.approx(2.5)]
    assert link.forms == {"pieces": pytest.approx(1.25), "whole": pytest.approx(1.25)}
    text = link.describe()
    assert "median of 3 repeats, 1.25-2.50" in text and "one copy of 16.00 MiB per request" in text


def test_a_delivered_figure_above_the_fastest_repeat_is_flagged():
    link = linkrate.summarize("p2p", 240 << 10, 16, 16 * (240 << 10), [[0.004], [0.002], [0.003]])
    top = link.gbps_max
    assert link.beaten_by(top) is None and link.beaten_by(link.gbps) is None
    line = link.beaten_by(top * 1.01)
    assert line and "\n" not in line and "raw messages of 0.23 MiB" in line
    assert link.beaten_by(None) is None


def test_a_link_written_before_repeats_still_reads_and_is_one_repeat():
    old = {"reference": "copy", "message_bytes": 3 << 20, "messages": 8, "seconds": 0.012, "gbps": 2.08,
           "schema": 1}
    link = from_dict(Link, old)
    assert link.repeats == 1 and link.gbps_max is None and link.samples == []
    assert link.ceiling == 2.08 and link.beaten_by(2.5) and link.beaten_by(2.0) is None
    assert link.describe() == "2.08 GB/s (one repeat) of a local copy_ of the same 3.00 MiB pieces"
    assert from_dict(Link, json.loads(json.dumps(to_dict(link)))) == link


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_slots_are_resident_before_the_first_message():
    """Staging is written at allocation: a page first written by a chunk or a reference message costs a fault
    and a zeroing inside the clock (the in-run gloo reference read 2.5-3.0 GB/s instead of 4.1-5.3 GB/s)."""
    before = _resident_bytes()
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so fresh pages, never reused resident ones
    pool = SlotPool(4, 16 << 20, torch.device("cpu"))
    grown = _resident_bytes() - before
    assert grown >= 0.9 * pool.storage.numel(), f"{grown} B resident of {pool.storage.numel()} B of slots"


@pytest.mark.slow
def test_every_run_reports_its_link_and_the_ratio_to_it(tmp_path):
    over = SMALL + QUIET + ["workload.requests=2"]
    summary = run_transfer(over, tmp_path)
    assert summary["verified"]
    setup = build(compose(over))
    order = plan_run(setup).order
    nbytes, n, pairs = linkrate.messages(order)
    link = summary["link"]
    assert link["reference"] == "p2p" and link["message_bytes"] == nbytes and link["messages"] == n * len(pairs)
    assert link["bytes"] == n * len(pairs) * nbytes
    assert summary["link_gbps"] == pytest.approx(n * len(pairs) * nbytes / link["seconds"] / 1e9)
    # the median of its repeats, with their range
    assert link["repeats"] == TransferSpec.baseline_repeats == len(link["samples"])
    assert link["gbps_min"] == pytest.approx(min(link["samples"]))
    assert link["gbps_max"] == pytest.approx(max(link["samples"]))
    assert link["gbps_min"] <= link["gbps"] <= link["gbps_max"]
    assert summary["link_ratio"] == pytest.approx(summary["gbps"] / summary["link_gbps"])
    # verification ran after the loop, off the clock
    assert summary["in_loop_requests"] == {"verify": 0}
    assert summary["fill_s"] > 0 and summary["verify_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert all(r["in_loop"] == [] and r["verify_s"] > 0 for r in rows)


@pytest.mark.slow
def test_baseline_can_be_skipped(tmp_path):
    summary = run_transfer(SMALL + QUIET + ["transfer.baseline=false"], tmp_path)
    assert summary["verified"]
    assert summary["link_gbps"] is None and summary["link_ratio"] is None and summary["link"] is None


@pytest.mark.slow
def test_a_cache_that_needs_the_blocks_verifies_inside_the_loop_and_says_so(tmp_path):
    # one slot, one request at a time: the cache holds two requests, so the third one's blocks are the
    # first one's, which must be checked before they are reused
    over = SMALL + QUIET + ["workload.requests=4", "workload.concurrency=1", "transfer.slots=1",
                            "parallel=same", "transfer.baseline=false"]
    summary = run_transfer(over, tmp_path)
    assert summary["verified"], summary
    rows = {r["request"]: r for r in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())}
    assert summary["in_loop_requests"]["verify"] == sum("verify" in r["in_loop"] for r in rows.values()) >= 1
    assert "verify" not in rows[3]["in_loop"]  # the last one is checked after the loop


def test_plot_link_ratio_draws_a_line_per_strategy_and_the_link():
    import pandas as pd

    from kvlab.analysis.sweeps import plot_link_ratio

    df = pd.DataFrame({"strategy": ["naive", "chunked", "chunked"], "isl_mean": [1024, 1024, 4096],
                       "link_ratio": [0.3, 0.5, 0.7]})
    ax = plot_link_ratio(df).axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    lines.update({c.get_label(): c.lines[0] for c in ax.containers})  # a strategy's medians, with range bars
    assert list(lines["chunked"].get_ydata()) == [0.5, 0.7]
    assert set(lines["raw link, same messages"].get_ydata()) == {1.0}


@pytest.mark.slow
def test_a_pulling_transport_measures_the_faster_of_pieces_and_one_copy_per_request(tmp_path):
    over = QUIET + ["transport=ipc", "ctx.tp=2", "gen.tp=1", "workload.isl=2000", "transfer.slot_mib=0.25",
                    "workload.requests=2"]
    summary = run_transfer(over, tmp_path)
    assert summary["verified"], summary
    link = summary["link"]
    order = plan_run(build(compose(over))).order
    plan = linkrate.copy_plan(order, 0)
    assert link["reference"] == "copy" and link["bytes"] == plan.nbytes and link["messages"] == plan.pieces
    assert link["whole_bytes"] == plan.whole > link["message_bytes"] == plan.piece
    assert set(link["forms"]) == {"pieces", "whole"}
    assert link["repeats"] == len(link["samples"]) == TransferSpec.baseline_repeats
    # each repeat counts the faster form, so the median is at least each form's median
    assert link["gbps"] >= min(link["forms"].values()) * (1 - 1e-9)
    assert link["gbps_min"] <= link["gbps"] <= link["gbps_max"]
    assert summary["link_ratio"] == pytest.approx(summary["gbps"] / link["gbps"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pulling_transport_on_a_gpu_times_both_forms_on_the_device(tmp_path):
    over = QUIET + ["transport=ipc", "device=cuda", "kernels=cuda", "parallel=same", "model=llama3_8b",
                    "model.num_layers=4", "workload.isl=8192", "workload.requests=2", "transfer.slot_mib=16"]
    summary = run_transfer(over, tmp_path)
    assert summary["verified"], summary
    link = summary["link"]
    plan = linkrate.copy_plan(plan_run(build(compose(over))).order, 0, "cuda")
    assert link["reference"] == "copy" and link["bytes"] == plan.nbytes >= linkrate.COPY_REPEAT_BYTES["cuda"]
    assert set(link["forms"]) == {"pieces", "whole"} and len(link["samples"]) == link["repeats"]
    assert link["gbps_min"] <= link["gbps"] <= link["gbps_max"]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc"])
def test_the_default_run_does_not_beat_its_reference(tmp_path, transport):
    """A reference is a ceiling: the default pulled run delivers no more than the copy reference's fastest
    repeat (a run that did would print so, and its link_ratio would describe the reference). The pushed
    (p2p over gloo) default is left out: beside two busy cores it delivered 2.02 GB/s against raw messages
    whose fastest repeat read 1.22, a reference taken at another moment of a loaded machine."""
    summary = run_transfer(QUIET + [f"transport={transport}"], tmp_path)
    assert summary["verified"], summary
    link = from_dict(Link, summary["link"])
    assert summary["gbps"] and link.beaten_by(summary["gbps"]) is None, (summary["gbps"], link.describe())
