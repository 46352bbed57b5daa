"""CUDA pack/unpack against the torch reference, byte for byte, on random pools.

Outputs start as a poison byte (twice, with two poisons) so that a byte the kernel skips
cannot pass by matching the expected value; guard bytes around every buffer catch writes
outside it. Pools and buffers are also taken at odd offsets to exercise the narrow-vector
and head/tail paths.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kvlab.memory.ops import get_ops, reference
from kvlab.model.layout import Rect
from kvlab.model.parallel import Layout
from kvlab.model.spec import Kind, PoolSpec
from kvlab.model.state import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

POISONS = (0xA5, 0x5A)
GUARD = 64


@pytest.fixture(scope="module")
def cuda_ops():
    from kvlab.memory.ops import cuda

    cuda.ensure_compiled()
    return cuda


def make_pool(rows, *, heads=8, held_heads=None, layers=4, held_layers=None, tpb=32, layout=Layout.block_major,
              kind=Kind.kv) -> RankPool:
    """A rank's pool whose components have ``rows`` bytes per token (fp8 elements, so elements = bytes)."""
    spec = PoolSpec("p", kind, tuple(range(layers)), 0, heads, tuple(rows), ("fp8",) * len(rows))
    return RankPool(spec, held_layers or range(layers), held_heads or range(heads), tpb, layout)


def block_table(pool: RankPool, num_blocks: int, rect: Rect, gen: torch.Generator, dtype, device, slack: int = 0):
    """Random distinct physical blocks for the rect's logical blocks; block_base may start before the rect."""
    tpb = pool.tokens_per_block
    first = rect.t0 // tpb
    base = max(0, first - slack)
    need = (rect.t1 - 1) // tpb - base + 1
    assert need <= num_blocks
    ids = torch.randperm(num_blocks, generator=gen)[:need]
    return ids.to(dtype=dtype, device=device), base


