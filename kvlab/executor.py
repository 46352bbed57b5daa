"""The executor: one rank's chunks, pipelined, whatever moves them.

Protocol (both sides, every rank): walk the global chunk order (``workload.interleave``)
restricted to the chunks this rank takes part in. Keep at most ``slots`` chunks in flight:
before chunk ``i`` is started, chunk ``i - slots`` is finished, so whatever chunk ``i``
reuses (a staging slot, a readiness flag) is free again. How a chunk moves is the
transport's (kvlab.transports: the protocol of that seam is at its top); what the chunks
are and when each may go is the strategy's (kvlab.schedule); the executor owns requests:

- ctx: open a request at its first chunk (allocate, fill: the prefill's output; tell the
  transport), [strategy ready=layer: wait until the simulated prefill has finished the
  chunk's layer; ready=request: every layer] -> start. After the request's last chunk is
  finished: free its blocks.
- gen: open a request at its first chunk (allocate) -> start. After its last chunk is
  finished: verify it bit-exactly, then free its blocks.

A chunk that fails (timeout, lost peer) fails every request this rank has open; the loop
stops there, since every later chunk would wait on the lost peer too.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvlab.cache import PagedCache
from kvlab.clock import Clock
from kvlab.config import Setup
from kvlab.faults import RankFaults
from kvlab.metrics import RequestRecord
from kvlab.plan import Request, Segment
from kvlab.schedule import Chunk, Ready
from kvlab.transports import ChunkFailed, Transport
from kvlab.workload import chunks_of


class Stopped(Exception):
    """The process was told to stop (SIGTERM from the launcher or torchrun's agent) during the transfers."""


@dataclass
class InFlight:
    index: int
    chunk: Chunk
    handle: object


class Executor:
    def __init__(self, setup: Setup, side: str, rank: int, world_rank: int, device: torch.device,
                 cache: PagedCache, transport: Transport, ops, clock: Clock | None, progress=None,
                 faults: RankFaults | None = None, beat=None):
        self.setup, self.side, self.rank, self.world_rank = setup, side, rank, world_rank
        self.device, self.cache, self.transport, self.ops, self.clock = device, cache, transport, ops, clock
        t = setup.transfer
        self.strategy = t.strategy
        self.window = t.slots
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

    def connect(self) -> None:
        """The transport's start-up (pair groups, staging, mapped pools); before the clock starts."""
        self.transport.connect(self)

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
            self.transport.opened(req)
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
        layer = c.ready_layer if self.strategy.ready == Ready.layer else self.setup.model.num_layers - 1
        delay = rec.prefill_start + (layer + 1) * ms / 1e3 - time.time()
        if delay > 0:
            time.sleep(delay)

    # -- chunks -----------------------------------------------------------------------------
    def _start(self, i: int, c: Chunk) -> InFlight:
        rec = self.records[c.request]
        if self.sending:
            self._wait_prefill(rec, c)
        return InFlight(i, c, self.transport.start(i, c, rec))

    def _finish(self, f: InFlight, segments: dict[int, list[Segment]], requests: dict[int, Request]) -> None:
        c, rec = f.chunk, self.records[f.chunk.request]
        in_place = self.transport.finish(f.handle, rec)
        rec.bytes += c.nbytes
        rec.chunks += 1
        rec.in_place += int(in_place)
        if self.sending:
            rec.layer_done[c.ready_layer] = rec.wire[-1][1]
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
                        self._finish(inflight.popleft(), segments, requests)
                    self.faults.before_post(i)
                    inflight.append(self._start(i, c))
                while inflight:
                    self._finish(inflight.popleft(), segments, requests)
        except (ChunkFailed, Stopped) as e:
            self._abort(e, inflight)
        if self.stream is not None and self.error is None:
            self.stream.synchronize()
        return list(self.records.values())

    def _abort(self, e: ChunkFailed | Stopped, inflight: deque[InFlight]) -> None:
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
            self.transport.abandon(f.handle)
        inflight.clear()
