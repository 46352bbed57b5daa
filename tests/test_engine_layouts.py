"""The engines' own cache layouts (kvlab.model.engine_layouts), checked against views built from the engines' tensor
shapes as the engines' code writes them, never from kvlab's orders or strides:

    vLLM            KVCacheLayout: one logical [L, B, H, N, C] tensor whose strides follow a stride permutation
                    (VLLM_STRIDE_ORDERS, as vllm/v1/kv_cache_layout.py writes them; strides as its
                    compute_layout_strides derives them), C a cell's K then V bytes;
                    K/V planes per layer [2, blocks, block_size, H, D] (NHD) or [2, blocks, H, block_size, D] (HND);
                    FlashAttention [blocks, H, block_size, 2*D]; MLA [blocks, block_size, 576];
                    DeepSeek-V3.2 indexer [blocks, block_size*132]: every token's 128 value bytes, then the scales
    FlashInfer      per layer [pages, 2, page_size, H, D] (NHD) or [pages, 2, H, page_size, D] (HND)
    SGLang          per layer k_buffer, v_buffer [slots, H, D] (slot = page*page_size + offset); MLA [slots, 1, 576];
                    DSA index K (pages, page_size*132): keys, then scales
    TensorRT-LLM    {blocks, layers, kvFactor, H*tokens_per_block*D}; the indexer pool {blocks, layers, 1, tpb*132}

An arange "pool" read through those views gives the address of every element; packing it through kvlab's
runs must give the same bytes in wire order, unpacking must land them there and nowhere else, and a chunk
is in place exactly where those addresses are consecutive.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kvlab.core.errors import ConfigError
from kvlab.memory.cache import PagedCache, blocks_for
from kvlab.memory.ops import cpu, get_ops, reference
from kvlab.model.engine_layouts import LAYOUTS, NAMES, EngineLayout
from kvlab.model.layout import Rect, first_byte, is_in_place, runs
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import preset, preset_names, schedule
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState, RankPool, wire_tile

SCALE = settings.default.max_examples / 100  # a tenth under `pytest -m "not slow"` (tests/conftest.py)
SETTINGS = settings(max_examples=int(200 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# vLLM's KVCacheLayout members: the stride permutation of the logical [L, B, H, N, C] dims (vllm/v1/kv_cache_layout.py)
VLLM_STRIDE_ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def vllm_view(t: torch.Tensor, order: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The logical [L, B, H, N, C bytes] view of a dense buffer, strides as vLLM's compute_layout_strides makes
    them: walking the permutation from its innermost dim out, each dim's stride is the size of what lies inside."""
    strides, cur = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    return t.as_strided(shape, strides)


