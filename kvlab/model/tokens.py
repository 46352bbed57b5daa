"""Which of a request's tokens one rank holds, and where they lie in its blocks (context parallelism).

Three ways a side splits a request's tokens over ranks, the engines' own:

- ``all``: no split; token ``t`` is position ``t`` of the rank's blocks.
- ``contiguous`` (TensorRT-LLM context parallelism, the prefill side, ``ctx.cp``): the prompt cut into
  ``cp`` consecutive chunks, rank ``r`` holding chunk ``r``.
- ``load_balanced`` (ring attention's zig-zag, Megatron's and TensorRT-LLM's load-balanced split): the prompt
  cut into ``2*cp`` chunks, rank ``r`` holding chunks ``r`` and ``2*cp-1-r``, so that under causal attention
  every rank computes about as much.

  In both, a chunk boundary falls on a multiple of the prefill's ``tokens_per_block`` (``align``): the chunks
  take whole blocks as evenly as they go (earlier chunks the extra block), the last one the prompt's partial
  tail. A CP rank keeps its tokens at their own positions: its block table names a physical block only for the
  logical blocks of its chunks (the others are never read: ``HOLE``), so a prefill rank's addressing is the
  undivided rank's and only its memory shrinks.
- ``interleaved`` (vLLM's decode context parallelism, the decode side, ``gen.dcp``): runs of ``interleave``
  tokens dealt round-robin over the ``dcp`` ranks, rank ``d`` holding the tokens with ``(t // I) % dcp == d``,
  stored back to back (*local* position ``u = (t // (I*dcp)) * I + t % I``) in blocks of ``tokens_per_block``:
  one vLLM *virtual block* of ``tokens_per_block * dcp`` tokens is one block on each DCP rank, which is why vLLM
  requires ``tokens_per_block % interleave == 0``.

A segment aimed at a DCP rank counts its tokens in that rank's local positions (``kvlab.model.layout.Rect.local``),
so that the gen pool is addressed as an undivided one, and the prefill side maps them back to global tokens
(``to_global``) to find them; a wire tile divides ``interleave``, so a tile's tokens are consecutive on both sides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEMES = ("contiguous", "load_balanced")
HOLE = -1  # a block-table entry of a logical block the rank holds no token of (never read or written)


@dataclass(frozen=True)
class Tokens:
    kind: str = "all"  # all | contiguous | load_balanced | interleaved
    ranks: int = 1  # cp or dcp
    rank: int = 0  # this rank's cp or dcp index
    interleave: int = 1  # interleaved: tokens per run
    align: int = 1  # contiguous / load_balanced: chunk boundaries fall on multiples of this (the block size)

    @property
    def local(self) -> tuple[int, int, int] | None:
        """(dcp, dcp rank, interleave) of a side whose rectangles count local positions; None: global ones."""
        return (self.ranks, self.rank, self.interleave) if self.kind == "interleaved" else None

    def chunks(self, isl: int) -> list[tuple[int, int]]:
        """The global token intervals this rank holds, ascending, none empty (interleaved: every token it holds
        lies in [0, isl), use ``count``)."""
        if self.kind in ("all", "interleaved"):
            return [(0, isl)]
        n = 2 * self.ranks if self.kind == "load_balanced" else self.ranks
        mine = [self.rank] if self.kind == "contiguous" else [self.rank, n - 1 - self.rank]
        spans = [(boundary(isl, n, self.align, i), boundary(isl, n, self.align, i + 1)) for i in sorted(mine)]
        return [(a, b) for a, b in spans if a < b]

    def count(self, isl: int) -> int:
        """Tokens of an ``isl``-token prompt this rank holds."""
        if self.kind == "interleaved":
            return self.local_ceil(isl)
        return sum(b - a for a, b in self.chunks(isl))

    def local_ceil(self, t: int) -> int:
        """Interleaved: how many of this rank's tokens lie below global token ``t`` (its local position of the
        first one at or after ``t``)."""
        period = self.interleave * self.ranks
        return t // period * self.interleave + min(max(t % period - self.rank * self.interleave, 0), self.interleave)

    def to_global(self, u: torch.Tensor) -> torch.Tensor:
        """Interleaved: the global tokens of local positions ``u``."""
        i = self.interleave
        return u // i * (i * self.ranks) + self.rank * i + u % i


def boundary(isl: int, n: int, align: int, i: int) -> int:
    """Boundary ``i`` (0..n) of ``n`` chunks of an ``isl``-token prompt, each a whole number of ``align``-token
    blocks but the last one's tail, earlier chunks taking the extra block; in closed form, so that a rank's chunks
    cost the same whatever the number of ranks."""
    base, extra = divmod(math.ceil(isl / align), n)
    return min(isl, (i * base + min(i, extra)) * align)


def to_global(local: tuple[int, int, int] | None, u: torch.Tensor) -> torch.Tensor:
    """Global tokens of a rectangle's positions ``u`` (``Rect.local``; None: they are global already)."""
    if local is None:
        return u
    return Tokens("interleaved", local[0], local[1], local[2]).to_global(u)
