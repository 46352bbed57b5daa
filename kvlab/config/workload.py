"""Requests and the order in which every rank serves their chunks.

Every request kvlab builds is built here: a run's (``make_requests``), ``kvlab plan``'s
(``plan_requests``) and the cost model's from bare prompt lengths (``as_requests``).
The request list, arrival times included (kvlab.core.arrivals), is a pure function of the
workload spec (seed included), so every rank derives the same list; request ``i`` (the
``i``-th to arrive) is prefilled by ctx DP group ``i % ctx.dp`` and decoded by gen DP group
``i % gen.dp``. ``interleave`` merges the requests' schedules into one global chunk order,
at most ``concurrency`` requests at a time, round-robin between them (fair: no request
starves) and admitting the next request when one runs out of chunks; ``serve_order`` puts
it on the prefill's timeline (kvlab.model.prefill), so that a chunk never waits behind one whose
layer is computed later. Every rank serves its own chunks in that global order; since all
ranks follow one total order, a sender and a receiver can never wait on each other in a
cycle. ``plan_run`` puts all of it into one record, the ``RunPlan``, built once per process and
passed to whatever needs a piece of it.
"""
from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property

from kvlab.config.devices import pair_backend
from kvlab.config.schema import Setup
from kvlab.core import arrivals, traces
from kvlab.model import prefill, prefix
from kvlab.model.plan import Request, Segment, plan
from kvlab.model.schedule import Chunk, Ready, schedule
from kvlab.model.spec import WorkloadSpec


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


def request(setup: Setup, i: int, isl: int, arrival_s: float = 0.0, osl: int | None = None) -> Request:
    """Request ``i``: prefilled by ctx DP group ``i % ctx.dp``, decoded by gen DP group ``i % gen.dp``."""
    return Request(i, int(isl), i % setup.ctx.dp, i % setup.gen.dp, arrival_s, osl)


def output_lengths(w: WorkloadSpec, n: int) -> list[int | None]:
    """Tokens each of ``n`` requests would decode: a trace's output lengths (Mooncake ``output_length``,
    Azure ``GeneratedTokens``), else ``workload.osl`` (None: unknown). No decode runs here; the rows carry
    them for whoever models decode (a fleet simulator)."""
    if w.arrival == "trace":
        return [r.output_tokens for r in traces.read(w.trace)[:n]]
    return [w.osl] * n


def make_requests(setup: Setup) -> list[Request]:
    """The run's requests, in arrival order; with ``gen.prefix_cache_tokens`` each one carries what the gen
    DP group's prefix cache holds of it at its arrival (kvlab.model.prefix: the same on every rank)."""
    w = setup.workload
    if w.arrival == "trace":
        timed = w.timed_trace(setup.cache.capacity_tokens)
    else:
        timed = list(zip(arrivals.times(w, w.requests), prompt_lengths(w, w.requests)))
    osl = output_lengths(w, len(timed))
    out = [request(setup, i, isl, t, osl[i]) for i, (t, isl) in enumerate(timed)]
    if setup.gen.prefix_cache_tokens:
        ids = [r.hash_ids for r in traces.read(w.trace)[:len(out)]]  # Setup checked that the trace has them
        held = prefix.assign([(r.id, r.isl, ids[r.id], r.gen_dp) for r in out], setup.gen.prefix_cache_tokens,
                             setup.gen.dp)
        out = [replace(r, prefix=held[r.id]) for r in out]
    return out


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


def serve_order(schedules: list[list[Chunk]], concurrency: int, ready, seconds) -> list[Chunk]:
    """The global order on a serving timeline: the order one link would serve the chunks in, taking
    the round-robin order of ``interleave`` among those whose layer is done. ``ready(chunk)``: when the
    prefill lets it go; ``seconds(chunk)``: its time on the link (an estimate: kvlab.core.rates). When the
    prefill is quick next to the transfer, this is ``interleave``'s order; when it is slow, a chunk never
    waits behind one whose layer is computed later."""
    base = interleave(schedules, concurrency)
    by_ready = sorted(range(len(base)), key=lambda i: (ready(base[i]), i))
    out, waiting, now, k = [], [], 0.0, 0
    while len(out) < len(base):
        while k < len(by_ready) and ready(base[by_ready[k]]) <= now:
            heapq.heappush(waiting, by_ready[k])
            k += 1
        if not waiting:
            now = ready(base[by_ready[k]])
            continue
        c = base[heapq.heappop(waiting)]
        out.append(c)
        now += seconds(c)
    return out


