"""The figure table (kvlab.core.figures) on synthetic parts: rows and summary obey the identities on any
timeline a run can produce, the identity check catches a row that breaks one, time in flight is
counted once across concurrent requests and not at all between them, figures a transport lacks are
absent rather than zero, and the records' fields come from the table."""
from __future__ import annotations

import dataclasses
import functools
import io
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from kvlab.config.schema import build, compose
from kvlab.core import figures, serving
from kvlab.results import metrics, records
from kvlab.results.records import Env, Peak, RankPart, RequestRow, Summary

SLOTS = figures.Traits(has=frozenset({"slots"}))  # p2p's
PULL = figures.Traits(pulls=True)  # ipc's: no staging slots


@functools.cache
def _setup():
    return build(compose(["logger=quiet"]))


@dataclass(frozen=True)
class Piece:
    """A chunk of the plan (what kvlab.config.workload.plan_run's segments and the global order carry)."""

    request: int
    src: int
    dst: int
    nbytes: int


@st.composite
def runs(draw):
    """(parts, global order) of a run on a consistent timeline: per request an arrival, a queue, a prefill
    whose first chunk is free to go at the latest at its end (a ctx rank's last chunk carries its last layer:
    after the end), then chunks in global order, each posted by its gen rank (ahead of the data or not) and
    its ctx rank after it is free to go, landing after both posts; a ctx rank may see its send complete
    before or after that."""
    n_ctx, n_gen = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n_req = draw(st.integers(1, 4))
    t = st.floats(0.0, 0.05, allow_nan=False)
    order, free, timeline = [], {}, {}
    for q in range(n_req):
        arrival = q * draw(st.floats(0.0, 0.2))
        start = arrival + draw(t)
        end = start + draw(st.floats(0.001, 0.05))
        free[q] = end - draw(st.floats(0.0, 1.0)) * (end - start)  # layer-wise: a layer before the end
        timeline[q] = (arrival, start, end)
        for src in range(n_ctx):
            for dst in range(n_gen):
                order += [Piece(q, src, dst, draw(st.integers(1, 2**20))) for _ in range(draw(st.integers(1, 3)))]
    order = draw(st.permutations(order))
    order = sorted(order, key=lambda c: [c.request for c in order].index(c.request))  # requests in turn...
    if n_req > 1 and draw(st.booleans()):  # ...or interleaved, as round-robin serves them
        order = draw(st.permutations(order))
    last = {(c.request, c.src): i for i, c in enumerate(order)}  # carries the rank's last layer: after the prefill
    marks: dict[tuple, list] = {}
    link = 0.0
    for i, c in enumerate(order):
        ready = max(timeline[c.request][2] if last[(c.request, c.src)] == i else free[c.request], link)
        ctx_post = ready + draw(t)
        gen_post = ctx_post - draw(st.floats(-0.01, 0.05))
        done = max(ctx_post, gen_post) + c.nbytes / 1e9 + draw(st.floats(0.0, 0.01))
        ctx_done = done + draw(st.floats(-0.5, 1.0)) * (done - ctx_post)
        link = done if draw(st.booleans()) else ctx_post  # the next chunk may go while this one flies
        marks.setdefault(("ctx", c.request, c.src), []).append((ctx_post, max(ctx_done, ctx_post), c.nbytes))
        marks.setdefault(("gen", c.request, c.dst), []).append((gen_post, done, c.nbytes))
    parts = []
    for (side, q, rank), ms in sorted(marks.items()):
        arrival, start, end = timeline[q]
        wire = [(a, b) for a, b, _ in ms]
        common = dict(request=q, isl=100, side=side, rank=rank, bytes=sum(n for *_, n in ms), chunks=len(ms),
                      chunks_total=len(ms), wire=wire, epoch=0.0, copy_s=0.001)
        if side == "ctx":
            parts.append(RankPart(**common, start=free[q], end=max(b for _, b in wire), arrival=arrival,
                                  prefill_start=start, prefill_end=end, first_post=wire[0][0],
                                  slot_wait=draw(st.floats(0.0, 0.01)), fill_s=0.001))
        else:
            parts.append(RankPart(**common, start=min(a for a, _ in wire), end=max(b for _, b in wire) + draw(t),
                                  verify_s=0.002))
    return parts, order


