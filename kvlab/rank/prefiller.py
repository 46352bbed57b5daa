"""A ctx rank's prefill on its own thread and its own clock: what the transfer loop waits for.

The prefill is not the transfer's: in a serving engine it runs on its own (a compute stream,
a scheduler step) and the KV transfer takes each layer as it is written. So the ctx rank runs
it on a thread of its own, first come first served over the requests this rank sends some of
(one ctx DP group prefills one request at a time), and the transfer loop (kvlab.rank.executor) only
waits for the layers a chunk needs. Nothing the prefill does waits on a transfer, except for
cache blocks (a request's blocks are allocated when its prefill starts, as an engine's
scheduler admits a prefill only with blocks for it): those are freed by earlier requests'
transfers, which never wait on a later request's prefill. So no wait cycle can form, whatever
the window of chunks in flight.

Every mark is taken when its event happens:

- ``prefill=sim``: the request is taken when it has arrived and the previous one is done
  (measured ``prefill_start``); layer ``l`` runs for its configured time (kvlab.model.prefill) from
  the measured end of layer ``l - 1``, writing this rank's cache of the layer inside that
  time (``fill_s`` says how long the writes took: when they outlast the layer, the layer ends
  later, and the measured marks say so). Tensor-parallel peers end a request together (a real
  prefill all-reduces every layer): the last layer is published after every peer has written
  its share, through the default group's store, under ``transfer.timeout_s``.
- ``prefill=gpu``: at the request's arrival its layers are queued on the compute stream (the
  stream serves requests in the order they are queued: FCFS) with an event after each layer's
  cache write; the marks are those events, and the transfer stream waits for them on the
  device, so the host never waits for the GPU.
- ``prefill=model``: at the request's arrival the model's forward runs (kvlab.rank.prefill_model); after each
  decoder layer its real cache is written and the layer marked at its completion (on a GPU after its stream
  is synchronised), so the marks are the forward's own per-layer times.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvlab.model import prefill
from kvlab.transports import ChunkFailed
from kvlab.transports.deadline import call_within

POLL_S = 0.05  # how often a blocked wait looks at the halt flag (a stop, a failed loop)
LEAD = 2  # prefill=gpu: layers queued ahead of the GPU (enough to keep it busy between launches)
LEAD_POLL_S = 50e-6


@dataclass
class Progress:
    """One request's prefill on this rank, as far as it has got (written by the prefill thread)."""

    request: int
    arrival: float  # host seconds: when the request arrived (the workload's arrival on the run's clock)
    start: object = None  # mark: its first layer began
    end: object = None  # mark: this rank's share done (its last layer, and its tensor-parallel peers')
    layers: int = 0  # layers 0 .. layers-1 are written and published
    ready: dict = field(default_factory=dict)  # global layer -> mark of its cache written
    stepped: object = None  # mark: every tensor-parallel peer has written its share (its last layer may go)
    done: object = None  # mark: every layer of the model done, later pipeline stages' too (a whole request may go)
    fill_s: float = 0.0  # host seconds writing this rank's cache of the request

    def go(self, layer: int):
        """When chunks of ``layer`` became free to go: its cache written (the last layer: by every peer)."""
        if layer in self.ready and self.stepped is not None and layer >= max(self.ready):
            return self.stepped
        return self.ready.get(layer, self.end)


class Halted(Exception):
    """The transfer loop stopped: the prefill thread ends without a report."""


