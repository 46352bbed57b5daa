"""Context parallelism: the token splits (kvlab.model.tokens), the rank numbering, the prefill's time, and runs
end to end over the transports, with the decode check reassembling a DCP group's shards in token order.

The plan's exact cover over cp, dcp, interleave, TP, PP, DP, block sizes and prompt lengths is drawn in
tests/test_plan_properties.py; the bad combinations are in tests/test_bad_input.py's catalogue.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import E2E, check_figures
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_check import run_decode
from test_mooncake import _loads as mooncake_loads

from kvlab.api import run_transfer
from kvlab.config.schema import build, compose
from kvlab.config.workload import make_requests
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import plan
from kvlab.model.prefill import PrefillSpec, layer_seconds
from kvlab.model.tokens import Tokens, boundary

QUIET = ["logger=quiet", "transfer.baseline=false"]


# ---------------------------------------------------------------- the token splits

@settings(max_examples=200, deadline=None)
@given(isl=st.integers(1, 5000), cp=st.integers(1, 6), align=st.sampled_from([1, 8, 16, 64]),
       scheme=st.sampled_from(["contiguous", "load_balanced"]))
def test_cp_chunks_cover_the_prompt_once_in_whole_blocks(isl, cp, align, scheme):
    held = [Tokens(scheme, cp, r, align=align).chunks(isl) for r in range(cp)]
    every = sorted(iv for chunks in held for iv in chunks)
    assert every[0][0] == 0 and every[-1][1] == isl
    assert all(a[1] == b[0] for a, b in zip(every, every[1:]))  # no gap, no overlap
    assert all(a % align == 0 for a, _ in every)  # a chunk starts a block of the prefill rank
    n = 2 * cp if scheme == "load_balanced" else cp
    sizes = [b - a for a, b in every]
    # whole blocks as even as they go: at most one block apart, the prompt's tail aside
    assert max(sizes[:-1] or [0]) - min(sizes) <= align + (align - isl % align) % align
    assert len(every) <= n
    if scheme == "load_balanced" and isl >= 2 * cp * align:  # rank r: chunks r and 2cp-1-r of 2cp
        bounds = sorted({a for a, _ in every} | {isl})
        for r, chunks in enumerate(held):
            assert chunks == [(bounds[r], bounds[r + 1]), (bounds[n - 1 - r], bounds[n - r])]


@settings(max_examples=200, deadline=None)
@given(isl=st.integers(1, 3000), dcp=st.integers(2, 5), interleave=st.sampled_from([1, 2, 4, 16]))
def test_dcp_ranks_hold_interleave_runs_in_local_order(isl, dcp, interleave):
    owner = [(t // interleave) % dcp for t in range(isl)]
    for d in range(dcp):
        t = Tokens("interleaved", dcp, d, interleave)
        mine = [x for x in range(isl) if owner[x] == d]
        assert t.count(isl) == len(mine)
        assert t.to_global(torch.arange(len(mine))).tolist() == mine  # local position u -> its global token
        assert all(t.local_ceil(x) == sum(1 for y in mine if y < x) for x in (0, isl // 3, isl - 1, isl))


def test_ranks_are_numbered_tp_then_cp_then_pp_then_dp_and_dcp_inside_tp():
    ctx = SideSpec("ctx", tp=2, pp=2, dp=2, cp=3, tokens_per_block=16)
    assert ctx.size == 24  # CP ranks add to the world
    c = ctx.coord(ctx.rank(dp=1, pp=1, tp=1, cp=2))
    assert (c.dp, c.pp, c.cp, c.tp) == (1, 1, 2, 1)
    assert [ctx.coord(r).cp for r in range(6)] == [0, 0, 1, 1, 2, 2]  # TP innermost, as TensorRT-LLM
    gen = SideSpec("gen", tp=2, dcp=2, dcp_interleave=4, tokens_per_block=16)
    assert gen.size == 4  # a TP group of tp * dcp ranks: vLLM's --tensor-parallel-size 4 --dcp 2
    assert [gen.head_range(8, t) for t in range(4)] == [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]
    from test_plan_properties import preset

    m = preset("tiny_gqa")
    assert [gen.tokens(r, m).rank for r in range(4)] == [0, 1, 0, 1]  # consecutive TP ranks form a DCP group


@settings(max_examples=200, deadline=None)
@given(isl=st.integers(1, 100_000), n=st.integers(1, 2048), align=st.sampled_from([1, 16, 32, 64, 256]))
def test_a_chunk_boundary_in_closed_form_is_the_block_by_block_walk(isl, n, align):
    """``boundary`` gives any one boundary at once (a rank's chunks cost the same whatever the CP degree); the
    reference walks the blocks out chunk by chunk, earlier chunks taking the extra block."""
    blocks = -(-isl // align)
    walk, b = [0], 0
    for i in range(n):
        b += blocks // n + (1 if i < blocks % n else 0)
        walk.append(min(isl, b * align))
    assert [boundary(isl, n, align, i) for i in range(n + 1)] == walk


@pytest.mark.parametrize("model", ["gemma3_27b", "deepseek_v32", "gpt_oss_120b"])
def test_layers_of_one_kind_are_costed_once_as_each_layer_would_be(model):
    """A CP prefill's layer time is worked out once per layer kind (its window or top-k, dense or MoE): the
    same figures as the slowest CP rank of each layer on its own, for models whose layers differ."""
    from kvlab.model.prefill import layer_flops, layer_kind

    m = build(compose([f"model={model}"])).model
    spec, n = PrefillSpec(), 50_000
    cp = Tokens("load_balanced", 3, 0, align=64)
    ranks = [Tokens("load_balanced", 3, r, align=64).chunks(n) for r in range(3)]
    rate = spec.tflops * 1e12 * spec.mfu
    each = [max(sum(layer_flops(m, layer, n, q) for q in chunks) for chunks in ranks) / rate
            for layer in range(m.num_layers)]
    assert layer_seconds(m, spec, 1, n, cp) == each
    assert len({layer_kind(m, layer) for layer in range(m.num_layers)}) > 1  # the models chosen mix kinds


@settings(max_examples=60, deadline=None)
@given(model=st.sampled_from(["tiny_gqa", "tiny_swa", "tiny_dsa"]), isl=st.integers(1, 20_000),
       split=st.sampled_from([("ctx", dict(cp=3, cp_scheme="load_balanced")), ("ctx", dict(cp=2)),
                              ("gen", dict(dcp=2, dcp_interleave=4)), ("gen", {})]),
       tpb=st.sampled_from([16, 32, 64]), data=st.data())
def test_a_rank_s_blocks_counted_without_the_table_are_the_table_s(model, isl, split, tpb, data):
    """``held_blocks`` counts the union of a rank's spans in closed form (a budget asks it of prompts of 2**32
    tokens, whose table would be a list of 2**28 entries): the count of the table's held entries."""
    from kvlab.model.state import CacheState

    name, kw = split
    m = build(compose([f"model={model}"])).model
    side = SideSpec(name, tokens_per_block=tpb, **kw)
    rank = data.draw(st.integers(0, side.size - 1))
    for pool in CacheState(m, side, rank).pools():
        assert pool.held_blocks(isl) == sum(pool.block_table(isl)[1]), (pool.name, rank)


