"""Staging memory: a fixed pool of slots allocated once at start, or the naive per-chunk buffers.

Nothing in the transfer path allocates after start except the naive baseline, whose buffer
per chunk is as large as its segment by design; ``peak_bytes`` shows the difference.
"""
from __future__ import annotations

import torch


class SlotPool:
    def __init__(self, slots: int, slot_bytes: int, device: torch.device):
        self.slots, self.slot_bytes = slots, slot_bytes
        # written once now, so its pages are mapped at start: on CPUs an untouched page costs a fault and
        # a zeroing the first time a chunk or a reference message lands in it, inside the clock
        self.storage = torch.zeros(slots * slot_bytes, dtype=torch.uint8, device=device)
        self.peak_bytes = self.storage.numel()

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.slot_bytes:
            raise ValueError(f"chunk of {nbytes} B does not fit a {self.slot_bytes} B slot")
        start = (index % self.slots) * self.slot_bytes
        return self.storage[start:start + nbytes]

    def put(self, buf: torch.Tensor) -> None:
        del buf


class PerChunkBuffers:
    """The naive baseline: one buffer per chunk, sized to it, freed when the chunk is done."""

    def __init__(self, device: torch.device):
        self.device = device
        self.live = 0
        self.peak_bytes = 0

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        del index
        self.live += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def put(self, buf: torch.Tensor) -> None:
        self.live -= buf.numel()
