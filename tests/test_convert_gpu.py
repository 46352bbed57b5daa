"""The KV dtype converted inside the copy (``kv_convert_rect`` in kernels/fp8_rows.cu) against the torch reference,
byte for byte: copy_rect between pools of two formats, and the converting pack and unpack, over drawn layout pairs
(the engines' and kvlab's), block sizes, tiles, partial first and last tiles, head and layer slices, bf16 and fp16,
K/V and MLA rows, both directions. Outputs start poisoned, so a byte the kernel skips or writes outside its rows
differs from the reference's; where both sides are aligned the one-pass kernel must be the path taken (the staged
form is patched to fail), elsewhere the staged form gives the same bytes."""
from __future__ import annotations

import math
from contextlib import nullcontext
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.memory.ops import paths, reference
from kvlab.model import kv_dtype
from kvlab.model.engine_layouts import LAYOUTS, EngineLayout, Layout
from kvlab.model.layout import Rect
from kvlab.model.spec import Kind, PoolSpec
from kvlab.model.state import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

POISON = 0xA5
ALL_LAYOUTS = [Layout(n) if n in Layout.__members__ else EngineLayout(n) for n in LAYOUTS]


@pytest.fixture(scope="module")
def cuda_ops():
    from kvlab.memory.ops import cuda

    cuda.ensure_compiled()
    return cuda


def values(n: int, elems: int, base: str, gen: torch.Generator) -> torch.Tensor:
    """fp32 values exact in ``base``: rows over forty binades, one all-zero row, zeros and negative zeros within
    rows, and a row of bf16 subnormals (a scale below the normal floats: the kernel's dividing branch)."""
    x = torch.randn(n, elems, generator=gen) * torch.exp2(torch.randint(-30, 10, (n, 1), generator=gen).float())
    x[0] = 0
    x[1::7, ::3] = 0
    x[3::5, 1::4] = -0.0
    x[2::11] *= 2.0**-128 / x[2::11].abs().amax(1, keepdim=True).clamp_min(1e-30)
    return x.to({"bf16": torch.bfloat16, "fp16": torch.float16}[base]).float()


def filled(nbytes: int, row: int, kind: str, elems: int, base: str, fmt: str, gen, off: int = 0):
    """(whole, view): ``nbytes`` of valid rows in ``fmt`` at byte ``off`` of a buffer on the GPU."""
    n = nbytes // row
    rows = kv_dtype.from_values(values(n, elems, base, gen), kind, base, fmt).reshape(-1)
    whole = torch.zeros(off + nbytes, dtype=torch.uint8)
    whole[off:] = rows
    whole = whole.cuda()
    return whole, whole[off:]


def poisoned(nbytes: int, off: int = 0):
    whole = torch.full((off + nbytes,), POISON, dtype=torch.uint8, device="cuda")
    return whole, whole[off:]


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["kv", "mla"]))
    base = draw(st.sampled_from(["bf16", "fp16"]))
    if kind == "kv":
        # every team size the kernel is compiled for: 1, 2, 4, 8, 16, 32 lanes a row (8-256 values)
        elems, ncomp, heads = draw(st.sampled_from([8, 16, 32, 64, 128, 200, 256])), 2, draw(st.integers(1, 4))
    else:
        elems, ncomp, heads = draw(st.sampled_from([576, 192])), 1, 1
    layouts = [lay for lay in ALL_LAYOUTS if LAYOUTS[lay.value].holds(kind)]
    lays = [draw(st.sampled_from(layouts)) for _ in range(2)]
    tpbs = [draw(st.sampled_from([1, 2, 4, 16, 32, 64])) for _ in range(2)]
    layers = draw(st.integers(1, 3))
    hl = draw(st.integers(0, layers - 1))
    held_l = range(hl, draw(st.integers(hl + 1, layers)))
    hh = draw(st.integers(0, heads - 1))
    held_h = range(hh, draw(st.integers(hh + 1, heads)))
    l0 = draw(st.integers(held_l.start, held_l.stop - 1))
    h0 = draw(st.integers(held_h.start, held_h.stop - 1))
    t0 = draw(st.integers(0, 70))
    t1 = t0 + draw(st.integers(1, 150))
    rect = dict(l0=l0, l1=draw(st.integers(l0 + 1, held_l.stop)), h0=h0, h1=draw(st.integers(h0 + 1, held_h.stop)),
                t0=t0, t1=t1)
    return dict(kind=kind, base=base, elems=elems, ncomp=ncomp, heads=heads, layers=layers, held_l=held_l,
                held_h=held_h, lays=lays, tpbs=tpbs, rect=rect, to_fp8=draw(st.booleans()),
                op=draw(st.sampled_from(["copy_rect", "pack", "unpack"])), ids64=draw(st.booleans()),
                off=draw(st.sampled_from([0, 0, 0, 2, 4])), ctas=draw(st.sampled_from([None, 1, 8, 132])),
                # the quantizing direction's cp.async ring: the default, the smallest, none (loads in registers)
                ring=draw(st.sampled_from([None, 2, 0])), seed=draw(st.integers(0, 2**31 - 1)))


