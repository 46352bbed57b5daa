"""The fp8 scale ``amax / 448`` as kernels/fp8_rows.cu computes it without a division (``kv_convert_rect``'s fast
form): the product by 1/448 rounded to nearest, then two residual corrections, is IEEE's fp32 quotient for every
bf16 and fp16 amax in the form's range [2^-100, 2^127] (fma emulated exactly with rationals; the GPU tests
compare the kernel itself against the torch rule)."""
from __future__ import annotations

from fractions import Fraction

import numpy as np

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
