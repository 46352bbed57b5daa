"""Named plan/schedule cases with expectations worked out by hand from the design.

``transfer`` runs a whole request through plan, schedule and the torch reference
pack/unpack between real (CPU) pools, with ctx pools filled by a function of the logical
coordinates, then checks every gen pool byte for byte: what must arrive did, nothing
else changed.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvlab.core.errors import ConfigError
from kvlab.memory.ops import reference
from kvlab.model.layout import runs
from kvlab.model.parallel import Layout, SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import preset as strategy_preset
from kvlab.model.schedule import preset_names, schedule
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


STRATEGY = {name: strategy_preset(name) for name in preset_names()}  # the presets of conf/transfer/


def preset(name: str) -> ModelSpec:
    d = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    d.pop("defaults", None)
    return ModelSpec(**d)


GQA8 = ModelSpec("gqa8", 4, "gqa", kv_heads=8, head_dim=16)
KV_HEAD_TOKEN = 2 * 16 * 2  # K and V, head_dim 16, bf16


def side(name, **kw) -> SideSpec:
    return SideSpec(name, **kw)


def summary(segs) -> set:
    return {(s.src, s.dst, s.rect.pool, s.rect.l0, s.rect.l1, s.rect.h0, s.rect.h1, s.rect.t0, s.rect.t1)
            for s in segs}


# ---------------------------------------------------------------- end-to-end through real pools

def comp_views(pool_t, rp, num_blocks):
    """[block, layer, head, token, row] per component, from the layout's definition."""
    nl, nh, tpb = len(rp.layers), len(rp.heads), rp.tokens_per_block
    rows = [e * ELEM_BYTES[d] for e, d in zip(rp.spec.comp_elems, rp.spec.comp_dtypes, strict=True)]
    per = nh * tpb * sum(rows)
    slabs = (pool_t.view(num_blocks, nl, per) if rp.layout == Layout.block_major
             else pool_t.view(nl, num_blocks, per).transpose(0, 1))
    out, off = [], 0
    for row in rows:
        out.append(slabs[:, :, off:off + nh * tpb * row].unflatten(-1, (nh, tpb, row)))
        off += nh * tpb * row
    return out


def values(rp, comp, n_logical, first_token=0, last_token=None):
    """Deterministic bytes of logical blocks [0, n_logical) of every (layer, head) of component ``comp``:
    [block, layer, head, token, row], zero outside tokens [first_token, last_token)."""
    tpb = rp.tokens_per_block
    row = rp.spec.comp_elems[comp] * ELEM_BYTES[rp.spec.comp_dtypes[comp]]
    layer = torch.tensor([rp.spec.layers[i] for i in rp.layers])[None, :, None, None, None]
    head = torch.tensor(list(rp.heads))[None, None, :, None, None]
    token = torch.arange(n_logical * tpb).view(n_logical, 1, 1, tpb, 1)
    byte = torch.arange(row)[None, None, None, None, :]
    v = layer * 1_000_003 + comp * 10_007 + head * 1_009 + token * 101 + byte + 7 * sum(map(ord, rp.name))
    v = ((v * 2654435761) >> 13) & 255
    keep = (token >= first_token) & (token < (last_token if last_token is not None else 1 << 62))
    return torch.where(keep, v, 0).to(torch.uint8)


def make_pools(model, spec, ranks, isl, fill, consecutive, gen):
    pools = {}
    for r in ranks:
        for rp in CacheState(model, spec, r).pools():
            n_logical = math.ceil(isl / rp.tokens_per_block)
            num_blocks = n_logical + 3
            if consecutive:
                table = torch.arange(1, n_logical + 1)
            else:
                table = torch.randperm(num_blocks, generator=gen)[:n_logical]
            t = torch.zeros(rp.pool_bytes(num_blocks), dtype=torch.uint8)
            if fill:
                for c, v in enumerate(comp_views(t, rp, num_blocks)):
                    v[table] = values(rp, c, n_logical)
            pools[(r, rp.name)] = (rp, num_blocks, table, t)
    return pools


