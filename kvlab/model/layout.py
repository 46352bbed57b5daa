"""Wire order and memory addresses of a rectangle of one rank's pool.

Wire order of a rectangle (layers [l0,l1), heads [h0,h1), tokens [t0,t1)) with tile T:
for each tile of T tokens (the first and last may be partial), for each layer, for each
component, for each head: the tile's token rows of that (layer, component, head). Because
T divides both sides' ``tokens_per_block``, every such *run* lies inside one block on both
sides, contiguous where the layout keeps a head's token rows together, else as single rows
(kvlab.model.engine_layouts; the plan uses T = 1 for such a pool, so that both sides' runs are the
same rows); pack and unpack are gathers and scatters of runs. A chunk needs no staging on
a side when its runs lie back to back in memory in wire order (``is_in_place``).

Everything here is torch arithmetic on small index tensors: the torch reference ops and
the CUDA kernels compute the same offsets (``kernels/kv_copy.cu`` mirrors ``runs``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvlab.model import kv_dtype
from kvlab.model.spec import PoolSpec
from kvlab.model.state import RankPool
from kvlab.model.tokens import to_global


@dataclass(frozen=True)
class Rect:
    pool: str
    l0: int  # pool-local layers [l0, l1)
    l1: int
    h0: int  # global heads [h0, h1) (0..1 for replicated pools)
    h1: int
    t0: int  # tokens [t0, t1)
    t1: int
    tile: int
    # the KV dtype on the wire where the two sides' differ (kvlab.model.kv_dtype): a pool of another format converts
    # its rows in the pack or the unpack (kvlab.memory.ops); "": each side's bytes as they are
    wire: str = ""
    # (dcp, dcp rank, interleave) where t0/t1 count a decode-context-parallel rank's local positions
    # (kvlab.model.tokens): the prefill side finds global token (u // I) * I * dcp + rank * I + u % I; None: global
    local: tuple[int, int, int] | None = None

    @property
    def n_layers(self) -> int:
        return self.l1 - self.l0

    @property
    def n_heads(self) -> int:
        return self.h1 - self.h0

    @property
    def n_tokens(self) -> int:
        return self.t1 - self.t0

    def nbytes(self, rows: tuple[int, ...]) -> int:
        return self.n_layers * self.n_heads * self.n_tokens * sum(rows)


@dataclass(frozen=True)
class Runs:
    """Copy runs of a rectangle: ``length[i]`` bytes at ``mem[i]`` in the pool and ``wire[i]`` on the wire."""

    mem: torch.Tensor
    wire: torch.Tensor
    length: torch.Tensor
    converts: bool = False  # the pool's rows are not the wire's (another KV dtype): never in place


def runs(pool: RankPool, num_blocks: int, rect: Rect, block_ids: torch.Tensor, block_base: int) -> Runs:
    """Runs of ``rect`` in ``pool``; ``block_ids[i]`` is the physical block of logical block ``block_base + i``.

    One run per (tile, layer, component, head), in wire order, where the pool keeps a head's token rows back
    to back (``RankPool.token_runs``); else one per token row of it, in the same wire order (the NHD layouts,
    K and V interleaved per token: the plan then sends the pool in tiles of one token, ``wire_tile``)."""
    dev = block_ids.device
    tpb, T = pool.tokens_per_block, rect.tile
    strides = pool.comp_strides(num_blocks)
    rows = pool.rows
    nh, nl = rect.n_heads, rect.n_layers
    bpl = nh * sum(rows)  # wire bytes per token per layer
    split = not pool.token_runs and T > 1  # runs of one token row each

    u = torch.arange(rect.t0 // T, (rect.t1 - 1) // T + 1, device=dev, dtype=torch.int64)
    ts = torch.clamp(u * T, min=rect.t0)
    te = torch.clamp((u + 1) * T, max=rect.t1)
    ntok = te - ts
    tile_wire = (ts - rect.t0) * nl * bpl
    at = mem_tokens(pool, rect, ts)  # where the tiles lie in this pool: a tile's tokens are consecutive there too
    blk = block_ids.to(torch.int64)[at // tpb - block_base]

    l = torch.arange(nl, device=dev, dtype=torch.int64)
    h = torch.arange(nh, device=dev, dtype=torch.int64)
    l_local = l + rect.l0 - pool.layers.start
    h_local = h + rect.h0 - pool.heads.start
    mems, wires, lens = [], [], []
    comp_wire = 0
    for row, s in zip(rows, strides):
        # [tile, layer, head] for this component; components interleave per layer below
        w = (tile_wire[:, None, None]
             + ntok[:, None, None] * (l[None, :, None] * bpl + comp_wire + h[None, None, :] * row))
        m = (blk[:, None, None] * s.block + l_local[None, :, None] * s.layer + s.offset
             + h_local[None, None, :] * s.head + (at % tpb)[:, None, None] * s.token)
        mems.append(m)
        wires.append(w)
        lens.append((ntok * row)[:, None, None].expand_as(m))
        comp_wire += nh * row
    # stack components between layer and head so that the flattened order is the wire order
    mem = torch.stack(mems, dim=2)
    wire = torch.stack(wires, dim=2)
    length = torch.stack(lens, dim=2)
    if split:  # each run becomes its tile's token rows: [tile, layer, comp, head, token]
        k = torch.arange(T, device=dev, dtype=torch.int64)
        keep = (k[None, :] < ntok[:, None])[:, None, None, None, :].expand(*mem.shape, T)
        tok = torch.tensor([s.token for s in strides], device=dev, dtype=torch.int64)[None, None, :, None, None]
        row = torch.tensor(rows, device=dev, dtype=torch.int64)[None, None, :, None, None]
        mem = (mem[..., None] + k * tok)[keep]
        wire = (wire[..., None] + k * row)[keep]
        length = row.expand(*length.shape, T)[keep]
    return Runs(mem.reshape(-1), wire.reshape(-1), length.reshape(-1), converts(pool, rect))


def mem_tokens(pool: RankPool, rect: Rect, ts: torch.Tensor) -> torch.Tensor:
    """The positions in ``pool``'s blocks of ``rect``'s positions ``ts``: the same where the rectangle counts
    the pool's own positions, the global tokens where it counts a DCP rank's and the pool holds global ones."""
    own = pool.tokens.local
    if rect.local == own:
        return ts
    if own is not None:
        raise ValueError(f"rect counts positions {rect.local}, the pool's rank keeps its own {own}")
    return to_global(rect.local, ts)


def converts(pool: RankPool, rect: Rect) -> bool:
    """Whether ``pool``'s rows are in another format than the wire of ``rect`` (kvlab.model.kv_dtype)."""
    return bool(rect.wire) and rect.wire != (pool.spec.fmt or pool.spec.comp_dtypes[0])


