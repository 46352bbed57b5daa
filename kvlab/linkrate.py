"""The link's own speed, measured in every run: the reference a transfer's GB/s is a share of.

After warm-up and before the clock starts, every ctx/gen pair that carries chunks in this
run moves a few raw messages of the run's own chunk size (the largest chunk), all pairs at
once and with the run's window of messages in flight, as the transfer will: nothing is
packed, unpacked or checked. ``link_gbps`` is the bytes of those messages over the time
from the barrier before the first one to the last completion on any rank; a run reports
``link_ratio`` = its delivered GB/s / ``link_gbps`` (kvlab.metrics). A few messages per
pair, bounded by ``MESSAGE_BUDGET`` bytes; ``transfer.baseline=false`` skips it.

The reference depends on how bytes cross, and each transport names its own
(``Transport.link_reference``): ``p2p`` sends messages over the transport's pair groups;
``nixl`` WRITEs them with the transport's NIXL agents (kvlab.transports.nixl); a transport
whose gen rank pulls the bytes itself measures a local ``copy_`` of the same bytes (``copy``,
the default); a transport without one (``None``) reports no link figures.
``REFERENCES`` maps a reference name to its measure.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvlab.config import Setup
from kvlab.records import Link
from kvlab.schedule import Chunk
from kvlab.staging import SlotPool
from kvlab.transports import Transport
from kvlab.transports.p2p import post

MESSAGE_BUDGET = 256 << 20  # timed bytes per pair: 8 messages of 32 MiB, never fewer than 2 messages
MAX_MESSAGES = 8


def messages(order: list[Chunk]) -> tuple[int, int, list[tuple[int, int]]]:
    """(message bytes, timed messages per pair, pairs as (ctx, gen) side-local ranks) of a run."""
    nbytes = max((c.nbytes for c in order), default=0)
    pairs = sorted({(c.src, c.dst) for c in order})
    n = max(2, min(MAX_MESSAGES, MESSAGE_BUDGET // max(nbytes, 1)))
    return nbytes, n, pairs


def raw_p2p(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk]) -> float:
    """Seconds this rank took, from the barrier, for its share of the messages (one untimed round first),
    over the transport's own pair groups and from its own slots (one message at a time from a buffer of
    the message's size for the naive baseline, which has no slots)."""
    nbytes, n, pairs = messages(order)
    mine = [(setup.world_rank("ctx", c), setup.world_rank("gen", g)) for c, g in pairs]
    mine = [p for p in mine if world_rank in p]
    staging = transport.staging
    if isinstance(staging, SlotPool):
        window = setup.transfer.slots
        buffer = lambda i: staging.get(i, nbytes)  # noqa: E731
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
    dist.barrier()
    t0 = time.perf_counter()
    rounds(n)
    return time.perf_counter() - t0


def local_copy(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk]) -> float:
    """Seconds this rank took to ``copy_`` the bytes it would receive (the reference of a pulling transport)."""
    nbytes, n, pairs = messages(order)
    side, rank = setup.side_of(world_rank)
    count = n * sum(1 for _, g in pairs if side.name == "gen" and g == rank)
    src = torch.zeros(nbytes if count else 1, dtype=torch.uint8, device=transport.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(count):
        dst.copy_(src)
    if dst.device.type == "cuda":
        torch.cuda.synchronize(dst.device)
    return time.perf_counter() - t0


def raw_nixl(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk]) -> float:
    """Seconds this rank took for its share of the messages as raw NIXL WRITEs between the transport's agents."""
    return transport.raw_writes(*messages(order))


REFERENCES: dict[str, Callable[[Setup, Transport, int, list[Chunk]], float]] = {
    "p2p": raw_p2p, "copy": local_copy, "nixl": raw_nixl}


def measure(setup: Setup, transport: Transport, world_rank: int, order: list[Chunk]) -> Link | None:
    """Every rank calls this at the same point, after ``transport.connect``; every rank returns the same
    figures. The reference is the transport's own (``Transport.link_reference``)."""
    reference = transport.link_reference
    if reference is None:  # the transport has no in-run reference: the run reports no link figures
        return None
    nbytes, n, pairs = messages(order)
    if not pairs or nbytes == 0:
        return Link(reference)
    seconds = REFERENCES[reference](setup, transport, world_rank, order)
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    s = float(slowest)
    return Link(reference, nbytes, n * len(pairs), s, n * len(pairs) * nbytes / s / 1e9 if s > 0 else None)
