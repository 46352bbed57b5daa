"""``copy_rect`` (one rectangle straight from one pool into another, resharding on the way) against
the definition: pack the rectangle out of the source pool, unpack it into the destination pool.
The reference runs on CPU (CI); the CUDA kernel is checked against it on a GPU."""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.memory.ops import reference
from kvlab.model.engine_layouts import LAYOUTS, EngineLayout
from kvlab.model.layout import Rect
from kvlab.model.parallel import Layout
from kvlab.model.spec import Kind, PoolSpec
from kvlab.model.state import RankPool

GUARD = 64
# kvlab's layouts and the engines' (K/V holders), for the pairs the kernels bridge
ENGINE_AND_OWN = [Layout(n) if n in Layout.__members__ else EngineLayout(n) for n in LAYOUTS if LAYOUTS[n].holds("kv")]


def side(rows, heads, layers, held_h, held_l, tpb, layout) -> RankPool:
    spec = PoolSpec("p", Kind.kv, tuple(range(layers)), 0, heads, tuple(rows), ("fp8",) * len(rows))
    return RankPool(spec, held_l, held_h, tpb, layout)


def random_pair(rng: random.Random, layouts=tuple(Layout), rows: tuple[int, ...] | None = None):
    """(src pool, dst pool, rect): one model's pool held by two ranks that split heads, layers, tokens per
    block and layout (drawn from ``layouts``) differently, and a rectangle both hold."""
    rows = rows or tuple(rng.choice([1, 2, 3, 16, 128, 256, 576]) for _ in range(rng.choice([1, 2])))
    heads, layers = rng.randint(1, 8), rng.randint(1, 5)
    h0 = rng.randrange(heads)
    h1 = rng.randint(h0 + 1, heads)
    l0 = rng.randrange(layers)
    l1 = rng.randint(l0 + 1, layers)
    pools = []
    for _ in range(2):  # each side holds a range around the rect's heads and layers
        held_h = range(rng.randint(0, h0), rng.randint(h1, heads))
        held_l = range(rng.randint(0, l0), rng.randint(l1, layers))
        pools.append(side(rows, heads, layers, held_h, held_l, rng.choice([1, 2, 4, 16, 32, 64]),
                          rng.choice(list(layouts))))
    g = math.gcd(pools[0].tokens_per_block, pools[1].tokens_per_block)
    tile = rng.choice([d for d in range(1, g + 1) if g % d == 0])
    t0 = rng.randrange(0, 130)
    rect = Rect("p", l0, l1, h0, h1, t0, t0 + rng.randint(1, 300), tile)
    return pools[0], pools[1], rect


def table(pool: RankPool, rect: Rect, gen: torch.Generator, dtype, device, slack: int):
    """(physical blocks, logical base, blocks in the pool): random distinct blocks, the base maybe before the rect."""
    tpb = pool.tokens_per_block
    base = max(0, rect.t0 // tpb - slack)
    need = (rect.t1 - 1) // tpb - base + 1
    num_blocks = need + slack + 1
    return torch.randperm(num_blocks, generator=gen)[:need].to(dtype=dtype, device=device), base, num_blocks


def case(seed: int, device: str):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    src_pool, dst_pool, rect = random_pair(rng)
    dtype = rng.choice([torch.int32, torch.int64])
    s_ids, s_base, s_nb = table(src_pool, rect, gen, dtype, device, rng.randint(0, 2))
    d_ids, d_base, d_nb = table(dst_pool, rect, gen, dtype, device, rng.randint(0, 2))
    off = rng.choice([0, 0, 1, 4, 8])  # misaligned storages take the narrower copy paths
    src_whole = torch.randint(0, 256, (off + src_pool.pool_bytes(s_nb) + GUARD,), dtype=torch.uint8, generator=gen)
    src = src_whole.to(device)[off:off + src_pool.pool_bytes(s_nb)]
    return (src, src_pool, s_nb, s_ids, s_base), (dst_pool, d_nb, d_ids, d_base), rect, off


def expected(src_args, dst_pool, d_nb, d_ids, d_base, rect, fill: int):
    """The definition: pack out of the source, unpack into a destination full of ``fill``."""
    src, src_pool, s_nb, s_ids, s_base = src_args
    wire = torch.empty(rect.nbytes(src_pool.rows), dtype=torch.uint8, device=src.device)
    reference.pack(src, src_pool, s_nb, rect, s_ids, s_base, wire)
    want = torch.full((dst_pool.pool_bytes(d_nb),), fill, dtype=torch.uint8, device=src.device)
    reference.unpack(wire, dst_pool, d_nb, rect, d_ids, d_base, want)
    return want


@pytest.mark.parametrize("seed", range(40))
def test_reference_is_pack_then_unpack(seed):
    src_args, (dst_pool, d_nb, d_ids, d_base), rect, _ = case(seed, "cpu")
    want = expected(src_args, dst_pool, d_nb, d_ids, d_base, rect, 0x5A)
    got = torch.full_like(want, 0x5A)
    reference.copy_rect(*src_args, got, dst_pool, d_nb, d_ids, d_base, rect)
    assert torch.equal(got, want)


def test_pools_of_different_kinds_are_refused():
    a = side((256,), 8, 2, range(8), range(2), 32, Layout.block_major)
    b = side((128,), 8, 2, range(8), range(2), 32, Layout.block_major)
    rect = Rect("p", 0, 1, 0, 1, 0, 32, 32)
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="rows differ"):
        reference.copy_rect(torch.zeros(a.pool_bytes(1), dtype=torch.uint8), a, 1, ids, 0,
                            torch.zeros(b.pool_bytes(1), dtype=torch.uint8), b, 1, ids, 0, rect)



