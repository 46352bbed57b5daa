"""Fault injection (``fault:`` in the config): a rank that dies, stalls or freezes at a chosen chunk, bytes
flipped in flight, and a layer the prefill never writes (what a chunk sent before its layer was
computed would carry), so that tests can show that failures end cleanly and corruption is caught.

Positions are given in one rank's own terms: its chunks are the chunks it sends (ctx) or
receives (gen), in the global order (kvlab.config.workload.interleave); its byte stream is their
messages laid end to end in that order. ``check`` names a position past the end of that
stream before anything is allocated.

The transfer's own failure classes (``fault.transfer``), each injected by one rank through its
transport's hooks (``RankContext.faults``: the transport asks at the point where the failure
would happen), at the rank's first chance from chunk ``fault.transfer_at_chunk`` on, once:

- ``drop_notice``: the notice that chunk's transfer sends is never sent: on a ctx rank the
  completion notification (nixl's and mooncake's ``D``, ipc's ready key), on a gen rank the
  acknowledgement or announcement (nixl's and mooncake's room ``R`` or block tables ``T``, ipc's
  pulled ``d``). The peer waits for it under its deadline.
- ``wrong_request``: that notice names another request: the next chunk of another request
  between the same two ranks (or, where there is none, a request the run does not have). Notices
  are matched by key, never by arrival: the chunk it was for is waited for until its deadline.
- ``stuck``: the rank that moves the bytes (the ctx rank, or the gen rank where it pulls) posts the
  chunk and it never progresses, nor does anything after it between those two ranks: the endpoint
  stays open, nobody sees a disconnect, only the deadline ends it.
- ``reused_block``: the first block of the chunk's rectangle in the rank's pool is handed to
  another request and written with that request's bytes while the transfer still needs it: on a
  ctx rank before the chunk leaves (blocks evicted before their send), on a gen rank after it
  landed (a late write into a slot freed and reused). The bug is put in on purpose; the gen rank's
  verification must catch it, naming the request, the block and the byte.
- ``torn_chunk``: the sender writes the first half of the chunk's bytes into the gen rank's memory,
  waits until they are there, and dies (exit code 3) before its completion notice: the receiver
  holds half a chunk it must never take for whole.

A transport declares which classes it can show and on which side (``Transport.injects``), and why
the others do not arise there (``Transport.cannot``); ``check`` refuses the rest before anything
is allocated.
"""
from __future__ import annotations

import bisect
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvlab.config.workload import RunPlan
from kvlab.core.errors import ConfigError
from kvlab.model.schedule import Chunk
from kvlab.model.spec import TRANSFER_FAULTS, FaultSpec

CLASSES = TRANSFER_FAULTS

# exit code of a rank killed by fault.kill_rank or fault.transfer=torn_chunk: neither success (0), failure (1)
# nor bad config (2)
KILLED_EXIT = 3


