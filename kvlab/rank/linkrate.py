"""The link's own speed, measured in every run: the ceiling a transfer's GB/s is a share of.

After warm-up and before the clock starts, every ctx/gen pair that carries chunks in this
run moves raw messages of the run's own chunk size (the largest chunk), all pairs at once
and with the run's window of messages in flight, as the transfer will: nothing is packed,
unpacked or checked. One untimed round first, then ``transfer.baseline_repeats`` timed
repeats, each from a barrier to the last completion
on any rank. ``Link`` keeps the median repeat (``seconds``, ``gbps``) and the range
(``gbps_min``, ``gbps_max``, ``samples``): one timing of a few megabytes read anywhere from
0.5 to 2.1 GB/s over identical runs, so a single figure says little. A run reports
``link_ratio`` = its delivered GB/s / the median (kvlab.results.metrics); a delivered figure above
the fastest repeat means the reference was no ceiling for these bytes (``Link.beaten_by``: the run prints it).
``transfer.baseline=false`` skips it.

Bytes per repeat: at least ``REPEAT_BYTES`` per pair (fixed costs, such as leaving the barrier
and the first message's latency, weigh little against them: 8 messages of 240 KiB timed in
8 ms once made a zerocopy run read 4.10 of its link), within ``MIN_MESSAGES`` and
``MAX_MESSAGES`` messages per pair.

The reference depends on how bytes cross, and each transport names its own
(``Transport.link_reference``): ``p2p`` sends messages over the transport's pair groups;
``nixl`` WRITEs them with the transport's NIXL agents (kvlab.transports.nixl), ``mooncake`` with its
Mooncake engines (kvlab.transports.mooncake); a transport
whose gen rank pulls the bytes itself measures local ``copy_`` of the same bytes (``copy``,
the default), in two forms, each repeat counting the faster: the bytes in chunk-sized
pieces, and one copy per request (``copy_plan``: a request's bytes on that gen rank, at most
``COPY_BYTES``), since a pull may move more per launch than one chunk's piece (on one H200,
chunks of 5.8 MB copied at 414 GB/s one by one and at 1609 GB/s as requests of 23 MB); a transport
without one (``None``) reports no link figures. ``REFERENCES`` maps a reference name to its
measure. ``Link.describe`` says in words what a reference measured.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvlab.config.schema import Setup
from kvlab.model.schedule import Chunk
from kvlab.results.records import Link
from kvlab.transports import Transport
from kvlab.transports.p2p import post

# timed bytes per pair and repeat, at least: a few times the fixed costs of a repeat on each kind of device
REPEAT_BYTES = {"cpu": 32 << 20, "cuda": 1 << 30}
MIN_MESSAGES, MAX_MESSAGES = 2, 512  # per pair and repeat
# a pulling transport's copies per gen rank and repeat, at least: timed on the host from a common barrier (gen
# ranks that share a GPU take turns on it, so each one's device events would count its own turns only), so
# enough that a host's launch and synchronize weigh little against a GPU's copy
COPY_REPEAT_BYTES = {"cpu": 32 << 20, "cuda": 8 << 30}
# a pulling transport's reference buffers (source and destination each), at most, or one chunk where that
# is larger: memory no budget counts, taken for the start-up only
COPY_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}


def _kind(device) -> str:
    return "cuda" if torch.device(device).type == "cuda" else "cpu"


def messages(order: list[Chunk], device="cpu") -> tuple[int, int, list[tuple[int, int]]]:
    """(message bytes, timed messages per pair and repeat, pairs as (ctx, gen) side-local ranks) of a run
    whose ranks use ``device`` (its kind sets the bytes per repeat)."""
    nbytes = max((c.nbytes for c in order), default=0)
    pairs = sorted({(c.src, c.dst) for c in order})
    n = max(MIN_MESSAGES, min(MAX_MESSAGES, -(-REPEAT_BYTES[_kind(device)] // max(nbytes, 1))))
    return nbytes, n, pairs


@dataclass(frozen=True)
class CopyPlan:
    """A gen rank's share of the ``copy`` reference: ``regions`` side by side in each buffer (no copy reads
    what an earlier one left in a cache), each ``whole`` bytes, copied ``passes`` times per repeat, once in
    ``piece``-sized copies and once as one copy per region."""

    piece: int
    whole: int
    regions: int
    passes: int

    @property
    def nbytes(self) -> int:
        """Bytes timed per repeat, in each form."""
        return self.passes * self.regions * self.whole

    @property
    def pieces(self) -> int:
        return self.passes * self.regions * math.ceil(self.whole / self.piece)

    def spans(self, whole: bool) -> list[tuple[int, int]]:
        """(offset, bytes) of one pass's copies."""
        if whole:
            return [(r * self.whole, self.whole) for r in range(self.regions)]
        return [(r * self.whole + o, min(self.piece, self.whole - o))
                for r in range(self.regions) for o in range(0, self.whole, self.piece)]