@pytest.fixture(scope="module")
def cuda_ops():
    from kvlab.memory.ops import cuda

    cuda.ensure_compiled()
    return cuda


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("tuning", ["default", "narrow"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_matches_reference(cuda_ops, seed, tuning):
    src_args, (dst_pool, d_nb, d_ids, d_base), rect, off = case(seed, "cuda")
    kw = {} if tuning == "default" else {"tuning": cuda_ops.Tuning(threads=64, unroll=1), "ctas": 3}
    for fill in (0xA5, 0x5A):
        want = expected(src_args, dst_pool, d_nb, d_ids, d_base, rect, fill)
        whole = torch.full((off + want.numel() + GUARD,), fill, dtype=torch.uint8, device="cuda")
        got = whole[off:off + want.numel()]
        before = src_args[0].clone()
        cuda_ops.copy_rect(*src_args, got, dst_pool, d_nb, d_ids, d_base, rect, **kw)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"seed {seed}: {(got != want).sum().item()} bytes differ"
        assert (whole[:off] == fill).all() and (whole[off + want.numel():] == fill).all(), "wrote outside the pool"
        assert torch.equal(src_args[0], before), "changed the source pool"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_input_checks(cuda_ops):
    src_args, (dst_pool, d_nb, d_ids, d_base), rect, _ = case(0, "cuda")
    dst = torch.zeros(dst_pool.pool_bytes(d_nb), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="one CUDA device"):
        cuda_ops.copy_rect(*src_args, dst.cpu(), dst_pool, d_nb, d_ids, d_base, rect)
    with pytest.raises(ValueError, match="block table"):
        cuda_ops.copy_rect(*src_args, dst, dst_pool, d_nb, d_ids[:0], d_base, rect)
    with pytest.raises(ValueError, match="bytes"):
        cuda_ops.copy_rect(*src_args, dst[1:], dst_pool, d_nb, d_ids, d_base, rect)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1),
       rows=st.sampled_from([(16,), (256, 256), (128, 128), (1152,), (48, 48), (64, 32), (4, 4),
                             (48, 48, 96, 1024), (12, 12, 24, 64)]),
       path=st.sampled_from(["span", "runs"]), ids64=st.booleans())
