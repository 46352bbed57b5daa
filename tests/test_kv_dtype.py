"""The KV dtype per side (``ctx.kv_dtype`` / ``gen.kv_dtype``) and its conversion in flight.

The fp8 rule is checked against a reference written here from the e4m3 format's definition (sign, 4 exponent
bits of bias 7, 3 mantissa bits, subnormals, 0x7F/0xFF NaN, no infinity): every code's value enumerated, a value
rounded to the nearest one, ties to the even code. The gen side's pools after a converting transfer must hold
the expected fp8 bytes that reference computes from the expected bf16 values.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_layouts import GQA, _caches, model_preset

from kvlab.core.errors import ConfigError
from kvlab.memory.fill import expected
from kvlab.memory.ops import get_ops
from kvlab.model import kv_dtype
from kvlab.model.parallel import SideSpec
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import preset, preset_names, schedule
from kvlab.model.state import CacheState

SCALE = settings.default.max_examples / 100


def e4m3_values() -> torch.Tensor:
    """float64 value of every non-negative e4m3fn code 0x00..0x7E (0x7F is NaN)."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(out, dtype=torch.float64)


VALUES = e4m3_values()


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Codes of fp32 ``x`` (|x| <= 448): nearest e4m3 value, ties to the even code, the sign bit kept."""
    mag = x.abs().double()[..., None]
    d = (VALUES - mag).abs()
    best = d.min(-1, keepdim=True).values
    tied = d == best
    code = torch.where(tied & (torch.arange(0x7F) % 2 == 0), torch.arange(0x7F), 0x7F).min(-1).values
    code = torch.where(tied.sum(-1) > 1, code, d.argmin(-1))  # a single nearest code wins outright
    return (code | torch.where(torch.signbit(x), 0x80, 0)).to(torch.uint8)


def reference_row(x: torch.Tensor, kind: str, base: str = "bf16") -> torch.Tensor:
    """One fp8 row (kvlab.model.kv_dtype's layout) of fp32 values ``x`` [..., elems], by this module's own rounding."""
    q = x.shape[-1] if kind == "kv" else x.shape[-1] - 64
    group = q if kind == "kv" else 128
    codes, scales = [], []
    for a in range(0, q, group):
        g = x[..., a:a + group]
        amax = g.abs().amax(-1, keepdim=True)
        s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        codes.append(round_e4m3((g / s).clamp(-448, 448)))
        scales.append(s.to(torch.float32).view(torch.uint8))
    parts = codes + scales
    if kind != "kv":
        parts.append(x[..., q:].to({"bf16": torch.bfloat16, "fp16": torch.float16}[base]).view(torch.uint8))
    return torch.cat(parts, -1)


@settings(max_examples=int(60 * SCALE), deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 7, 16, 128]), st.floats(1e-6, 1e6))
def test_quantize_is_the_e4m3_rule(seed, n, spread):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, n, generator=g) * spread
    x[0] = 0  # an all-zero group: scale 1
    x[1, 0] = -0.0
    got = kv_dtype.from_values(x, "kv", "bf16", "fp8")
    assert torch.equal(got, reference_row(x, "kv"))


def test_ties_go_to_the_even_code():
    # midpoints between neighbouring e4m3 values, scaled so that the row's amax is exactly 448 (scale 1)
    mids = (VALUES[1:] + VALUES[:-1]) / 2
    x = torch.cat([mids, torch.tensor([448.0])]).float()[None]
    assert torch.equal(kv_dtype.from_values(x, "kv", "bf16", "fp8"), reference_row(x, "kv"))
    codes = kv_dtype.from_values(x, "kv", "bf16", "fp8")[0, :-5]
    assert (codes[:-1] % 2 == 0).all()


@pytest.mark.parametrize("kind, elems, row", [("kv", 128, 132), ("kv", 16, 20), ("mla", 576, 656)])
def test_row_sizes_and_the_round_trip(kind, elems, row):
    """K/V rows: D codes and one scale per token and head; MLA as vLLM's fp8_ds_mla (656 B for 576 values)."""
    assert kv_dtype.row_bytes(kind, elems, "bf16", "fp8") == row
    x = torch.randn(8, elems, generator=torch.Generator().manual_seed(elems)).to(torch.bfloat16).float()
    rows = kv_dtype.from_values(x, kind, "bf16", "fp8")
    assert rows.shape == (8, row) and torch.equal(rows, reference_row(x, kind))
    back = kv_dtype.to_values(rows, kind, elems, "bf16", "fp8")
    q = elems if kind == "kv" else elems - 64
    group = q if kind == "kv" else 128
    amax = x[:, :q].unflatten(-1, (-1, group)).abs().amax(-1).repeat_interleave(group, -1)
    assert ((back[:, :q] - x[:, :q]).abs() <= amax / 448 * 16 * (1 + 1e-5)).all()  # half an e4m3 step at the top
    assert torch.equal(back[:, q:], x[:, q:])  # the RoPE part is kept


# ---------------------------------------------------------------- converted in flight, checked by value

DSA = model_preset("tiny_dsa")


def _transfer(model, ctx, gen, isl, strategy, pull, device="cpu"):
    req, ops = Request(0, isl), get_ops("cuda" if device == "cuda" else "auto", device)
    src, dst = _caches(model, ctx, isl, 0.3, device), _caches(model, gen, isl, 0.3, device)
    for c in src.values():
        c.fill(req, ops)
    segments = plan(model, ctx, gen, req)
    chunks = schedule(model, ctx, gen, segments, preset(strategy), None if pull else 1 << 14)
    for c in chunks:
        s, d = src[c.src], dst[c.dst]
        sp, dp, st_, dt = s.pools[c.rect.pool], d.pools[c.rect.pool], s.tables[0][c.rect.pool], d.tables[0][c.rect.pool]
        if pull:
            ops.copy_rect(sp.storage, sp.pool, sp.num_blocks, st_.ids, st_.base,
                          dp.storage, dp.pool, dp.num_blocks, dt.ids, dt.base, c.rect)
            continue
        assert not (c.rect.wire and c.ctx_in_place and sp.pool.spec.fmt != gen.fmt)
        wire = torch.empty(c.nbytes, dtype=torch.uint8, device=device)
        ops.pack(sp.storage, sp.pool, sp.num_blocks, c.rect, st_.ids, st_.base, wire)
        ops.unpack(wire, dp.pool, dp.num_blocks, c.rect, dt.ids, dt.base, dp.storage)
    return dst, segments, chunks, ops, req


@pytest.mark.parametrize("model_name", ["tiny_gqa", "tiny_dsa"])
@pytest.mark.parametrize("strategy, pull", [(s, False) for s in preset_names()] + [("chunked", True)])
def test_bf16_to_fp8_lands_the_expected_values(model_name, strategy, pull):
    check_bf16_to_fp8(model_name, strategy, pull, "cpu")


def check_bf16_to_fp8(model_name, strategy, pull, device):
    """ctx bf16 (vLLM NHD) -> gen fp8 (TensorRT-LLM): what the gen pools hold is this module's own rounding of
    the expected bf16 values; the wire carried fp8 (converted in the pack), or the pull converted in its copy."""
    model = GQA if model_name == "tiny_gqa" else DSA
    ctx = SideSpec("ctx", tp=2 if model is GQA else 1, layout="vllm_lbnhc").resolved(model)
    gen = SideSpec("gen", layout="trtllm", kv_dtype="fp8").resolved(model)
    dst, segments, chunks, ops, req = _transfer(model, ctx, gen, 130, strategy, pull, device)
    for g, cache in dst.items():
        for name, store in cache.pools.items():
            rect = cache.held_rect(name, req.isl)
            got = torch.empty(rect.nbytes(store.pool.rows), dtype=torch.uint8, device=device)
            ops.pack(store.storage, store.pool, store.num_blocks, rect, cache.tables[0][name].ids,
                     cache.tables[0][name].base, got)
            base = CacheState(model, SideSpec("gen", layout="trtllm").resolved(model), g).pool(name)
            want = expected(0, base, rect)
            if store.pool.spec.fmt:  # rows of each component, in wire order: rounded here, not by kvlab
                want = _reference_wire(want, rect, base, store.pool)
            assert torch.equal(got.cpu(), want), name
        assert cache.verify(req, [s for s in segments if s.dst == g], ops) == []
    kv = [c for c in chunks if c.rect.pool in ("kv", "mla")]
    assert kv and all(c.rect.wire == "fp8" for c in kv)


@pytest.mark.parametrize("strategy, pull", [("chunked", False), ("chunked", True), ("layerwise", False)])
def test_the_conversion_goes_in_pieces_of_whole_tiles(monkeypatch, strategy, pull):
    """Conversion scratch is bounded whatever the chunk: pieces of one tile, and batches of a few rows, land the
    same values as one piece per chunk."""
    from kvlab.model import layout

    monkeypatch.setattr(layout, "CONVERT_PIECE", 300)
    check_bf16_to_fp8("tiny_dsa", strategy, pull, "cpu")
    check_bf16_to_fp8("tiny_gqa", strategy, pull, "cpu")


def _reference_wire(data, rect, base, pool):
    """Every row of ``data`` (one row size for every component of K/V and MLA pools, in wire order) in fp8."""
    kind = str(getattr(base.spec.kind, "value", base.spec.kind))
    (row,) = set(base.rows)
    vals = data.view(-1, row).view(torch.bfloat16).float()  # every row of every component: one row size
    return reference_row(vals, kind).reshape(-1)


@pytest.mark.parametrize("ctx_kv, gen_kv, place", [(None, "fp16", "unpack"), ("bf16", "fp8", "pack"),
                                                    ("fp8", "fp8", "none"), ("fp16", "fp16", "none")])
def test_other_pairs_convert_where_the_plan_says_and_verify(ctx_kv, gen_kv, place):
    ctx = SideSpec("ctx", tp=2, layout="flashinfer_hnd", kv_dtype=ctx_kv)
    gen = SideSpec("gen", layout="vllm_lbhnc", kv_dtype=gen_kv).resolved(GQA)
    segments = plan(GQA, ctx, gen, Request(0, 70))
    assert {s.rect.wire for s in segments} == ({""} if place == "none" else {"fp8" if "fp8" in (ctx_kv, gen_kv)
                                                                              else "bf16"})
    dst, segments, _, ops, req = _transfer(GQA, ctx, gen, 70, "zerocopy", False)
    for g, cache in dst.items():
        assert cache.verify(req, [s for s in segments if s.dst == g], ops) == []


def test_fp8_halves_the_wire_bytes_of_bf16_kv():
    ctx, gen = SideSpec("ctx", tp=1), SideSpec("gen", kv_dtype="fp8")
    model = model_preset("llama3_8b")
    bf16 = sum(s.nbytes for s in plan(model, ctx, SideSpec("gen"), Request(0, 4096)))
    fp8 = sum(s.nbytes for s in plan(model, ctx, gen, Request(0, 4096)))
    assert fp8 * 2 * 128 == bf16 * 132  # 128 codes and a 4-byte scale per 256-byte row
    assert math.isclose(fp8 / bf16, 132 / 256)


@pytest.mark.parametrize("overrides, message", [
    (["gen.kv_dtype=fp4"], "gen.kv_dtype=fp4: use one of bf16, fp16, fp8"),
    (["ctx.kv_dtype=fp8"], "ctx.kv_dtype=fp8: kvlab converts the prefill's own bf16 values in flight, not values "
                           "already kept in fp8; leave ctx.kv_dtype unset, or set gen.kv_dtype=fp8 too"),
    (["ctx.dtype=fp32", "gen.dtype=fp32", "gen.kv_dtype=fp8"], "gen.kv_dtype=fp8: converts bf16 or fp16 values"),
    (["model=tiny_dsa", "gen.kv_dtype=fp8", "transport=mooncake", "transport.mode=direct"],
     "transport.mode=direct: writes pool to pool with no pack or unpack to convert ctx.kv_dtype=bf16 into "
     "gen.kv_dtype=fp8 in"),
])
def test_a_kv_dtype_that_cannot_work_is_one_line(overrides, message):
    from kvlab.config.schema import build, compose

    with pytest.raises(ConfigError) as e:
        build(compose(overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