def transfer(model, ctx, gen, req, strategy=STRATEGY["chunked"], slot=1 << 20, consecutive=False):
    """Move one request between real pools; returns the chunks after checking every gen byte."""
    g = torch.Generator().manual_seed(req.isl)
    segs = plan(model, ctx, gen, req)
    chunks = schedule(model, ctx, gen, segs, strategy, slot)
    cgroup = range(req.ctx_dp * ctx.pp * ctx.tp, (req.ctx_dp + 1) * ctx.pp * ctx.tp)
    ggroup = range(req.gen_dp * gen.pp * gen.tp, (req.gen_dp + 1) * gen.pp * gen.tp)
    src = make_pools(model, ctx, cgroup, req.isl, True, consecutive, g)
    dst = make_pools(model, gen, ggroup, req.isl, False, consecutive, g)
    for c in chunks:
        rp, nb, table, pool = src[(c.src, c.rect.pool)]
        wire = torch.empty(c.nbytes, dtype=torch.uint8)
        reference.pack(pool, rp, nb, c.rect, table, 0, wire)
        if c.ctx_in_place and consecutive:
            m0 = int(runs(rp, nb, c.rect, table, 0).mem[0])
            assert torch.equal(wire, pool[m0:m0 + c.nbytes]), "ctx_in_place chunk is not a slice of the ctx pool"
        rp, nb, table, pool = dst[(c.dst, c.rect.pool)]
        if c.gen_in_place and consecutive:
            m0 = int(runs(rp, nb, c.rect, table, 0).mem[0])
            pool[m0:m0 + c.nbytes] = wire
        else:
            reference.unpack(wire, rp, nb, c.rect, table, 0, pool)
    tile = math.gcd(ctx.tokens_per_block, gen.tokens_per_block)
    for (_, _), (rp, nb, table, pool) in dst.items():
        expect = torch.zeros_like(pool)
        first = max(0, req.isl - rp.spec.window) // tile * tile if rp.spec.window else 0
        for c, v in enumerate(comp_views(expect, rp, nb)):
            v[table] = values(rp, c, len(table), first, req.isl)
        assert torch.equal(pool, expect), f"gen pool {rp.name} differs"
    return chunks


# ---------------------------------------------------------------- tensor parallel

