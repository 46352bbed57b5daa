"""Deterministic cache contents, so that the gen side can check every byte it received.

Byte ``x`` of the row of (request, pool kind, global layer, component, global head, token)
is a hash of those coordinates: misplaced rows, swapped heads or layers, a shifted token
and the MLA latent delivered as indexer keys all change the bytes. With prefix reuse on the
decode side (kvlab.model.prefix) the request's place is taken, token by token, by the chain key of the
trace block holding the token (``PrefixKey``): a prefix two prompts share then has the same bytes
in both, as a real model's cache would, so a gen rank may hold it once for both and the check of
each request covers the blocks it shares; everything after the shared prefix stays distinct,
since the chain keys of different prompts differ from their first different block on. ``expected`` produces
a rectangle's bytes in wire order, so fill is "unpack the expected bytes" and verify is
"pack and compare" with the very ops under test.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from kvlab.model.layout import Rect, as_stored, convert_wire, tile_groups
from kvlab.model.prefix import BLOCK_TOKENS
from kvlab.model.spec import KINDS
from kvlab.model.state import RankPool

_MASK = 0xFFFFFFFF
_STEP = 0x9E3779B1  # golden-ratio multiplier of the byte position
_PIECE_BYTES = 1 << 20  # expected bytes computed per step: stays in cache
# the high byte of every 2-byte float (bf16, fp16) of K/V and MLA rows: sign kept, exponent 120-127 (bf16) or 15
# (fp16): finite values in [2^-7, 2) or [1, 2), so that a side keeping them in another KV dtype converts values,
# not infinities and NaNs (kvlab.model.kv_dtype)
_HIGH_KEEP, _HIGH_SET = 0x83, 0x3C
_FLOAT16 = ("bf16", "fp16")


def mix(v: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on 32 bits held in int64 (products wrap; masking keeps the low bits)
    v = v & _MASK
    v = ((v ^ (v >> 16)) * 0x85EBCA6B) & _MASK
    v = ((v ^ (v >> 13)) * 0xC2B2AE35) & _MASK
    return v ^ (v >> 16)


@functools.lru_cache(maxsize=64)
def _layers(layers: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(layers, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class PrefixKey:
    """A request's contents keyed by its trace blocks (kvlab.model.prefix.Prefix.keys) instead of its id."""

    keys: tuple[int, ...]  # chain key of every trace block of the prompt


def key_of(req):
    """What a request's contents are a hash of: its id, or its blocks' chain keys with prefix reuse on."""
    return req.id if req.prefix is None else PrefixKey(req.prefix.keys)


@functools.lru_cache(maxsize=64)
def _block_keys(keys: tuple[int, ...], device: str) -> torch.Tensor:
    # built once per request and device (a host-to-device copy queues behind the device's work: not per piece)
    return torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys], dtype=torch.int64, device=device)


def row_seeds(request, pool: RankPool, rect: Rect, comp: int, device) -> torch.Tensor:
    """int64 [layers, heads, tokens]: one seed per row of component ``comp`` of ``rect``; ``request``: its id,
    or a PrefixKey (a key per token, from the trace block holding it)."""
    # no tensor built from host data on the device: that copy would wait for every kernel queued before it
    layers = _layers(pool.spec.layers, str(device))[rect.l0:rect.l1]
    heads = torch.arange(rect.h0, rect.h1, device=device, dtype=torch.int64)
    tokens = torch.arange(rect.t0, rect.t1, device=device, dtype=torch.int64)
    tag = KINDS[pool.spec.kind].fill_tag * 0x7F4A7C15 + comp * 0x6A09E667
    # a block's key joins the token's term, in the last mix: no more work per row than a request's id (the fill
    # is part of the emulated prefill's time)
    per_token = tokens * 0x510E527F
    if isinstance(request, PrefixKey):
        blocks = _block_keys(request.keys, str(device))[torch.div(tokens, BLOCK_TOKENS, rounding_mode="floor")]
        per_token = per_token + mix(blocks) * 0x2545F491
        request = 0
    key = int(mix(torch.tensor(request * 0x9E3779B1 + tag, dtype=torch.int64)))
    v = mix(key + layers[:, None, None] * 0x3C6EF372)
    v = mix(v + heads[None, :, None] * 0xBB67AE85)
    return mix(v + per_token[None, None, :])


def _tile_groups(rect: Rect) -> list[tuple[int, int, int]]:
    """(first token, tiles, tokens per tile) for runs of equally long tiles (kvlab.model.layout.tile_groups)."""
    return tile_groups(rect)


_BUCKET_SHIFT = 12  # the carry search looks a seed's low 24 bits up in 4096 buckets of 4096 values


@dataclass(frozen=True)
class _RowTable:
    """Byte ``x`` of a row with seed ``s`` is the top byte of ``s + x * K`` (mod 2**32): the top byte
    of ``s``, plus the top byte of ``x * K``, plus a carry when the low 24 bits of both overflow,
    that is when ``s``'s low 24 bits reach ``x``'s threshold. Sorted by threshold, the positions a
    seed carries into are a prefix: ``k`` = how many thresholds the seed reaches names it, and
    ``table[k]`` is the whole row but for the top byte of ``s``.

    ``k`` is found without a binary search (70 ns per row on this path's CPUs): ``below[b]`` counts
    the thresholds under bucket ``b`` of the low 24 bits, ``inside[j, b]`` is the ``j``-th threshold
    in bucket ``b`` (2**24, never reached, where there is none). The multiplier's equidistribution
    leaves at most one or two thresholds per bucket for rows of KiBs."""

    below: torch.Tensor  # int64 [4096]
    inside: torch.Tensor  # int32 [most thresholds in one bucket, 4096]
    table: torch.Tensor  # uint8 [row + 1, row]

    def carries(self, low: torch.Tensor) -> torch.Tensor:
        """``k`` for seeds whose low 24 bits are ``low`` (int32): how many thresholds they reach."""
        b = (low >> _BUCKET_SHIFT).long()
        k = self.below[b]
        for edge in self.inside:
            k += low >= edge[b]
        return k


