"""Extra device memory counts the transfer's allocations only: what fill and verification allocate, and keep,
stays out of every later peak (kvlab.rank.executor.Executor.untracked). A fake allocator stands in for CUDA's."""
from __future__ import annotations

import types

import torch

from kvlab.rank.executor import Executor


class FakeAllocator:
    def __init__(self, base: int):
        self.allocated = self.peak = base

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n


def test_what_fill_keeps_is_not_the_transfers(monkeypatch):
    mem = FakeAllocator(base=1000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: mem.allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(mem, "peak", mem.allocated))
    ex = types.SimpleNamespace(device=torch.device("cuda", 0), transfer_peak=0, untracked_kept=0)
    ex.tracked_peak = lambda: Executor.tracked_peak(ex)
    untracked = lambda: Executor.untracked.__wrapped__(ex)  # noqa: E731 - the generator behind the context

    mem.alloc(10)  # a chunk's temporaries
    mem.free(10)
    for _ in range(2):  # two fills: the first keeps 16 (scratch, cached tables), both use 50 more for a while
        gen = untracked()
        next(gen)
        mem.alloc(66 if mem.allocated == 1000 else 50)
        mem.free(50)
        next(gen, None)
    mem.alloc(30)  # the transfer's own peak after the fills
    mem.free(30)
    extra = max(ex.transfer_peak, ex.tracked_peak()) - 1000
    assert ex.untracked_kept == 16
    assert extra == 30, extra  # 46 if the fills' 16 kept bytes counted
