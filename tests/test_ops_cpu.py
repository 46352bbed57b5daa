"""The CPU row path (kvlab.ops.cpu) against the torch reference, on random rectangles and layouts."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from test_layout import cases, oracle_pool_bytes, rect_nbytes

from kvlab.layout import Rect
from kvlab.ops import cpu, get_ops, reference
from kvlab.parallel import Layout
from kvlab.spec import ModelSpec
from kvlab.state import RankPool

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@SETTINGS
@given(cases())
def test_pack_and_unpack_match_the_reference(case):
    rp, num_blocks, rect, ids, base = case
    size = oracle_pool_bytes(rp, num_blocks)
    src = _random(size, num_blocks * 131 + rect.t0)
    want = torch.empty(rect_nbytes(rp, rect), dtype=torch.uint8)
    reference.pack(src, rp, num_blocks, rect, ids, base, want)
    got = _random(want.numel(), 7)  # poisoned: every byte must be written
    cpu.pack(src, rp, num_blocks, rect, ids, base, got)
    assert torch.equal(got, want)

    wire = _random(want.numel(), rect.t1)
    ref_pool = _random(size, 3)
    fast_pool = ref_pool.clone()
    reference.unpack(wire, rp, num_blocks, rect, ids, base, ref_pool)
    cpu.unpack(wire, rp, num_blocks, rect, ids, base, fast_pool)
    assert torch.equal(fast_pool, ref_pool)  # the rect's bytes written, nothing else touched


def test_odd_alignment_of_the_wire_buffer():
    # a staging slot of a fractional MiB size starts at any byte: the rows fall back to narrower words
    spec = ModelSpec("g", 2, "gqa", kv_heads=2, head_dim=8).pools()[0]
    rp = RankPool(spec, range(2), range(2), 8, Layout.block_major)
    rect = Rect(spec.name, 0, 2, 0, 2, 3, 29, 8)
    ids = torch.tensor([4, 1, 3, 0], dtype=torch.int64)
    src = _random(rp.pool_bytes(5), 1)
    n = rect.nbytes(rp.rows)
    want = torch.empty(n, dtype=torch.uint8)
    reference.pack(src, rp, 5, rect, ids, 0, want)
    backing = torch.zeros(n + 3, dtype=torch.uint8)
    got = backing[3:]
    cpu.pack(src, rp, 5, rect, ids, 0, got)
    assert torch.equal(got, want)
    dst = torch.zeros_like(src)
    cpu.unpack(got, rp, 5, rect, ids, 0, dst)
    ref = torch.zeros_like(src)
    reference.unpack(want, rp, 5, rect, ids, 0, ref)
    assert torch.equal(dst, ref)


def test_chunks_of_one_shape_share_their_row_template():
    spec = ModelSpec("g", 2, "gqa", kv_heads=2, head_dim=8).pools()[0]
    rp = RankPool(spec, range(2), range(2), 8, Layout.layer_major)
    cpu._template.cache_clear()
    ids = torch.randperm(12)
    for t0 in range(0, 80, 16):  # five chunks of two blocks each
        rect = Rect(spec.name, 0, 2, 0, 2, t0, t0 + 16, 8)
        out = torch.empty(rect.nbytes(rp.rows), dtype=torch.uint8)
        cpu.pack(_random(rp.pool_bytes(12), t0), rp, 12, rect, ids, 0, out)
    assert cpu._template.cache_info().misses == 1


def test_get_ops_picks_the_row_path_for_cpu_tensors():
    assert get_ops("auto", "cpu").name == "cpu"
    assert get_ops("torch", "cpu").name == "torch"
