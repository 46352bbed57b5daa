"""What a chunk is capped at for the run's transport (``Setup.chunk_cap``), and what follows from it.

A transport that stages cuts chunks to its slot (16 MiB unless ``transfer.slot_mib`` is set). A
pulling transport (``ipc``) has no slot: unless the user sets ``transfer.slot_mib``, a chunk is one
segment (per ready layer for a layer-wise cut). The schedule must still cover the plan's bytes
exactly once (the oracle of test_plan_properties), and the plan, cost model, memory budget and
``kvlab plan`` must agree with the schedule.
"""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan_properties import SCALE, SETTINGS, STRATEGY, Case, cases, check_plan, check_schedule

from kvlab.cli import commands as cli
from kvlab.cli.plan_cmd import summarize
from kvlab.config.schema import DEFAULT_SLOT_MIB, build, compose
from kvlab.config.workload import plan_run
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import Cut, schedule
from kvlab.sizing import budget
from kvlab.sizing.cost import predict
from kvlab.transports.ipc import copy_pieces

QUIET = ["logger=quiet"]
UNCAPPED = 1 << 62  # what check_schedule compares chunk sizes with when nothing caps them


def check_uncut(case: Case, segs, chunks) -> None:
    """One chunk per segment, or per (segment, layer) for a layer-wise cut, each over the segment's tokens."""
    # a context-parallel rank owes a gen rank one segment per chunk of its tokens: a segment is its token span too
    def key(x):
        return x.src, x.dst, x.rect.pool, x.rect.t0, x.rect.t1

    per_seg = Counter(key(c) for c in chunks)
    for s in segs:
        n = s.rect.l1 - s.rect.l0 if case.strategy.cut == Cut.layer else 1
        assert per_seg[key(s)] == n, (s, n)
    assert set(per_seg) == {key(s) for s in segs}
    assert sum(c.nbytes for c in chunks) == sum(s.nbytes for s in segs)


@settings(max_examples=int(400 * SCALE), **SETTINGS)
@given(cases(strategies=(STRATEGY["naive"], STRATEGY["chunked"], STRATEGY["layerwise"], STRATEGY["zerocopy"])))
def test_uncut_chunks_cover_the_plan_exactly_once(case):
    segs = plan(case.model, case.ctx, case.gen, case.req)
    check_plan(case, segs)
    chunks = schedule(case.model, case.ctx, case.gen, segs, case.strategy, None)
    check_schedule(Case(case.model, case.ctx, case.gen, case.req, case.strategy, UNCAPPED), segs, chunks)
    check_uncut(case, segs, chunks)


@settings(max_examples=int(300 * SCALE), **SETTINGS)
@given(cases(strategies=(STRATEGY["chunked"], STRATEGY["layerwise"])))
def test_an_uncut_chunk_is_copied_in_bounded_pieces_exactly_once(case):
    """ipc's copies that build index tensors (torch, CPU rows) go in pieces: flat memory whatever the chunk."""
    segs = plan(case.model, case.ctx, case.gen, case.req)
    pools = {p.name: p for p in case.model.pools(case.ctx.dtype)}
    for c in schedule(case.model, case.ctx, case.gen, segs, case.strategy, None):
        rows = pools[c.rect.pool].comp_row_bytes()
        assert copy_pieces(c.rect, rows, "cuda") == [c.rect]
        pieces = copy_pieces(c.rect, rows, "torch", case.slot_bytes)
        assert all(p.nbytes(rows) <= case.slot_bytes for p in pieces)
        assert sum(p.nbytes(rows) for p in pieces) == c.nbytes
        cover = Counter((layer, t) for p in pieces for layer in range(p.l0, p.l1) for t in (p.t0, p.t1))
        # within each layer the pieces' token intervals abut: every inner bound is one's end and the next's start
        for layer in range(c.rect.l0, c.rect.l1):
            assert cover[(layer, c.rect.t0)] == 1 and cover[(layer, c.rect.t1)] == 1
        assert all(n == 2 for (layer, t), n in cover.items() if t not in (c.rect.t0, c.rect.t1))
        assert all((p.h0, p.h1, p.tile, p.pool) == (c.rect.h0, c.rect.h1, c.rect.tile, c.rect.pool) for p in pieces)


@settings(max_examples=int(300 * SCALE), **SETTINGS)
@given(cases(strategies=(STRATEGY["chunked"], STRATEGY["layerwise"], STRATEGY["zerocopy"])))
def test_a_cap_never_gives_fewer_chunks_than_none(case):
    segs = plan(case.model, case.ctx, case.gen, case.req)
    capped = schedule(case.model, case.ctx, case.gen, segs, case.strategy, case.slot_bytes)
    uncut = schedule(case.model, case.ctx, case.gen, segs, case.strategy, None)
    assert len(uncut) <= len(capped)
    assert sum(c.nbytes for c in uncut) == sum(c.nbytes for c in capped)


@pytest.mark.parametrize("transport, slot_mib, cap", [
    ("p2p", None, int(DEFAULT_SLOT_MIB * 2**20)), ("p2p", 1, 2**20), ("ipc", None, None), ("ipc", 1, 2**20),
    ("ipc", DEFAULT_SLOT_MIB, int(DEFAULT_SLOT_MIB * 2**20)), ("nixl", None, int(DEFAULT_SLOT_MIB * 2**20))])
