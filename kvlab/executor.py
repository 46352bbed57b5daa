"""The executor: one rank's chunks, pipelined through its staging slots.

Protocol (both sides, every rank): walk the global chunk order (``workload.interleave``)
restricted to the chunks this rank takes part in. Keep at most ``slots`` chunks in flight;
chunk ``i`` uses slot ``i % slots``, and before chunk ``i`` is posted, chunk ``i - slots``
is completed, so a slot is reused only after its consumer has finished.

- ctx (sender): [layerwise: wait until the prefill has finished the chunk's layer]
  pack into the slot (or send in place) -> isend. Completing = the send is done.
- gen (receiver): irecv into the slot (or in place), posted ``slots`` chunks ahead.
  Completing = wait for the bytes, unpack. After a request's last chunk: verify it
  bit-exactly, then free its blocks.

On GPUs every copy runs on one side stream; NCCL orders itself after the work queued
there when an op is posted, and ``Work.wait`` makes the side stream wait for NCCL, so the
host never blocks on the device inside the loop and pack(i+1) overlaps the wire of i.
On CPUs (gloo) the same calls block the host where they must.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import re
import time
import types
from collections import deque
from dataclasses import dataclass

import torch

from kvlab.cache import PagedCache
from kvlab.clock import Clock
from kvlab.config import Setup
from kvlab.faults import RankFaults
from kvlab.layout import first_byte
from kvlab.metrics import RequestRecord
from kvlab.plan import Request, Segment
from kvlab.schedule import Chunk, Strategy
from kvlab.staging import PerChunkBuffers, SlotPool
from kvlab.transport import post
from kvlab.workload import chunks_of


def _short(e: BaseException) -> str:
    """The backend's reason without its source location and advice: it goes into one-line reports."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


class Stopped(Exception):
    """The process was told to stop (SIGTERM from the launcher or torchrun's agent) during the transfers."""


class TransferTimeout(RuntimeError):
    """A chunk that did not complete within ``transfer.timeout_s``, or whose peer is gone."""

    def __init__(self, message: str, request: int):
        super().__init__(message)
        self.request = request


@dataclass
class InFlight:
    index: int
    chunk: Chunk
    work: object
    buf: torch.Tensor
    staged: bool
    posted: object