@functools.lru_cache(maxsize=64)
def _row_table(row: int, device: str) -> _RowTable:
    c = (torch.arange(row, dtype=torch.int64) * _STEP) & _MASK
    thr = (1 << 24) - (c & 0xFFFFFF)  # 2**24 when x never carries
    order = torch.argsort(thr, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(row)
    carry = rank[None, :] < torch.arange(row + 1)[:, None]  # [k, x]
    table = ((c >> 24)[None, :] + carry).to(torch.uint8)
    reached = thr[thr < (1 << 24)]
    n_buckets = 1 << (24 - _BUCKET_SHIFT)
    bucket = reached >> _BUCKET_SHIFT
    below = torch.searchsorted(torch.sort(reached).values, torch.arange(n_buckets) << _BUCKET_SHIFT)
    per = torch.bincount(bucket, minlength=n_buckets)
    inside = torch.full((int(per.max()) if reached.numel() else 0, n_buckets), 1 << 24, dtype=torch.int64)
    for t in torch.sort(reached).values.tolist():  # once per row size: a few hundred thresholds
        b = t >> _BUCKET_SHIFT
        j = int((inside[:, b] < (1 << 24)).sum())
        inside[j, b] = t
    return _RowTable(below.to(device), inside.to(torch.int32).to(device), table.to(device))


_MAX_ROW = 4096  # bytes of the longest row _row_table makes: its table is [row + 1, row]


def _sub_row(row: int) -> int:
    """The longest divisor of ``row`` of at most _MAX_ROW bytes (``row`` itself when short)."""
    if row <= _MAX_ROW:
        return row
    return next(d for d in range(_MAX_ROW, 0, -1) if row % d == 0)


def expected(request, pool: RankPool, rect: Rect, device="cpu", out: torch.Tensor | None = None) -> torch.Tensor:
    """The bytes of ``rect`` for ``request`` in wire order (uint8, ``rect.nbytes(pool.rows)`` long), written
    into ``out`` when given. Per row one search and a gather of a table row (``_row_table``), a few
    layers at a time so that the pieces stay in cache: no arithmetic per byte but one add."""
    rows = pool.rows
    nl, nh = rect.n_layers, rect.n_heads
    bpl = nh * sum(rows)
    n = rect.nbytes(rows)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=device)
    elif out.numel() != n or out.dtype != torch.uint8:
        raise ValueError(f"expected(): out has {out.numel()} {out.dtype} elements, the rectangle needs {n} uint8")
    if pool.spec.fmt:  # the values of the pool in its base dtype, in its KV dtype (a value check: kvlab.model.kv_dtype)
        base = replace(pool, spec=replace(pool.spec, fmt=""))
        own = as_stored(rect)
        return convert_wire(expected(request, base, own, out.device), own, base.spec, pool.spec, out)
    floats = [d in _FLOAT16 and KINDS[pool.spec.kind].name in ("kv", "mla") for d in pool.spec.comp_dtypes]
    dev = out.device
    seeds = [row_seeds(request, pool, rect, c, dev) for c in range(len(rows))]  # [l, h, t]
    for ts, ntiles, ntok in _tile_groups(rect):
        base = (ts - rect.t0) * nl * bpl
        # wire: [tile][layer][component: head, token, byte]
        group = out[base:base + ntiles * nl * ntok * bpl].view(ntiles, nl, ntok * bpl)
        # layers per step: on a CPU the step stays in cache; a GPU takes the group in one go (launches cost)
        step = nl if dev.type == "cuda" else max(1, _PIECE_BYTES // (ntiles * ntok * bpl))
        off = 0
        for c, row in enumerate(rows):
            # a long row (a recurrent state's, hundreds of KiB) as ``parts`` rows of ``sub`` bytes: byte x of the
            # row is the top byte of seed + x * _STEP, so part j is a row of seed + j * sub * _STEP
            sub = _sub_row(row)
            parts = row // sub
            rt = _row_table(sub, str(dev))
            s = seeds[c][:, :, ts - rect.t0:ts - rect.t0 + ntiles * ntok].reshape(nl, nh, ntiles, ntok)
            s = s.permute(2, 0, 1, 3).contiguous()  # [tile, l, h, tok], as on the wire
            if parts > 1:
                step_j = (torch.arange(parts, device=dev, dtype=torch.int64) * sub * _STEP) & _MASK
                s = ((s[..., None] + step_j) & _MASK).flatten(-2)
            hi = (s >> 24).to(torch.uint8)
            k = rt.carries((s & 0xFFFFFF).to(torch.int32))
            dst = group[:, :, off:off + nh * ntok * row].view(ntiles, nl, nh, ntok * parts, sub)
            for a in range(0, nl, step):
                d = dst[:, a:a + step]
                low = torch.index_select(rt.table, 0, k[:, a:a + step].reshape(-1)).view(d.shape)
                torch.add(low, hi[:, a:a + step, ..., None], out=d)
            if floats[c]:  # finite values (_HIGH_KEEP): the high byte of each little-endian 2-byte float
                high = dst[..., 1::2]
                high.bitwise_and_(_HIGH_KEEP).bitwise_or_(_HIGH_SET)
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
