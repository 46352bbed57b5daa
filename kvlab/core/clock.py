"""Timestamps that do not stall the GPU: CUDA events on GPUs, wall time on CPUs.

Every rank starts its clock right after a barrier, so that times from different ranks of
one host share an epoch (``time.time()`` at that barrier); GPU events are turned into
seconds only once, after the run, with one synchronisation.

A GPU rank's epoch is its base event's wall time, and ranks' marks are compared (a layer landing on a gen
rank against its prefill's end on a ctx rank): the base event is bracketed by host times taken before its
record and after its completion, and the tightest of SYNC_TRIES brackets gives its midpoint. A single
``time.time()`` after the synchronisation was late by however long the process waited to run again: on a
loaded host 0.5 ms, which put a layer's landing before the layer was written.

The GPU's timer and the host's clock do not tick at one rate: on one H100 the event timer fell behind the
host by about 30 us a second, so a gen rank's copy ending (an event) and a ctx rank's post (a host time) drew
closer by 0.16 ms a request, 5 s apart, until a request's time in flight read half its kernel's. ``settle``,
once the run's device work is done, brackets a second event the same way, and marks are placed on the line
through the two: within the wider bracket's half of the host's time, whatever the rate.
"""
from __future__ import annotations

import time

import torch

SYNC_TRIES = 8
MAX_RATE_ERROR = 1e-3


def _bracketed(device: torch.device) -> tuple[float, float, torch.cuda.Event]:
    """(width, midpoint, event): an event recorded on an idle device, and the host's time of it to within half
    of the width, the tightest of SYNC_TRIES tries."""
    torch.cuda.synchronize(device)
    tries = []
    for _ in range(SYNC_TRIES):
        e = torch.cuda.Event(enable_timing=True)
        before = time.time()
        e.record()
        torch.cuda.synchronize(device)
        after = time.time()
        tries.append((after - before, (before + after) / 2, e))
    return min(tries, key=lambda t: t[0])


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.epoch = time.time()
        self.bracket_s = 0.0  # the epoch is the base event's wall time to within half of this
        self.rate = 1.0  # host seconds per second of the device's timer, from settle
        if self.cuda:
            self.bracket_s, self.epoch, self.base = _bracketed(device)

    def settle(self) -> None:
        """Once the device work whose marks will be read is done: the timer's rate against the host's clock,
        from a second bracketed event (``bracket_s`` becomes the wider of the two)."""
        if not self.cuda:
            return
        width, at, end = _bracketed(self.device)
        elapsed = self.base.elapsed_time(end) / 1e3
        rate = (at - self.epoch) / elapsed if elapsed > 0 else 1.0
        # no two clocks' crystals differ by a thousandth: a rate beyond it is a wall clock set meanwhile, or
        # brackets as wide as a short run, and the timer's own rate is then the better guess
        if abs(rate - 1) <= MAX_RATE_ERROR:
            self.rate = rate
            self.bracket_s = max(self.bracket_s, width)

    def mark(self):
        """A timestamp of the work queued so far on the current stream (now, on CPUs)."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.time()

    def host(self) -> float:
        return time.time()

    def seconds(self, mark) -> float:
        """Absolute wall time of a mark; call after the device work it follows has finished (and ``settle``, for
        marks compared with another clock's or a host time)."""
        if isinstance(mark, float):
            return mark
        return self.epoch + self.base.elapsed_time(mark) / 1e3 * self.rate

    def span(self, a, b) -> float:
        return self.seconds(b) - self.seconds(a)


def launches_s(fn, iters: int = 1, gpu: bool | None = None) -> float:
    """Seconds per call of ``fn`` called ``iters`` times back to back: on a GPU from CUDA events recorded around
    the calls on the current stream (the device's time for the work they queue, not the host's time to queue it),
    on a CPU from the wall clock. ``gpu``: which of the two (None: events wherever CUDA is up). The benchmarks' one
    timer (scripts/*_bench.py), and the prefill's reference (kvlab.rank.prefill_gpu)."""
    if gpu is None:
        gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    if not gpu:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def median_launches_s(fn, iters: int = 1, trials: int = 5, warmup: int = 2) -> float:
    """The median over ``trials`` of ``launches_s``, after ``warmup`` calls (compiles, first-touch allocations)."""
    for _ in range(warmup):
        fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    times = sorted(launches_s(fn, iters) for _ in range(trials))
    return times[len(times) // 2]
