"""The deterministic cache contents (kvlab.memory.fill) against their definition, byte by byte."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from test_layout import cases

from kvlab.memory import fill

SCALE = settings.default.max_examples / 100  # a tenth under `pytest -m "not slow"` (tests/conftest.py)


def definition(request: int, pool, rect) -> torch.Tensor:
    """Byte ``x`` of each row is the top byte of ``seed + x * K`` (mod 2**32), rows in wire order:
    tile, layer, component, head, token; the high byte of each 2-byte float of K/V and MLA rows keeps its
    sign and two low exponent bits, the others set to a finite exponent."""
    rows = pool.rows
    seeds = [fill.row_seeds(request, pool, rect, c, "cpu") for c in range(len(rows))]  # [l, h, t]
    out = []
    t = rect.t0
    while t < rect.t1:
        e = min(rect.t1, (t // rect.tile + 1) * rect.tile)
        for li in range(rect.n_layers):
            for c, row in enumerate(rows):
                s = seeds[c][li, :, t - rect.t0:e - rect.t0]  # [h, tok]
                x = torch.arange(row, dtype=torch.int64)
                b = (((s[..., None] + x * fill._STEP) & fill._MASK) >> 24).to(torch.uint8)
                if pool.spec.comp_dtypes[c] in ("bf16", "fp16") and pool.spec.kind in ("kv", "mla"):
                    b[..., 1::2] = b[..., 1::2] & 0x83 | 0x3C  # finite 2-byte floats: exponent 120-127 (bf16)
                out.append(b.reshape(-1))
        t = e
    return torch.cat(out)


@settings(max_examples=int(150 * SCALE), deadline=None)
@given(cases())
def test_expected_bytes_are_the_definition(case):
    rp, _, rect, _, _ = case
    assert torch.equal(fill.expected(7, rp, rect), definition(7, rp, rect))


@pytest.mark.parametrize("row", [1, 2, 3, 5, 16, 132, 256, 576, 1152, 4096, 7168])
def test_carry_lookup_is_the_binary_search_it_replaces(row):
    rt = fill._row_table(row, "cpu")
    x = torch.arange(row, dtype=torch.int64)
    thr = torch.sort(((1 << 24) - ((x * fill._STEP) & 0xFFFFFF)).to(torch.int32)).values
    reached = thr[thr < (1 << 24)]
    drawn = torch.randint(0, 1 << 24, (50000,), dtype=torch.int32, generator=torch.Generator().manual_seed(row))
    edges = torch.tensor([0, (1 << 24) - 1], dtype=torch.int32)
    low = torch.cat([drawn, reached, reached - 1, edges]).clamp(0, (1 << 24) - 1)
    assert torch.equal(rt.carries(low), torch.searchsorted(thr, low, right=True))
    if row >= 4096:
        assert rt.inside.shape[0] > 1  # buckets holding several thresholds are covered too