def _merged(parts, order, traits=SLOTS):
    rows, _ = metrics.merge(parts, {}, {}, {}, False, traits, order)
    summary = metrics.summarize(rows, parts, _setup(), [Peak()], Env(), [], None, [], None, traits, order)
    return rows, summary


@settings(max_examples=100, deadline=None)
@given(runs())
def test_any_timeline_obeys_the_identities(run):
    parts, order = run
    rows, summary = _merged(parts, order)
    assert metrics.violations(rows, summary, parts, order) == []
    assert summary.verified and summary.total_bytes == sum(c.nbytes for c in order)
    for r in rows:
        assert r.ttft_s is not None and r.exposed_s is not None and r.busy_s > 0
        assert r.gbps == figures.rate(r.bytes, r.busy_s)
    # the run's time in flight counts concurrent requests once, and no more than their own times
    assert max(r.busy_s for r in rows) <= summary.busy_s <= sum(r.busy_s for r in rows) + 1e-9
    assert summary.gbps == figures.rate(summary.total_bytes, summary.busy_s)
    assert summary.serving["ttft_s"]["n"] == len(rows)
    # the plan's other sides' view: the segments by request give the same bytes
    by_request = {}
    for c in order:
        by_request.setdefault(c.request, []).append(c)
    assert metrics.violations(rows, summary, parts, by_request) == []


@settings(max_examples=30, deadline=None)
@given(runs(), st.floats(1.0, 100.0))
def test_idle_time_between_requests_changes_the_span_not_the_rate(run, gap):
    """Delivered GB/s is over the time in flight: arrivals further apart stretch the run, not the rate."""
    parts, order = run
    shifted = [dataclasses.replace(
        p, start=p.start + gap * p.request, end=p.end + gap * p.request,
        wire=[(a + gap * p.request, b + gap * p.request) for a, b in p.wire],
        **({} if p.side == "gen" else dict(arrival=p.arrival + gap * p.request,
                                           prefill_start=p.prefill_start + gap * p.request,
                                           prefill_end=p.prefill_end + gap * p.request,
                                           first_post=p.first_post + gap * p.request))) for p in parts]
    rows, summary = _merged(parts, order)
    rows2, summary2 = _merged(shifted, order)
    assert [r.busy_s for r in rows2] == [pytest_approx(r.busy_s) for r in rows]
    assert [r.gbps for r in rows2] == [pytest_approx(r.gbps) for r in rows]
    if len(rows) > 1:
        assert summary2.makespan_s > summary.makespan_s
        assert summary2.busy_s >= summary.busy_s - 1e-6  # requests that overlapped no longer do


def pytest_approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-6)


def test_one_chunk_in_flight_from_the_later_post_to_the_landing():
    """A gen rank posts its receive ahead of the data and a ctx rank sees its send done late: neither side's
    own interval is the chunk's flight."""
    ctx = RankPart(request=0, isl=1, side="ctx", rank=0, start=1.0, end=5.0, bytes=10**9, chunks=1, chunks_total=1,
                   wire=[(2.0, 5.0)])
    gen = RankPart(request=0, isl=1, side="gen", rank=0, start=0.0, end=3.5, bytes=10**9, chunks=1, chunks_total=1,
                   wire=[(0.5, 3.0)])
    (row,), _ = metrics.merge([ctx, gen], {}, {}, {}, False, SLOTS, [Piece(0, 0, 0, 10**9)])
    assert (row.start, row.end, row.seconds) == (1.0, 3.5, 2.5)
    assert row.busy_s == 1.0 and row.gbps == 1.0  # posted at 2.0 by ctx, landed at 3.0 on gen
    # without the order, the side that moves the bytes stands for both, clipped to the request's span
    (row,), _ = metrics.merge([ctx, gen], {}, {}, {}, False, SLOTS)
    assert row.busy_s == 1.5  # ctx's (2.0, 5.0) up to the gen rank's end
    (row,), _ = metrics.merge([ctx, gen], {}, {}, {}, False, PULL)
    assert row.busy_s == 2.0  # gen's (0.5, 3.0) from the ctx rank's start