def as_stored(rect: Rect) -> Rect:
    """``rect`` as its pool's own bytes: what a pack into the pool's format, or an unpack from it, moves."""
    return replace(rect, wire="") if rect.wire else rect


def tile_groups(rect: Rect) -> list[tuple[int, int, int]]:
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


# Bytes of one format converted at a time: the conversion's temporaries (fp32 values, their magnitudes, the scaled
# codes) are several times the rows they convert; a whole 4 GiB pull of Llama-3.1-8B at 32k converted at once held
# 25 GiB of device memory. kvlab.memory.ops.convert cuts its scratch pieces to this size as well.
CONVERT_PIECE = 32 << 20


def convert_wire(data: torch.Tensor, rect: Rect, src: PoolSpec, dst: PoolSpec, out: torch.Tensor | None = None,
                 rows_fn=kv_dtype.convert_rows) -> torch.Tensor:
    """``rect``'s bytes in wire order with ``src``'s rows, as ``dst``'s rows (one pool kind, another KV dtype):
    each component's rows converted where they lie by ``rows_fn`` (kvlab.model.kv_dtype.convert_rows, or an
    implementation of the same rule: the GPU's kernel)."""
    if src.comp_row_bytes() == dst.comp_row_bytes() and (src.fmt or src.comp_dtypes[0]) == (dst.fmt or
                                                                                            dst.comp_dtypes[0]):
        return data if out is None else out.copy_(data)
    srows, drows = src.comp_row_bytes(), dst.comp_row_bytes()
    kind = str(getattr(src.kind, "value", src.kind))
    sf, df = src.fmt or src.comp_dtypes[0], dst.fmt or dst.comp_dtypes[0]
    if out is None:
        out = torch.empty(rect.nbytes(drows), dtype=torch.uint8, device=data.device)
    nl, nh = rect.n_layers, rect.n_heads
    so = do = 0
    for _, ntiles, ntok in tile_groups(rect):
        sn, dn = ntiles * nl * ntok * nh * sum(srows), ntiles * nl * ntok * nh * sum(drows)
        sg, dg = data[so:so + sn].view(ntiles, nl, -1), out[do:do + dn].view(ntiles, nl, -1)
        sc = dc = 0
        for c, (sr, dr) in enumerate(zip(srows, drows)):
            rows = sg[:, :, sc:sc + nh * ntok * sr].reshape(-1, sr)
            got = torch.empty((rows.shape[0], dr), dtype=torch.uint8, device=data.device)
            step = max(1, CONVERT_PIECE // max(sr, dr))
            for a in range(0, rows.shape[0], step):
                got[a:a + step] = rows_fn(rows[a:a + step], kind, src.comp_elems[c], src.comp_dtypes[c], sf, df)
            dg[:, :, dc:dc + nh * ntok * dr] = got.view(ntiles, nl, nh * ntok * dr)
            sc, dc = sc + nh * ntok * sr, dc + nh * ntok * dr
        so, do = so + sn, do + dn
    return out


def is_in_place(r: Runs) -> bool:
    """True when the runs lie back to back in memory in wire order: the chunk can be sent or received in place."""
    if r.converts:
        return False
    d = r.mem - r.wire
    return bool((d == d[0]).all())


def first_byte(pool: RankPool, num_blocks: int, rect: Rect, first_block: int) -> int:
    """Pool offset of the first byte of ``rect`` when its first token lies in physical block ``first_block``."""
    s = pool.comp_strides(num_blocks)[0]
    t0 = int(mem_tokens(pool, rect, torch.tensor([rect.t0]))[0])
    return (s.offset + first_block * s.block + (rect.l0 - pool.layers.start) * s.layer
            + (rect.h0 - pool.heads.start) * s.head + t0 % pool.tokens_per_block * s.token)


def mem_span(pool: RankPool, rect: Rect) -> tuple[int, int]:
    """(first, last) logical block of ``pool`` that ``rect``'s tokens lie in."""
    ends = mem_tokens(pool, rect, torch.tensor([rect.t0, rect.t1 - 1]))
    return int(ends[0]) // pool.tokens_per_block, int(ends[1]) // pool.tokens_per_block


def identity_blocks(rect: Rect, tokens_per_block: int, pool: RankPool | None = None) -> tuple[torch.Tensor, int]:
    """A block table of consecutive blocks covering ``rect`` (in ``pool``, where it counts other positions than
    the pool's own): for shape-only questions."""
    if pool is not None:
        first, last = mem_span(pool, rect)
    else:
        first, last = rect.t0 // tokens_per_block, (rect.t1 - 1) // tokens_per_block
    return torch.arange(0, last - first + 1, dtype=torch.int64), first
