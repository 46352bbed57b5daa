"""Timestamps that do not stall the GPU: CUDA events on GPUs, wall time on CPUs.

Every rank starts its clock right after a barrier, so that times from different ranks of
one host share an epoch (``time.time()`` at that barrier); GPU events are turned into
seconds only once, after the run, with one synchronisation.

A GPU rank's epoch is its base event's wall time, and ranks' marks are compared (a layer landing on a gen
rank against its prefill's end on a ctx rank): the base event is bracketed by host times taken before its
record and after its completion, and the tightest of SYNC_TRIES brackets gives its midpoint. A single
``time.time()`` after the synchronisation was late by however long the process waited to run again: on a
loaded host 0.5 ms, which put a layer's landing before the layer was written.
"""
from __future__ import annotations

import time

import torch

SYNC_TRIES = 8


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.epoch = time.time()
        self.bracket_s = 0.0  # the epoch is the base event's wall time to within half of this
        if self.cuda:
            torch.cuda.synchronize(device)
            tries = []
            for _ in range(SYNC_TRIES):
                e = torch.cuda.Event(enable_timing=True)
                before = time.time()
                e.record()
                torch.cuda.synchronize(device)
                after = time.time()
                tries.append((after - before, (before + after) / 2, e))
            self.bracket_s, self.epoch, self.base = min(tries, key=lambda t: t[0])

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
        """Absolute wall time of a mark; call after the device work it follows has finished."""
        if isinstance(mark, float):
            return mark
        return self.epoch + self.base.elapsed_time(mark) / 1e3

    def span(self, a, b) -> float:
        return self.seconds(b) - self.seconds(a)


def launches_s(fn, iters: int = 1) -> float:
    """Seconds per call of ``fn`` called ``iters`` times back to back: on a GPU from CUDA events recorded around
    the calls on the current stream (the device's time for the work they queue, not the host's time to queue it),
    on a CPU from the wall clock. The benchmarks' one timer (scripts/*_bench.py)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
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
