"""The CPU row path (kvlab.memory.ops.cpu) against the torch reference, on random rectangles, layouts and
pairs of mismatched sides."""
from __future__ import annotations

import functools
import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_layout import cases, layer_head_ranges, oracle_pool_bytes, pool_specs, rect_nbytes

from kvlab.memory.ops import cpu, get_ops, reference
from kvlab.model.layout import Rect
from kvlab.model.parallel import Layout
from kvlab.model.spec import ModelSpec
from kvlab.model.state import RankPool

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


@st.composite
def rect_pairs(draw):
    """One rectangle in two pools of the same model that hold it differently: their own heads and
    layers around it, tokens per block, layout, block ids, and storage alignment."""
    spec = draw(pool_specs())
    n = len(spec.layers)
    l0, l1, h0, h1 = layer_head_ranges(draw, spec)
    tpbs = [draw(st.sampled_from([1, 4, 8, 12, 16, 32, 64])) for _ in range(2)]
    tile = math.gcd(*tpbs, draw(st.sampled_from([4, 6, 8, 16, 32, 64])))
    t0 = draw(st.integers(0, 3 * max(tpbs)))
    t1 = draw(st.integers(t0 + 1, t0 + 4 * max(tpbs) + 3))
    rect = Rect(spec.name, l0, l1, h0, h1, t0, t1, tile)
    sides = []
    for tpb in tpbs:
        la, lb = draw(st.integers(0, l0)), draw(st.integers(l1, n))
        ha, hb = draw(st.integers(0, h0)), draw(st.integers(h1, spec.heads))
        rp = RankPool(spec, range(la, lb), range(ha, hb), tpb, draw(st.sampled_from(list(Layout))))
        base = t0 // tpb - draw(st.integers(0, min(1, t0 // tpb)))  # the table may start before the rect
        n_logical = (t1 - 1) // tpb - base + 1
        num_blocks = n_logical + draw(st.integers(0, 3))
        dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        ids = torch.tensor(draw(st.permutations(range(num_blocks)))[:n_logical], dtype=dtype)
        sides.append((rp, num_blocks, ids, base, draw(st.sampled_from([0, 0, 1, 2, 4]))))
    piece = draw(st.sampled_from([cpu._PIECE_BYTES, 64, 16, 4]))
    return sides, rect, piece


@SETTINGS
@given(rect_pairs())
def test_copy_rect_matches_the_reference_between_mismatched_sides(case):
    ((sp, s_nb, s_ids, s_base, s_off), (dp, d_nb, d_ids, d_base, d_off)), rect, piece = case
    seed = sp.pool_bytes(s_nb) * 31 + dp.pool_bytes(d_nb)
    src = _random(sp.pool_bytes(s_nb) + s_off, seed)[s_off:]
    dst_backing = _random(dp.pool_bytes(d_nb) + d_off, seed + 1)  # poisoned: only the rect's bytes may change
    want = dst_backing[d_off:].clone()
    reference.copy_rect(src, sp, s_nb, s_ids, s_base, want, dp, d_nb, d_ids, d_base, rect)
    got = dst_backing[d_off:]
    # small pieces and rows: the row loop goes through several pieces, long rows are copied one by one
    with mock.patch.object(cpu, "_PIECE_BYTES", piece), mock.patch.object(cpu, "_DIRECT_ROW_BYTES", piece):
        cpu.copy_rect(src, sp, s_nb, s_ids, s_base, got, dp, d_nb, d_ids, d_base, rect)
    assert torch.equal(got, want)


def test_copy_rect_between_sides_whose_rows_differ():
    # three tokens in blocks of 12 on one side are one 12-byte row per component; in blocks of 4 on the
    # other the offsets allow only 4 bytes: the copy runs at the smaller unit on both sides
    spec = ModelSpec("g", 1, "gqa", kv_heads=1, head_dim=4).pools("fp8")[0]
    src_pool = RankPool(spec, range(1), range(1), 12, Layout.block_major)
    dst_pool = RankPool(spec, range(1), range(1), 4, Layout.layer_major)
    rect = Rect(spec.name, 0, 1, 0, 1, 12, 15, 4)
    src_ids, dst_ids = torch.tensor([2, 0]), torch.tensor([5, 1, 0, 3])
    assert (cpu._rows(src_pool, 3, rect, src_ids, 0)[0], cpu._rows(dst_pool, 6, rect, dst_ids, 0)[0]) == (12, 4)
    src = _random(src_pool.pool_bytes(3), 8)
    want = _random(dst_pool.pool_bytes(6), 9)
    got = want.clone()
    reference.copy_rect(src, src_pool, 3, src_ids, 0, want, dst_pool, 6, dst_ids, 0, rect)
    cpu.copy_rect(src, src_pool, 3, src_ids, 0, got, dst_pool, 6, dst_ids, 0, rect)
    assert torch.equal(got, want)
    back = _random(dst_pool.pool_bytes(6), 11)  # and the other way round
    want = _random(src.numel(), 10)
    got = want.clone()
    reference.copy_rect(back, dst_pool, 6, dst_ids, 0, want, src_pool, 3, src_ids, 0, rect)
    cpu.copy_rect(back, dst_pool, 6, dst_ids, 0, got, src_pool, 3, src_ids, 0, rect)
    assert torch.equal(got, want)