def _row(**kw) -> RequestRow:
    base = dict(request=0, verified=True, ttft_s=1.0, queue_s=0.25, prefill_s=0.5, exposed_s=0.25, seconds=0.5,
                busy_s=0.4, bytes=8)
    return RequestRow(**{**base, **kw})


def test_violations_name_the_identity_each_row_breaks():
    assert metrics.violations([_row()], Summary(busy_s=1.0, makespan_s=2.0)) == []
    broken = {
        "ttft_s": _row(ttft_s=1.5),
        "< 0": _row(exposed_s=-0.1, ttft_s=0.65),
        "exposed_s": _row(exposed_s=0.75, ttft_s=1.5),
        "busy_s": _row(busy_s=0.6),
    }
    for what, row in broken.items():
        (line,) = metrics.violations([row])
        assert line.startswith("request 0: ") and what in line, line
    (line,) = metrics.violations([], Summary(busy_s=3.0, makespan_s=2.0))
    assert line.startswith("run: busy_s")
    # absent figures are not checked
    assert metrics.violations([_row(ttft_s=None, exposed_s=None, busy_s=None, seconds=None)]) == []


def test_a_pulling_gen_ranks_copies_fit_in_the_requests_flight():
    """ipc: a gen rank's pulls are its chunks' flight, so their time is at most the request's busy_s; unless a ctx
    rank's marks are missing (it sent no report), which leaves its chunks' flight out of busy_s."""
    def parts(copy_s):
        return [RankPart(request=0, isl=1, side="ctx", rank=r, bytes=4, chunks=1, chunks_total=1) for r in (0, 1)] + [
            RankPart(request=0, isl=1, side="gen", rank=0, bytes=8, chunks=2, chunks_total=2, copy_s=copy_s,
                     peer_bytes={0: 4, 1: 4})]

    assert metrics.violations([_row()], None, parts(0.4), pulls=True) == []
    (line,) = metrics.violations([_row()], None, parts(0.5), pulls=True)
    assert line == "request 0: gen0's copies took 0.500000 s, more than its time in flight (busy_s) 0.400000"
    assert metrics.violations([_row()], None, parts(0.5)) == []  # a pushing transport's unpack lands after it
    assert metrics.violations([_row()], Summary(silent_ranks=[1]), parts(0.5), pulls=True) == []
    assert metrics.violations([_row()], None, parts(0.5)[1:], pulls=True) == []  # ctx0's part is not there


def test_bytes_against_the_plan():
    plan = [Piece(0, 0, 0, 5), Piece(0, 1, 0, 3), Piece(0, 0, 0, 2)]
    part = lambda side, rank, n, **kw: RankPart(**{"request": 0, "isl": 1, "side": side, "rank": rank,  # noqa: E731
                                                   "bytes": n, "chunks": 1, "chunks_total": 1, **kw})
    good = [part("ctx", 0, 7, peer_bytes={0: 7}), part("ctx", 1, 3), part("gen", 0, 10, peer_bytes={0: 7, 1: 3})]
    assert metrics.violations([_row(bytes=10)], parts=good, plan=plan) == []
    bad = [part("ctx", 0, 7, peer_bytes={0: 6}), part("ctx", 1, 4), part("gen", 0, 10)]
    lines = metrics.violations([_row(bytes=11)], parts=bad, plan=plan)
    assert any("ctx1: 4 bytes moved, the plan's 3" in x for x in lines)
    assert any("ctx0 -> gen0: 6 bytes" in x for x in lines)
    assert any("11 bytes delivered, the plan's 10" in x for x in lines)
    stopped = [part("ctx", 1, 1, chunks_total=2)]  # part way through: it says so elsewhere
    assert metrics.violations([], parts=stopped, plan=plan) == []


@settings(max_examples=20, deadline=None)
@given(runs())
def test_slot_wait_is_absent_without_slots(run):
    """transport=ipc has no staging slots: no slot wait anywhere, not a zero one."""
    parts, order = run
    rows, summary = _merged(parts, order, PULL)
    assert all(r.slot_wait_s is None for r in rows)
    assert "slot_wait_s" not in summary.serving and "slot wait" not in serving.summary_line(summary.serving)
    rows, summary = _merged(parts, order, SLOTS)
    assert [r.slot_wait_s for r in rows] == [sum(p.slot_wait for p in parts if p.request == r.request
                                                 and p.side == "ctx") for r in rows]
    assert "slot wait" in serving.summary_line(summary.serving)


