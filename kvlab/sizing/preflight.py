"""Checks that need the run's plan, made before anything is allocated, and the cache blocks each rank needs.

Every rank makes the same checks on the same pure plan, so that all ranks stop or none does.
"""
from __future__ import annotations

import math

from kvlab.config import faults
from kvlab.config.workload import RunPlan, plan_run
from kvlab.core.errors import ConfigError
from kvlab.memory.cache import blocks_for
from kvlab.model.prefix import users
from kvlab.model.schedule import Chunk
from kvlab.model.state import CacheState


def held_spans(mine: list[Chunk], window: int, order: list[Chunk] | None = None,
               fcfs: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """When each request holds its blocks on one rank, as [first, last) positions of one chunk order.

    A gen rank holds a request from its first chunk until ``window`` of its chunks after its last
    (completion lags posting by up to the window): positions of its own chunks. A ctx rank's prefill
    allocates a request when the prefill takes it (kvlab.rank.prefiller), first come first served
    (``fcfs``: its requests in arrival order), possibly long before the transfer loop needs it; the
    prefill waits for blocks, and is needed (by this rank, or by a tensor-parallel peer whose prefill
    ends in step with it) from the request's first chunk in the global ``order``. So it holds a
    request from there, or from a later-arriving request's first chunk if that comes first (the
    prefill takes requests in arrival order), until the global position of its own chunk ``window``
    after the request's last: positions of the global order."""
    last = {}
    for i, c in enumerate(mine):
        last[c.request] = i + window
    if order is None:
        first = {}
        for i, c in enumerate(mine):
            first.setdefault(c.request, i)
        return {r: (first[r], last[r]) for r in first}
    at = {id(c): g for g, c in enumerate(order)}
    first_any: dict[int, int] = {}
    for g, c in enumerate(order):
        first_any.setdefault(c.request, g)
    spans, start = {}, len(order)
    for r in reversed([r for r in (fcfs or []) if r in last]):
        start = min(start, first_any[r])
        spans[r] = (start, at[id(mine[last[r]])] if last[r] < len(mine) else len(order))
    return spans


def peak_blocks(state: CacheState, spans: dict[int, tuple[int, int]], isl: dict[int, int]) -> dict[str, int]:
    """Blocks per pool held at the worst moment, given when each request holds its blocks (``held_spans``)."""
    events = sorted([(a, 1, r) for r, (a, _) in spans.items()] + [(b, -1, r) for r, (_, b) in spans.items()],
                    key=lambda e: (e[0], -e[1]))
    out = {}
    for pool in state.pools():
        cur = peak = 0
        for _, sign, r in events:
            cur += sign * blocks_for(pool, isl[r])
            peak = max(peak, cur)
        out[pool.name] = peak
    return out


def shared_peak_blocks(state: CacheState, spans: dict[int, tuple[int, int]], requests) -> dict[str, int]:
    """``peak_blocks`` of a gen rank with prefix reuse (kvlab.model.prefix, PagedCache.share): a request
    holds its blocks from its first chunk or the first of a sharer opened before it; it is complete once its
    sources are (kvlab.rank.executor), and a block later requests share is kept until the last of them is released.

    Each request is counted with all its blocks, the shared ones too: the cache is never tighter than without
    reuse, so the retained prefix adds memory (bounded by what the sharers hold) rather than pull more checks
    into the transfer loop to free blocks (the gen rank verifies in the loop only when the cache needs blocks,
    and releasing a request whose blocks are shared frees few: a tighter cache made every third-turn request of
    a conversation trace wait for several checks in a row)."""
    by_id = {r.id: r for r in requests if r.id in spans}
    pools = [(p.name, p.tokens_per_block, p.spec.shares_prefix, p) for p in state.pools()]
    plan_users = users({r.id: r.prefix for r in by_id.values() if r.prefix is not None},
                       {r.id: r.isl for r in by_id.values()}, [(n, t, w) for n, t, w, _ in pools])
    start = {r: a for r, (a, _) in spans.items() if r in by_id}
    for (src, _, _), us in plan_users.items():
        start[src] = min([start[src]] + [start[u] for u in us])
    end = {}
    for r in sorted(by_id.values(), key=lambda r: (r.arrival_s, r.id)):  # sources arrive before their sharers
        srcs = {r.prefix.source(n, t) for _, t, w, _ in pools if w and r.prefix is not None
                for n in range(r.prefix.shared_blocks(r.isl, t))}
        end[r.id] = max([spans[r.id][1]] + [end[s] for s in srcs if s in end])
    out = {}
    for name, _, _, pool in pools:
        events = []
        for rid, r in by_id.items():
            own = blocks_for(pool, r.isl)
            events.append((start[rid], own))
            kept = [max([end[rid]] + [end[u] for u in us]) for (src, pn, _), us in plan_users.items()
                    if src == rid and pn == name]
            events += [(t, -1) for t in kept] + [(end[rid], -(own - len(kept)))]
        cur = peak = 0
        for _, n in sorted(events, key=lambda e: (e[0], -e[1])):
            cur += n
            peak = max(peak, cur)
        out[name] = peak
    return out


def preflight(setup, plan: RunPlan | None = None, rank: int | None = None) -> dict[str, int] | None:
    """Checks that need the plan (``plan``; built here when not given), before anything is allocated; returns
    the blocks per pool that world rank ``rank`` allocates. With ``cache.capacity_tokens`` every pool holds
    that many tokens, and the requests in flight at the worst moment must fit on every rank (checked for all
    of them, so that every rank stops or none does): kvlab has no admission control for cache blocks."""
    if plan is None:
        plan = plan_run(setup)
    faults.check(setup, plan)
    requests, order = plan.requests, plan.order
    isl = {r.id: r.isl for r in requests}
    fcfs = [r.id for r in sorted(requests, key=lambda r: (r.arrival_s, r.id))]
    cap = setup.cache.capacity_tokens
    out = None
    for w in range(setup.world_size) if cap else ([] if rank is None else [rank]):
        side, side_rank = setup.side_of(w)
        state = CacheState(setup.model, side, side_rank)
        mine = plan.chunks_of(w)
        spans = (held_spans(mine, setup.transfer.slots, order, fcfs) if side.name == "ctx"
                 else held_spans(mine, setup.transfer.slots))
        need = (shared_peak_blocks(state, spans, requests) if side.name == "gen" and side.prefix_cache_tokens
                else peak_blocks(state, spans, isl))
        if cap:
            # a recurrent state is one block per request, whatever the prompt: sized to the requests held at once
            for pool in (p for p in state.pools() if not p.spec.per_request):
                have = math.ceil(cap / pool.tokens_per_block)
                if need[pool.name] > have:
                    tokens = need[pool.name] * pool.tokens_per_block
                    raise ConfigError("cache.capacity_tokens", cap,
                                      f"the requests {side.name}{side_rank} holds at once need {need[pool.name]} "
                                      f"blocks ({tokens} tokens) of pool {pool.name}; raise it to >= {tokens} or "
                                      "lower workload.concurrency (0 sizes the cache to the workload)")
            need = {pool.name: need[pool.name] if pool.spec.per_request else math.ceil(cap / pool.tokens_per_block)
                    for pool in state.pools()}
        if w == rank:
            out = need
    return out