def test_copy_rect_of_long_rows():
    # an MLA latent in whole blocks: one row per block and layer, 288 KiB, copied one by one
    spec = ModelSpec("m", 2, "mla", mla_dim=576).pools()[0]
    rp = RankPool(spec, range(2), range(1), 256, Layout.block_major)
    rect = Rect(spec.name, 0, 2, 0, 1, 256, 1024, 256)
    assert cpu._rows(rp, 6, rect, torch.arange(3), 1)[0] >= cpu._DIRECT_ROW_BYTES
    src = _random(rp.pool_bytes(6), 5)
    src_ids, dst_ids = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 5])
    want = _random(src.numel(), 6)
    got = want.clone()
    reference.copy_rect(src, rp, 6, src_ids, 1, want, rp, 6, dst_ids, 1, rect)
    cpu.copy_rect(src, rp, 6, src_ids, 1, got, rp, 6, dst_ids, 1, rect)
    assert torch.equal(got, want)
    # the transport's warm-up: a rectangle copied onto itself changes nothing
    cpu.copy_rect(got, rp, 6, dst_ids, 1, got, rp, 6, dst_ids, 1, rect)
    assert torch.equal(got, want)


def test_copy_rect_refuses_pools_of_two_kinds():
    a = ModelSpec("g", 2, "gqa", kv_heads=2, head_dim=8).pools()[0]
    b = ModelSpec("g", 2, "gqa", kv_heads=2, head_dim=4).pools()[0]
    pa, pb = (RankPool(s, range(2), range(2), 8, Layout.block_major) for s in (a, b))
    ids, rect = torch.arange(2), Rect(a.name, 0, 2, 0, 2, 0, 16, 8)
    with pytest.raises(ValueError, match="rows differ"):
        cpu.copy_rect(torch.zeros(pa.pool_bytes(2), dtype=torch.uint8), pa, 2, ids, 0,
                      torch.zeros(pb.pool_bytes(2), dtype=torch.uint8), pb, 2, ids, 0, rect)


def test_auto_kernels_that_fail_to_compile_say_so_before_torch_copies(monkeypatch, capsys, tmp_path):
    """kernels=auto on a GPU falls back to torch's copies when a kernel source fails to compile: the run's figures
    are then torch's, so the fallback is one line that says why, not only ``kernels: torch`` in the records."""
    cuda_ops = pytest.importorskip("kvlab.memory.ops.cuda")

    def broken():
        raise RuntimeError("kernels/fp8_rows.cu(12): error: identifier \"KV_RING\" is undefined\n1 error detected")

    monkeypatch.setattr(cuda_ops, "ensure_compiled", broken)
    assert get_ops("auto", "cuda").name == "torch"
    assert capsys.readouterr().err == (
        "kvlab: kernels=auto: the CUDA kernels are unavailable here (kernels/fp8_rows.cu(12): error: identifier "
        "\"KV_RING\" is undefined); this process copies with torch, kernels=cuda would stop instead\n")
    with pytest.raises(RuntimeError, match="kernels=cuda: the CUDA kernels are unavailable here"):
        get_ops("cuda", "cuda")
    # in a run every rank of a host falls back alike: its first local rank says it, the others' records do
    from kvlab.rank.runner import say_for_host

    for local_rank in ("1", "0"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert get_ops("auto", "cuda", say=functools.partial(say_for_host, tmp_path, "kernels-auto")).name == "torch"
        err = capsys.readouterr().err
        assert err.startswith("kvlab: kernels=auto: the CUDA kernels are unavailable") if local_rank == "0" else not err


def test_get_ops_copies_rectangles_on_the_row_path_for_cpu_tensors():
    assert get_ops("auto", "cpu").copy_rect is cpu.copy_rect
