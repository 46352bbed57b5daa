"""Wire order and memory runs of a rectangle, checked against an oracle built from torch views.

The oracle never calls ``runs``: it views the pool bytes as [block, layer] slabs of
[comp][head][token][row] (the layout the design fixes) and walks tiles, layers,
components and heads in the documented wire order. Packing an arange "pool" through the
same views gives the memory address of every wire byte, so in-place decisions can be
checked against real addresses.
"""
from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.memory.ops import reference
from kvlab.model.layout import Rect, is_in_place, runs
from kvlab.model.parallel import Layout
from kvlab.model.spec import ModelSpec
from kvlab.model.state import RankPool

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
SCALE = settings.default.max_examples / 100  # 0.1 under `pytest -m "not slow"` (tests/conftest.py)
SETTINGS = settings(max_examples=int(250 * SCALE), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def row_bytes(rp: RankPool) -> list[int]:
    return [e * ELEM_BYTES[d] for e, d in zip(rp.spec.comp_elems, rp.spec.comp_dtypes, strict=True)]


def oracle_pool_bytes(rp: RankPool, num_blocks: int) -> int:
    return num_blocks * len(rp.layers) * len(rp.heads) * rp.tokens_per_block * sum(row_bytes(rp))


def comp_views(pool_t: torch.Tensor, rp: RankPool, num_blocks: int) -> list[torch.Tensor]:
    """One [block, layer, head, token, row] view per component."""
    nl, nh, tpb = len(rp.layers), len(rp.heads), rp.tokens_per_block
    rows = row_bytes(rp)
    per_block_layer = nh * tpb * sum(rows)
    if rp.layout == Layout.block_major:
        slabs = pool_t.view(num_blocks, nl, per_block_layer)
    else:
        slabs = pool_t.view(nl, num_blocks, per_block_layer).transpose(0, 1)
    views, off = [], 0
    for row in rows:
        views.append(slabs[:, :, off:off + nh * tpb * row].unflatten(-1, (nh, tpb, row)))
        off += nh * tpb * row
    return views


def oracle_wire(pool_t: torch.Tensor, rp: RankPool, num_blocks: int, rect: Rect, block_ids, base: int):
    views = comp_views(pool_t, rp, num_blocks)
    tpb, T = rp.tokens_per_block, rect.tile
    parts = []
    a = rect.t0
    while a < rect.t1:
        e = min((a // T + 1) * T, rect.t1)
        b = int(block_ids[a // tpb - base])
        w = a % tpb
        for layer in range(rect.l0, rect.l1):
            for v in views:
                for h in range(rect.h0, rect.h1):
                    parts.append(v[b, layer - rp.layers.start, h - rp.heads.start, w:w + (e - a)].reshape(-1))
        a = e
    return torch.cat(parts)


def oracle_addresses(rp, num_blocks, rect, block_ids, base) -> torch.Tensor:
    addr = torch.arange(oracle_pool_bytes(rp, num_blocks), dtype=torch.int64)
    return oracle_wire(addr, rp, num_blocks, rect, block_ids, base)


def rect_nbytes(rp: RankPool, rect: Rect) -> int:
    return (rect.l1 - rect.l0) * (rect.h1 - rect.h0) * (rect.t1 - rect.t0) * sum(row_bytes(rp))


@st.composite
def pool_specs(draw):
    dtype = draw(st.sampled_from(sorted(ELEM_BYTES)))
    layers = draw(st.integers(1, 4))
    if draw(st.booleans()):
        model = ModelSpec("g", layers, "gqa", kv_heads=draw(st.integers(1, 4)),
                          head_dim=draw(st.sampled_from([1, 3, 8])))
    else:
        model = ModelSpec("m", layers, "mla", mla_dim=draw(st.sampled_from([1, 5, 16])), indexer=draw(st.booleans()))
    return draw(st.sampled_from(model.pools(dtype)))


def layer_head_ranges(draw, spec) -> tuple[int, int, int, int]:
    """Non-empty layers [l0, l1) and heads [h0, h1) of a pool spec, drawn with ``draw``."""
    n = len(spec.layers)
    l0 = draw(st.integers(0, n - 1))
    l1 = draw(st.integers(l0 + 1, n))
    h0 = draw(st.integers(0, spec.heads - 1))
    h1 = draw(st.integers(h0 + 1, spec.heads))
    return l0, l1, h0, h1


@st.composite
def cases(draw, layouts=(Layout.block_major, Layout.layer_major)):
    spec = draw(pool_specs())
    la, lb, ha, hb = layer_head_ranges(draw, spec)
    tpb = draw(st.sampled_from([4, 8, 12, 16, 32]))
    tile = math.gcd(tpb, draw(st.sampled_from([4, 6, 8, 16, 32, 64])))
    rp = RankPool(spec, range(la, lb), range(ha, hb), tpb, draw(st.sampled_from(layouts)))
    l0 = draw(st.integers(la, lb - 1))
    l1 = draw(st.integers(l0 + 1, lb))
    h0 = draw(st.integers(ha, hb - 1))
    h1 = draw(st.integers(h0 + 1, hb))
    t0 = draw(st.integers(0, 3 * tpb))
    t1 = draw(st.integers(t0 + 1, t0 + 4 * tpb + 3))
    rect = Rect(spec.name, l0, l1, h0, h1, t0, t1, tile)
    base = t0 // tpb
    n_logical = (t1 - 1) // tpb - base + 1
    num_blocks = n_logical + draw(st.integers(0, 4))
    block_ids = torch.tensor(draw(st.permutations(range(num_blocks)))[:n_logical], dtype=torch.int64)
    return rp, num_blocks, rect, block_ids, base


@SETTINGS
@given(cases())
def test_wire_offsets_are_a_contiguous_cover_in_order(case):
    rp, num_blocks, rect, ids, base = case
    r = runs(rp, num_blocks, rect, ids, base)
    assert (r.length > 0).all()
    # emitted order is the wire order: each run starts where the previous ended
    starts = torch.cumsum(r.length, 0) - r.length
    assert torch.equal(r.wire, starts)
    assert int(r.length.sum()) == rect_nbytes(rp, rect) == rect.nbytes(tuple(row_bytes(rp)))


@SETTINGS
@given(cases())
def test_memory_runs_lie_inside_the_pool_without_overlap(case):
    rp, num_blocks, rect, ids, base = case
    r = runs(rp, num_blocks, rect, ids, base)
    size = oracle_pool_bytes(rp, num_blocks)
    assert rp.pool_bytes(num_blocks) == size
    assert int(r.mem.min()) >= 0 and int((r.mem + r.length).max()) <= size
    order = torch.argsort(r.mem)
    m, n = r.mem[order], r.length[order]
    assert (m[:-1] + n[:-1] <= m[1:]).all()


@SETTINGS
@given(cases())
def test_pack_matches_oracle_and_unpack_restores_only_the_rect(case):
    rp, num_blocks, rect, ids, base = case
    size = oracle_pool_bytes(rp, num_blocks)
    g = torch.Generator().manual_seed(num_blocks * 7919 + rect.t1)
    src = torch.randint(1, 256, (size,), dtype=torch.uint8, generator=g)
    wire = torch.empty(rect_nbytes(rp, rect), dtype=torch.uint8)
    reference.pack(src, rp, num_blocks, rect, ids, base, wire)
    assert torch.equal(wire, oracle_wire(src, rp, num_blocks, rect, ids, base))

    dst = torch.zeros(size, dtype=torch.uint8)
    reference.unpack(wire, rp, num_blocks, rect, ids, base, dst)
    mask = torch.zeros(size, dtype=torch.bool)
    mask[oracle_addresses(rp, num_blocks, rect, ids, base)] = True
    assert torch.equal(dst, torch.where(mask, src, torch.zeros_like(src)))


@SETTINGS
@given(cases())
def test_is_in_place_matches_real_addresses(case):
    rp, num_blocks, rect, ids, base = case
    addr = oracle_addresses(rp, num_blocks, rect, ids, base)
    contiguous = bool(torch.equal(addr, addr[0] + torch.arange(addr.numel())))
    assert is_in_place(runs(rp, num_blocks, rect, ids, base)) == contiguous


@st.composite
def whole_block_cases(draw):
    spec = draw(pool_specs())
    tpb = draw(st.sampled_from([4, 8, 16]))
    rp = RankPool(spec, range(len(spec.layers)), range(spec.heads), tpb, Layout.block_major)
    n_blocks = draw(st.integers(2, 5))
    first_logical = draw(st.integers(0, 3))
    first_physical = draw(st.integers(0, 3))
    num_blocks = first_physical + n_blocks + draw(st.integers(0, 2))
    rect = Rect(spec.name, 0, len(spec.layers), 0, spec.heads, first_logical * tpb,
                (first_logical + n_blocks) * tpb, tpb)
    i = draw(st.integers(0, n_blocks - 2))
    j = draw(st.integers(i + 1, n_blocks - 1))
    return rp, num_blocks, rect, first_logical, first_physical, n_blocks, (i, j)


@SETTINGS
@given(whole_block_cases())
def test_whole_blocks_in_place_on_block_major_until_shuffled(case):
    rp, num_blocks, rect, base, first, n, (i, j) = case
    ids = torch.arange(first, first + n)
    size = oracle_pool_bytes(rp, num_blocks)
    assert is_in_place(runs(rp, num_blocks, rect, ids, base))
    # in place means the wire bytes are the pool's own bytes of those blocks, unchanged
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    wire = torch.empty(rect_nbytes(rp, rect), dtype=torch.uint8)
    reference.pack(src, rp, num_blocks, rect, ids, base, wire)
    block = size // num_blocks
    assert torch.equal(wire, src[first * block:(first + n) * block])

    swapped = ids.clone()
    swapped[[i, j]] = swapped[[j, i]]
    assert not is_in_place(runs(rp, num_blocks, rect, swapped, base))


def test_layer_major_single_layer_in_place_multi_layer_not():
    spec = ModelSpec("g", 3, "gqa", kv_heads=2, head_dim=4).pools()[0]
    rp = RankPool(spec, range(3), range(2), 8, Layout.layer_major)
    ids = torch.arange(1, 4)
    one = Rect(spec.name, 1, 2, 0, 2, 8, 32, 8)
    assert is_in_place(runs(rp, 6, one, ids, 1))
    two = Rect(spec.name, 1, 3, 0, 2, 8, 32, 8)
    assert not is_in_place(runs(rp, 6, two, ids, 1))
