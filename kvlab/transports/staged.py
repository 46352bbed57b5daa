"""Chunks through staging, for the transports that move one contiguous message per chunk (p2p, nixl's
staged mode): where a chunk lies in wire order in the pool it goes from there, else through a slot
(or the naive baseline's buffer per chunk); the pack on the ctx rank, the unpack on the gen rank; and
fault injection's flips on the message, never on the cache.
"""
from __future__ import annotations

import torch

from kvlab.memory.staging import PerChunkBuffers, SlotPool
from kvlab.model.layout import first_byte, mem_span
from kvlab.model.schedule import Chunk, Staging
from kvlab.transports import RankContext


class ChunkStaging:
    """One rank's staging: ``slots`` of ``slot_bytes`` allocated now (the transfer's extra memory), or a
    buffer per chunk for the naive baseline. ``ops`` are the pack/unpack the transport chose (e.g. on few
    CTAs, kvlab.transports.p2p.narrow)."""

    def __init__(self, ctx: RankContext, ops):
        t = ctx.setup.transfer
        self.ctx, self.ops = ctx, ops
        self.memory = (PerChunkBuffers(ctx.device) if t.strategy.staging == Staging.per_chunk
                       else SlotPool(t.slots, t.slot_bytes, ctx.device))

    @property
    def per_chunk(self) -> bool:
        return isinstance(self.memory, PerChunkBuffers)

    @property
    def slots(self) -> SlotPool | None:
        return self.memory if isinstance(self.memory, SlotPool) else None

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak_bytes

    def get(self, i: int, nbytes: int) -> torch.Tensor:
        return self.memory.get(i, nbytes)

    def put(self, buf: torch.Tensor) -> None:
        self.memory.put(buf)

    def buffer(self, i: int, c: Chunk) -> tuple[torch.Tensor, bool]:
        """(buffer, staged): the pool itself when the chunk lies there in wire order, else staging."""
        cache = self.ctx.cache
        if c.ctx_in_place if self.ctx.side == "ctx" else c.gen_in_place:
            # the shape is in wire order (schedule, from both states); it lies there when the chunk's
            # blocks are consecutive in this side's table. Either way the message is the same.
            store = cache.pools[c.rect.pool]
            table = cache.tables[c.request][c.rect.pool]
            first, last = mem_span(store.pool, c.rect)
            ids = table.host[first - table.base:last - table.base + 1]
            if all(b == ids[0] + k for k, b in enumerate(ids)):
                start = first_byte(store.pool, store.num_blocks, c.rect, ids[0])
                return store.storage[start:start + c.nbytes], False
        return self.get(i, c.nbytes), True

    def copy(self, c: Chunk, buf: torch.Tensor, rec) -> None:
        """Pack the chunk into ``buf`` (ctx) or unpack it from there (gen), marked in ``rec.pack``."""
        cache, clock = self.ctx.cache, self.ctx.clock
        store = cache.pools[c.rect.pool]
        table = cache.tables[c.request][c.rect.pool]
        t0 = clock.mark()
        if self.ctx.side == "ctx":
            self.ops.pack(store.storage, store.pool, store.num_blocks, c.rect, table.ids, table.base, buf)
        else:
            self.ops.unpack(buf, store.pool, store.num_blocks, c.rect, table.ids, table.base, store.storage)
        rec.pack.append((t0, clock.mark()))

    def flip_outgoing(self, i: int, c: Chunk, buf: torch.Tensor | None, staged: bool, rec
                      ) -> tuple[torch.Tensor | None, bool]:
        """A ctx rank's chunk ``i`` with fault injection's flips applied: on a staged copy of the message,
        never on the cache (the same bytes may go to another gen rank); ``buf`` None: not packed yet."""
        faults = self.ctx.faults
        if i not in faults.flips:
            return buf, staged
        if not staged:
            out = self.get(i, c.nbytes)
            if buf is None:
                self.copy(c, out, rec)
            else:
                out.copy_(buf)
            buf, staged = out, True
        faults.flip(i, buf)
        return buf, staged
