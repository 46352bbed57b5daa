"""The executor: one rank's chunks, pipelined, whatever moves them.

Protocol (both sides, every rank): walk the global chunk order (``workload.interleave``)
restricted to the chunks this rank takes part in. Keep at most ``slots`` chunks in flight:
before chunk ``i`` is started, chunk ``i - slots`` is finished, so whatever chunk ``i``
reuses (a staging slot, a readiness flag) is free again. How a chunk moves is the
transport's (kvlab.transports: the protocol of that seam is at its top); what the chunks
are and when each may go is the strategy's (kvlab.schedule); the executor owns requests:

- ctx: open a request at its first chunk (allocate; tell the transport), run its prefill as
  far as the chunk needs (kvlab.prefill: it starts when the request has arrived and its DP
  group is free, and writes each layer's cache when that layer is computed; strategy
  ready=layer: the chunk's layer; ready=request: every layer) -> start. A chunk started
  before its layer was written would carry stale bytes, and the gen side's check says so.
  With prefill=sim the ctx ranks of one tensor-parallel group end a request's prefill
  together, as their collectives make a real prefill end. After the request's last chunk is
  finished: free its blocks.
- gen: open a request at its first chunk (allocate) -> start. After its last chunk is
  finished (its clock stops there): verify it bit-exactly, then free its blocks.

Verification (standing in for decode) stays off the measured path: the gen side verifies a
finished request after the loop, or inside it only when the cache needs its blocks for a
request opening later (``RequestRecord.in_loop`` says so), so it never stalls the chunks of
the requests in flight.

A chunk that fails (timeout, lost peer) fails every request this rank has open; the loop
stops there, since every later chunk would wait on the lost peer too.
"""
from __future__ import annotations

import contextlib
import datetime
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