def guarded(n: int, fill: int, offset: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole, view): a uint8 view of ``n`` bytes at ``offset`` into a filled buffer with guard bytes after it."""
    whole = torch.full((offset + n + GUARD,), fill, dtype=torch.uint8, device=device)
    return whole, whole[offset:offset + n]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str):
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        i = bad[0].item()
        raise AssertionError(f"{what}: {bad.numel()} of {want.numel()} bytes differ, first at {i}: "
                             f"got {got[i].item()}, want {want[i].item()}")


def check_case(ops, pool, num_blocks, rect, *, ctas, ids_dtype=torch.int64, pool_off=0, buf_off=0, seed=0,
               slack=0, device="cuda", **kw):
    gen = torch.Generator().manual_seed(seed)
    ids, base = block_table(pool, num_blocks, rect, gen, ids_dtype, device, slack)
    n_pool, n = pool.pool_bytes(num_blocks), rect.nbytes(pool.rows)
    src_whole, src = guarded(n_pool, 0, pool_off, device)
    src.copy_(torch.randint(0, 256, (n_pool,), dtype=torch.uint8, generator=gen))
    want = torch.empty(n, dtype=torch.uint8, device=device)
    reference.pack(src, pool, num_blocks, rect, ids, base, want)
    src_before = src_whole.clone()
    for poison in POISONS:
        whole, out = guarded(n, poison, buf_off, device)
        ops.pack(src, pool, num_blocks, rect, ids, base, out, ctas=ctas, **kw)
        torch.cuda.synchronize(device)
        assert_same(out, want, f"pack (poison {poison:#x})")
        assert (whole[:buf_off] == poison).all() and (whole[buf_off + n:] == poison).all(), "pack wrote outside out"
    assert torch.equal(src_whole, src_before), "pack changed the pool"

    wire_whole, wire = guarded(n, 0, buf_off, device)
    wire.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
    for poison in POISONS:
        ref_pool = torch.full((n_pool,), poison, dtype=torch.uint8, device=device)
        reference.unpack(wire, pool, num_blocks, rect, ids, base, ref_pool)
        whole, dst = guarded(n_pool, poison, pool_off, device)
        ops.unpack(wire, pool, num_blocks, rect, ids, base, dst, ctas=ctas, **kw)
        torch.cuda.synchronize(device)
        assert_same(dst, ref_pool, f"unpack (poison {poison:#x})")
        assert (whole[:pool_off] == poison).all() and (whole[pool_off + n_pool:] == poison).all(), \
            "unpack wrote outside the pool"


def full_rect(pool: RankPool, t0: int, t1: int, tile: int) -> Rect:
    return Rect("p", pool.layers.start, pool.layers.stop, pool.heads.start, pool.heads.stop, t0, t1, tile)


# (name, pool, num_blocks, rect): every cache kind and the parallel splits kvlab plans
CASES = []


def _case(name, pool, num_blocks, rect=None, **kw):
    CASES.append(pytest.param(pool, num_blocks, rect or full_rect(pool, 0, 100, pool.tokens_per_block), kw, id=name))


_kv = make_pool((256, 256))  # bf16, head_dim 128
_case("bf16-block_major-partial_last_tile", _kv, 8)
_case("bf16-layer_major-tile16-partial_both", make_pool((256, 256), layout=Layout.layer_major), 8,
      Rect("p", 0, 4, 0, 8, 5, 77, 16))
_case("bf16-head_subset", _kv, 8, Rect("p", 0, 4, 2, 5, 0, 64, 32))
_case("bf16-layer_subset-layer_major", make_pool((256, 256), layout=Layout.layer_major), 6,
      Rect("p", 1, 3, 0, 8, 40, 130, 32))
_case("bf16-tp2_rank1-heads5_7", make_pool((256, 256), held_heads=range(4, 8)), 8, Rect("p", 0, 4, 5, 7, 3, 90, 8))
_case("bf16-pp_stage-layers3_5", make_pool((256, 256), layers=6, held_layers=range(2, 5)), 8,
      Rect("p", 3, 5, 0, 8, 0, 96, 32))
_case("fp8-tpb16-tile8", make_pool((128, 128), tpb=16), 12, Rect("p", 0, 4, 0, 8, 9, 150, 8))
_case("fp32-tpb16", make_pool((512, 512), tpb=16, layout=Layout.layer_major), 10, Rect("p", 0, 4, 1, 8, 0, 100, 16))
_case("mla-1152-tpb64", make_pool((1152,), heads=1, tpb=64, kind=Kind.mla), 4, Rect("p", 0, 4, 0, 1, 0, 200, 64))
_case("mla-1152-tile32-layer_major", make_pool((1152,), heads=1, tpb=64, kind=Kind.mla, layout=Layout.layer_major),
      4, Rect("p", 1, 4, 0, 1, 17, 199, 32))
_case("indexer-128+4", make_pool((128, 4), heads=1, tpb=64, kind=Kind.indexer), 5, Rect("p", 0, 4, 0, 1, 0, 130, 64))
_case("indexer-128+4-tile1", make_pool((128, 4), heads=1, tpb=4, kind=Kind.indexer), 20,
      Rect("p", 0, 4, 0, 1, 3, 29, 1))
_case("odd_rows-3+5", make_pool((3, 5), tpb=8), 16, Rect("p", 0, 4, 0, 8, 1, 61, 4))
_case("bf16-misaligned_pool_and_buf", _kv, 8, None, pool_off=1, buf_off=3)
_case("bf16-pool_off8-buf_off4", _kv, 8, None, pool_off=8, buf_off=4)
_case("bf16-same_misalignment", _kv, 8, None, pool_off=6, buf_off=6)
_case("indexer-misaligned", make_pool((128, 4), heads=1, tpb=64, kind=Kind.indexer), 5,
      Rect("p", 0, 4, 0, 1, 0, 130, 64), pool_off=2, buf_off=1)
_case("int32_block_ids-block_base", _kv, 10, Rect("p", 0, 4, 0, 8, 70, 200, 32), ids_dtype=torch.int32, slack=2)
# Runs longer than a warp step, cut into pieces: MLA rows (1152 B) in 64-, 128- and 256-token
# blocks, whole and partial tiles, pieces that do not divide the run (tile 16: 18 KiB runs)
_mla = dict(heads=1, kind=Kind.mla)
_case("mla-1152-tpb64-tile64-61layers", make_pool((1152,), layers=61, tpb=64, **_mla), 5,
      Rect("p", 0, 61, 0, 1, 0, 256, 64))
_case("mla-1152-tpb128-tile128-partial_both", make_pool((1152,), tpb=128, **_mla), 6,
      Rect("p", 0, 4, 0, 1, 37, 601, 128))
_case("mla-1152-tpb256-tile256", make_pool((1152,), tpb=256, **_mla), 5, Rect("p", 0, 4, 0, 1, 0, 1024, 256))
_case("mla-1152-tpb256-tile256-partial-layer_major",
      make_pool((1152,), layers=5, held_layers=range(1, 5), tpb=256, layout=Layout.layer_major, **_mla), 6,
      Rect("p", 2, 5, 0, 1, 255, 1030, 256))
_case("mla-1152-tpb256-tile64", make_pool((1152,), tpb=256, **_mla), 4, Rect("p", 0, 4, 0, 1, 100, 700, 64))
_case("mla-1152-tpb16-tile16", make_pool((1152,), tpb=16, **_mla), 20, Rect("p", 0, 4, 0, 1, 3, 300, 16))
_case("mla-1152-tpb128-pool_off4-buf_off4", make_pool((1152,), tpb=128, **_mla), 4, Rect("p", 0, 4, 0, 1, 0, 384, 128),
      pool_off=4, buf_off=4)
_case("mla-1152-tpb256-misaligned", make_pool((1152,), tpb=256, **_mla), 3, Rect("p", 0, 4, 0, 1, 1, 500, 256),
      pool_off=2, buf_off=7)
_case("mla-1152-tpb128-gqa_heads", make_pool((1152, 1152), heads=3, tpb=128), 4, Rect("p", 0, 4, 1, 3, 5, 300, 128))
# Runs far shorter than a warp step, batched per lane group: 4-byte rows (indexer scales)
# alone and beside long runs, tiles of 1 to 64 tokens, many layers and heads
_case("scale-4-tpb32-tile32-61layers", make_pool((4,), layers=61, tpb=32, heads=1, kind=Kind.indexer), 6,
      Rect("p", 0, 61, 0, 1, 0, 150, 32))
_case("indexer-128+4-tpb32-61layers-partial", make_pool((128, 4), layers=61, tpb=32, heads=1, kind=Kind.indexer), 8,
      Rect("p", 3, 60, 0, 1, 7, 201, 32))
_case("scale-4-tpb64-tile64", make_pool((4,), tpb=64, heads=1, kind=Kind.indexer), 5, Rect("p", 0, 4, 0, 1, 0, 300, 64))
_case("scale-4-tpb1-tile1", make_pool((4,), layers=7, tpb=1, heads=1, kind=Kind.indexer), 80,
      Rect("p", 0, 7, 0, 1, 2, 75, 1))
_case("scale-4+4-8heads-tpb16-tile4", make_pool((4, 4), tpb=16), 12, Rect("p", 0, 4, 1, 8, 3, 170, 4))
_case("mla+scale-1152+4-tpb256", make_pool((1152, 4), tpb=256, heads=1, kind=Kind.indexer), 4,
      Rect("p", 0, 4, 0, 1, 9, 800, 256))
_case("scale-4-misaligned", make_pool((4,), layers=9, tpb=32, heads=2), 6, Rect("p", 0, 9, 0, 2, 1, 140, 32),
      pool_off=1, buf_off=2)


@pytest.mark.parametrize("ctas", [1, 8, 132])
@pytest.mark.parametrize("pool,num_blocks,rect,kw", CASES)
def test_matches_reference(cuda_ops, pool, num_blocks, rect, kw, ctas):
    check_case(cuda_ops, pool, num_blocks, rect, ctas=ctas, **kw)


def random_case(rng: random.Random):
    rows = tuple(rng.choice([1, 2, 3, 4, 5, 16, 128, 256, 512, 1152]) for _ in range(rng.choice([1, 2])))
    tpb = rng.choice([1, 2, 4, 16, 32, 64, 128, 256])
    tile = rng.choice([d for d in range(1, tpb + 1) if tpb % d == 0])
    heads, layers = rng.randint(1, 8), rng.randint(1, 5)
    hh0 = rng.randrange(heads)
    held_h = range(hh0, rng.randint(hh0 + 1, heads))
    hl0 = rng.randrange(layers)
    held_l = range(hl0, rng.randint(hl0 + 1, layers))
    pool = make_pool(rows, heads=heads, held_heads=held_h, layers=layers, held_layers=held_l, tpb=tpb,
                     layout=rng.choice(list(Layout)))
    h0 = rng.randrange(held_h.start, held_h.stop)
    l0 = rng.randrange(held_l.start, held_l.stop)
    t0 = rng.randrange(0, 3 * tpb)
    t1 = t0 + rng.randint(1, 4 * tpb + 5)
    rect = Rect("p", l0, rng.randint(l0 + 1, held_l.stop), h0, rng.randint(h0 + 1, held_h.stop), t0, t1, tile)
    num_blocks = (t1 - 1) // tpb + 1 + rng.randint(0, 3)
    kw = dict(ctas=rng.choice([1, 2, 8, 132]), ids_dtype=rng.choice([torch.int32, torch.int64]),
              pool_off=rng.choice([0, 0, 1, 4, 8, 12]), buf_off=rng.choice([0, 0, 2, 8, 16]), slack=rng.randint(0, 2))
    return pool, num_blocks, rect, kw


@pytest.mark.parametrize("seed", range(60))
def test_random_matches_reference(cuda_ops, seed):
    pool, num_blocks, rect, kw = random_case(random.Random(seed))
    check_case(cuda_ops, pool, num_blocks, rect, seed=seed, **kw)


def test_tunings(cuda_ops):
    pool = make_pool((256, 256), layout=Layout.layer_major)
    for tuning in (cuda_ops.Tuning(threads=512, unroll=4), cuda_ops.Tuning(threads=64, unroll=1)):
        check_case(cuda_ops, pool, 8, Rect("p", 0, 4, 1, 7, 5, 200, 16), ctas=8, tuning=tuning)


def test_side_stream_and_fresh_thread(cuda_ops):
    pool = make_pool((256, 256))
    rect = full_rect(pool, 0, 256, 32)
    gen = torch.Generator().manual_seed(1)
    ids, base = block_table(pool, 8, rect, gen, torch.int64, "cuda")
    src = torch.randint(0, 256, (pool.pool_bytes(8),), dtype=torch.uint8, generator=gen).cuda()
    want = torch.empty(rect.nbytes(pool.rows), dtype=torch.uint8, device="cuda")
    reference.pack(src, pool, 8, rect, ids, base, want)
    torch.cuda.synchronize()

    s = torch.cuda.Stream()
    out = torch.empty_like(want)
    with torch.cuda.stream(s):
        # ordered after the fill only if the kernel runs on s
        out.fill_(0)
        cuda_ops.pack(src, pool, 8, rect, ids, base, out, ctas=4)
    s.synchronize()
    assert_same(out, want, "pack on a side stream")

    result = {}

    def worker():
        try:
            o = torch.zeros_like(want)
            cuda_ops.pack(src, pool, 8, rect, ids, base, o)
            torch.cuda.synchronize()
            result["out"] = o
        except Exception as e:  # surfaced in the main thread
            result["err"] = e

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert "err" not in result, result.get("err")
    assert_same(result["out"], want, "pack from a fresh thread")


def test_input_checks(cuda_ops):
    pool = make_pool((256, 256))
    rect = full_rect(pool, 0, 64, 32)
    ids = torch.arange(2, device="cuda")
    src = torch.zeros(pool.pool_bytes(4), dtype=torch.uint8, device="cuda")
    out = torch.empty(rect.nbytes(pool.rows), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match="CUDA tensors"):
        cuda_ops.pack(src.cpu(), pool, 4, rect, ids.cpu(), 0, out.cpu())
    with pytest.raises(ValueError, match="block_ids"):
        cuda_ops.pack(src, pool, 4, rect, ids.cpu(), 0, out)
    with pytest.raises(TypeError, match="int32 or int64"):
        cuda_ops.pack(src, pool, 4, rect, ids.to(torch.int16), 0, out)
    with pytest.raises(ValueError, match="wire buffer"):
        cuda_ops.pack(src, pool, 4, rect, ids, 0, out[1:])
    with pytest.raises(ValueError, match="block table"):
        cuda_ops.pack(src, pool, 4, rect, ids[:1], 0, out)
    with pytest.raises(ValueError, match="tile"):
        cuda_ops.pack(src, pool, 4, Rect("p", 0, 4, 0, 8, 0, 64, 24), ids, 0, out)
    with pytest.raises(TypeError):
        cuda_ops.pack(src.view(torch.int8), pool, 4, rect, ids, 0, out)


def test_get_ops_picks_kernels(cuda_ops):
    assert get_ops("cuda", "cuda").name == "cuda"
    assert get_ops("auto", "cuda").name == "cuda"


# The cp.async.bulk kernels last: a fault there would poison the CUDA context for what follows.
def _bulk_tunings():
    from kvlab.memory.ops.cuda import Tuning

    # the bench's shape; a two-stage ring of tiny pieces (many pieces per run, the ring's edge cases)
    return [Tuning(threads=128, bulk=True, stages=6, piece=8192), Tuning(threads=64, bulk=True, stages=2, piece=48),
            Tuning(threads=96, bulk=True, stages=3, piece=4096)]


@pytest.fixture(scope="module")
def bulk_ops(cuda_ops):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk kernels need sm_90")
    return cuda_ops


@pytest.mark.parametrize("pool,num_blocks,rect,kw", CASES)
def test_bulk_matches_reference(bulk_ops, pool, num_blocks, rect, kw):
    for i, tuning in enumerate(_bulk_tunings()):
        check_case(bulk_ops, pool, num_blocks, rect, ctas=(8, 1, 132)[i], tuning=tuning, **kw)


@pytest.mark.parametrize("seed", range(30))
def test_bulk_random_matches_reference(bulk_ops, seed):
    pool, num_blocks, rect, kw = random_case(random.Random(1000 + seed))
    check_case(bulk_ops, pool, num_blocks, rect, seed=seed, tuning=_bulk_tunings()[seed % 3], **kw)