def test_records_take_their_figure_fields_from_the_table():
    row_fields = {f.name for f in dataclasses.fields(RequestRow)}
    summary_fields = {f.name for f in dataclasses.fields(Summary)}
    assert {f.name for f in figures.request_figures()} <= row_fields
    assert {f.summary_name for f in figures.run_figures()} <= summary_fields
    assert dataclasses.fields(RequestRow)[-1].name == "schema" == dataclasses.fields(Summary)[-1].name
    # each figure says what it is, and every unit can be shown
    for f in figures.TABLE:
        assert f.meaning.endswith(".") and f.how and f.unit in figures.DISPLAY, f.name
        assert f.request is not None or f.run is not None, f.name


def test_files_of_schema_1_read_under_the_new_names(tmp_path):
    row = {"request": 3, "bytes": 8, "seconds": 2.0, "wire_s": 0.5, "gbps": 4e-9, "verified": True, "schema": 1}
    (tmp_path / records.RESULTS).write_text(json.dumps(row) + "\n")
    (tmp_path / records.SUMMARY).write_text(json.dumps({"seconds": 2.0, "gbps": 4e-9, "schema": 1}))
    (back,) = records.read_rows(tmp_path)
    assert (back.schema, back.seconds, back.busy_s, back.gbps) == (1, 2.0, 0.5, 4e-9)  # gbps keeps its old meaning
    s = records.read_summary(tmp_path)
    assert (s.schema, s.makespan_s, s.busy_s) == (1, 2.0, None)


def test_the_terminal_table_shows_the_columns_of_the_table():
    rows = [_row(request=i, isl=100, bytes=2**20, gbps=1.0, arrival_s=0.1 * i) for i in range(15)]
    summary = Summary(total_bytes=15 * 2**20, busy_s=1.0, makespan_s=2.0, gbps=0.0157, exposed_s=0.25,
                      ctx={"tp": 1, "pp": 1, "dp": 1}, gen={"tp": 1, "pp": 1, "dp": 1}, verified=True,
                      serving=serving.percentiles(rows))
    out = io.StringIO()
    metrics.print_table(rows, summary, Console(file=out, width=200), limit=12)
    text = out.getvalue()
    for f in figures.columns():  # a column shows where a row has a value in it (no SLO set: no SLO column)
        assert (f.column in text) == any(getattr(r, f.name) is not None for r in rows), f.column
    assert "4 more" in text and "over 1,000.0 ms with chunks in flight, of the run's 2,000.0 ms" in text
    (all_row,) = [line for line in text.splitlines() if " all " in line]
    cells = [c.strip() for c in all_row.strip("│ ").split("│")]
    assert cells[2] == "15.00" and cells[-1] == "yes"
    assert "250.0" not in all_row  # the largest exposed transfer is one request's, not the run's


def test_transports_declare_what_their_figures_need():
    from kvlab.transports.ipc import Ipc
    from kvlab.transports.nixl import Nixl
    from kvlab.transports.p2p import P2P

    assert figures.Traits.of(P2P, {}) == SLOTS
    assert figures.Traits.of(Ipc, {}) == PULL  # pulls, and no staging slots
    assert figures.Traits.of(Nixl, {"mode": "staged"}) == SLOTS
    assert figures.Traits.of(Nixl, {"mode": "direct"}) == figures.PLAIN  # pool to pool: no slots either


def test_the_terminal_says_a_ratio_is_absent_rather_than_zero():
    summary = Summary(ctx={"tp": 1, "pp": 1, "dp": 1}, gen={"tp": 1, "pp": 1, "dp": 1}, link_gbps=4.0,
                      link=records.Link(message_bytes=2**20))
    out = io.StringIO()
    metrics.print_table([_row(verified=False, busy_s=None, gbps=None)], summary, Console(file=out, width=200))
    text = out.getvalue()
    assert "no delivered figure" in text and "link_ratio" not in text and "with chunks in flight" not in text