def test_both_paths_match_reference_over_engine_layouts(cuda_ops, seed, rows, path, ids64):
    """kv_copy_span and kv_copy_rect, each forced, against the definition over the engines' layouts on both sides
    (NHD into HND and back, K and V interleaved or apart), block sizes, partial first and last spans, head and
    layer slices and both block-table dtypes; rows or strides that are not 16-byte aligned fall back to the runs.
    Four components (a recurrent state's pool): the span kernel launches per component; kv_copy_rect, which
    addresses two, and unaligned rows leave them to the torch reference."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    src_pool, dst_pool, rect = random_pair(rng, ENGINE_AND_OWN, rows)
    dtype = torch.int64 if ids64 else torch.int32
    s_ids, s_base, s_nb = table(src_pool, rect, gen, dtype, "cuda", rng.randint(0, 2))
    d_ids, d_base, d_nb = table(dst_pool, rect, gen, dtype, "cuda", rng.randint(0, 2))
    src = torch.randint(0, 256, (src_pool.pool_bytes(s_nb),), dtype=torch.uint8, generator=gen).cuda()
    src_args = (src, src_pool, s_nb, s_ids, s_base)
    want = expected(src_args, dst_pool, d_nb, d_ids, d_base, rect, 0xA5)
    got = torch.full_like(want, 0xA5)
    cuda_ops.copy_rect(*src_args, got, dst_pool, d_nb, d_ids, d_base, rect, path=path,
                       ctas=rng.choice([None, 1, 7]))
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1), rows=st.sampled_from([(256, 256), (128, 128), (1152,), (48, 48)]),
       dcp=st.sampled_from([2, 4]), interleave=st.sampled_from([1, 2, 4, 16]), ids64=st.booleans())
def test_a_dcp_ranks_positions_take_the_span_kernel(cuda_ops, seed, rows, dcp, interleave, ids64):
    """A decode-context-parallel rank's rectangle (its local positions) from a pool of global tokens, on the span
    kernel (the torch reference is patched to fail there), byte for byte the reference's: each span mapped to the
    global tokens it holds, over layouts, block sizes (the DCP side's a multiple of the interleave, as vLLM
    requires), ranks, partial first and last runs and head and layer slices."""
    from dataclasses import replace
    from unittest import mock

    from kvlab.memory.ops import paths
    from kvlab.model.tokens import Tokens, to_global

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, layers = rng.randint(1, 4), rng.randint(1, 3)
    h0, l0 = rng.randrange(heads), rng.randrange(layers)
    h1, l1 = rng.randint(h0 + 1, heads), rng.randint(l0 + 1, layers)
    rank = rng.randrange(dcp)
    src_pool = side(rows, heads, layers, range(heads), range(layers), rng.choice([1, 2, 4, 16, 32, 64]),
                    rng.choice(ENGINE_AND_OWN))
    dst_pool = replace(side(rows, heads, layers, range(heads), range(layers), interleave * rng.choice([1, 2, 4]),
                            rng.choice(ENGINE_AND_OWN)), tokens=Tokens("interleaved", dcp, rank, interleave))
    assert paths.copy_path(src_pool, dst_pool)[0] == "span"
    t0 = rng.randrange(0, 100)
    local = (dcp, rank, interleave)
    tile = rng.choice([d for d in range(1, interleave + 1) if interleave % d == 0
                       and src_pool.tokens_per_block % d == 0 and dst_pool.tokens_per_block % d == 0])
    rect = Rect("p", l0, l1, h0, h1, t0, t0 + rng.randint(1, 200), tile, local=local)
    dtype = torch.int64 if ids64 else torch.int32
    first, last = (int(t) for t in to_global(local, torch.tensor([rect.t0, rect.t1 - 1])))
    s_tpb = src_pool.tokens_per_block
    s_base = max(0, first // s_tpb - rng.randint(0, 2))
    s_nb = last // s_tpb - s_base + 1 + rng.randint(0, 2)
    s_ids = torch.randperm(s_nb, generator=gen)[:last // s_tpb - s_base + 1].to(dtype=dtype, device="cuda")
    d_ids, d_base, d_nb = table(dst_pool, rect, gen, dtype, "cuda", rng.randint(0, 2))
    src = torch.randint(0, 256, (src_pool.pool_bytes(s_nb),), dtype=torch.uint8, generator=gen).cuda()
    want = torch.full((dst_pool.pool_bytes(d_nb),), 0xA5, dtype=torch.uint8, device="cuda")
    reference.copy_rect(src, src_pool, s_nb, s_ids, s_base, want, dst_pool, d_nb, d_ids, d_base, rect)
    got = torch.full_like(want, 0xA5)
    with mock.patch.object(cuda_ops.reference, "copy_rect", side_effect=AssertionError("the reference ran")):
        cuda_ops.copy_rect(src, src_pool, s_nb, s_ids, s_base, got, dst_pool, d_nb, d_ids, d_base, rect,
                           ctas=rng.choice([None, 1, 7]))
    torch.cuda.synchronize()
    assert torch.equal(got, want), f"{(got != want).sum().item()} bytes differ"