@dataclass
class RankFaults:
    kill_at: int = -1
    stall_at: int = -1
    stall_s: float = 0.0
    freeze_at: int = -1
    flips: dict[int, list[int]] = field(default_factory=dict)  # chunk index -> byte offsets inside its message
    unwritten_layer: int = -1  # a ctx rank's prefill skips writing this layer: as if its chunks left too early

    def before_post(self, index: int) -> None:
        if index == self.kill_at:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(KILLED_EXIT)  # no cleanup, no report: as abrupt as a crash
        if index == self.stall_at:
            time.sleep(self.stall_s)
        if index == self.freeze_at:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # until someone resumes or kills it

    # fault.transfer on this rank: the class, from which chunk on, this rank's chunks (whose pairs and
    # requests its notices name), and whether it has fired yet
    transfer: str = ""
    transfer_at: int = -1
    mine: list[Chunk] = field(default_factory=list)
    fired: bool = False
    stuck_pair: tuple[int, int] | None = None  # stuck: the (ctx, gen) ranks whose transfers never progress
    name: str = ""  # "rank 1": how this rank's notes name it

    def _fire(self, what: str, i: int) -> bool:
        """Whether class ``what`` acts at chunk ``i``: the first time this rank asks at or after its chunk."""
        if self.fired or self.transfer != what or i < self.transfer_at:
            return False
        self.fired = True
        return True

    def note(self, text: str) -> None:
        """One line on stderr saying what was injected, where: the run's log names the cause it was given."""
        print(f"{self.name}: fault.transfer={self.transfer}: {text}", file=sys.stderr, flush=True)

    def notice(self, i: int, c: Chunk) -> Chunk | None:
        """The chunk the notice of chunk ``i`` (``c``) names: ``c`` itself; None where it is dropped
        (drop_notice); another chunk where it goes astray (wrong_request). Transports ask where they send one."""
        if self._fire("drop_notice", i):
            self.note(f"the notice of request {c.request} chunk {c.seq} (ctx{c.src} -> gen{c.dst}) is never sent")
            return None
        if self._fire("wrong_request", i):
            other = self.other(i)
            self.note(f"the notice of request {c.request} chunk {c.seq} (ctx{c.src} -> gen{c.dst}) names request "
                      f"{other.request} chunk {other.seq}")
            return other
        return c

    def other(self, i: int) -> Chunk:
        """Another request's chunk between the same two ranks: the next one after chunk ``i``, else the last
        one before it, else chunk ``i`` renamed to a request the run does not have."""
        c = self.mine[i]
        same = [j for j, d in enumerate(self.mine) if (d.src, d.dst) == (c.src, c.dst) and d.request != c.request]
        later = [j for j in same if j > i]
        if later or same:
            return self.mine[later[0] if later else same[-1]]
        return dataclasses.replace(c, request=1 + max(d.request for d in self.mine))

    def stuck(self, i: int, c: Chunk) -> bool:
        """Whether chunk ``i`` (``c``) never progresses: from the first chunk the class acts at, every chunk
        between the same two ranks."""
        if self._fire("stuck", i):
            self.stuck_pair = (c.src, c.dst)
            self.note(f"request {c.request} chunk {c.seq} (ctx{c.src} -> gen{c.dst}) and every later one between "
                      "those ranks are posted and never progress")
        return self.stuck_pair == (c.src, c.dst)

    def torn(self, i: int, c: Chunk) -> bool:
        """Whether this (sending) rank writes half of chunk ``i`` and then dies (``die``)."""
        if self._fire("torn_chunk", i):
            self.note(f"request {c.request} chunk {c.seq} (ctx{c.src} -> gen{c.dst}): half of its {c.nbytes} bytes "
                      "written, then the sender dies")
            return True
        return False

    @staticmethod
    def half(src, dst, length) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The runs (source, destination, length, in wire order) that hold the first half of a chunk's bytes."""
        src, dst, length = (np.asarray(x, dtype=np.int64) for x in (src, dst, length))
        keep = max(1, int(length.sum()) // 2)
        ends = np.cumsum(length)
        n = int(np.searchsorted(ends, keep, side="left")) + 1
        out = length[:n].copy()
        out[-1] -= int(ends[n - 1]) - keep
        return src[:n], dst[:n], out

    def die(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(KILLED_EXIT)

    def reuse(self, ctx, i: int, c: Chunk) -> None:
        """reused_block: the first block of chunk ``i``'s rectangle in this rank's pool given to another request,
        which writes its own bytes over the chunk's part of it (``ctx``: the transport's RankContext)."""
        if not self._fire("reused_block", i):
            return
        other = self.other(i).request
        store = ctx.cache.pools[c.rect.pool]
        table = ctx.cache.tables[c.request][c.rect.pool]
        tpb = store.pool.tokens_per_block
        first = c.rect.t0 // tpb
        part = dataclasses.replace(c.rect, t1=min(c.rect.t1, (first + 1) * tpb))
        data = torch.empty(part.nbytes(store.pool.rows), dtype=torch.uint8, device=ctx.device)
        ctx.cache.contents(other, store.pool, part, out=data)
        ctx.ops.unpack(data, store.pool, store.num_blocks, part, table.ids, table.base, store.storage)
        when = "before chunk {} left" if ctx.side == "ctx" else "as chunk {} landed"
        self.note(f"block {table.host[first - table.base]} of pool {c.rect.pool} (request {c.request}, tokens "
                  f"{first * tpb}-{(first + 1) * tpb - 1}) reused by request {other} {when.format(c.seq)}")

    def flip(self, index: int, buf: torch.Tensor) -> list[int]:
        """Invert the chosen bytes of chunk ``index``'s message in ``buf``; returns the offsets flipped."""
        offsets = self.flips.get(index, [])
        for j in offsets:
            buf[j:j + 1].bitwise_xor_(0xFF)
        return offsets


def locate_flip(chunks: list[Chunk], offset: int) -> tuple[int, int]:
    """(chunk index, byte inside its message) of byte ``offset`` of a rank's stream."""
    starts, acc = [], 0
    for c in chunks:
        starts.append(acc)
        acc += c.nbytes
    if not chunks or offset >= acc:
        raise IndexError(offset)
    i = bisect.bisect_right(starts, offset) - 1
    return i, offset - starts[i]


def check(setup, plan: RunPlan) -> None:
    """ConfigError for a fault position the run's ``plan`` never reaches, or a transfer fault class its transport
    cannot show (the same on every rank)."""
    f = setup.fault
    if f.transfer:
        cls = setup.transport.cls()
        side = setup.side_of(f.transfer_rank)[0].name
        name = setup.transport.name
        if f.transfer in cls.cannot:
            raise ConfigError("fault.transfer", f.transfer,
                              f"transport={name} cannot show it: {cls.cannot[f.transfer]}")
        sides = cls.injects.get(f.transfer, frozenset())
        if not sides:
            raise ConfigError("fault.transfer", f.transfer, f"transport={name} has no injection hook for it; use "
                              f"a transport that has (p2p, ipc, nixl, mooncake)")
        if side not in sides:
            (other,) = sides
            lo, hi = setup.world_rank(other, 0), setup.world_rank(other, getattr(setup, other).size - 1)
            raise ConfigError("fault.transfer_rank", f.transfer_rank, f"with transport={name}, {f.transfer} arises on "
                              f"a {other} rank (world rank {lo if lo == hi else f'{lo}..{hi}'}); this one is {side}")
    for name in ("kill", "stall", "freeze", "transfer"):
        r, at = getattr(f, f"{name}_rank"), getattr(f, f"{name}_at_chunk")
        if r >= 0:
            n = len(plan.chunks_of(r))
            if at >= n:
                raise ConfigError(f"fault.{name}_at_chunk", at, f"rank {r} takes part in {n} chunks; use 0..{n - 1}")
    if f.flip_rank >= 0:
        total = plan.bytes_of(f.flip_rank)
        bad = [x for x in f.flip_at if x >= total]
        if bad:
            raise ConfigError("fault.flip_at", list(f.flip_at),
                              f"rank {f.flip_rank} moves {total} bytes; offsets must be below that ({bad} are not)")


def for_rank(f: FaultSpec, world_rank: int, mine: list[Chunk]) -> RankFaults:
    out = RankFaults(unwritten_layer=f.unwritten_layer)  # only a ctx rank's prefill writes layers
    if f.kill_rank == world_rank:
        out.kill_at = f.kill_at_chunk
    if f.stall_rank == world_rank:
        out.stall_at, out.stall_s = f.stall_at_chunk, float(f.stall_s)
    if f.freeze_rank == world_rank:
        out.freeze_at = f.freeze_at_chunk
    if f.transfer_rank == world_rank:
        out.transfer, out.transfer_at, out.mine, out.name = f.transfer, f.transfer_at_chunk, mine, f"rank {world_rank}"
    if f.flip_rank == world_rank:
        for x in f.flip_at:
            i, j = locate_flip(mine, x)
            out.flips.setdefault(i, []).append(j)
    return out