def test_a_dp_group_s_ranks_are_bounded_by_their_product_naming_the_largest():
    from kvlab.core.errors import ConfigError
    from kvlab.model.parallel import MAX_GROUP

    assert SideSpec("ctx", tp=8, cp=MAX_GROUP // 8).size == MAX_GROUP  # the bound itself is a group
    with pytest.raises(ConfigError) as e:
        SideSpec("gen", tp=8, pp=2, dcp=MAX_GROUP // 8)
    assert str(e.value).startswith(f"gen.dcp={MAX_GROUP // 8}:") and f"use gen.dcp <= {MAX_GROUP // 16}" in str(e.value)
    with pytest.raises(ConfigError) as e:  # no one size can fix it alone: the line says so
        SideSpec("ctx", tp=MAX_GROUP * 2, pp=MAX_GROUP * 2)
    assert "lower ctx.tp, ctx.pp, ctx.cp, ctx.dcp" in str(e.value)


def test_the_prefill_layer_ends_with_its_slowest_cp_rank():
    from test_plan_properties import preset

    m = build(compose(["model=llama3_8b"])).model
    spec, n = PrefillSpec(), 65536
    one = sum(layer_seconds(m, spec, 1, n))
    contiguous = sum(layer_seconds(m, spec, 1, n, Tokens("contiguous", 4, 0, align=32)))
    balanced = sum(layer_seconds(m, spec, 1, n, Tokens("load_balanced", 4, 0, align=32)))
    # causal attention leaves the last contiguous chunk the most keys; the zig-zag pairs evens it out
    assert balanced < contiguous < one
    assert balanced == pytest.approx(one / 4, rel=1e-3)
    assert sum(layer_seconds(preset("tiny_gqa"), PrefillSpec(layer_ms=2), 1, n, Tokens("contiguous", 2, 0))) == \
        pytest.approx(preset("tiny_gqa").num_layers * 2e-3)


def test_a_cp_rank_allocates_its_chunks_only_and_a_dcp_rank_its_runs():
    s = build(compose(["ctx.cp=2", "ctx.cp_scheme=load_balanced", "ctx.tp=1", "ctx.tokens_per_block=16",
                       "gen.dcp=2", "gen.tokens_per_block=16", "gen.dcp_interleave=4", "workload.isl=100"]))
    from kvlab.model.state import CacheState

    ctx0 = CacheState(s.model, s.ctx, 0).pools()[0]
    # 7 blocks in 4 chunks of 2, 2, 2, 1: rank 0 holds chunks 0 and 3, blocks 0-1 and 6, none between
    assert ctx0.held(100) == [(0, 32), (96, 100)]
    assert ctx0.block_table(100) == (0, [True, True, False, False, False, False, True])
    gen1 = CacheState(s.model, s.gen, 1).pools()[0]
    assert gen1.held(100) == [(0, 48)] and gen1.held_blocks(100) == 3


# ---------------------------------------------------------------- end to end

TRANSPORTS = ["p2p", "ipc"] + (["nixl"] if importlib.util.find_spec("nixl_cu13") else []) + \
    (["mooncake"] if mooncake_loads() else [])


@pytest.mark.slow
@settings(max_examples=3, **E2E)
@given(transport=st.sampled_from(TRANSPORTS), transfer=st.sampled_from(["chunked", "layerwise", "zerocopy", "naive"]),
       cp=st.sampled_from([(1, "contiguous"), (2, "contiguous"), (2, "load_balanced")]),
       dcp=st.sampled_from([(1, 1), (2, 1), (2, 8), (3, 4)]), ctx_tp=st.sampled_from([1, 2]),
       model=st.sampled_from(["tiny_gqa", "tiny_mla", "tiny_swa"]), isl=st.integers(40, 700))
def test_cp_to_dcp_runs_verified(transport, transfer, cp, dcp, ctx_tp, model, isl, tmp_path_factory):
    if cp[0] == 1 and dcp[0] == 1:
        cp = (2, "load_balanced")
    overrides = [f"model={model}", "model.num_layers=2", f"transport={transport}", f"transfer={transfer}",
                 f"ctx.cp={cp[0]}", f"ctx.cp_scheme={cp[1]}", f"ctx.tp={ctx_tp}", "gen.tp=1", f"gen.dcp={dcp[0]}",
                 f"gen.dcp_interleave={dcp[1]}", "ctx.tokens_per_block=16", "gen.tokens_per_block=8",
                 "workload.requests=2", f"workload.isl={isl}", "transfer.slot_mib=0.02"]
    if transport == "ipc":
        overrides.remove("transfer.slot_mib=0.02")
    elif transport in ("nixl", "mooncake") and transfer != "naive":  # staged through slots, or pool to pool
        overrides.append(f"transport.mode={'direct' if isl % 2 else 'staged'}")
    tmp_path = tmp_path_factory.mktemp("cp")
    summary = run_transfer(overrides + QUIET, tmp_path)
    assert summary["verified"] and summary["failed_requests"] == [] and summary["errors"] == [], summary
    setup = build(compose(overrides + QUIET))
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    for req, row in zip(make_requests(setup), rows):
        assert row["bytes"] == sum(s.nbytes for s in plan(setup.model, setup.ctx, setup.gen, req))
    check_figures(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_decode_reassembles_a_dcp_group_in_token_order_and_a_misplaced_run_fails(kvlab_cli, tmp_path):
    args = ["model=llama3_8b", "ctx.cp=2", "ctx.cp_scheme=load_balanced", "ctx.tp=1", "gen.dcp=2",
            "gen.dcp_interleave=4", "workload.isl=61", "workload.requests=1", "check.tokens=4"]
    for d in ("good", "bad"):
        (tmp_path / d).mkdir()
    res, summary, rows, _ = run_decode(kvlab_cli, tmp_path / "good", *args)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert summary["decode_tokens_equal"] == 4 and summary["decode_max_logit_diff"] == 0.0
    assert "check=decode: 1/1 requests decode as the reference" in res.stdout
    res, summary, rows, _ = run_decode(kvlab_cli, tmp_path / "bad", *args, "fault.misplaced_run=3")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert rows[0]["byte_check_failures"] == 0  # every byte arrived where it belongs: only the gather is wrong
    assert "every byte sent verified, and decoding still diverged" in res.stdout
