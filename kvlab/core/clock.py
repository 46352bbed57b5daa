"""Timestamps that do not stall the GPU: CUDA events on GPUs, wall time on CPUs.

Every rank starts its clock right after a barrier, so that times from different ranks of
one host share an epoch (``time.time()`` at that barrier); GPU events are turned into
seconds only once, after the run, with one synchronisation.
"""
from __future__ import annotations

import time

import torch


class Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()
            torch.cuda.synchronize(device)
        self.epoch = time.time()

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