class Prefiller:
    """The prefill of one ctx rank; ``start`` it after the clock, ``stop`` it when the loop ends."""

    def __init__(self, executor, requests: list):
        """``requests``: those this rank sends some of; the ctx ranks sending each one come from the run's plan
        (``executor.plan``: kvlab.config.workload.RunPlan)."""
        self.x = executor
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.id))  # FCFS, as every rank orders them
        self.senders = executor.plan.senders
        self.progress: dict[int, Progress] = {}
        self.cond = threading.Condition()
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.held = sorted(executor.held_layers)
        # prefill=sim on a GPU writes the cache on a stream of its own and waits for it before a layer counts as
        # written (the host marks are the layer's end, so the write must be done by then)
        self.fill_stream = (torch.cuda.Stream(executor.device)
                            if executor.device.type == "cuda" and executor.gpu_prefill is None else None)
        self.queued: list = []  # prefill=gpu: the events of the layers queued last, oldest first
        self.thread = threading.Thread(target=self._main, name=f"prefill-ctx{executor.rank}", daemon=True)

    # -- the transfer loop's side --------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        with self.cond:
            self.cond.notify_all()
        self.thread.join(timeout=self.x.setup.transfer.timeout_s + 5.0)

    def released(self) -> None:
        """Cache blocks were freed: a prefill waiting for blocks may go on."""
        with self.cond:
            self.cond.notify_all()

    def ready(self, request: int, layer: int) -> Progress | None:
        """The request's progress once layers up to ``layer`` are written and published, else None.
        Raises what stopped the prefill thread."""
        if self.error is not None:
            raise self.error
        p = self.progress.get(request)
        return p if p is not None and p.layers > layer else None

    def wait(self, timeout: float) -> None:
        """Block until the prefill publishes something (or ``timeout`` passes)."""
        with self.cond:
            if self.error is None:
                self.cond.wait(timeout)

    # -- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        x = self.x
        try:
            if x.device.type == "cuda":
                torch.cuda.set_device(x.device)
            for req in self.requests:
                self._sleep_until(x.clock.epoch + req.arrival_s)
                p = Progress(req.id, x.clock.epoch + req.arrival_s)
                self._allocate(req)
                if x.gpu_prefill is not None:
                    self._gpu(req, p)
                elif x.model_prefill is not None:
                    self._model(req, p)
                else:
                    self._sim(req, p)
        except Halted:
            pass
        except BaseException as e:  # noqa: BLE001 -- whatever it is, the loop raises it where it waits
            self.error = e if isinstance(e, ChunkFailed) else ChunkFailed(
                f"ctx{x.rank}: prefill failed: {type(e).__name__}: {e}", getattr(e, "request", -1))
        finally:
            with self.cond:
                self.cond.notify_all()

    def _sleep_until(self, t: float) -> None:
        delay = t - time.time()
        if delay > 0 and self.halt.wait(delay):
            raise Halted()
        if self.halt.is_set():
            raise Halted()

    def _allocate(self, req) -> None:
        """The request's blocks, waiting for earlier requests' transfers to free some if the cache is full."""
        x, timeout = self.x, self.x.setup.transfer.timeout_s
        deadline = time.time() + timeout
        with self.cond:
            while True:
                try:
                    x.cache.allocate(req)
                    return
                except MemoryError as e:
                    if self.halt.is_set():
                        raise Halted() from e
                    if time.time() > deadline:
                        raise ChunkFailed(f"request {req.id}: no cache blocks freed within {timeout:g} s "
                                          f"on ctx{x.rank} ({e})", req.id) from e
                    self.cond.wait(POLL_S)

    def _publish(self, p: Progress, layers: int) -> None:
        with self.cond:
            self.progress[p.request] = p
            p.layers = layers
            self.cond.notify_all()

    def _sim(self, req, p: Progress) -> None:
        x = self.x
        seconds = prefill.layer_seconds(x.setup.model, x.setup.prefill, x.setup.ctx.tp, req.isl,
                                        x.setup.ctx.tokens(0, x.setup.model))
        p.start = t = time.time()
        self._publish(p, 0)
        last = self.held[-1]
        for layer in range(last + 1):
            if layer in x.held_layers and layer != x.faults.unwritten_layer:
                t0 = time.perf_counter()
                with x.untracked(), self._on_fill_stream():
                    x.cache.fill(req, x.ops, layer)
                    if self.fill_stream is not None:
                        self.fill_stream.synchronize()
                p.fill_s += time.perf_counter() - t0
            self._sleep_until(t + seconds[layer])
            t = time.time()
            p.ready[layer] = t
            if layer < last:
                self._publish(p, layer + 1)
        # this rank's share is done: its end (a later pipeline stage's rank measures the model's end)
        p.end = p.stepped = time.time() if self._in_step(req) else t
        self._publish(p, last + 1)
        # the other pipeline stages' layers come after this rank's: the prefill ends with the model's last
        for layer in range(last + 1, len(seconds)):
            self._sleep_until(t + seconds[layer])
            t = time.time()
        p.done = time.time()
        self._publish(p, len(seconds))

    def _model(self, req, p: Progress) -> None:
        x = self.x
        net, check = x.model_prefill
        last = self.held[-1]
        cuda = x.device.type == "cuda"
        p.start = time.time()
        self._publish(p, 0)

        def on_layer(layer: int) -> None:
            if self.halt.is_set():
                raise Halted()
            if layer in x.held_layers and layer != x.faults.unwritten_layer:
                t0 = time.perf_counter()
                with x.untracked():
                    x.cache.fill(req, x.ops, layer)
                p.fill_s += time.perf_counter() - t0
            if cuda:  # the layer's kernels and its write done: the mark is their completion on the device, not when
                # this thread ran again after waiting for them (late by the host's load)
                done = x.clock.mark()
                torch.cuda.current_stream().synchronize()
                p.ready[layer] = done
            else:
                p.ready[layer] = time.time()
            if layer < last:
                self._publish(p, layer + 1)
            elif layer == last:
                # alone, the share ends with its last layer's mark (on a GPU the device's completion, not when this
                # thread ran again); with tensor-parallel peers, when the last of them is heard of
                p.end = p.stepped = time.time() if self._in_step(req) else p.ready[layer]
                self._publish(p, last + 1)

        ended: list = []

        def on_end() -> None:  # the forward's end, the lm head's included, marked before its token is read back
            ended.append(x.clock.mark() if cuda else time.time())

        with self._on_fill_stream():
            first = net.run(req.id, req.isl, check.planes.setdefault(req.id, {}), on_layer, on_end)
        check.planes.pop(req.id, None)  # every layer is in the pools: the device keeps one request's planes at a time
        check.post_first(req.id, first)
        p.done = ended[0]
        self._publish(p, x.setup.model.num_layers)

    def _on_fill_stream(self):
        return torch.cuda.stream(self.fill_stream) if self.fill_stream is not None else contextlib.nullcontext()

    def _in_step(self, req) -> bool:
        """Wait until every ctx rank of this rank's (dp, pp) group that sends some of the request has
        written its share (a real prefill's collectives end it together on every TP rank); whether there were
        such peers to wait for."""
        x = self.x
        side = x.setup.ctx
        if side.ranks_tp * side.cp == 1:  # the TP and CP ranks of a stage end a prefill together
            return False
        me = side.coord(x.rank)
        peers = [r for r in self.senders[req.id] if r != x.rank and side.coord(r).dp == me.dp
                 and side.coord(r).pp == me.pp]  # only ranks that send some of it prefill it (MLA: maybe one)
        if not peers:
            return False
        key = f"prefill/{req.id}/{me.dp}/{me.pp}"
        store = dist.distributed_c10d._get_default_store()
        timeout = x.setup.transfer.timeout_s
        try:  # a frozen store host never answers: the add alone would wait forever
            count = call_within(store.add, key, 1, timeout_s=timeout, what="the store's host (rank 0)")
        except (TimeoutError, RuntimeError) as e:
            raise ChunkFailed(f"request {req.id}: tensor-parallel peers' prefill not counted: {e}", req.id) from e
        if count == len(peers) + 1:
            store.set(key + "/all", "1")
            return True
        deadline = time.time() + timeout
        while True:  # in short waits: a stopped loop must not leave this thread behind
            try:
                store.wait([key + "/all"], datetime.timedelta(seconds=min(1.0, max(0.01, deadline - time.time()))))
                return True
            except RuntimeError as e:  # this wait's deadline passed, or the store's host is gone
                if self.halt.is_set():
                    raise Halted() from e
                if time.time() > deadline:
                    raise ChunkFailed(f"request {req.id} with {'/'.join(f'ctx{r}' for r in peers)}: tensor-parallel "
                                      f"peers' prefill not done within {timeout:g} s", req.id) from e

    def _gpu(self, req, p: Progress) -> None:
        x, g = self.x, self.x.gpu_prefill
        last = self.held[-1]
        with torch.cuda.stream(g.stream), x.untracked():
            p.start = x.clock.mark()
            self._publish(p, 0)
            for layer in range(last + 1):
                if layer in x.held_layers:
                    self._lead()
                    g.layer(layer, req.isl)
                    if layer != x.faults.unwritten_layer:
                        x.cache.fill(req, x.ops, layer)
                    p.ready[layer] = x.clock.mark()
                    self.queued.append(p.ready[layer])
                if layer < last:
                    # published once queued: its chunks wait on the layer's event on the device, so a layer-wise
                    # transfer follows the GPU's prefill instead of starting after its last launch
                    self._publish(p, layer + 1)
            p.end = p.stepped = p.done = p.ready[last]
        self._publish(p, x.setup.model.num_layers)


    def _lead(self) -> None:
        """Keep at most LEAD layers queued ahead of the GPU. A launch into a full queue blocks in the driver
        with the interpreter's lock held, which would stall the transfer loop's thread for as long as the
        GPU takes to drain the queue (a whole prefill): this thread waits for the GPU instead, politely."""
        while len(self.queued) >= LEAD:
            e = self.queued[0]
            while not e.query():
                if self.halt.wait(LEAD_POLL_S):
                    raise Halted()
            self.queued.pop(0)


@contextlib.contextmanager
def running(prefiller: Prefiller | None):
    """The prefill thread for the duration of the transfer loop; stopped and joined however it ends."""
    if prefiller is None:
        yield None
        return
    prefiller.start()
    try:
        yield prefiller
    finally:
        prefiller.stop()
