"""Deterministic cache contents, so that the gen side can check every byte it received.

Byte ``x`` of the row of (request, pool kind, global layer, component, global head, token)
is a hash of those coordinates: misplaced rows, swapped heads or layers, a shifted token
and the MLA latent delivered as indexer keys all change the bytes. ``expected`` produces
a rectangle's bytes in wire order, so fill is "unpack the expected bytes" and verify is
"pack and compare" with the very ops under test.
"""
from __future__ import annotations

import torch

from kvlab.layout import Rect
from kvlab.spec import Kind
from kvlab.state import RankPool

_KIND = {Kind.kv: 1, Kind.mla: 2, Kind.indexer: 3}
_MASK = 0xFFFFFFFF


def mix(v: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on 32 bits held in int64 (products wrap; masking keeps the low bits)
    v = v & _MASK
    v = ((v ^ (v >> 16)) * 0x85EBCA6B) & _MASK
    v = ((v ^ (v >> 13)) * 0xC2B2AE35) & _MASK
    return v ^ (v >> 16)


def row_seeds(request: int, pool: RankPool, rect: Rect, comp: int, device) -> torch.Tensor:
    """int64 [layers, heads, tokens]: one seed per row of component ``comp`` of ``rect``."""
    layers = torch.tensor(pool.spec.layers[rect.l0:rect.l1], device=device, dtype=torch.int64)
    heads = torch.arange(rect.h0, rect.h1, device=device, dtype=torch.int64)
    tokens = torch.arange(rect.t0, rect.t1, device=device, dtype=torch.int64)
    key = mix(torch.tensor(request * 0x9E3779B1 + _KIND[pool.spec.kind] * 0x7F4A7C15 + comp * 0x6A09E667,
                            device=device, dtype=torch.int64))
    v = mix(key + layers[:, None, None] * 0x3C6EF372)
    v = mix(v + heads[None, :, None] * 0xBB67AE85)
    return mix(v + tokens[None, None, :] * 0x510E527F)


def _tile_groups(rect: Rect) -> list[tuple[int, int, int]]:
    """(first token, tiles, tokens per tile) for runs of equally long tiles: partial head, full tiles, partial tail."""
    T, t0, t1 = rect.tile, rect.t0, rect.t1
    groups = []
    head_end = min(t1, (t0 // T + 1) * T)
    if t0 % T or head_end - t0 < T:
        groups.append((t0, 1, head_end - t0))
        t0 = head_end
    full = (t1 - t0) // T
    if full:
        groups.append((t0, full, T))
        t0 += full * T
    if t0 < t1:
        groups.append((t0, 1, t1 - t0))
    return groups


def expected(request: int, pool: RankPool, rect: Rect, device="cpu") -> torch.Tensor:
    """The bytes of ``rect`` for ``request`` in wire order (uint8, ``rect.nbytes(pool.rows)`` long)."""
    rows = pool.rows
    nl, nh = rect.n_layers, rect.n_heads
    bpl = nh * sum(rows)
    out = torch.empty(rect.nbytes(rows), dtype=torch.uint8, device=device)
    seeds = [row_seeds(request, pool, rect, c, device).to(torch.int32) for c in range(len(rows))]  # [l, h, t]
    for ts, ntiles, ntok in _tile_groups(rect):
        base = (ts - rect.t0) * nl * bpl
        # wire: [tile][layer][component: head, token, byte]
        group = out[base:base + ntiles * nl * ntok * bpl].view(ntiles, nl, ntok * bpl)
        off = 0
        for c, row in enumerate(rows):
            s = seeds[c][:, :, ts - rect.t0:ts - rect.t0 + ntiles * ntok].reshape(nl, nh, ntiles, ntok)
            x = torch.arange(row, device=device, dtype=torch.int32)
            # int32 products wrap; the top byte of seed + x*K varies with every input
            vals = ((s[..., None] + x * -1640531535) >> 24).to(torch.uint8)  # [l, h, tile, tok, x]
            dst = group[:, :, off:off + nh * ntok * row].view(ntiles, nl, nh, ntok, row)
            dst.copy_(vals.permute(2, 0, 1, 3, 4))
            off += nh * ntok * row
    return out


def locate(pool: RankPool, rect: Rect, offset: int) -> dict:
    """Logical coordinates of wire byte ``offset`` of ``rect``: for error messages that name the element."""
    rows = pool.rows
    nl, nh, T = rect.n_layers, rect.n_heads, rect.tile
    bpl = nh * sum(rows)
    ts = rect.t0
    while True:
        te = min(rect.t1, (ts // T + 1) * T)
        size = (te - ts) * nl * bpl
        if offset < size:
            break
        offset -= size
        ts = te
    ntok = te - ts
    layer, rem = divmod(offset, ntok * bpl)
    for c, row in enumerate(rows):
        if rem < ntok * nh * row:
            head, rem = divmod(rem, ntok * row)
            tok, byte = divmod(rem, row)
            return {"pool": pool.name, "layer": pool.spec.layers[rect.l0 + layer], "component": c,
                    "head": rect.h0 + head, "token": ts + tok, "byte": byte}
        rem -= ntok * nh * row
    raise AssertionError("offset outside the rectangle")