def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


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
        self.untracked_kept = 0  # device bytes fill and verify allocated and kept (their caches): not the transfer's
        self.unverified: deque[tuple[Request, list[Segment]]] = deque()  # finished, blocks still held
        self.looping = False
        self.prefill: dict = {}  # request -> kvlab.prefill.PrefillTimes: the run's timeline (set by the runner)
        self.requests: dict[int, Request] = {}
        held = [p.spec.layers[i] for p in cache.state.pools() for i in p.layers] if side == "ctx" else []
        self.held_layers = frozenset(held)  # global layers whose cache this (ctx) rank writes
        self.gpu_prefill = None  # kvlab.prefill_gpu.GpuPrefill with prefill=gpu (set by the runner)
        self.prefill_alone: dict[int, float] = {}  # prompt tokens -> seconds of that prefill alone (prefill=gpu)
        self.store = None  # the default group's store: tensor-parallel ctx peers end a prefill in step

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
        self.transfer_peak = max(self.transfer_peak, self.tracked_peak())
        before = torch.cuda.memory_allocated(self.device)
        try:
            yield
        finally:
            # what they keep (cached tables, scratch) stays allocated under every later peak
            self.untracked_kept += torch.cuda.memory_allocated(self.device) - before
            torch.cuda.reset_peak_memory_stats(self.device)

    def tracked_peak(self) -> int:
        """The allocator's peak since the last reset, less what fill and verify keep allocated."""
        return torch.cuda.max_memory_allocated(self.device) - self.untracked_kept

    @property
    def sending(self) -> bool:
        return self.side == "ctx"

    # -- requests ---------------------------------------------------------------------------
    def _open(self, req: Request, n_chunks: int) -> RequestRecord:
        while True:
            try:
                self.cache.allocate(req)
                break
            except MemoryError:
                if not self.unverified:
                    raise
                self._verify(*self.unverified.popleft())  # the cache needs its blocks now
        rec = RequestRecord(req.id, req.isl, self.side, self.rank, n_chunks)
        if self.sending:
            t = self.prefill[req.id]
            rec.arrival, rec.prefill_start = self.clock.epoch + t.arrival, self.clock.epoch + t.start
            rec.prefill_alone_s = self.prefill_alone.get(req.isl)
            self.transport.opened(req)
        rec.start = self.clock.mark()
        self.records[req.id] = rec
        return rec

    def _close(self, req: Request, segments: list[Segment]) -> None:
        rec = self.records[req.id]
        rec.end = self.clock.mark()
        self.transport.closed(req.id)
        if self.sending:
            self.cache.release(req.id)
        else:
            self.unverified.append((req, [s for s in segments if s.dst == self.rank]))

    def _verify(self, req: Request, mine: list[Segment]) -> None:
        rec = self.records[req.id]
        t0 = time.perf_counter()
        with self._untracked():
            rec.errors += self.cache.verify(req, mine, self.ops)
        rec.verify_s = time.perf_counter() - t0
        if self.looping:
            rec.in_loop.append("verify")
        self.cache.release(req.id)

    def verify_finished(self) -> None:
        """Verify every finished request still waiting (after the loop: off the clock)."""
        while self.unverified:
            self._verify(*self.unverified.popleft())

    def _prefill(self, rec: RequestRecord, c: Chunk) -> None:
        """Run the request's prefill up to the layer chunk ``c`` needs: layer l is computed between the
        timeline's end of layer l-1 and its own end, and this rank writes its cache of layer l then."""
        t = self.prefill[c.request]
        need = c.ready_layer if self.strategy.ready == Ready.layer else self.setup.model.num_layers - 1
        epoch = self.clock.epoch
        if self.gpu_prefill is not None:
            self._prefill_gpu(rec, c, need)
            return
        while rec.next_layer <= need:
            layer = rec.next_layer
            _sleep_until(epoch + (t.layer_end[layer - 1] if layer else t.start))
            if layer in self.held_layers and layer != self.faults.unwritten_layer:
                t0 = time.perf_counter()
                with self._untracked():
                    self.cache.fill(self.requests[c.request], self.ops, layer)
                rec.fill_s += time.perf_counter() - t0
            _sleep_until(epoch + t.layer_end[layer])
            rec.layer_ready[layer] = time.time()
            rec.next_layer += 1
        if rec.prefill_end is None and rec.next_layer > max(self.held_layers):
            self._in_step(c)
            # the timeline's end, or later if writing this rank's layers took longer (other pipeline
            # stages may still be computing: the prefill ends with the last layer)
            rec.prefill_end = max(time.time(), epoch + t.end)

    def _in_step(self, c: Chunk) -> None:
        """Tensor-parallel peers end a prefill together (a real one all-reduces every layer): wait until every
        ctx rank of this rank's (dp, pp) group has written its share of the request. Without it, a peer that
        took longer to write its emulated output would put that delay inside the transfer's clock."""
        side = self.setup.ctx
        if side.tp == 1:
            return
        if self.device.type == "cuda":
            self.stream.synchronize()  # the writes were queued: the share is written once they ran
        me = side.coord(self.rank)
        peers = [r for r in self.senders[c.request] if r != self.rank and side.coord(r).dp == me.dp
                 and side.coord(r).pp == me.pp]  # only ranks that send some of it prefill it (MLA: maybe one)
        if not peers:
            return
        key = f"prefill/{c.request}/{me.dp}/{me.pp}"
        store = self._store()
        if store.add(key, 1) == len(peers) + 1:
            store.set(key + "/all", "1")
            return
        timeout = self.setup.transfer.timeout_s
        try:
            store.wait([key + "/all"], datetime.timedelta(seconds=timeout))
        except RuntimeError as e:  # the deadline passed, or the store's host is gone
            raise ChunkFailed(f"request {c.request} chunk {c.seq} with {'/'.join(f'ctx{r}' for r in peers)}: "
                              f"tensor-parallel peers' prefill not done within {timeout:g} s", c.request) from e

    def _store(self):
        if self.store is None:
            import torch.distributed as dist
            self.store = dist.distributed_c10d._get_default_store()
        return self.store

    def _prefill_gpu(self, rec: RequestRecord, c: Chunk, need: int) -> None:
        """prefill=gpu: queue this rank's layers up to ``need`` on the compute stream once the request has
        arrived (the stream serves requests in the order they are queued: FIFO), each layer's cache written
        after its kernels and an event recorded; the transfer stream waits for the event, the host does not."""
        g, req = self.gpu_prefill, self.requests[c.request]
        last = max(self.held_layers)
        if rec.next_layer == 0:
            _sleep_until(self.clock.epoch + self.prefill[c.request].arrival)
        with torch.cuda.stream(g.stream), self._untracked():
            while rec.next_layer <= min(need, last):
                layer = rec.next_layer
                if layer in self.held_layers:
                    if layer == min(self.held_layers):
                        rec.prefill_start = self.clock.mark()
                    g.layer(layer, req.isl)
                    if layer != self.faults.unwritten_layer:
                        self.cache.fill(req, self.ops, layer)
                    rec.layer_ready[layer] = self.clock.mark()
                rec.next_layer += 1
        ready = [rec.layer_ready[x] for x in rec.layer_ready if x <= need]
        if ready:
            self.stream.wait_event(ready[-1])  # layers are queued in order: the last one covers the rest
        if rec.prefill_end is None and rec.next_layer > last:
            rec.prefill_end = rec.layer_ready[last]

    # -- chunks -----------------------------------------------------------------------------
    def _start(self, i: int, c: Chunk) -> InFlight:
        rec = self.records[c.request]
        if self.sending:
            self._prefill(rec, c)
            if rec.first_post is None:
                rec.start = self.clock.mark()  # its transfer starts with the first chunk free to go
        if rec.first_post is None:
            rec.first_post = self.clock.mark()
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
        self.chunks = mine
        self.senders: dict[int, set[int]] = {}  # request -> the ctx ranks that send some of it
        for c in order:
            self.senders.setdefault(c.request, set()).add(c.src)
        self.requests = requests
        counts: dict[int, int] = {}
        for c in mine:
            counts[c.request] = counts.get(c.request, 0) + 1
        inflight: deque[InFlight] = deque()
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        self.looping = True
        try:
            with ctx:
                for i, c in enumerate(mine):
                    if c.request not in self.records:
                        self._open(requests[c.request], counts[c.request])
                    if len(inflight) >= self.window:
                        t0 = time.time()
                        self._finish(inflight.popleft(), segments, requests)
                        self.records[c.request].slot_wait += time.time() - t0
                    self.faults.before_post(i)
                    inflight.append(self._start(i, c))
                while inflight:
                    self._finish(inflight.popleft(), segments, requests)
        except (ChunkFailed, Stopped) as e:
            self._abort(e, inflight)
        finally:
            self.looping = False
        if self.stream is not None and self.error is None:
            self.stream.synchronize()
        if not self.stopped:  # requests finished before a failure are still checked
            try:
                with ctx:
                    self.verify_finished()
            except Stopped as e:  # a signal that came while the loop's last wait blocked lands here
                self.stopped = True
                self.error = self.error or f"{self.side}{self.rank}: {e}"
                self._unverified_failed(e)
        return list(self.records.values())

    def _unverified_failed(self, e: Stopped) -> None:
        """Told to stop: nobody will wait for the finished requests' verification."""
        while self.unverified:
            req, _ = self.unverified.popleft()
            self.failures[req.id] = f"{self.side}{self.rank}: {e} before verification"
            self.cache.release(req.id)

    def _abort(self, e: ChunkFailed | Stopped, inflight: deque[InFlight]) -> None:
        """Fail every request this rank has open and free their blocks and slots. The loop stops here:
        every rank follows one global order, so the chunks after this one would wait on the lost peer too."""
        self.error = f"{self.side}{self.rank}: {e}"
        self.error_at = time.time()
        self.stopped = isinstance(e, Stopped)
        failed = getattr(e, "request", None)
        if self.stopped:
            self._unverified_failed(e)
        for rid, rec in self.records.items():
            if rec.end is None or rid == failed:  # failed: also one whose end was marked (a pull not done in time)
                direct = rid == failed or self.stopped
                self.failures[rid] = self.error if direct else f"{self.side}{self.rank}: aborted after {e}"
                if rid in self.cache.tables:
                    self.cache.release(rid)
        for f in inflight:
            self.transport.abandon(f.handle)
        inflight.clear()