@dataclass(frozen=True, eq=False)
class RunPlan:
    """What a run moves and in which order: everything its ranks need that follows from the config alone.

    Pure: a function of the config, seed included, so every rank builds the same one and none exchanges
    it. ``plan_run`` builds it once per process (each rank's runner, the launcher's checks and its merge of
    an interrupted run, the simulator's calibration), and what needs a piece of it takes the plan (or that
    field) from there rather than deriving it again from ``setup``, which stays the config.

    - ``requests``: in arrival order (request ``i`` is the ``i``-th to arrive), each with its prefix hit on
      the gen DP group's cache (kvlab.model.prefix) when that is on;
    - ``segments``: by request id, the exact cover of its cache from ctx to gen ranks (kvlab.model.plan);
    - ``order``: the global chunk order (``serve_order``), which every rank walks restricted to its own
      chunks (``chunks_of``);
    - ``times``: by request id, its prefill on the estimated timeline ``order`` was planned from
      (kvlab.model.prefill; a ctx rank's prefill measures what really happens);
    - ``ctx_ranks``: world ranks below it are ctx ranks, the others gen ranks (``Setup.side_of``).
    """

    requests: tuple[Request, ...]
    segments: dict[int, tuple[Segment, ...]]
    order: tuple[Chunk, ...]
    times: dict[int, prefill.PrefillTimes]
    ctx_ranks: int
    _mine: dict[int, list[Chunk]] = field(default_factory=dict, init=False, repr=False)

    @cached_property
    def by_id(self) -> dict[int, Request]:
        return {r.id: r for r in self.requests}

    @cached_property
    def senders(self) -> dict[int, frozenset[int]]:
        """Request id -> the ctx ranks that send some of it (those whose prefill of it ends together)."""
        out: dict[int, set[int]] = {}
        for c in self.order:
            out.setdefault(c.request, set()).add(c.src)
        return {r: frozenset(s) for r, s in out.items()}

    def chunks_of(self, world_rank: int) -> list[Chunk]:
        """The chunks one rank sends (ctx) or receives (gen), in the global order; derived once per rank."""
        if world_rank not in self._mine:
            if world_rank < self.ctx_ranks:
                mine = [c for c in self.order if c.src == world_rank]
            else:
                mine = [c for c in self.order if c.dst == world_rank - self.ctx_ranks]
            self._mine[world_rank] = mine
        return self._mine[world_rank]

    def bytes_of(self, world_rank: int) -> int:
        """Bytes one rank sends (ctx) or receives (gen) over the run."""
        return sum(c.nbytes for c in self.chunks_of(world_rank))


def plan_run(setup: Setup) -> RunPlan:
    """The run's plan (``RunPlan``): requests, their segments and schedules, the prefill timeline and the
    global chunk order put on it."""
    requests = make_requests(setup)
    segments = {r.id: tuple(plan(setup.model, setup.ctx, setup.gen, r, setup.fault.window_trim))
                for r in requests}
    schedules = [schedule(setup.model, setup.ctx, setup.gen, segments[r.id], setup.transfer.strategy,
                          setup.chunk_cap) for r in requests]
    times = prefill.times_for(setup, requests)
    per_layer = setup.transfer.strategy.ready == Ready.layer
    link = setup.cost.rates(pair_backend(setup))  # an estimate of each chunk's time on the link
    order = serve_order(schedules, setup.workload.concurrency,
                        lambda c: prefill.ready_s(times[c.request], c.ready_layer, per_layer),
                        lambda c: link.message_s(c.nbytes))
    return RunPlan(tuple(requests), segments, tuple(order), times, setup.ctx.size)
