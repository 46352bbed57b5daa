"""Each request's transfer as the run's own plan: bytes, chunks and staged bytes per (ctx rank, gen rank).

``kvlab.model.plan.plan`` and ``kvlab.model.schedule.schedule`` are run exactly, for the first DP group of each side,
at a grid of prompt lengths: every distinct length when there are few (a kvlab run's replay: exact),
else ``GRID`` lengths spaced geometrically over the workload's range plus every sliding window's size,
where a pool's bytes stop growing. Between grid points each pair's figures are interpolated linearly:
a full-attention pool's bytes are linear in the prompt, so they are exact up to the tile rounding; a
chunk count is a step function that the line follows to within one chunk per grid interval.

An in-place decision (strategy trait ``in_place``) needs the cache states of both sides for every
chunk, slow on large prompts: it is decided exactly at prompts up to ``PROBE_TOKENS``; above, the
chunks are cut as they would be and the share of bytes that went in place at the largest such prompt
is applied (the shapes decide it, not the length).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvlab.config.schema import Setup
from kvlab.model.plan import Request, plan
from kvlab.model.schedule import schedule

GRID = 14
EXACT_BELOW = 48  # distinct prompt lengths planned one by one
PROBE_TOKENS = 4096


@dataclass
class PlanTable:
    """Per request (rows) and pair (columns, ``pairs``): bytes, pieces (chunks) and staged bytes."""

    pairs: list[tuple[int, int]]  # (ctx rank, gen rank) within DP group 0 of each side
    bytes: np.ndarray
    pieces: np.ndarray
    staged: np.ndarray
    kv_token_bytes: float  # cache bytes per prompt token on the gen side, all of one DP group's ranks

    def per_src(self, values: np.ndarray, ranks: int) -> np.ndarray:
        """``values`` (requests x pairs) summed per ctx rank: requests x ranks."""
        out = np.zeros((values.shape[0], ranks))
        for k, (s, _) in enumerate(self.pairs):
            out[:, s] += values[:, k]
        return out

    def per_dst(self, values: np.ndarray, ranks: int) -> np.ndarray:
        out = np.zeros((values.shape[0], ranks))
        for k, (_, d) in enumerate(self.pairs):
            out[:, d] += values[:, k]
        return out


def _one(setup: Setup, isl: int, pulls: bool, in_place_share: float | None) -> dict:
    strategy = setup.transfer.strategy
    if in_place_share is not None:
        strategy = dataclasses.replace(strategy, in_place=False)
    segs = plan(setup.model, setup.ctx, setup.gen, Request(0, int(isl)))
    chunks = schedule(setup.model, setup.ctx, setup.gen, segs, strategy, setup.chunk_cap)
    out: dict[tuple[int, int], list[float]] = {}
    for c in chunks:
        row = out.setdefault((c.src, c.dst), [0.0, 0.0, 0.0])
        row[0] += c.nbytes
        row[1] += 1
        if not pulls:  # a pulling transport copies straight from pool to pool: nothing is staged
            row[2] += c.nbytes * ((not c.ctx_in_place) + (not c.gen_in_place)) / 2
    if in_place_share is not None and not pulls:
        for row in out.values():
            row[2] = row[0] * (1 - in_place_share)
    return out


def grid_for(isls: np.ndarray, setup: Setup) -> list[int]:
    distinct = np.unique(isls)
    if len(distinct) <= EXACT_BELOW:
        return [int(x) for x in distinct]
    lo, hi = int(distinct[0]), int(distinct[-1])
    pts = set(np.unique(np.geomspace(lo, hi, GRID).round().astype(int)).tolist()) | {lo, hi}
    pts |= {w for w in {setup.model.layer_window(i) for i in range(setup.model.num_layers)} if lo < w < hi}
    return sorted(pts)


def build(setup: Setup, isls, check: Callable[[float], None] | None = None) -> PlanTable:
    """The table of prompts ``isls``; ``check``, given, is called first with the gen side's cache bytes per prompt
    token of the largest prompt, from its plan's segments (``kv_token_bytes``), before any prompt is cut into chunks:
    kvlab sim refuses there a request that no decode group can hold, instead of after the whole table."""
    isls = np.asarray(isls, dtype=float)
    pulls = setup.transport.cls().pulls
    grid = grid_for(isls, setup)
    if check is not None:  # the plan's segments hold its bytes; cutting them into chunks is the long part
        segs = plan(setup.model, setup.ctx, setup.gen, Request(0, grid[-1]))
        check(sum(seg.nbytes for seg in segs) / grid[-1])
    share = None
    if setup.transfer.strategy.in_place and grid[-1] > PROBE_TOKENS:
        probe = _one(setup, min(PROBE_TOKENS, grid[-1]), pulls, None)
        moved = sum(r[0] for r in probe.values())
        staged = sum(r[2] for r in probe.values())
        share = 1 - staged / moved if moved else 0.0
    rows = [_one(setup, g, pulls, share if g > PROBE_TOKENS else None) for g in grid]
    pairs = sorted({p for r in rows for p in r})
    table = np.zeros((3, len(grid), len(pairs)))
    for i, r in enumerate(rows):
        for k, p in enumerate(pairs):
            table[:, i, k] = r.get(p, (0.0, 0.0, 0.0))
    gx = np.asarray(grid, dtype=float)
    cols = [np.stack([np.interp(isls, gx, table[f, :, k]) for k in range(len(pairs))], axis=1)
            if pairs else np.zeros((len(isls), 0)) for f in range(3)]
    per_token = table[0, -1].sum() / grid[-1] if pairs else 0.0
    return PlanTable(pairs, cols[0], np.round(cols[1]), cols[2], per_token)