def engine_views(t: torch.Tensor, rp: RankPool, nb: int) -> list[torch.Tensor]:
    """One [block, layer, head, token, row bytes] view of pool tensor ``t`` per component, through the engine's
    own shape (the module's docstring)."""
    nl, nh, n = len(rp.layers), len(rp.heads), rp.tokens_per_block
    rows = rp.rows
    kind = str(getattr(rp.spec.kind, "value", rp.spec.kind))
    name = rp.layout.value
    if name == "block_major":  # [block][layer][comp][head][token][row]
        slab = t.view(nb, nl, -1)
        return _split(slab, rows, nh, n)
    if name == "layer_major":
        return _split(t.view(nl, nb, -1).transpose(0, 1), rows, nh, n)
    if name == "trtllm":  # {blocks, layers, kvFactor, H*tpb*D}; the indexer pool values then scales per block
        return _split(t.view(nb, nl, -1), rows, nh, n)
    if name in VLLM_STRIDE_ORDERS:  # [L, B, H, N, C]: C is K then V (one row for MLA)
        order = VLLM_STRIDE_ORDERS[name]
        if kind == "indexer":  # one cell per block and head: every token's values, then their scales
            cell = vllm_view(t, order, (nl, nb, nh, 1, n * sum(rows)))[:, :, :, 0].transpose(0, 1)
            return [cell[..., :n * rows[0]].unflatten(-1, (n, rows[0])),
                    cell[..., n * rows[0]:].unflatten(-1, (n, rows[1]))]
        cells = vllm_view(t, order, (nl, nb, nh, n, sum(rows))).transpose(0, 1)
        out, off = [], 0
        for row in rows:
            out.append(cells[..., off:off + row])
            off += row
        return out
    if kind == "indexer":  # vLLM / SGLang: per layer [blocks, block_size*132], values of every token, then scales
        blocks = t.view(nl, nb, n * sum(rows)).transpose(0, 1)
        return [blocks[:, :, None, :n * rows[0]].unflatten(-1, (n, rows[0])),
                blocks[:, :, None, n * rows[0]:].unflatten(-1, (n, rows[1]))]
    if kind == "mla":  # vLLM [blocks, block_size, 576], SGLang [slots, 1, 576]: one row per token
        return [t.view(nl, nb, n, 1, rows[0]).permute(1, 0, 3, 2, 4)]
    (row,) = set(rows)  # K and V
    if name == "vllm_lbnhc":  # per layer [2, blocks, block_size, H, D]
        kv = t.view(nl, 2, nb, n, nh, row)
        return [kv[:, c].permute(1, 0, 3, 2, 4) for c in range(2)]
    if name == "vllm_lbhnc":  # per layer [2, blocks, H, block_size, D]
        kv = t.view(nl, 2, nb, nh, n, row)
        return [kv[:, c].transpose(0, 1) for c in range(2)]
    if name == "vllm_flash":  # per layer [blocks, H, block_size, 2*D], split as transpose(1,2).split(D, -1)
        kv = t.view(nl, nb, nh, n, 2 * row).transpose(0, 1)
        return [kv[..., :row], kv[..., row:]]
    if name == "flashinfer_nhd":  # per layer [pages, 2, page_size, H, D]
        kv = t.view(nl, nb, 2, n, nh, row).transpose(0, 1)
        return [kv[:, :, c].transpose(2, 3) for c in range(2)]
    if name == "flashinfer_hnd":  # per layer [pages, 2, H, page_size, D]
        kv = t.view(nl, nb, 2, nh, n, row).transpose(0, 1)
        return [kv[:, :, c] for c in range(2)]
    if name == "sglang":  # per layer k_buffer[l], v_buffer[l]: [slots, H, D], slot = page * page_size + offset
        kv = t.view(nl, 2, nb * n, nh, row)
        return [kv[:, c].unflatten(1, (nb, n)).permute(1, 0, 3, 2, 4) for c in range(2)]
    raise AssertionError(name)


def _split(slab: torch.Tensor, rows, nh: int, n: int) -> list[torch.Tensor]:
    out, off = [], 0
    for row in rows:
        out.append(slab[:, :, off:off + nh * n * row].unflatten(-1, (nh, n, row)))
        off += nh * n * row
    return out


