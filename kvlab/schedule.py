"""The schedule: a request's segments cut into chunks and ordered by the strategy.

Pure, like the plan: both sides derive the same chunk list from the same states. Each
chunk is exactly one message on the wire, whatever either side does with it, so a side's
choice to send or receive a chunk in place never changes what the other side posts: the
zero-copy hang of engines that switch to one message per block cannot happen here.

Strategies:
- ``naive``: one chunk per segment, as large as the segment (a buffer sized to the request).
- ``chunked``: chunks of at most one slot, round-robin over the segments so that every
  pair of ranks is busy.
- ``layerwise``: chunks never span layers and go in the order the prefill finishes layers;
  ``Chunk.ready_layer`` is the global layer that must be done first.
- ``zerocopy``: chunked, with the last partial tile cut off so that whole-block chunks can
  go in place; ``ctx_in_place`` / ``gen_in_place`` say, from both cache states alone,
  whether a chunk's shape is in wire order on that side when its blocks are consecutive.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from kvlab.errors import ConfigError
from kvlab.layout import Rect, identity_blocks, is_in_place, runs
from kvlab.parallel import SideSpec
from kvlab.plan import Segment
from kvlab.spec import ModelSpec
from kvlab.state import CacheState


class Strategy(str, Enum):
    naive = "naive"
    chunked = "chunked"
    layerwise = "layerwise"
    zerocopy = "zerocopy"


@dataclass(frozen=True)
class Chunk:
    request: int
    seq: int  # position in the request's schedule
    src: int  # ctx side-local rank
    dst: int  # gen side-local rank
    rect: Rect
    nbytes: int
    ready_layer: int  # global layer the prefill must have finished
    ctx_in_place: bool = False
    gen_in_place: bool = False


def cut_rect(seg: Segment, rows: tuple[int, ...], slot_bytes: int, per_layer: bool, split_tail: bool) -> list[Rect]:
    r = seg.rect
    T = r.tile
    bpl = r.n_heads * sum(rows)  # bytes per token per layer
    if per_layer:
        groups = [(layer, layer + 1) for layer in range(r.l0, r.l1)]
    else:
        m = max(1, min(r.n_layers, slot_bytes // (T * bpl)))
        groups = [(a, min(a + m, r.l1)) for a in range(r.l0, r.l1, m)]
    out = []
    for a, b in groups:
        per_tok = (b - a) * bpl
        if per_tok > slot_bytes:
            raise ConfigError("transfer.slot_mib", slot_bytes / 2**20,
                              f"a slot must hold one token row of pool {r.pool} ({per_tok} B)")
        step = (slot_bytes // (T * per_tok)) * T or slot_bytes // per_tok
        ends = list(range(r.t0 + step, r.t1, step)) + [r.t1]
        if split_tail and (r.t1 - r.t0) > T and r.t1 % T:
            tail = r.t1 // T * T  # first token of the partial last tile
            # keep cuts inside the tail too: when a slot holds less than a tile they bound its size
            ends = sorted(set(ends) | {tail})
        start = r.t0
        for end in ends:
            out.append(replace(r, l0=a, l1=b, t0=start, t1=end))
            start = end
    return out


def in_place_shape(state: CacheState, rect: Rect) -> bool:
    """Whether ``rect`` lies in wire order in this side's memory when its blocks are consecutive."""
    pool = state.pool(rect.pool)
    ids, base = identity_blocks(rect, pool.tokens_per_block)
    return is_in_place(runs(pool, len(ids) + 1, rect, ids, base))


def schedule(model: ModelSpec, ctx: SideSpec, gen: SideSpec, segments: list[Segment], strategy: Strategy,
             slot_bytes: int) -> list[Chunk]:
    strategy = Strategy(strategy)
    per_seg: list[list[Chunk]] = []
    for seg in segments:
        spec = model.pools(ctx.dtype)
        pool = next(p for p in spec if p.name == seg.rect.pool)
        rows = pool.comp_row_bytes()
        if strategy == Strategy.naive:
            rects = [seg.rect]
        else:
            rects = cut_rect(seg, rows, slot_bytes, strategy == Strategy.layerwise, strategy == Strategy.zerocopy)
        chunks = []
        for rect in rects:
            c = Chunk(seg.request, 0, seg.src, seg.dst, rect, rect.nbytes(rows), pool.layers[rect.l1 - 1])
            if strategy == Strategy.zerocopy:
                c = replace(c, ctx_in_place=in_place_shape(CacheState(model, ctx, seg.src), rect),
                            gen_in_place=in_place_shape(CacheState(model, gen, seg.dst), rect))
            chunks.append(c)
        per_seg.append(chunks)

    if strategy == Strategy.naive:
        order = [c for chunks in per_seg for c in chunks]
    else:
        # round-robin over segments: every ctx/gen pair gets work early
        order = [chunks[i] for i in range(max(map(len, per_seg), default=0)) for chunks in per_seg if i < len(chunks)]
        if strategy == Strategy.layerwise:
            order.sort(key=lambda c: c.ready_layer)  # stable: round-robin within a layer
    return [replace(c, seq=i) for i, c in enumerate(order)]