def test_the_cap_follows_the_transport_and_an_explicit_slot(transport, slot_mib, cap):
    extra = [] if slot_mib is None else [f"transfer.slot_mib={slot_mib}"]
    setup = build(compose(QUIET + [f"transport={transport}", *extra]))
    assert setup.chunk_cap == cap
    assert setup.transfer.slot_bytes == int((slot_mib or DEFAULT_SLOT_MIB) * 2**20)  # staging's slot, as before
    # the record keeps the difference: a rebuilt run cuts its chunks the same way
    assert build(compose(QUIET)).to_dict()["transfer"]["slot_mib"] is None
    assert setup.to_dict()["transfer"]["slot_mib"] == slot_mib


GEMMA = ["model=gemma3_27b", "ctx.tp=2", "gen.tp=1", "gen.layout=layer_major", "gen.tokens_per_block=64",
         "workload.isl=32768", "cost=h200"]


@pytest.mark.parametrize("transfer", ["chunked", "layerwise", "zerocopy", "naive"])
def test_plan_cost_and_budget_follow_the_schedule(transfer):
    pull = build(compose(GEMMA + [f"transfer={transfer}", "transport=ipc"]))
    push = build(compose(GEMMA + [f"transfer={transfer}", "transport=p2p"]))
    s_pull, s_push = summarize(pull), summarize(push)
    assert s_pull["total_bytes"] == s_push["total_bytes"]
    segments = sum(p["segments"] for p in s_pull["pairs"])
    layers = sum(s.rect.l1 - s.rect.l0 for s in plan(pull.model, pull.ctx, pull.gen, plan_run(pull).requests[0]))
    want = layers if transfer == "layerwise" else segments
    assert s_pull["total_chunks"] == want and s_pull["chunk_cap_bytes"] is None
    if transfer != "naive":  # 204 slot-sized chunks over p2p at the default slot
        assert s_push["total_chunks"] > want and s_push["chunk_cap_bytes"] == push.transfer.slot_bytes
    # the budget counts the same chunks, and no staging for the pulling transport
    b = budget.estimate(pull)
    assert b.chunks_per_request == want and all(r.staging == 0 for r in b.ranks)
    assert all(r.staging > 0 for r in budget.estimate(push).ranks)
    # the cost model walks the same chunks: one message each, no extra memory
    p = predict(pull, [32768])
    assert p.messages == want and p.extra_bytes == 0


def test_run_order_is_uncut_for_ipc():
    setup = build(compose(QUIET + ["transport=ipc", "transfer=layerwise", "workload.requests=3"]))
    run = plan_run(setup)
    requests, segments, order = run.requests, run.segments, run.order
    for r in requests:
        mine = [c for c in order if c.request == r.id]
        assert len(mine) == sum(s.rect.l1 - s.rect.l0 for s in segments[r.id])
        assert sum(c.nbytes for c in mine) == sum(s.nbytes for s in segments[r.id])


def test_a_slot_row_is_checked_only_where_there_is_a_cap():
    # a 1-byte slot cannot hold a token row: refused with a cap, irrelevant without one
    with pytest.raises(Exception, match=r"^transfer.slot_mib=1e-06: a slot must hold one token row"):
        build(compose(QUIET + ["transport=ipc", "transfer.slot_mib=0.000001"]))
    build(compose(QUIET + ["transport=ipc"]))


def test_kvlab_plan_says_chunks_are_not_cut(tmp_path, capsys):
    run_dir = tmp_path / "plan"
    cli.main(["plan", f"hydra.run.dir={run_dir}", "transport=ipc"])
    out = " ".join(capsys.readouterr().out.split())  # the table's title wraps
    data = json.loads((run_dir / "plan.json").read_text())
    assert data["chunk_cap_bytes"] is None and data["total_chunks"] == sum(p["segments"] for p in data["pairs"])
    assert "chunks not cut by size (ipc pulls)" in out
    assert data["memory"]["ranks"][0]["staging"] == 0


@settings(max_examples=12, deadline=None)
@given(ctx_dp=st.integers(1, 4), gen_dp=st.integers(1, 4), ctx_tp=st.sampled_from([1, 2]),
       gen_tp=st.sampled_from([1, 2]), model=st.sampled_from(["tiny_gqa", "tiny_swa", "tiny_mla"]))
def test_a_rank_s_staging_is_what_the_requests_to_its_dp_group_give_it(ctx_dp, gen_dp, ctx_tp, gen_tp, model):
    """The budget plans one request, to DP group 0, and gives every rank what its place in group 0 needs (a request
    to other groups is the same plan offset by whole groups). The reference plans one request for every combination
    of groups the requests cycle through, and filters each rank's segments out of all of them; a naive transfer
    stages a buffer per segment in flight, so each rank's staging shows both its count and its largest."""
    setup = build(compose([f"model={model}", f"ctx.dp={ctx_dp}", f"gen.dp={gen_dp}", f"ctx.tp={ctx_tp}",
                           f"gen.tp={gen_tp}", "transfer=naive", *QUIET]))
    b = budget.estimate(setup)
    t, tokens = setup.transfer, b.longest[2]
    samples = [plan(setup.model, setup.ctx, setup.gen, Request(i, tokens, i % ctx_dp, i % gen_dp))
               for i in range(math.lcm(ctx_dp, gen_dp))]
    for need in b.ranks:
        side, r = setup.side_of(need.world_rank)
        mine = [[s for s in segs if (s.src if side.name == "ctx" else s.dst) == r] for segs in samples]
        in_flight = min(t.slots, b.open_requests * max(len(segs) for segs in mine))
        assert need.staging == in_flight * max((s.nbytes for segs in mine for s in segs), default=0), need.name