def test_gqa_tp4_to_tp2():
    isl = 50
    ctx, gen = side("ctx", tp=4), side("gen", tp=2)
    segs = plan(GQA8, ctx, gen, Request(0, isl))
    # gen rank g holds heads [4g, 4g+4); ctx rank c holds [2c, 2c+2)
    assert summary(segs) == {(c, c // 2, "kv", 0, 4, 2 * c, 2 * c + 2, 0, isl) for c in range(4)}
    assert all(s.nbytes == 4 * 2 * isl * KV_HEAD_TOKEN for s in segs)
    transfer(GQA8, ctx, gen, Request(0, isl))


def test_gqa_tp2_to_tp4():
    isl = 33
    ctx, gen = side("ctx", tp=2), side("gen", tp=4)
    segs = plan(GQA8, ctx, gen, Request(0, isl))
    assert summary(segs) == {(g // 2, g, "kv", 0, 4, 2 * g, 2 * g + 2, 0, isl) for g in range(4)}
    transfer(GQA8, ctx, gen, Request(0, isl), STRATEGY["layerwise"], slot=4096)


def test_non_power_of_two_ratio_tp3_to_tp2():
    m = preset("tiny_gqa")  # 6 kv heads
    ctx, gen = side("ctx", tp=3), side("gen", tp=2)
    segs = plan(m, ctx, gen, Request(0, 40))
    # gen0 holds heads 0-2: ctx0 has 0-1, ctx1 has 2-3; gen1 holds 3-5: ctx1 has 3, ctx2 has 4-5
    heads = {(s.src, s.dst, s.rect.h0, s.rect.h1) for s in segs}
    assert heads == {(0, 0, 0, 2), (1, 0, 2, 3), (1, 1, 3, 4), (2, 1, 4, 6)}
    assert sum(s.nbytes for s in segs) == m.request_bytes(40)
    transfer(m, ctx, gen, Request(0, 40), STRATEGY["chunked"], slot=2048)


def test_duplicated_heads_tp6_to_tp12():
    m = preset("tiny_gqa")
    ctx, gen = side("ctx", tp=6), side("gen", tp=12)
    segs = plan(m, ctx, gen, Request(0, 40))
    # each head lives on two gen ranks (2h, 2h+1) and one ctx rank (h): both copies arrive, from ctx h
    assert summary(segs) == {(g // 2, g, "kv", 0, 4, g // 2, g // 2 + 1, 0, 40) for g in range(12)}
    assert sum(s.nbytes for s in segs) == 2 * m.request_bytes(40)
    transfer(m, ctx, gen, Request(0, 40))


def test_duplicated_heads_on_ctx_come_from_one_copy():
    m = preset("tiny_gqa")
    ctx, gen = side("ctx", tp=12), side("gen", tp=6)
    segs = plan(m, ctx, gen, Request(0, 40))
    assert len(segs) == 6
    for s in segs:
        # gen rank h holds head h; ctx ranks 2h and 2h+1 both hold it
        assert (s.rect.h0, s.rect.h1) == (s.dst, s.dst + 1)
        assert s.src in (2 * s.dst, 2 * s.dst + 1)
    assert sum(s.nbytes for s in segs) == m.request_bytes(40)


# ---------------------------------------------------------------- pipeline parallel, attention-DP

def test_ctx_pp2_uneven_to_gen_pp3():
    m = ModelSpec("ten", 10, "gqa", kv_heads=2, head_dim=4)
    ctx = side("ctx", pp=2, layer_split=(3, 7))  # layers 0-2 | 3-9
    gen = side("gen", pp=3)  # even split, earlier stages take the remainder: 0-3 | 4-6 | 7-9
    segs = plan(m, ctx, gen, Request(0, 20))
    assert {(s.src, s.dst, s.rect.l0, s.rect.l1) for s in segs} == {
        (0, 0, 0, 3), (1, 0, 3, 4), (1, 1, 4, 7), (1, 2, 7, 10)}
    transfer(m, ctx, gen, Request(0, 20))


def test_pp_and_tp_mixed_on_both_sides():
    m = preset("tiny_swa")
    ctx = side("ctx", tp=2, pp=2, layer_split=(1, 5), tokens_per_block=16)
    gen = side("gen", tp=4, pp=3, tokens_per_block=8, layout=Layout.layer_major)
    transfer(m, ctx, gen, Request(0, 150), STRATEGY["layerwise"], slot=1024)


def test_attention_dp_groups():
    ctx = side("ctx", tp=2, dp=2)
    gen = side("gen", tp=4, dp=3)
    req = Request(7, 30, ctx_dp=1, gen_dp=2)
    segs = plan(GQA8, ctx, gen, req)
    assert {s.src for s in segs} == {2, 3}  # ctx DP group 1
    assert {s.dst for s in segs} == {8, 9, 10, 11}  # gen DP group 2
    assert all(s.request == 7 for s in segs)
    transfer(GQA8, ctx, gen, req)
    with pytest.raises(ConfigError, match="request.gen_dp"):
        plan(GQA8, ctx, gen, Request(0, 30, gen_dp=3))


# ---------------------------------------------------------------- MLA and the indexer

def test_mla_tp4_to_tp1_sends_from_one_ctx_rank():
    m = preset("tiny_mla")
    segs = plan(m, side("ctx", tp=4), side("gen", tp=1), Request(0, 64))
    assert {s.src for s in segs} == {0}
    assert sum(s.nbytes for s in segs) == 4 * 64 * 576 * 2
    # two gen ranks each get the latent once, from different ctx ranks so the load spreads
    segs = plan(m, side("ctx", tp=4), side("gen", tp=2), Request(0, 64))
    assert sorted(s.dst for s in segs) == [0, 1]
    assert len({s.src for s in segs}) == 2


@pytest.mark.parametrize("ctx_kw,gen_kw", [
    ({"tp": 4}, {"tp": 1}),
    ({"tp": 2, "pp": 2}, {"tp": 3, "pp": 3, "tokens_per_block": 16}),
    ({"pp": 4, "tokens_per_block": 64}, {"tp": 2, "dp": 2, "layout": Layout.layer_major}),
])
def test_indexer_travels_with_its_mla_layers(ctx_kw, gen_kw):
    m = preset("tiny_dsa")
    ctx, gen = side("ctx", **ctx_kw), side("gen", **gen_kw)
    segs = plan(m, ctx, gen, Request(0, 77))
    mla = {(s.src, s.dst, s.rect.l0, s.rect.l1, s.rect.t0, s.rect.t1): s for s in segs if s.rect.pool == "mla"}
    idx = {(s.src, s.dst, s.rect.l0, s.rect.l1, s.rect.t0, s.rect.t1): s for s in segs if s.rect.pool == "indexer"}
    assert mla.keys() == idx.keys() and len(mla) + len(idx) == len(segs)
    for k, s in idx.items():
        n_layers, n_tokens = k[3] - k[2], k[5] - k[4]
        assert s.nbytes == n_layers * n_tokens * 132
        assert mla[k].nbytes == n_layers * n_tokens * 576 * 2
    transfer(m, ctx, gen, Request(0, 77), STRATEGY["chunked"], slot=1 << 16)


# ---------------------------------------------------------------- sliding windows

def test_gpt_oss_moves_window_tiles_of_sliding_layers_only():
    m = preset("gpt_oss_120b")
    ctx, gen = side("ctx", tp=2), side("gen", tp=1)
    isl = 1000
    segs = plan(m, ctx, gen, Request(0, isl))
    sliding = [s for s in segs if s.rect.pool.endswith("w128")]
    full = [s for s in segs if s not in sliding]
    # window [872, 1000) starts inside the 32-token tile [864, 896): the move starts at 864
    assert {(s.rect.t0, s.rect.t1) for s in sliding} == {(864, 1000)}
    assert {(s.rect.t0, s.rect.t1) for s in full} == {(0, 1000)}
    per_token = 8 * 2 * 64 * 2  # one layer: 8 kv heads, K and V, head_dim 64, bf16
    assert sum(s.nbytes for s in sliding) == 18 * (1000 - 864) * per_token
    assert sum(s.nbytes for s in full) == 18 * 1000 * per_token
    # the sliding layers are the even ones
    pools = {p.name: p for p in m.pools()}
    for s in sliding:
        assert all(pools[s.rect.pool].layers[i] % 2 == 0 for i in range(s.rect.l0, s.rect.l1))

    short = plan(m, ctx, gen, Request(0, 100))  # shorter than the window: everything moves
    assert sum(s.nbytes for s in short) == 36 * 100 * per_token


def test_sliding_window_end_to_end():
    m = preset("tiny_swa")  # window 64 on even layers
    ctx = side("ctx", tp=4, tokens_per_block=16)
    gen = side("gen", tp=2, pp=2, tokens_per_block=32)
    chunks = transfer(m, ctx, gen, Request(0, 201), STRATEGY["zerocopy"], slot=4096)
    # window [137, 201) lies in 16-token tiles from 128 on
    assert min(c.rect.t0 for c in chunks if c.rect.pool == "kv_w64") == 128


# ---------------------------------------------------------------- block sizes, layouts, zero-copy

def test_ctx_block_32_to_gen_block_64():
    ctx = side("ctx", tokens_per_block=32)
    gen = side("gen", tokens_per_block=64)
    isl = 32 * 6 + 5
    two_blocks = 2 * 32 * 4 * 8 * KV_HEAD_TOKEN
    chunks = transfer(GQA8, ctx, gen, Request(0, isl), STRATEGY["zerocopy"], slot=two_blocks, consecutive=True)
    assert {c.rect.tile for c in chunks} == {32}
    assert [(c.rect.t0, c.rect.t1) for c in chunks] == [(0, 64), (64, 128), (128, 192), (192, 197)]
    # ctx: every whole 32-token block of all layers and heads is already in wire order; the tail is not
    assert [c.ctx_in_place for c in chunks] == [True, True, True, False]
    # gen: a 32-token tile is half a 64-token block, K and V of 8 heads interleave: never in place
    assert not any(c.gen_in_place for c in chunks)


def test_block_major_to_layer_major():
    ctx = side("ctx", tokens_per_block=16, layout=Layout.block_major)
    gen = side("gen", tokens_per_block=16, layout=Layout.layer_major)
    req = Request(0, 64)
    assert plan(GQA8, ctx, gen, req) == plan(GQA8, ctx, side("gen", tokens_per_block=16), req)
    block_all_layers = 4 * 8 * 16 * KV_HEAD_TOKEN
    many = transfer(GQA8, ctx, gen, req, STRATEGY["zerocopy"], slot=block_all_layers, consecutive=True)
    # a slot of one block of all layers: in place on block_major, spans layers on layer_major
    assert all(c.ctx_in_place and not c.gen_in_place and c.rect.l1 - c.rect.l0 == 4 for c in many)
    one_layer = transfer(GQA8, ctx, gen, req, STRATEGY["zerocopy"], slot=block_all_layers // 4, consecutive=True)
    # one layer of one block: a slice of either layout
    assert all(c.ctx_in_place and c.gen_in_place and c.rect.l1 - c.rect.l0 == 1 for c in one_layer)


def test_zerocopy_whole_blocks_in_place_partial_tail_not():
    ctx = side("ctx", tokens_per_block=16)
    gen = side("gen", tokens_per_block=16)
    isl = 16 * 5 + 7
    chunks = transfer(GQA8, ctx, gen, Request(0, isl), STRATEGY["zerocopy"], slot=1 << 20, consecutive=True)
    spans = [(c.rect.t0, c.rect.t1, c.ctx_in_place, c.gen_in_place) for c in chunks]
    assert spans == [(0, 80, True, True), (80, 87, False, False)]
    # the same layout on a layer_major pair: chunks span all 4 layers, so neither side can take them in place
    lm = side("ctx", tokens_per_block=16, layout=Layout.layer_major)
    chunks = transfer(GQA8, lm, side("gen", tokens_per_block=16, layout=Layout.layer_major), Request(0, isl),
                      STRATEGY["zerocopy"], slot=1 << 20, consecutive=True)
    assert not any(c.ctx_in_place or c.gen_in_place for c in chunks)


def test_naive_is_one_chunk_per_segment_whatever_the_slot():
    segs = plan(GQA8, side("ctx", tp=4), side("gen", tp=2), Request(0, 1000))
    chunks = schedule(GQA8, side("ctx", tp=4), side("gen", tp=2), segs, STRATEGY["naive"], 1)
    assert [(c.src, c.dst, c.rect, c.nbytes) for c in chunks] == [(s.src, s.dst, s.rect, s.nbytes) for s in segs]


def test_slot_smaller_than_a_token_row_is_a_config_error():
    segs = plan(GQA8, side("ctx"), side("gen"), Request(0, 10))
    row = 8 * KV_HEAD_TOKEN  # one token of one layer, all 8 heads
    schedule(GQA8, side("ctx"), side("gen"), segs, STRATEGY["chunked"], row)
    with pytest.raises(ConfigError, match="transfer.slot_mib"):
        schedule(GQA8, side("ctx"), side("gen"), segs, STRATEGY["chunked"], row - 1)


def test_tiny_slot_zerocopy_stays_within_the_slot():
    # a slot of 3 token rows: chunks are cut inside the tile, the partial tail included
    row = 8 * KV_HEAD_TOKEN
    chunks = transfer(GQA8, side("ctx", tokens_per_block=8), side("gen", tokens_per_block=8), Request(0, 21),
                      STRATEGY["zerocopy"], slot=3 * row)
    assert max(c.nbytes for c in chunks) <= 3 * row


def test_plan_rejects_a_head_split_the_sides_cannot_make():
    m = preset("tiny_gqa")  # 6 kv heads: tp 4 would leave heads 4 and 5 on no rank
    with pytest.raises(ConfigError, match="ctx.tp"):
        plan(m, side("ctx", tp=4), side("gen"), Request(0, 8))
    with pytest.raises(ConfigError, match="gen.pp"):
        plan(m, side("ctx"), side("gen", pp=5), Request(0, 8))
