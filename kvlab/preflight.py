"""Checks that need the run's plan, made before anything is allocated, and the cache blocks each rank needs.

Every rank makes the same checks on the same pure plan, so that all ranks stop or none does.
"""
from __future__ import annotations

import math

from kvlab import faults
from kvlab.cache import blocks_for
from kvlab.errors import ConfigError
from kvlab.schedule import Chunk
from kvlab.state import CacheState
from kvlab.workload import chunks_of, plan_run


def peak_blocks(state: CacheState, mine: list[Chunk], isl: dict[int, int], window: int) -> dict[str, int]:
    """Blocks per pool held at the worst moment: a request is open from its first chunk on this rank
    until ``window`` chunks after its last (completion lags posting by up to the window)."""
    first, last = {}, {}
    for i, c in enumerate(mine):
        first.setdefault(c.request, i)
        last[c.request] = i + window
    events = sorted([(i, 1, r) for r, i in first.items()] + [(i, -1, r) for r, i in last.items()],
                    key=lambda e: (e[0], -e[1]))
    out = {}
    for pool in state.pools():
        cur = peak = 0
        for _, sign, r in events:
            cur += sign * blocks_for(pool, isl[r])
            peak = max(peak, cur)
        out[pool.name] = peak
    return out


def preflight(setup, requests=None, order=None, rank: int | None = None) -> dict[str, int] | None:
    """Checks that need the plan, before anything is allocated; returns the blocks per pool that world
    rank ``rank`` allocates. With ``cache.capacity_tokens`` every pool holds that many tokens, and the
    requests in flight at the worst moment must fit on every rank (checked for all of them, so that
    every rank stops or none does): kvlab has no admission control for cache blocks."""
    if requests is None:
        requests, _, order = plan_run(setup)
    faults.check(setup, order)
    isl = {r.id: r.isl for r in requests}
    cap = setup.cache.capacity_tokens
    out = None
    for w in range(setup.world_size) if cap else ([] if rank is None else [rank]):
        side, side_rank = setup.side_of(w)
        state = CacheState(setup.model, side, side_rank)
        need = peak_blocks(state, chunks_of(order, setup, w), isl, setup.transfer.slots)
        if cap:
            for pool in state.pools():
                have = math.ceil(cap / pool.tokens_per_block)
                if need[pool.name] > have:
                    tokens = need[pool.name] * pool.tokens_per_block
                    raise ConfigError("cache.capacity_tokens", cap,
                                      f"the requests {side.name}{side_rank} holds at once need {need[pool.name]} "
                                      f"blocks ({tokens} tokens) of pool {pool.name}; raise it to >= {tokens} or "
                                      "lower workload.concurrency (0 sizes the cache to the workload)")
            need = {pool.name: math.ceil(cap / pool.tokens_per_block) for pool in state.pools()}
        if w == rank:
            out = need
    return out
