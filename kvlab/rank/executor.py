"""The executor: one rank's chunks, pipelined, whatever moves them.

Protocol (both sides, every rank): walk the global chunk order of the run's plan
(kvlab.config.workload.RunPlan, built once by the runner) restricted to the chunks this rank
takes part in. Keep at most ``slots`` chunks in flight: chunk ``i`` is started only once chunk
``i - slots`` is finished, so whatever chunk ``i`` reuses (a staging slot, a readiness flag) is
free again. How a chunk moves is the transport's (kvlab.transports: the protocol of that seam
is at its top); what the chunks are and when each may go is the strategy's
(kvlab.model.schedule); the executor owns requests.

The loop is driven by events, not by its own pace: each turn it finishes the chunks in flight
that are done (a transport that ``polls`` has marked each completion when it happened), posts
the next chunk if it is ready and the window has room, and otherwise waits: for a free slot
(the oldest chunk must finish; a ctx rank's ready chunk counts that as the request's
``slot_wait``) or for the prefill.

- ctx: the prefill runs on its own thread (kvlab.rank.prefiller: first come first served per ctx DP
  group, on its own clock, every mark measured when it happens); a chunk is ready once the
  layers it needs are written (strategy ready=layer: its layer; ready=request: every layer). A
  request is opened (the transport told: ``opened``) once the prefill has allocated its blocks;
  its transfer starts when its first chunk became free to go. After its last chunk is finished:
  its prefill marks go into its record, and its blocks are freed (which may let the prefill
  take the next request).
- gen: open a request at its first chunk (allocate) -> start. After its last chunk is
  finished (its clock stops there): verify it bit-exactly, then free its blocks. With prefix
  reuse (kvlab.model.prefix) a request's table points at blocks of the earlier requests it shares
  them with (its sources, allocated first, ahead of their own first chunk if need be), and it is
  complete only once their chunks have landed too: its clock stops at the later of the two, so
  TTFT counts the wait for a shared block still arriving, and it is verified after them.

Nothing the prefill waits for depends on a later chunk (kvlab.rank.prefiller says why), and every
rank follows one global order, so no wait cycle can form between ranks, whatever the window.

Verification (standing in for decode) stays off the measured path: the gen side verifies a
finished request after the loop, or inside it only when the cache needs its blocks for a
request opening later (``RequestRecord.in_loop`` says so), so it never stalls the chunks of
the requests in flight.

A chunk that fails (timeout, lost peer), or a prefill that does, fails every request this rank
has open; the loop stops there, since every later chunk would wait on the lost peer too.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass

import torch

from kvlab.config.faults import RankFaults
from kvlab.config.schema import Setup
from kvlab.config.workload import RunPlan
from kvlab.core.clock import Clock
from kvlab.memory.cache import PagedCache
from kvlab.model.plan import Request, Segment
from kvlab.model.schedule import Chunk, Ready
from kvlab.rank.prefiller import Prefiller, running
from kvlab.results.metrics import RequestRecord
from kvlab.transports import ChunkFailed, RankContext, Transport
from kvlab.transports.deadline import wait_until

POLL_S = 0.0005  # between looks at the chunks in flight, when a transport can say which are done
WAIT_S = 0.05  # the longest wait for the prefill with nothing in flight (signals and beats in between)


class Stopped(BaseException):
    """The process was told to stop (SIGTERM from the launcher or torchrun's agent) during the transfers.

    BaseException, so that a transport's ``except Exception`` around a peer call does not report the signal
    as that peer's failure ("control store unreachable: stopped by SIGTERM"). ``after_death``: the local
    launcher's SIGTERM once it found a peer dead, which ends the waits on peers but leaves the requests that
    landed whole to be checked (work that waits on nobody)."""

    def __init__(self, *args, after_death: bool = False):
        super().__init__(*args)
        self.after_death = after_death


@dataclass
class InFlight:
    index: int
    chunk: Chunk
    handle: object


class Executor:
    """One rank's transfer loop over its chunks of ``plan`` (the module's docstring says how); ``setup``: the
    run's config."""

    def __init__(self, setup: Setup, plan: RunPlan, side: str, rank: int, world_rank: int, device: torch.device,
                 cache: PagedCache, transport: Transport, ops, clock: Clock | None, progress=None,
                 faults: RankFaults | None = None, beat=None, died=None, local_work=None):
        self.setup, self.plan, self.side, self.rank, self.world_rank = setup, plan, side, rank, world_rank
        self.rank_ctx: RankContext | None = None  # what the transport sees of this rank (made by connect)
        self.device, self.cache, self.transport, self.ops, self.clock = device, cache, transport, ops, clock
        t = setup.transfer
        self.strategy = t.strategy
        self.window = t.slots
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # GPUs: block tables and checks, which must not queue behind a device wait on the transfer stream for a
        # peer that died (a copy from host memory, a host sync there, would wait forever)
        self.aside = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.progress = progress
        self.records: dict[int, RequestRecord] = {}
        self.faults = faults or RankFaults()
        self.beat = beat or (lambda: None)  # proof of progress for the end-of-run exchange (kvlab.rank.report)
        self.died = died or (lambda: "")  # "ctx1 (rank 1)": a rank the launcher found dead, "" while none is
        # around work that waits on no peer: the runner's stop, which puts off the launcher's SIGTERM after a death
        self.local_work = local_work or contextlib.nullcontext
        self.failures: dict[int, str] = {}  # request -> why it failed on this rank
        self.error: str | None = None  # the failure that stopped this rank's loop
        self.error_at: float | None = None
        self.stopped = False  # told to stop from outside: nobody is left to report to
        self.after_death = False  # ... by the launcher after a death: the requests that landed are still checked
        self.transfer_peak = 0  # allocator peak of the transfer alone (fill and verify excluded)
        self.untracked_kept = 0  # device bytes fill and verify allocated and kept (their caches): not the transfer's
        # finished, blocks still held: (request, its segments here, its landing event on GPUs)
        self.unverified: deque[tuple[Request, list[Segment], object]] = deque()
        self.looping = False
        self.prefiller: Prefiller | None = None  # a ctx rank's prefill thread (kvlab.rank.prefiller), made by run
        self.requests: dict[int, Request] = plan.by_id
        # prefix reuse (gen): requests allocated ahead of their first chunk, as the source of an earlier-opened
        # sharer's blocks; those closed here; and those whose own chunks landed before their sources' did
        self.ahead: set[int] = set()
        self.closed: set[int] = set()
        self.pending: dict[int, tuple[Request, list[Segment], set[int]]] = {}
        self.skipped: dict[int, int] = {}  # request -> bytes this gen rank did not need moved (set by the runner)
        held = [p.spec.layers[i] for p in cache.state.pools() for i in p.layers] if side == "ctx" else []
        self.held_layers = frozenset(held)  # global layers whose cache this (ctx) rank writes
        self.gpu_prefill = None  # kvlab.rank.prefill_gpu.GpuPrefill with prefill=gpu (set by the runner)
        # prefill=model: (kvlab.rank.prefill_model.ModelPrefill, the rank's DecodeCheck), set by the runner
        self.model_prefill = None
        self.prefill_alone: dict[int, float] = {}  # prompt tokens -> seconds of that prefill alone (prefill=gpu)

    def connect(self) -> None:
        """The transport's start-up (pair groups, staging, mapped pools); before the clock starts."""
        self.rank_ctx = RankContext(self.setup, self.side, self.rank, self.world_rank, self.device, self.cache,
                                    self.ops, self.stream, self.faults, self._clock, aside=self.aside)
        self.transport.connect(self.rank_ctx)

    @property
    def clock(self) -> Clock | None:
        return self._clock

    @clock.setter
    def clock(self, clock: Clock | None) -> None:
        self._clock = clock
        if self.rank_ctx is not None:
            self.rank_ctx.clock = clock

    @contextlib.contextmanager
    def untracked(self):
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
        if self.sending:  # the prefill thread allocated its blocks when its prefill began
            self.transport.opened(req)
        else:
            while True:
                try:
                    if req.id in self.ahead:
                        self.ahead.discard(req.id)
                    else:
                        self._allocate_with_sources(req)
                    break
                except MemoryError:
                    if not self.unverified:
                        raise
                    self._verify(*self.unverified.popleft())  # the cache needs its blocks now
        rec = RequestRecord(req.id, req.isl, self.side, self.rank, n_chunks)
        if not self.sending:
            rec.start = self.clock.mark()
            if req.prefix is not None:
                rec.prefix_hit_blocks, rec.prefix_blocks = req.prefix.hit, req.prefix.full
                rec.skipped_bytes = self.skipped.get(req.id, 0)
        self.records[req.id] = rec
        return rec

    def _close(self, req: Request, segments: tuple[Segment, ...]) -> None:
        rec = self.records[req.id]
        rec.end = self.clock.mark()
        self.transport.closed(req.id)
        if self.sending:
            self._release(req.id)
        else:
            mine = [s for s in segments if s.dst == self.rank]
            waits = self.cache.sources(req) - self.closed
            if waits:  # blocks it shares are still arriving for an earlier request: complete once they are in
                rec.end = None
                self.pending[req.id] = (req, mine, waits)
                return
            self._landed(req, mine)

    def _landed(self, req: Request, mine: list[Segment]) -> None:
        """A gen rank holds all of ``req``'s cache: queue its check, and complete the sharers that waited for it."""
        landed = None
        if self.stream is not None:  # its bytes are in once the work queued so far on the stream has run
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.unverified.append((req, mine, landed))
        self.closed.add(req.id)
        for rid, (other, theirs, waits) in list(self.pending.items()):
            waits.discard(req.id)
            if not waits and rid in self.pending:
                del self.pending[rid]
                self.records[rid].end = self.records[req.id].end
                self._landed(other, theirs)

    def _allocate_with_sources(self, req: Request) -> None:
        """``req``'s blocks, after those of the sources it shares blocks with that have not opened yet (their own
        first chunk comes later here: they are allocated ahead, and opened without allocating)."""
        for src in sorted(self.cache.missing(req)):
            self._allocate_with_sources(self.requests[src])
            self.ahead.add(src)
        self._allocate_aside(req)

    def _release(self, rid: int) -> None:
        with self.prefiller.cond if self.prefiller is not None else contextlib.nullcontext():
            self.cache.release(rid)
        if self.prefiller is not None:
            self.prefiller.released()

    def _allocate_aside(self, req: Request) -> None:
        """A gen rank's blocks for ``req``, their tables uploaded beside the transfer stream (``uploading``)."""
        with self.rank_ctx.uploading():
            tables = self.cache.allocate(req)
        if self.aside is not None:
            for t in tables.values():
                t.ids.record_stream(self.stream)

    def _verify(self, req: Request, mine: list[Segment], landed=None) -> None:
        rec = self.records[req.id]
        t0 = time.perf_counter()
        # on a stream of its own, after the request's own copies only: the transfer stream may hold a device
        # wait for a ctx rank that died (ipc), which the check must not queue behind
        on = torch.cuda.stream(self.aside) if self.aside is not None else contextlib.nullcontext()
        if landed is not None:
            # a device wait for a dead ctx rank's data queued before the request's last copies holds them
            # forever: the check's host sync would too, so it waits here, under the deadline
            timeout = self.setup.transfer.timeout_s
            wait_until(landed.query, time.time() + timeout, lambda: ChunkFailed(
                f"{self.side}{self.rank}: request {req.id}'s copies not done within {timeout:g} s (work queued "
                "before them waits for a ctx rank's data that never came)", req.id))
        with self.untracked(), on:
            if landed is not None:
                self.aside.wait_event(landed)
            rec.errors += self.cache.verify(req, mine, self.ops)
        rec.verify_s = time.perf_counter() - t0
        if self.looping:
            rec.in_loop.append("verify")
        self.cache.release(req.id)

    def verify_finished(self) -> None:
        """Verify every finished request still waiting (after the loop: off the clock)."""
        while self.unverified:
            req, *rest = self.unverified.popleft()
            try:
                self._verify(req, *rest)
            except ChunkFailed as e:  # its bytes never all landed: failed, not checked
                self.failures[req.id] = str(e)
                self.cache.release(req.id)

    def _allocated(self, c: Chunk) -> bool:
        return c.request in self.prefiller.progress

    def _ready(self, c: Chunk):
        """The request's prefill progress once chunk ``c``'s layers are written (ctx), else None; a gen rank's
        chunk may always be posted."""
        if not self.sending:
            return True
        need = c.ready_layer if self.strategy.ready == Ready.layer else self.setup.model.num_layers - 1
        return self.prefiller.ready(c.request, need)

    # -- chunks -----------------------------------------------------------------------------
    def _start(self, i: int, c: Chunk, ready) -> InFlight:
        rec = self.records[c.request]
        if self.sending:
            free = ready.go(c.ready_layer) if self.strategy.ready == Ready.layer else ready.done
            if rec.first_post is None:
                rec.start = free  # its transfer starts with its first chunk free to go
            if self.gpu_prefill is not None:  # after the layer's writes, queued on the compute stream
                self.stream.wait_event(free)
        if rec.first_post is None:
            rec.first_post = self.clock.mark()
        return InFlight(i, c, self.transport.start(i, c, rec))

    def _finish(self, f: InFlight, segments: dict[int, tuple[Segment, ...]], requests: dict[int, Request]) -> None:
        c, rec = f.chunk, self.records[f.chunk.request]
        in_place = self.transport.finish(f.handle, rec)
        rec.bytes += c.nbytes
        peer = c.dst if self.sending else c.src
        rec.peer_bytes[peer] = rec.peer_bytes.get(peer, 0) + c.nbytes
        rec.chunks += 1
        rec.in_place += int(in_place)
        # a layer's last chunk done: on a gen rank where it landed; on a ctx rank where it left, which a pulling
        # transport's ctx rank does not see (its marks there are when it published the layer, not a landing)
        if rec.wire and (not self.sending or not self.transport.pulls):
            rec.layer_done[c.ready_layer] = rec.wire[-1][1]
        if rec.chunks == rec.chunks_total:
            if self.sending:
                self._prefill_marks(rec)
            self._close(requests[c.request], segments[c.request])
        if self.progress is not None:
            self.progress(c.nbytes)
        self.beat()

    def _prefill_marks(self, rec: RequestRecord) -> None:
        """The request's prefill as the prefill thread measured it, into its record."""
        p = self.prefiller.progress[rec.request]
        rec.arrival, rec.prefill_start, rec.prefill_end = p.arrival, p.start, p.end
        rec.layer_ready = dict(p.ready)
        rec.fill_s = p.fill_s
        rec.prefill_alone_s = self.prefill_alone.get(rec.isl)

    def _reap(self, inflight: deque[InFlight], segments, requests) -> None:
        """Finish, in order, the chunks in flight that are done (their completion was marked when it was
        seen: kvlab.transports, ``poll``)."""
        if not self.transport.polls:
            return
        for f in inflight:
            self.transport.poll(f.handle)
        while inflight and self.transport.poll(inflight[0].handle):
            self._finish(inflight.popleft(), segments, requests)

    def run(self) -> list[RequestRecord]:
        """The transfer loop: post each chunk as soon as it is ready and the window has room, finish chunks
        as they complete. A ctx rank's prefill runs meanwhile on its own thread (kvlab.rank.prefiller)."""
        mine = self.plan.chunks_of(self.world_rank)
        self.chunks = mine
        if self.rank_ctx is not None:
            self.rank_ctx.chunks = mine
        requests, segments = self.requests, self.plan.segments
        counts: dict[int, int] = {}
        for c in mine:
            counts[c.request] = counts.get(c.request, 0) + 1
        if self.sending:
            self.prefiller = Prefiller(self, [requests[r] for r in counts])
        inflight: deque[InFlight] = deque()
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        polls = self.transport.polls
        self.looping = True
        i = 0
        try:
            with ctx, running(self.prefiller):
                while i < len(mine) or inflight:
                    self._reap(inflight, segments, requests)
                    if i == len(mine) and not inflight:
                        break
                    c = mine[i] if i < len(mine) else None
                    ready = self._ready(c) if c is not None else None
                    if c is not None and c.request not in self.records and (ready or self._allocated(c)):
                        self._open(requests[c.request], counts[c.request])  # its block table may be published
                    if ready and len(inflight) < self.window:
                        self.faults.before_post(i)
                        inflight.append(self._start(i, c, ready))
                        i += 1
                        continue
                    if inflight and (ready or c is None or not polls):
                        # the head must finish first: a ready chunk waits for a free slot meanwhile
                        t0 = time.time()
                        self._drain_head(inflight, segments, requests, polls)
                        if ready and self.sending:
                            self.records[c.request].slot_wait += time.time() - t0
                        continue
                    # the next chunk's layers are not written yet: wait for the prefill, seeing completions
                    self.prefiller.wait(POLL_S if inflight else WAIT_S)
                    self.beat()
        except (ChunkFailed, Stopped) as e:
            self._abort(e, inflight)
        finally:
            self.looping = False
        for rid in list(self.pending):  # (a source that never closed here stopped the loop: failed above)
            self.failures.setdefault(rid, f"{self.side}{self.rank}: the blocks it shares never landed")
            del self.pending[rid]
            self._release(rid)
        if self.stream is not None and self.error is None:
            self.stream.synchronize()
        if not self.stopped or self.after_death:  # requests finished before a failure are still checked
            try:
                with ctx, self.local_work():
                    self.verify_finished()
            except Stopped as e:  # a signal that came while the loop's last wait blocked lands here
                self.stopped = True
                self.error = self.error or f"{self.side}{self.rank}: {e}"
                self._unverified_failed(e)
        return list(self.records.values())

    def _drain_head(self, inflight: deque[InFlight], segments, requests, polls: bool) -> None:
        """Finish the oldest chunk in flight. A transport that can say when a chunk is done is polled
        (every chunk's completion is marked when it happens, the head's included); one that cannot is
        finished at once, blocking until the head is done."""
        if polls:
            def others() -> None:
                for f in inflight:
                    self.transport.poll(f.handle)
                self.beat()  # waiting on a peer within the deadline is not silence

            # past the deadline the transport's finish names the chunk and the peer, without a deadline of its own
            try:
                wait_until(lambda: self.transport.poll(inflight[0].handle),
                           time.time() + self.setup.transfer.timeout_s, TimeoutError, poll_s=POLL_S, between=others)
            except TimeoutError:
                self.rank_ctx.overdue = True
        try:
            self._finish(inflight.popleft(), segments, requests)
        finally:
            self.rank_ctx.overdue = False

    def _unverified_failed(self, e: Stopped) -> None:
        """Told to stop: nobody will wait for the finished requests' verification."""
        while self.unverified:
            req, *_ = self.unverified.popleft()
            self.failures[req.id] = f"{self.side}{self.rank}: {e} before verification"
            self.cache.release(req.id)

    def _abort(self, e: ChunkFailed | Stopped, inflight: deque[InFlight]) -> None:
        """Fail every request this rank has open and free their blocks and slots. The loop stops here:
        every rank follows one global order, so the chunks after this one would wait on the lost peer too."""
        self.stopped = isinstance(e, Stopped)
        self.after_death = self.stopped and e.after_death
        if not self.stopped:
            # a wait on a live peer that ran out because another rank died (ctx0 held at its tensor-parallel
            # barrier by a dead ctx1) says so: the report names the dead rank, not only the peer it waited on
            gone = self.died()
            if gone and f"with {gone.split(' ')[0]}:" not in str(e):
                e = ChunkFailed(f"{e}; {gone} had died", getattr(e, "request", None))
        self.error = f"{self.side}{self.rank}: {e}"
        self.error_at = time.time()
        failed = getattr(e, "request", None)
        if self.stopped and not self.after_death:
            self._unverified_failed(e)
        for rid, rec in self.records.items():
            if rec.end is None or rid == failed:  # failed: also one whose end was marked (a pull not done in time)
                direct = rid == failed or self.stopped
                self.failures[rid] = self.error if direct else f"{self.side}{self.rank}: aborted after {e}"
                if rid in self.cache.tables:
                    self._release(rid)
        for rid in [r for r in self.ahead if r in self.cache.tables]:  # allocated for sharers, never opened
            self.failures.setdefault(rid, f"{self.side}{self.rank}: aborted after {e}")
            self.cache.release(rid)
        self.ahead.clear()
        self.pending.clear()
        if self.sending:  # the prefill (stopped by now) may have taken requests the loop never opened
            for rid in list(self.cache.tables):
                why = self.error if self.stopped else f"{self.side}{self.rank}: aborted after {e}"
                self.failures.setdefault(rid, why)
                self._release(rid)
        for f in inflight:
            self.transport.abandon(f.handle)
        inflight.clear()
        self.transport.aborted()