def engine_wire(t: torch.Tensor, rp: RankPool, nb: int, rect: Rect, ids, base: int) -> torch.Tensor:
    """The wire order of ``rect`` (kvlab.model.layout's docstring) read through the engine's views."""
    views = engine_views(t, rp, nb)
    tpb, T = rp.tokens_per_block, rect.tile
    parts, a = [], rect.t0
    while a < rect.t1:
        e = min((a // T + 1) * T, rect.t1)
        b, w = int(ids[a // tpb - base]), a % tpb
        for layer in range(rect.l0, rect.l1):
            for v in views:
                for h in range(rect.h0, rect.h1):
                    parts.append(v[b, layer - rp.layers.start, h - rp.heads.start, w:w + e - a].reshape(-1))
        a = e
    return torch.cat(parts)


MODELS = {"gqa": ModelSpec("g", 3, "gqa", kv_heads=4, head_dim=3), "mla": ModelSpec("m", 2, "mla", mla_dim=5),
          "dsa": ModelSpec("d", 2, "mla", mla_dim=5, indexer=True)}


def fits(layout: str, model: ModelSpec, tpb: int) -> bool:
    try:
        SideSpec("gen", layout=layout, tokens_per_block=tpb).validate_layout(model)
        return True
    except ConfigError:
        return False


@st.composite
def cases(draw):
    model = MODELS[draw(st.sampled_from(sorted(MODELS)))]
    tpb = draw(st.sampled_from([16, 32, 64]))
    layout = draw(st.sampled_from([n for n in NAMES if fits(n, model, tpb)]))
    dtype = draw(st.sampled_from(["bf16", "fp8"]))
    spec = draw(st.sampled_from(model.pools(dtype)))
    n, heads = len(spec.layers), spec.heads
    la = draw(st.integers(0, n - 1))
    lb = draw(st.integers(la + 1, n))
    ha = draw(st.integers(0, heads - 1))
    hb = draw(st.integers(ha + 1, heads))
    rp = RankPool(spec, range(la, lb), range(ha, hb), tpb, SideSpec("gen", layout=layout).layout)
    l0 = draw(st.integers(la, lb - 1))
    l1 = draw(st.integers(l0 + 1, lb))
    h0 = draw(st.integers(ha, hb - 1))
    h1 = draw(st.integers(h0 + 1, hb))
    t0 = draw(st.integers(0, 2 * tpb))
    t1 = draw(st.integers(t0 + 1, t0 + 3 * tpb + 3))
    tile = math.gcd(tpb, draw(st.sampled_from([1, 4, 16, 64])))
    rect = Rect(spec.name, l0, l1, h0, h1, t0, t1, tile)
    base = t0 // tpb
    need = (t1 - 1) // tpb - base + 1
    nb = need + draw(st.integers(0, 3))
    ids = torch.tensor(draw(st.permutations(range(nb)))[:need], dtype=torch.int64)
    return model, rp, nb, rect, ids, base


@SETTINGS
@given(cases())
def test_pack_reads_the_engines_tensors_in_wire_order_and_unpack_writes_only_there(case):
    _, rp, nb, rect, ids, base = case
    size = rp.pool_bytes(nb)
    assert sum(v.numel() for v in engine_views(torch.empty(size, dtype=torch.uint8), rp, nb)) == size
    addr = engine_wire(torch.arange(size), rp, nb, rect, ids, base)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size + rect.t1))
    for ops in (reference, cpu):
        wire = torch.empty(rect.nbytes(rp.rows), dtype=torch.uint8)
        ops.pack(src, rp, nb, rect, ids, base, wire)
        assert torch.equal(wire, src[addr]), (ops.__name__, rp.layout.value)
        dst = torch.zeros(size, dtype=torch.uint8)
        ops.unpack(wire, rp, nb, rect, ids, base, dst)
        want = torch.zeros(size, dtype=torch.uint8)
        want[addr] = src[addr]
        assert torch.equal(dst, want), (ops.__name__, rp.layout.value)
    # in place exactly where the engine's addresses of the wire bytes are consecutive
    assert is_in_place(runs(rp, nb, rect, ids, base)) == bool(torch.equal(addr, addr[0] + torch.arange(addr.numel())))


@SETTINGS
@given(a=cases(), layout=st.sampled_from(NAMES), tpb=st.sampled_from([16, 64]), seed=st.integers(0, 99))
def test_copy_rect_between_any_two_layouts_is_pack_then_unpack(a, layout, tpb, seed):
    """One rectangle straight from a pool of one layout into a pool of another (transport=ipc), at the tile the
    plan would use for the pair: byte for byte what packing one and unpacking into the other gives."""
    model, src_rp, src_nb, rect, src_ids, src_base = a
    if not fits(layout, model, tpb):
        return
    dst_rp = RankPool(src_rp.spec, src_rp.layers, src_rp.heads, tpb, SideSpec("gen", layout=layout).layout)
    tile = math.gcd(src_rp.tokens_per_block, tpb) if src_rp.token_runs and dst_rp.token_runs else 1
    rect = Rect(rect.pool, rect.l0, rect.l1, rect.h0, rect.h1, rect.t0, rect.t1, tile)
    dst_base = rect.t0 // tpb
    need = (rect.t1 - 1) // tpb - dst_base + 1
    g = torch.Generator().manual_seed(seed)
    dst_nb = need + 2
    dst_ids = torch.randperm(dst_nb, generator=g)[:need]
    src = torch.randint(0, 256, (src_rp.pool_bytes(src_nb),), dtype=torch.uint8, generator=g)
    wire = torch.empty(rect.nbytes(src_rp.rows), dtype=torch.uint8)
    reference.pack(src, src_rp, src_nb, rect, src_ids, src_base, wire)
    want = torch.randint(0, 256, (dst_rp.pool_bytes(dst_nb),), dtype=torch.uint8, generator=g)
    start = want.clone()
    reference.unpack(wire, dst_rp, dst_nb, rect, dst_ids, dst_base, want)
    for ops in (reference, cpu):
        got = start.clone()
        ops.copy_rect(src, src_rp, src_nb, src_ids, src_base, got, dst_rp, dst_nb, dst_ids, dst_base, rect)
        assert torch.equal(got, want), (ops.__name__, src_rp.layout.value, layout)


def test_the_plan_sends_a_pool_whose_token_rows_are_split_in_tiles_of_one_token():
    gqa, dsa = MODELS["gqa"], MODELS["dsa"]
    nhd = SideSpec("ctx", tp=1, layout="vllm_lbnhc", tokens_per_block=16)
    hnd = SideSpec("gen", tp=1, layout="flashinfer_hnd", tokens_per_block=32)
    assert wire_tile(nhd, hnd, gqa, gqa.pools()[0]) == 1  # K/V rows of a head are H rows apart in NHD
    assert wire_tile(SideSpec("ctx", tp=4, layout="vllm_lbnhc", tokens_per_block=16), hnd, gqa, gqa.pools()[0]) == 16
    trt = SideSpec("gen", layout="trtllm")
    for pool in dsa.pools():  # one head: NHD keeps its rows together; vLLM and TensorRT-LLM blocks of 64
        assert wire_tile(SideSpec("ctx", layout="vllm_lbnhc"), trt, dsa, pool) == 64


@pytest.mark.parametrize("overrides, message", [
    (dict(model="dsa", layout="flashinfer_nhd"), "gen.layout=flashinfer_nhd: FlashInfer stores per-head K and V"),
    (dict(model="mla", layout="vllm_flash"), "gen.layout=vllm_flash: vLLM's FlashAttention backend stores per-head"),
    (dict(model="dsa", layout="trtllm", tpb=32), "gen.tokens_per_block=32: TensorRT-LLM (trtllm) stores d's indexer "
                                                 "keys in blocks of 64 tokens; use 64, or leave it unset"),
    (dict(model="dsa", layout="vllm_lbhnc", tpb=16), "gen.tokens_per_block=16: vLLM (vllm_lbhnc) stores d's indexer"),
    (dict(model="gqa", layout="vllm_flash", tpb=24), "gen.tokens_per_block=24: vLLM's FlashAttention backend "
                                                     "(vllm_flash) takes block sizes that are a multiple of 16"),
    (dict(model="gqa", layout="trtllm", tpb=48), "gen.tokens_per_block=48: TensorRT-LLM (trtllm) takes block sizes "
                                                 "that are a power of two"),
])
def test_a_layout_the_model_cannot_have_is_one_line(overrides, message):
    side = SideSpec("gen", layout=overrides["layout"], tokens_per_block=overrides.get("tpb"))
    with pytest.raises(ConfigError) as e:
        side.validate_for(MODELS[overrides["model"]])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_layouts_that_fix_a_block_size_say_so_and_take_it_when_none_is_given():
    dsa, gqa = MODELS["dsa"], MODELS["gqa"]
    for name in ("vllm_lbnhc", "vllm_lbhnc", "sglang", "trtllm", *VLLM_STRIDE_ORDERS):
        assert LAYOUTS[name].fixed_tpb == {"indexer": 64}
        side = SideSpec("gen", layout=name)
        assert side.resolved(dsa).tokens_per_block == 64
        assert side.resolved(gqa).tokens_per_block == LAYOUTS[name].default_tpb
        assert {p.tokens_per_block for p in CacheState(dsa, side, 0).pools()} == {64}
    assert SideSpec("gen", layout="block_major").tokens_per_block == 32  # kvlab's own: as before
    assert set(EngineLayout) == {EngineLayout(n) for n in NAMES[2:]}


def test_every_vllm_kv_cache_layout_is_a_layout_and_its_legacy_names_alias_two():
    assert {n for n in NAMES if n in VLLM_STRIDE_ORDERS} == set(VLLM_STRIDE_ORDERS)
    assert SideSpec("gen", layout="NHD").layout is EngineLayout.LBNHC
    assert SideSpec("ctx", layout="HND").layout is EngineLayout.LBHNC
    # vLLM's FlashAttention shape [blocks, H, block_size, 2*D] is LBHNC, the identity permutation
    assert LAYOUTS["vllm_flash"].order("kv") == LAYOUTS["LBHNC"].order("kv")
    with pytest.raises(ConfigError, match=r"gen.layout=NDH: use one of .*LBHNC.* \(or vLLM's aliases NHD=LBNHC"):
        SideSpec("gen", layout="NDH")


# ---------------------------------------------------------------- every engine preset pair, end to end in one process

CONF = Path(__file__).resolve().parent.parent / "conf" / "model"
STRATEGIES = preset_names()  # the presets of conf/transfer/


def model_preset(name: str) -> ModelSpec:
    d = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    d.pop("defaults", None)
    return ModelSpec(**d)


def _caches(model, side, isl, fragmentation, device="cpu"):
    out = {}
    for r in range(side.size):
        state = CacheState(model, side, r)
        need = {p.name: blocks_for(p, isl) for p in state.pools()}
        out[r] = PagedCache(state, need, spare_blocks=2, fragmentation=fragmentation, seed=r,
                            device=torch.device(device))
        out[r].allocate(Request(0, isl))
    return out


def move(model, ctx, gen, isl, strategy, pull=False, fragmentation=0.0, slot=1 << 16, device="cpu"):
    """One request from ctx pools to gen pools as the transports move it: ``pull`` (ipc) one ``copy_rect`` per
    chunk; else pack (from the pool itself where the chunk is in place and its blocks consecutive), the message,
    unpack (into the pool itself likewise); on ``device`` with its ops (the NVRTC kernels on cuda). Returns
    (errors of the byte check, chunks, chunks in place)."""
    req, ops = Request(0, isl), get_ops("cuda" if device == "cuda" else "auto", device)
    src, dst = (_caches(model, ctx, isl, fragmentation, device),
                _caches(model, gen, isl, fragmentation, device))
    for c in src.values():
        c.fill(req, ops)
    segments = plan(model, ctx, gen, req)
    chunks = schedule(model, ctx, gen, segments, preset(strategy), None if pull else slot)
    in_place = 0
    for c in chunks:
        s, d = src[c.src], dst[c.dst]
        sp, dp = s.pools[c.rect.pool], d.pools[c.rect.pool]
        st_, dt = s.tables[0][c.rect.pool], d.tables[0][c.rect.pool]
        if pull:
            ops.copy_rect(sp.storage, sp.pool, sp.num_blocks, st_.ids, st_.base,
                          dp.storage, dp.pool, dp.num_blocks, dt.ids, dt.base, c.rect)
            continue
        wire = torch.empty(c.nbytes, dtype=torch.uint8, device=device)
        ops.pack(sp.storage, sp.pool, sp.num_blocks, c.rect, st_.ids, st_.base, wire)
        here = [_slice(sp, st_, c) if c.ctx_in_place else None, _slice(dp, dt, c) if c.gen_in_place else None]
        if here[0] is not None:  # zero-copy on ctx: the pool's own bytes are the message
            assert torch.equal(here[0], wire), f"ctx chunk {c.seq} in place is not the message"
        if here[1] is not None:
            here[1].copy_(wire)
        else:
            ops.unpack(wire, dp.pool, dp.num_blocks, c.rect, dt.ids, dt.base, dp.storage)
        in_place += here[0] is not None and here[1] is not None
    errors = []
    for g, cache in dst.items():
        errors += cache.verify(req, [x for x in segments if x.dst == g], ops) + cache.check_canaries()
    return errors, chunks, in_place


def _slice(store, table, c):
    """The pool bytes a chunk in place occupies when its blocks are consecutive, else None."""
    tpb = store.pool.tokens_per_block
    ids = table.host[c.rect.t0 // tpb - table.base:(c.rect.t1 - 1) // tpb - table.base + 1]
    if any(b != ids[0] + k for k, b in enumerate(ids)):
        return None
    start = first_byte(store.pool, store.num_blocks, c.rect, ids[0])
    return store.storage[start:start + c.nbytes]


def pairs(model: ModelSpec) -> list[tuple[str, str]]:
    ok = [n for n in NAMES if fits(n, model, LAYOUTS[n].block_tokens({p.kind for p in model.pools()})[0])]
    return [(a, b) for a in ok for b in ok]


GQA, DSA = model_preset("tiny_gqa"), model_preset("tiny_dsa")
MATRIX = [("tiny_gqa", a, b) for a, b in pairs(GQA)] + [("tiny_dsa", a, b) for a, b in pairs(DSA)]


@pytest.mark.slow  # 117 pairs, a second each on two shared cores: a share of them drawn in each run
@settings(max_examples=int(30 * SCALE) or 1, deadline=None, suppress_health_check=list(HealthCheck))
@given(pair=st.sampled_from(MATRIX), strategy=st.sampled_from(STRATEGIES), pull=st.booleans(),
       fragmentation=st.sampled_from([0.0, 0.5]))
def test_every_preset_pair_moves_verified(pair, strategy, pull, fragmentation):
    """Any layout the model can have on the ctx side, to any one on the gen side (the layouts' own block
    sizes), TP2 -> TP1 for GQA (heads merged) and TP1 -> TP2 for MLA (the latent replicated), through any
    strategy, pushed or pulled: every byte and canary checked."""
    model_name, ctx_layout, gen_layout = pair
    model = GQA if model_name == "tiny_gqa" else DSA
    ctx = SideSpec("ctx", tp=2 if model is GQA else 1, layout=ctx_layout).resolved(model)
    gen = SideSpec("gen", tp=1 if model is GQA else 2, layout=gen_layout).resolved(model)
    errors, chunks, _ = move(model, ctx, gen, 150 if model is DSA else 70, strategy, pull=pull,
                             fragmentation=fragmentation)
    assert errors == [] and chunks


def test_zero_copy_only_where_both_sides_hold_the_wire_order():
    """TensorRT-LLM's block-major pool to itself, whole blocks of one TP rank: in place on both sides; vLLM's NHD
    K and V into FlashInfer's HND never are (single token rows); FlashAttention's interleaved K and V with one head
    per rank and one layer per chunk are in wire order at tiles of one token."""
    gqa8 = ModelSpec("gqa8", 2, "gqa", kv_heads=2, head_dim=16)
    trt = SideSpec("ctx", layout="trtllm").resolved(gqa8)
    errors, chunks, in_place = move(gqa8, trt, replace(trt, name="gen"), 128, "zerocopy")
    assert errors == [] and in_place == len(chunks) > 0
    nhd, hnd = SideSpec("ctx", layout="vllm_lbnhc"), SideSpec("gen", layout="flashinfer_hnd")
    errors, chunks, in_place = move(gqa8, nhd, hnd, 128, "zerocopy")
    assert errors == [] and in_place == 0 and all(c.rect.tile == 1 for c in chunks)
    flash, one_layer = SideSpec("ctx", tp=2, layout="vllm_flash"), replace(gqa8, num_layers=1)
    errors, chunks, in_place = move(one_layer, flash, replace(flash, name="gen"), 64, "zerocopy", slot=2048)
    assert errors == [] and all(c.ctx_in_place and c.gen_in_place and c.rect.tile == 1 for c in chunks)
    assert in_place == len(chunks) > 0


def test_kvlab_plan_names_each_pairs_layouts_and_each_pools_wire_tile():
    from kvlab.cli.plan_cmd import summarize
    from kvlab.config.schema import build, compose

    setup = build(compose(["model=deepseek_v32", "ctx.layout=vllm_lbnhc", "gen.layout=trtllm", "ctx.tp=2"]))
    s = summarize(setup)
    assert {(r["ctx_layout"], r["gen_layout"]) for r in s["pairs"]} == {("vllm_lbnhc/64", "trtllm/64")}
    assert s["gen"]["shape"]["mla"] == "{blocks, layers, 1, tokens_per_block*576}"
    assert s["ctx"]["wire_tile"] == {"mla": 64, "indexer": 64}
    setup = build(compose(["model=llama3_8b", "ctx.layout=vllm_lbnhc", "gen.layout=flashinfer_hnd"]))
    assert summarize(setup)["gen"]["wire_tile"] == {"kv": 1}
