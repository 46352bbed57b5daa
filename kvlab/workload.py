"""Requests and the order in which every rank serves their chunks.

The request list is a pure function of the workload config (seed included), so every
rank derives the same list; request ``i`` is prefilled by ctx DP group ``i % ctx.dp`` and
decoded by gen DP group ``i % gen.dp``. ``interleave`` merges the requests' schedules into
one global chunk order, at most ``concurrency`` requests at a time, round-robin between
them (fair: no request starves) and admitting the next request when one runs out of
chunks. Every rank serves its own chunks in that global order; since all ranks follow one
total order, a sender and a receiver can never wait on each other in a cycle.
"""
from __future__ import annotations

import math
import random
from collections import deque

from kvlab.config import Setup
from kvlab.plan import Request
from kvlab.schedule import Chunk


def prompt_lengths(w, n: int) -> list[int]:
    if w.isl_list:
        return [int(w.isl_list[i % len(w.isl_list)]) for i in range(n)]
    rng = random.Random(w.seed)
    if w.distribution == "fixed":
        return [int(w.isl)] * n
    if w.distribution == "uniform":
        return [rng.randint(w.isl_min, w.isl_max) for _ in range(n)]
    # lognormal around isl with a heavy tail, clipped to [isl_min, isl_max]
    mu, sigma = math.log(w.isl), 1.0
    return [min(w.isl_max, max(w.isl_min, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def make_requests(setup: Setup) -> list[Request]:
    w = setup.cfg.workload
    return [Request(i, isl, i % setup.ctx.dp, i % setup.gen.dp)
            for i, isl in enumerate(prompt_lengths(w, w.requests))]


def interleave(schedules: list[list[Chunk]], concurrency: int) -> list[Chunk]:
    """One global chunk order: round-robin over at most ``concurrency`` active requests."""
    waiting = deque(range(len(schedules)))
    active: deque[tuple[int, int]] = deque()  # (request index, next chunk)
    out = []
    while waiting and len(active) < concurrency:
        active.append((waiting.popleft(), 0))
    while active:
        r, i = active.popleft()
        if i < len(schedules[r]):
            out.append(schedules[r][i])
        if i + 1 < len(schedules[r]):
            active.append((r, i + 1))
        elif waiting:
            active.append((waiting.popleft(), 0))
    return out


def chunks_of(order: list[Chunk], setup: Setup, world_rank: int) -> list[Chunk]:
    """The chunks one rank sends (ctx) or receives (gen), in the global order."""
    side, rank = setup.side_of(world_rank)
    return [c for c in order if (c.src if side.name == "ctx" else c.dst) == rank]
