"""The plan: which ctx rank owes which gen rank which rectangle of one request's cache.

``plan`` is pure: both sides call it with the same exchanged states and get the same list.
For every gen rank of the request's gen DP group, every pool it holds, every ctx pipeline
stage whose layers overlap its own and every ctx TP rank whose heads overlap its own, one
segment. Data held by several ctx ranks (MLA latents and indexer keys on every TP rank,
kv heads duplicated when ``tp > kv_heads``) comes from exactly one of them, picked by the
gen rank's TP index so that the load spreads: each element a gen rank holds arrives once.
Sliding-window pools move only the tiles that overlap the window. A request whose leading blocks the gen DP
group's prefix cache holds (``Request.prefix``, kvlab.model.prefix) moves, in every pool without a window, only
the tokens from the first gen block the hit does not cover: a multiple of that gen pool's block, and so of
the wire tile, whatever the ctx side's block size.

Context parallelism (kvlab.model.tokens): a prefill CP rank sends the tokens of its chunks, one segment per
chunk, and a segment aimed at a decode DCP rank holds the tokens of that rank among them, counted in its local
positions (``Rect.local``): the gen pool is addressed as an undivided one, and the ctx side finds each tile's
global tokens. Every (layer, head, token) a gen rank holds still arrives exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.errors import positive, require
from kvlab.model.layout import Rect
from kvlab.model.parallel import SideSpec
from kvlab.model.prefix import Prefix
from kvlab.model.spec import ModelSpec
from kvlab.model.state import CacheState, check_kv_dtypes, pool_format, side_pools, window_start, wire_pool, wire_tile


@dataclass(frozen=True)
class Request:
    id: int
    isl: int  # prompt tokens
    ctx_dp: int = 0  # attention-DP group that prefills it
    gen_dp: int = 0  # attention-DP group that decodes it
    arrival_s: float = 0.0  # when it arrives, seconds from the run's start (kvlab.core.arrivals)
    osl: int | None = None  # tokens it would decode (a trace's output_length, or workload.osl); None: unknown
    # its blocks as the gen DP group's prefix cache saw them (kvlab.model.prefix); None: off
    prefix: Prefix | None = None

    def validate(self, ctx: SideSpec, gen: SideSpec) -> None:
        positive("workload.isl", self.isl)
        require(0 <= self.ctx_dp < ctx.dp, "request.ctx_dp", self.ctx_dp, f"must be in [0, {ctx.dp})")
        require(0 <= self.gen_dp < gen.dp, "request.gen_dp", self.gen_dp, f"must be in [0, {gen.dp})")


@dataclass(frozen=True)
class Segment:
    request: int
    src: int  # ctx side-local rank
    dst: int  # gen side-local rank
    rect: Rect
    nbytes: int


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def plan(model: ModelSpec, ctx: SideSpec, gen: SideSpec, req: Request, window_trim: int = 0) -> list[Segment]:
    """``window_trim`` (fault.window_trim): sliding-window segments leave out that many tokens from the first one
    the next token attends to (and the window's older tokens before it)."""
    req.validate(ctx, gen)
    # a head split the specs cannot make would silently leave heads out of the cover
    ctx.validate_for(model)
    gen.validate_for(model)
    check_kv_dtypes(ctx, gen)
    segments = []
    wires: dict[str, tuple[int, str, int]] = {}  # per pool, the same for every gen rank: worked out once
    for g_tp_pp in range(gen.pp * gen.ranks_tp):
        dst = req.gen_dp * gen.pp * gen.ranks_tp + g_tp_pp
        g = gen.coord(dst)
        mine = gen.tokens(dst, model)  # a DCP rank's tokens, counted in its local positions
        for gp in CacheState(model, gen, dst).pools():
            spec = gp.spec
            if spec.name not in wires:
                tile = wire_tile(ctx, gen, model, spec)  # per pool: one token where a side splits token rows
                on_wire, place = wire_pool(model, ctx, gen, spec.name)  # a KV dtype converted in flight: its rows
                wires[spec.name] = tile, (pool_format(on_wire) if place != "none" else ""), on_wire.comp_row_bytes()
            tile, wire, wire_rows = wires[spec.name]
            t0 = window_start(spec, req.isl, tile)
            if window_trim and spec.window:
                t0 = min(req.isl - 1, max(0, req.isl - spec.window + 1) + window_trim)
            if req.prefix is not None and spec.shares_prefix:  # the gen rank holds these blocks already
                t0 = max(t0, req.prefix.shared_tokens(req.isl, gp.tokens_per_block))
            for c_pp in range(ctx.pp):
                stage = ctx.stage_layers(model, c_pp)
                local = [i for i in gp.layers if spec.layers[i] in stage]
                if not local:
                    continue
                l0, l1 = local[0], local[-1] + 1
                # each CP rank sends the tokens of its chunks (kvlab.model.tokens), cut at ctx block boundaries:
                # a multiple of the tile, in global tokens and in a DCP rank's local positions alike
                for c_cp in range(ctx.cp):
                    for a, b in ctx.tokens(ctx.rank(req.ctx_dp, c_pp, 0, c_cp), model).chunks(req.isl):
                        a, b = max(a, t0), min(b, spec.held_tokens(req.isl))  # a recurrent state: token 0 only
                        if mine.local is not None:
                            a, b = mine.local_ceil(a), mine.local_ceil(b)
                        if a >= b:
                            continue
                        # ctx TP ranks whose heads overlap the gen rank's, each head from one holder
                        for c_tp in range(ctx.ranks_tp):
                            heads = _overlap(gp.heads, ctx.head_range(spec.heads, c_tp))
                            if not heads:
                                continue
                            holders = ctx.head_holders(spec.heads, heads.start)
                            if c_tp != holders[g.tp % len(holders)]:
                                continue
                            rect = Rect(spec.name, l0, l1, heads.start, heads.stop, a, b, tile, wire, mine.local)
                            src = ctx.rank(req.ctx_dp, c_pp, c_tp, c_cp)
                            segments.append(Segment(req.id, src, dst, rect, rect.nbytes(wire_rows)))
    return segments


def conversion_bytes(model: ModelSpec, ctx: SideSpec, gen: SideSpec, rect: Rect) -> tuple[int, int]:
    """(ctx, gen): the bytes of ``rect`` a side converts from its own KV dtype into the wire's or back (its pool's
    rows; 0 where it converts nothing): what the cost model charges a conversion (kvlab.sizing.cost)."""
    if not rect.wire:
        return 0, 0
    _, place = wire_pool(model, ctx, gen, rect.pool)
    side = ctx if place == "pack" else gen
    own = next(p for p in side_pools(model, side) if p.name == rect.pool)
    n = rect.nbytes(own.comp_row_bytes())
    return (n, 0) if place == "pack" else (0, n)