def pool_of(c, side: int, fmt: str) -> RankPool:
    kind = Kind(c["kind"])
    spec = PoolSpec("p", kind, tuple(range(c["layers"])), 0, c["heads"], (c["elems"],) * c["ncomp"],
                    (c["base"],) * c["ncomp"], "" if fmt == c["base"] else fmt)
    return RankPool(spec, c["held_l"], c["held_h"], c["tpbs"][side], c["lays"][side])


def table(pool: RankPool, rect: Rect, gen, ids64: bool):
    tpb = pool.tokens_per_block
    base = rect.t0 // tpb
    need = (rect.t1 - 1) // tpb - base + 1
    num_blocks = need + 2
    ids = torch.randperm(num_blocks, generator=gen)[:need]
    return num_blocks, ids.to(torch.int64 if ids64 else torch.int32).cuda(), base


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(c=cases())
def test_conversion_in_the_copy_is_the_reference(cuda_ops, c):
    gen = torch.Generator().manual_seed(c["seed"])
    fmts = (c["base"], "fp8") if c["to_fp8"] else ("fp8", c["base"])
    src_pool, dst_pool = pool_of(c, 0, fmts[0]), pool_of(c, 1, fmts[1])
    both_runs = src_pool.token_runs and dst_pool.token_runs
    tile = math.gcd(*c["tpbs"]) if both_runs else 1
    rect = Rect("p", **c["rect"], tile=tile)
    shape = paths.convert_shape(c["kind"], c["elems"], c["base"], *fmts)
    one_pass = shape is not None and c["off"] == 0
    staged = mock.patch.object(cuda_ops.convert, c["op"], side_effect=AssertionError("the staged form ran"))
    ring = mock.patch.object(cuda_ops, "CONVERT_RING", cuda_ops.CONVERT_RING if c["ring"] is None else c["ring"])
    with ring:
        got_w, want_w = run_case(cuda_ops, c, gen, fmts, src_pool, dst_pool, rect, one_pass, staged)
    torch.cuda.synchronize()
    assert torch.equal(got_w.cpu(), want_w.cpu())


def run_case(cuda_ops, c, gen, fmts, src_pool, dst_pool, rect, one_pass, staged):
    """The case's kernel call and the reference's, on poisoned outputs: (the kernel's buffer, the reference's)."""
    kind, base, elems = c["kind"], c["base"], c["elems"]
    if c["op"] == "copy_rect":
        snb, sids, sbase = table(src_pool, rect, gen, c["ids64"])
        dnb, dids, dbase = table(dst_pool, rect, gen, not c["ids64"])
        _, src = filled(src_pool.pool_bytes(snb), src_pool.rows[0], kind, elems, base, fmts[0], gen, c["off"])
        got_w, got = poisoned(dst_pool.pool_bytes(dnb), c["off"])
        want_w, want = poisoned(dst_pool.pool_bytes(dnb), c["off"])
        with staged if one_pass else nullcontext():
            cuda_ops.copy_rect(src, src_pool, snb, sids, sbase, got, dst_pool, dnb, dids, dbase, rect,
                               ctas=c["ctas"])
        reference.copy_rect(src, src_pool, snb, sids, sbase, want, dst_pool, dnb, dids, dbase, rect)
    else:  # the pool in fmts[0] packs into a wire of fmts[1], or unpacks from one
        pool_fmt, wire_fmt = fmts if c["op"] == "pack" else fmts[::-1]
        pool = pool_of(c, 0, pool_fmt)
        rect = Rect("p", **c["rect"], tile=math.gcd(*c["tpbs"]) if pool.token_runs else 1,
                    wire=wire_fmt)
        nb, ids, bbase = table(pool, rect, gen, c["ids64"])
        wire_row = pool_of(c, 0, wire_fmt).rows[0]
        ctas = c["ctas"] or 16
        with staged if one_pass else nullcontext():
            if c["op"] == "pack":
                _, src = filled(pool.pool_bytes(nb), pool.rows[0], kind, elems, base, pool_fmt, gen, c["off"])
                got_w, got = poisoned(rect.nbytes((wire_row,) * c["ncomp"]), c["off"])
                want_w, want = poisoned(got.numel(), c["off"])
                cuda_ops.pack(src, pool, nb, rect, ids, bbase, got, ctas=ctas)
            else:
                n = rect.nbytes((wire_row,) * c["ncomp"])
                _, src = filled(n, wire_row, kind, elems, base, wire_fmt, gen, c["off"])
                got_w, got = poisoned(pool.pool_bytes(nb), c["off"])
                want_w, want = poisoned(pool.pool_bytes(nb), c["off"])
                cuda_ops.unpack(src, pool, nb, rect, ids, bbase, got, ctas=ctas)
        getattr(reference, c["op"])(*((src, pool, nb, rect, ids, bbase, want)))
    return got_w, want_w

