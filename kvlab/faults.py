"""Fault injection (``fault:`` in the config): a rank that dies, stalls or freezes at a chosen chunk, bytes
flipped in flight, and a layer the prefill never writes (what a chunk sent before its layer was
computed would carry), so that tests can show that failures end cleanly and corruption is caught.

Positions are given in one rank's own terms: its chunks are the chunks it sends (ctx) or
receives (gen), in the global order (kvlab.workload.interleave); its byte stream is their
messages laid end to end in that order. ``check`` names a position past the end of that
stream before anything is allocated.
"""
from __future__ import annotations

import bisect
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

from kvlab.errors import ConfigError
from kvlab.schedule import Chunk
from kvlab.spec import FaultSpec
from kvlab.workload import chunks_of

KILLED_EXIT = 3  # exit code of a rank killed by fault.kill_rank: neither success (0), failure (1) nor bad config (2)


@dataclass
class RankFaults:
    kill_at: int = -1
    stall_at: int = -1
    stall_s: float = 0.0
    freeze_at: int = -1
    flips: dict[int, list[int]] = field(default_factory=dict)  # chunk index -> byte offsets inside its message
    unwritten_layer: int = -1  # a ctx rank's prefill skips writing this layer: as if its chunks left too early

    def before_post(self, index: int) -> None:
        if index == self.kill_at:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(KILLED_EXIT)  # no cleanup, no report: as abrupt as a crash
        if index == self.stall_at:
            time.sleep(self.stall_s)
        if index == self.freeze_at:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGSTOP)  # until someone resumes or kills it

    def flip(self, index: int, buf: torch.Tensor) -> list[int]:
        """Invert the chosen bytes of chunk ``index``'s message in ``buf``; returns the offsets flipped."""
        offsets = self.flips.get(index, [])
        for j in offsets:
            buf[j:j + 1].bitwise_xor_(0xFF)
        return offsets


def locate_flip(chunks: list[Chunk], offset: int) -> tuple[int, int]:
    """(chunk index, byte inside its message) of byte ``offset`` of a rank's stream."""
    starts, acc = [], 0
    for c in chunks:
        starts.append(acc)
        acc += c.nbytes
    if not chunks or offset >= acc:
        raise IndexError(offset)
    i = bisect.bisect_right(starts, offset) - 1
    return i, offset - starts[i]


def check(setup, order: list[Chunk]) -> None:
    """ConfigError for a fault position the run never reaches (the same on every rank)."""
    f = setup.fault
    for name in ("kill", "stall", "freeze"):
        r, at = getattr(f, f"{name}_rank"), getattr(f, f"{name}_at_chunk")
        if r >= 0:
            n = len(chunks_of(order, setup, r))
            if at >= n:
                raise ConfigError(f"fault.{name}_at_chunk", at, f"rank {r} takes part in {n} chunks; use 0..{n - 1}")
    if f.flip_rank >= 0:
        mine = chunks_of(order, setup, f.flip_rank)
        total = sum(c.nbytes for c in mine)
        bad = [x for x in f.flip_at if x >= total]
        if bad:
            raise ConfigError("fault.flip_at", list(f.flip_at),
                              f"rank {f.flip_rank} moves {total} bytes; offsets must be below that ({bad} are not)")


def for_rank(f: FaultSpec, world_rank: int, mine: list[Chunk]) -> RankFaults:
    out = RankFaults(unwritten_layer=f.unwritten_layer)  # only a ctx rank's prefill writes layers
    if f.kill_rank == world_rank:
        out.kill_at = f.kill_at_chunk
    if f.stall_rank == world_rank:
        out.stall_at, out.stall_s = f.stall_at_chunk, float(f.stall_s)
    if f.freeze_rank == world_rank:
        out.freeze_at = f.freeze_at_chunk
    if f.flip_rank == world_rank:
        for x in f.flip_at:
            i, j = locate_flip(mine, x)
            out.flips.setdefault(i, []).append(j)
    return out