def copy_plan(order: list[Chunk], gen_rank: int, device="cpu") -> CopyPlan | None:
    """The ``copy`` reference of gen rank ``gen_rank`` (side-local), None where it receives nothing: pieces of
    the run's largest chunk (at most ``COPY_BYTES``), and as the whole the largest request it receives (at
    least one piece, at most ``COPY_BYTES``)."""
    nbytes = max((c.nbytes for c in order), default=0)
    per_request: dict[int, int] = {}
    for c in order:
        if c.dst == gen_rank:
            per_request[c.request] = per_request.get(c.request, 0) + c.nbytes
    if not per_request or nbytes == 0:
        return None
    kind = _kind(device)
    # a pulling transport's chunks are not cut by size (a whole request can be one chunk of many GiB): past
    # COPY_BYTES a copy runs at the same rate, so the reference copies pieces of at most that
    cap = COPY_BYTES[kind]
    nbytes = min(nbytes, cap)
    whole = min(max(nbytes, max(per_request.values())), cap)
    regions = max(1, cap // whole)
    per_pass = regions * math.ceil(whole / nbytes)
    passes = max(1, min(-(-COPY_REPEAT_BYTES[kind] // (regions * whole)), MAX_MESSAGES // per_pass))
    return CopyPlan(nbytes, whole, regions, passes)


def copies_s(copies: list[tuple[torch.Tensor, torch.Tensor]], passes: int = 1, events: bool = False) -> float:
    """Seconds of ``dst.copy_(src)`` for every (dst, src) in order, ``passes`` times: host seconds from the call
    until the copies are done (a GPU synchronized at the end; the caller makes it idle first), or with
    ``events`` on a GPU the device's own time between events on the current stream (for a process that has
    the GPU to itself)."""
    cuda = bool(copies) and copies[0][0].device.type == "cuda"
    if cuda and events:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
    t0 = time.perf_counter()
    for _ in range(passes):
        for dst, src in copies:
            dst.copy_(src)
    if cuda and events:
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3
    if cuda:
        torch.cuda.synchronize(copies[0][0].device)
    return time.perf_counter() - t0


def views(src: torch.Tensor, dst: torch.Tensor, spans: list[tuple[int, int]]
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) slices of ``spans``, made before the clock: a slice costs host time that is no copy's."""
    return [(dst[o:o + n], src[o:o + n]) for o, n in spans]


def raw_p2p(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk], repeats: int
            ) -> list[tuple[float, ...]]:
    """Seconds this rank took per repeat, from the barrier, for its share of the messages (one untimed round
    first), over the transport's own pair groups and from its own slots (one message at a time from a buffer
    of the message's size for the naive baseline, which has no slots)."""
    nbytes, n, pairs = messages(order, transport.device)
    mine = [(setup.world_rank("ctx", c), setup.world_rank("gen", g)) for c, g in pairs]
    mine = [p for p in mine if world_rank in p]
    slots = transport.staging.slots
    if slots is not None:
        window = setup.transfer.slots
        buffer = lambda i: slots.get(i, nbytes)  # noqa: E731
    else:
        window, own = 1, torch.empty(nbytes, dtype=torch.uint8, device=transport.device)
        buffer = lambda i: own  # noqa: E731

    def rounds(count: int) -> None:
        inflight: deque = deque()
        for i in range(count * len(mine)):
            c, g = mine[i % len(mine)]
            if len(inflight) >= window:
                inflight.popleft().wait()
            sending = world_rank == c
            inflight.append(post(buffer(i), g if sending else c, transport.groups[(c, g)], send=sending))
        while inflight:
            inflight.popleft().wait()
        if transport.device.type == "cuda":
            torch.cuda.synchronize(transport.device)

    rounds(1)  # first messages of this size: connections and buffers are set up here, not timed
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        rounds(n)
        out.append((time.perf_counter() - t0,))
    return out


def local_copy(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk], repeats: int
               ) -> list[tuple[float, ...]]:
    """Seconds this rank took per repeat to ``copy_`` the bytes it would receive (the reference of a pulling
    transport), (in pieces, as wholes); every gen rank at once, each form from its own barrier, on the host's
    clock."""
    side, rank = setup.side_of(world_rank)
    plan = copy_plan(order, rank, transport.device) if side.name == "gen" else None
    forms: list[tuple[list, int]] = [([], 1), ([], 1)]
    if plan is not None:
        src = torch.zeros(plan.regions * plan.whole, dtype=torch.uint8, device=transport.device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # every page written once before the clock
        forms = [(views(src, dst, plan.spans(whole)), plan.passes) for whole in (False, True)]
        for copies, _ in forms:
            copies_s(copies)  # the copy kernels of both forms loaded, not timed
    out = []
    for _ in range(repeats):
        times = []
        for copies, passes in forms:
            if transport.device.type == "cuda":
                torch.cuda.synchronize(transport.device)
            dist.barrier()
            times.append(copies_s(copies, passes) if copies else 0.0)
        out.append(tuple(times))
    return out


def raw_nixl(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk], repeats: int
             ) -> list[tuple[float, ...]]:
    """Seconds this rank took per repeat for its share of the messages as raw NIXL WRITEs between the
    transport's agents (each repeat with its own untimed round and its own buffers)."""
    args = messages(order, transport.device)
    store = dist.distributed_c10d._get_default_store()
    out = []
    for _ in range(repeats):
        out.append((transport.raw_writes(*args),))
        # each call publishes its gen buffers under the same keys: a ctx rank that read the last call's key
        # would WRITE into a buffer already deregistered, so the keys go before the next call starts
        dist.barrier()
        if world_rank == 0:
            for g in sorted({g for _, g in args[2]}):
                store.delete_key(f"nixl/link/gen{g}")
        dist.barrier()
    return out


def raw_mooncake(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk], repeats: int
                 ) -> list[tuple[float, ...]]:
    """Seconds this rank took per repeat for its share of the messages as raw Mooncake writes between the
    transport's engines (kvlab.transports.mooncake; each repeat with its own untimed round and buffers)."""
    args = messages(order, transport.device)
    return [(transport.raw_writes(*args),) for _ in range(repeats)]


REFERENCES: dict[str, Callable[[Setup, Transport, int, list[Chunk], int], list[tuple[float, ...]]]] = {
    "p2p": raw_p2p, "copy": local_copy, "nixl": raw_nixl, "mooncake": raw_mooncake}
FORMS = {"copy": ("pieces", "whole")}  # a reference measured in several forms: each repeat counts the fastest


def measure(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk],
            repeats: int | None = None) -> Link | None:
    """Every rank calls this at the same point, after ``transport.connect``; every rank returns the same
    figures. The reference is the transport's own (``Transport.link_reference``); ``repeats`` by default the
    config's ``transfer.baseline_repeats``."""
    reference = transport.link_reference
    if reference is None:  # the transport has no in-run reference: the run reports no link figures
        return None
    if repeats is None:
        repeats = setup.transfer.baseline_repeats
    repeats = max(1, int(repeats))
    nbytes, n, pairs = messages(order, transport.device)
    if not pairs or nbytes == 0:
        return Link(reference, repeats=0)
    seconds = torch.tensor(REFERENCES[reference](setup, transport, world_rank, order, repeats), dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # each repeat and form takes as long as its slowest rank
    whole = 0
    if reference == "copy":
        plans = [p for p in (copy_plan(order, g, transport.device) for g in sorted({g for _, g in pairs})) if p]
        total, count = sum(p.nbytes for p in plans), sum(p.pieces for p in plans)
        whole = max(p.whole for p in plans)
    else:
        total, count = n * len(pairs) * nbytes, n * len(pairs)
    return summarize(reference, nbytes, count, total, seconds.tolist(), FORMS.get(reference, ()), whole)


def summarize(reference: str, message_bytes: int, messages: int, total: int, seconds: list[list[float]],
              forms: tuple[str, ...] = (), whole_bytes: int = 0) -> Link:
    """A ``Link`` from each repeat's seconds per form (``total`` bytes each): each repeat counts its fastest
    form; ``seconds`` and ``gbps`` are the median repeat's, ``gbps_min``/``gbps_max`` the range."""
    best = [min((s for s in row if s > 0), default=0.0) for row in seconds]
    timed = [s for s in best if s > 0]
    rate = lambda s: total / s / 1e9  # noqa: E731
    if not timed:
        return Link(reference, message_bytes, messages, 0.0, None, repeats=len(seconds), bytes=total,
                    whole_bytes=whole_bytes)
    median = statistics.median(timed)
    named = {}
    for i, name in enumerate(forms):
        column = [row[i] for row in seconds if row[i] > 0]
        if column:
            named[name] = rate(statistics.median(column))
    return Link(reference, message_bytes, messages, median, rate(median), repeats=len(seconds),
                gbps_min=rate(max(timed)), gbps_max=rate(min(timed)), bytes=total,
                samples=[rate(s) for s in timed], forms=named, whole_bytes=whole_bytes)

