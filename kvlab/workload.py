"""Requests and the order in which every rank serves their chunks.

Every request kvlab builds is built here: a run's (``make_requests``), ``kvlab plan``'s
(``plan_requests``) and the cost model's from bare prompt lengths (``as_requests``).
The request list is a pure function of the workload spec (seed included), so every
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
from collections.abc import Iterable

from kvlab.config import Setup
from kvlab.plan import Request, plan
from kvlab.schedule import Chunk, schedule
from kvlab.spec import WorkloadSpec


def prompt_lengths(w: WorkloadSpec, n: int) -> list[int]:
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


def request(setup: Setup, i: int, isl: int) -> Request:
    """Request ``i``: prefilled by ctx DP group ``i % ctx.dp``, decoded by gen DP group ``i % gen.dp``."""
    return Request(i, int(isl), i % setup.ctx.dp, i % setup.gen.dp)


def make_requests(setup: Setup) -> list[Request]:
    """The run's requests."""
    w = setup.workload
    return [request(setup, i, isl) for i, isl in enumerate(prompt_lengths(w, w.requests))]


def plan_requests(setup: Setup) -> list[Request]:
    """``kvlab plan``'s requests: one of ``workload.isl`` tokens for every gen attention-DP group."""
    return [request(setup, i, setup.workload.isl) for i in range(setup.gen.dp)]


def as_requests(setup: Setup, requests: Iterable[Request | int] | None = None) -> list[Request]:
    """The run's requests by default; bare prompt lengths are spread over the DP groups."""
    if requests is None:
        return make_requests(setup)
    return [r if isinstance(r, Request) else request(setup, i, r) for i, r in enumerate(requests)]


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


def plan_run(setup) -> tuple[list, dict, list[Chunk]]:
    """(requests, segments by request, global chunk order): pure, the same on every rank."""
    requests = make_requests(setup)
    segments = {r.id: plan(setup.model, setup.ctx, setup.gen, r) for r in requests}
    schedules = [schedule(setup.model, setup.ctx, setup.gen, segments[r.id], setup.transfer.strategy,
                          setup.transfer.slot_bytes) for r in requests]
    return requests, segments, interleave(schedules, setup.workload.concurrency)
