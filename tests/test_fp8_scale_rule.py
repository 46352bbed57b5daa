"""The fp8 rule's arithmetic as kernels/fp8_rows.cu does it without divisions (``kv_convert_rect``'s fast form):

- the scale ``amax / 448``: the product by 1/448 rounded to nearest, then two residual corrections, is IEEE's fp32
  quotient for every bf16 and fp16 amax in the form's range [2^-100, 2^127] (fma emulated exactly with rationals);
- the codes: ``x * y + x * yl`` (y = 1/s rounded down, yl = (1 - s y) y, fp32 operations emulated) has the
  rule's e4m3 code of ``x / s`` for every bf16 x against every bf16 amax significand, from either fp32 reciprocal
  around 1/s, and for fp16 on a drawn sample of amax.

The GPU tests compare the kernel itself against the torch rule."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

LO, HI = 2.0**-100, 2.0**127  # the kernel's fast range (outside it, a division)


def rn32(q: Fraction) -> float:
    """``q`` rounded to the nearest fp32, ties to even (no overflow in this range)."""
    if q == 0:
        return 0.0
    sign, q = (-1 if q < 0 else 1), abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    quantum = Fraction(2) ** (max(e, -126) - 23)
    m = q / quantum
    fl, rem = m.numerator // m.denominator, m - m.numerator // m.denominator
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2):
        fl += 1
    return sign * float(fl * quantum)


def fma(a: float, b: float, c: float) -> float:
    return rn32(Fraction(a) * Fraction(b) + Fraction(c))


def kernel_scale(a: float, y: float) -> float:
    t = rn32(Fraction(a) * Fraction(y))
    t = fma(fma(-448.0, t, a), y, t)
    return fma(fma(-448.0, t, a), y, t)


def test_scale_without_division_is_ieees_quotient():
    y = float.fromhex("0x1.24924ap-9")  # Y448 in kernels/fp8_rows.cu
    assert y == float(np.float32(1) / np.float32(448))
    bf16 = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    fp16 = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    amax = np.unique(np.concatenate([bf16, fp16]))
    amax = amax[(amax >= LO) & (amax <= HI)]
    want = amax / np.float32(448)  # numpy's fp32 division: IEEE
    bad = [float(a) for a, w in zip(amax, want) if kernel_scale(float(a), y) != float(w)]
    assert len(amax) > 50_000 and not bad, bad[:5]


def e4m3(q: np.ndarray) -> np.ndarray:
    """The rule's code of fp32 values: clamped to [-448, 448], nearest e4m3 (e4m3fn), ties to even."""
    return torch.from_numpy(np.clip(q, -448, 448).astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def kernel_codes(x: np.ndarray, amax: np.ndarray, y_from: str = "nearest") -> np.ndarray:
    """``codes_fast``'s codes, each fp32 operation emulated: products of fp32 values are exact in fp64 here (at most
    48 significant bits, the last sum at most 53) and rounded to fp32 once. The kernel's reciprocal (rcp.approx and
    a Newton step) is 1/s rounded to nearest or the fp32 on the other side of 1/s: ``y_from`` picks which."""
    f32, f64 = np.float32, np.float64
    s = amax / f32(448)

    def residual(y):  # fmaf(-s, y, 1): s * y exact in fp64, 1 minus it too
        return (f64(1) - s.astype(f64) * y.astype(f64)).astype(f32)

    y = f32(1) / s
    e = residual(y)
    if y_from == "below":
        y = np.where(e < 0, np.nextafter(y, f32(0)), y).astype(f32)
    elif y_from == "above":
        y = np.where(e > 0, np.nextafter(y, f32(np.inf)), y).astype(f32)
    e = residual(y)
    down = e < 0  # the kernel: y one step down where it is above 1/s, so that yl >= 0
    y = np.where(down, np.nextafter(y, f32(0)), y).astype(f32)
    e = residual(y)
    yl = (e.astype(f64) * y.astype(f64)).astype(f32)
    p = (x.astype(f64) * yl.astype(f64)).astype(f32)  # x * yl
    return e4m3((x.astype(f64) * y.astype(f64) + p.astype(f64)).astype(f32))  # fmaf(x, y, p)


def pairs(sig: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x, amax) for every amax significand of ``sig`` and every x of ``xs`` (both signs) of at most amax: scaling
    both by a power of two scales x / s alike, so one binade of amax stands for all."""
    xs = np.concatenate([xs, -xs, np.float32([0.0, -0.0])]).astype(np.float32)
    a, x = np.meshgrid(sig, xs)
    keep = np.abs(x) <= a
    return x[keep], a[keep]


def test_codes_by_the_reciprocal_and_its_residual_are_the_rules():
    # bf16: every amax significand, every x down to 2^-32 (its code is 0 long before)
    sig = (np.arange(0x3F80, 0x4000, dtype=np.uint32) << 16).view(np.float32)
    x, a = pairs(sig, (np.arange(0x2F80, 0x4000, dtype=np.uint32) << 16).view(np.float32))
    rule = e4m3(x / (a / np.float32(448)))  # numpy's fp32 division: IEEE, as torch's rule divides
    assert len(x) > 1_000_000
    for y_from in ("nearest", "below", "above"):
        assert np.array_equal(kernel_codes(x, a, y_from), rule), y_from
    # fp16: 11-bit values, amax drawn, every x from 2^-14 up
    gen = np.random.default_rng(0)
    sig16 = gen.integers(0x3C00, 0x4000, 64, dtype=np.uint16).view(np.float16).astype(np.float32)
    x, a = pairs(sig16, np.arange(0x0400, 0x4000, dtype=np.uint16).view(np.float16).astype(np.float32))
    assert np.array_equal(kernel_codes(x, a), e4m3(x / (a / np.float32(448))))