class Executor:
    def __init__(self, setup: Setup, side: str, rank: int, world_rank: int, device: torch.device,
                 cache: PagedCache, groups: dict, ops, clock: Clock | None, progress=None,
                 faults: RankFaults | None = None, beat=None):
        self.setup, self.side, self.rank, self.world_rank = setup, side, rank, world_rank
        self.device, self.cache, self.groups, self.ops, self.clock = device, cache, groups, ops, clock
        if ops.name == "cuda":  # few CTAs: the copies must leave NCCL its SMs (docs/design.md)
            ops = types.SimpleNamespace(name=ops.name, pack=functools.partial(ops.pack, ctas=setup.transfer.pack_ctas),
                                        unpack=functools.partial(ops.unpack, ctas=setup.transfer.pack_ctas))
            self.ops = ops
        t = setup.transfer
        self.strategy = t.strategy
        self.window = t.slots
        self.timeout = t.timeout_s
        self.staging = (PerChunkBuffers(device) if self.strategy == Strategy.naive
                        else SlotPool(t.slots, t.slot_bytes, device))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.progress = progress
        self.records: dict[int, RequestRecord] = {}
        self.faults = faults or RankFaults()
        self.beat = beat or (lambda: None)  # proof of progress for the end-of-run exchange (kvlab.report)
        self.failures: dict[int, str] = {}  # request -> why it failed on this rank
        self.error: str | None = None  # the failure that stopped this rank's loop
        self.error_at: float | None = None
        self.stopped = False  # told to stop from outside: nobody is left to report to
        self.transfer_peak = 0  # allocator peak of the transfer alone (fill and verify excluded)

    @contextlib.contextmanager
    def _untracked(self):
        """Fill (the prefill's output) and verification are not the transfer: keep their temporaries
        out of the peak extra device memory."""
        if self.device.type != "cuda":
            yield
            return
        self.transfer_peak = max(self.transfer_peak, torch.cuda.max_memory_allocated(self.device))
        try:
            yield
        finally:
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def sending(self) -> bool:
        return self.side == "ctx"

    def _peer(self, c: Chunk) -> int:
        return self.setup.world_rank("gen" if self.sending else "ctx", c.dst if self.sending else c.src)

    def _group(self, c: Chunk):
        return self.groups[(self.setup.world_rank("ctx", c.src), self.setup.world_rank("gen", c.dst))]

    # -- requests ---------------------------------------------------------------------------
    def _open(self, req: Request, n_chunks: int) -> RequestRecord:
        self.cache.allocate(req)
        rec = RequestRecord(req.id, req.isl, self.side, self.rank, n_chunks)
        if self.sending:
            with self._untracked():
                self.cache.fill(req, self.ops)  # the prefill's output
            if self.stream is not None:
                # the simulated prefill runs on the host clock: it must not start while the device is
                # still writing the cache, or layer-wise chunks wait behind the fill, not the layers
                self.stream.synchronize()
            rec.prefill_start = self.clock.host()
            ms = self.setup.transfer.layer_compute_ms
            if ms:
                rec.prefill_end = rec.prefill_start + self.setup.model.num_layers * ms / 1e3
        rec.start = self.clock.mark()
        self.records[req.id] = rec
        return rec

    def _close(self, req: Request, segments: list[Segment]) -> None:
        rec = self.records[req.id]
        rec.end = self.clock.mark()
        if not self.sending:
            mine = [s for s in segments if s.dst == self.rank]
            with self._untracked():
                rec.errors += self.cache.verify(req, mine, self.ops)
        self.cache.release(req.id)

    def _wait_prefill(self, rec: RequestRecord, c: Chunk) -> None:
        ms = self.setup.transfer.layer_compute_ms
        if not ms:
            return
        layer = c.ready_layer if self.strategy == Strategy.layerwise else self.setup.model.num_layers - 1
        delay = rec.prefill_start + (layer + 1) * ms / 1e3 - time.time()
        if delay > 0:
            time.sleep(delay)

    # -- chunks -----------------------------------------------------------------------------
    def _buffer(self, i: int, c: Chunk) -> tuple[torch.Tensor, bool]:
        """(buffer, staged): the pool itself when the chunk lies there in wire order, else a slot."""
        if c.ctx_in_place if self.sending else c.gen_in_place:
            # the shape is in wire order (schedule, from both states); it lies there when the chunk's
            # blocks are consecutive in this side's table. Either way the message is the same.
            store = self.cache.pools[c.rect.pool]
            table = self.cache.tables[c.request][c.rect.pool]
            tpb = store.pool.tokens_per_block
            ids = table.host[c.rect.t0 // tpb - table.base:(c.rect.t1 - 1) // tpb - table.base + 1]
            if all(b == ids[0] + k for k, b in enumerate(ids)):
                start = first_byte(store.pool, store.num_blocks, c.rect, ids[0])
                return store.storage[start:start + c.nbytes], False
        return self.staging.get(i, c.nbytes), True

    def _copy(self, c: Chunk, buf: torch.Tensor, rec: RequestRecord) -> None:
        store = self.cache.pools[c.rect.pool]
        table = self.cache.tables[c.request][c.rect.pool]
        t0 = self.clock.mark()
        if self.sending:
            self.ops.pack(store.storage, store.pool, store.num_blocks, c.rect, table.ids, table.base, buf)
        else:
            self.ops.unpack(buf, store.pool, store.num_blocks, c.rect, table.ids, table.base, store.storage)
        rec.pack.append((t0, self.clock.mark()))

    def _post(self, i: int, c: Chunk) -> InFlight:
        rec = self.records[c.request]
        if self.sending:
            self._wait_prefill(rec, c)
        buf, staged = self._buffer(i, c)
        if self.sending and staged:
            self._copy(c, buf, rec)
        if self.sending and i in self.faults.flips:
            if not staged:  # corrupt the message, not the cache: the same bytes may go to another gen rank
                buf, staged = self.staging.get(i, c.nbytes).copy_(buf), True
            self.faults.flip(i, buf)
        posted = self.clock.mark()
        try:
            work = post(buf, self._peer(c), self._group(c), send=self.sending)
        except RuntimeError as e:  # gloo refuses to post to a peer whose connection is gone
            raise self._failed(c, "posting failed", e) from e
        return InFlight(i, c, work, buf, staged, posted)

    def _failed(self, c: Chunk, what: str, e: BaseException) -> TransferTimeout:
        peer = ("gen" if self.sending else "ctx") + str(c.dst if self.sending else c.src)
        return TransferTimeout(f"request {c.request} chunk {c.seq} with {peer}: {what}: {_short(e)}", c.request)

    def _complete(self, f: InFlight, segments: dict[int, list[Segment]], requests: dict[int, Request]) -> None:
        c, rec = f.chunk, self.records[f.chunk.request]
        try:
            if self.stream is not None:
                f.work.wait()  # a timeout here would block the host; NCCL's watchdog enforces transfer.timeout_s
            else:
                f.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise self._failed(c, f"not done within {self.timeout:g} s or peer gone", e) from e
        done = self.clock.mark()
        rec.wire.append((f.posted, done))
        if not self.sending:
            self.faults.flip(f.index, f.buf)
        if not self.sending and f.staged:
            self._copy(c, f.buf, rec)
        if f.staged:
            self.staging.put(f.buf)
        rec.bytes += c.nbytes
        rec.chunks += 1
        rec.in_place += int(not f.staged)
        if self.sending:
            rec.layer_done[c.ready_layer] = done
        if rec.chunks == rec.chunks_total:
            self._close(requests[c.request], segments[c.request])
        if self.progress is not None:
            self.progress(c.nbytes)
        self.beat()

    def run(self, order: list[Chunk], requests: dict[int, Request], segments: dict[int, list[Segment]]
            ) -> list[RequestRecord]:
        mine = chunks_of(order, self.setup, self.world_rank)
        counts: dict[int, int] = {}
        for c in mine:
            counts[c.request] = counts.get(c.request, 0) + 1
        inflight: deque[InFlight] = deque()
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        try:
            with ctx:
                for i, c in enumerate(mine):
                    if c.request not in self.records:
                        self._open(requests[c.request], counts[c.request])
                    if len(inflight) >= self.window:
                        self._complete(inflight.popleft(), segments, requests)
                    self.faults.before_post(i)
                    inflight.append(self._post(i, c))
                while inflight:
                    self._complete(inflight.popleft(), segments, requests)
        except (TransferTimeout, Stopped) as e:
            self._abort(e, inflight)
        if self.stream is not None and self.error is None:
            self.stream.synchronize()
        return list(self.records.values())

    def _abort(self, e: TransferTimeout | Stopped, inflight: deque[InFlight]) -> None:
        """Fail every request this rank has open and free their blocks and slots. The loop stops here:
        every rank follows one global order, so the chunks after this one would wait on the lost peer too."""
        self.error = f"{self.side}{self.rank}: {e}"
        self.error_at = time.time()
        self.stopped = isinstance(e, Stopped)
        failed = getattr(e, "request", None)
        for rid, rec in self.records.items():
            if rec.end is None:
                direct = rid == failed or self.stopped
                self.failures[rid] = self.error if direct else f"{self.side}{self.rank}: aborted after {e}"
                if rid in self.cache.tables:
                    self.cache.release(rid)
        for f in inflight:
            if f.staged:
                self.staging.put(f.buf)
        inflight.clear()

