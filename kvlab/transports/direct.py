"""What the transports that write pool to pool (nixl's and mooncake's ``mode=direct``) share: a chunk's runs
in a rank's pool as host arrays, neighbouring runs merged, and fault injection's flips where the bytes landed.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from kvlab.model.layout import runs
from kvlab.model.schedule import Chunk
from kvlab.transports import RankContext


def rank_runs(pool, num_blocks: int, c: Chunk, ids: torch.Tensor, base: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(memory offset, wire offset, length) of each run of chunk ``c`` in a pool laid out as ``pool`` with
    block table ``ids`` from logical block ``base``, in wire order."""
    r = runs(pool, num_blocks, c.rect, ids, base)
    return r.mem.cpu().numpy(), r.wire.cpu().numpy(), r.length.cpu().numpy()


def own_runs(ctx: RankContext, c: Chunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of chunk ``c`` in this rank's own pool."""
    store = ctx.cache.pools[c.rect.pool]
    table = ctx.cache.tables[c.request][c.rect.pool]
    return rank_runs(store.pool, store.num_blocks, c, torch.tensor(table.host), table.base)


def block_tables(ctx: RankContext, request: int) -> str:
    """This rank's block tables of a request, every pool: all a peer needs to address its chunks."""
    return json.dumps({name: [t.base, *t.host] for name, t in ctx.cache.tables[request].items()})


def pair_runs(src: np.ndarray, src_wire: np.ndarray, dst: np.ndarray, dst_wire: np.ndarray,
              dst_length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source, destination, length) of one chunk's writes between two layouts: the runs of the two sides are
    cut at different wire offsets when the layouts or block sizes differ (ctx block_major, gen layer_major of
    64-token blocks), so each write is cut wherever either side's run is; ``src``/``dst`` are each side's run
    starts, ``*_wire`` their wire offsets (both in wire order, covering the same bytes)."""
    if len(dst_length) == 0:
        return src[:0], dst[:0], dst_length
    total = int(dst_wire[-1] + dst_length[-1])
    cuts = np.union1d(src_wire, dst_wire)
    length = np.diff(np.append(cuts, total))
    ks = np.searchsorted(src_wire, cuts, side="right") - 1
    kd = np.searchsorted(dst_wire, cuts, side="right") - 1
    return src[ks] + (cuts - src_wire[ks]), dst[kd] + (cuts - dst_wire[kd]), length


def coalesce(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs in wire order, neighbours that continue each other on both sides merged into one."""
    if len(length) == 0:
        return src, dst, length
    brk = np.ones(len(length), dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + length[:-1]) | (dst[1:] != dst[:-1] + length[:-1])
    first = np.flatnonzero(brk)
    return src[first], dst[first], np.add.reduceat(length, first)


def flip_landed(ctx: RankContext, index: int, c: Chunk, buf: torch.Tensor | None) -> None:
    """Fault injection on a gen rank: chunk ``index``'s chosen bytes inverted where they landed, in its staging
    ``buf`` or, written straight into the pool (``buf`` None), at their wire offsets among its runs."""
    offsets = ctx.faults.flips.get(index, [])
    if not offsets:
        return
    if buf is not None:
        ctx.faults.flip(index, buf)
        return
    mem, wire, _ = own_runs(ctx, c)
    storage = ctx.cache.pools[c.rect.pool].storage
    for j in offsets:
        k = np.searchsorted(wire, j, side="right") - 1
        at = int(mem[k] + j - wire[k])
        storage[at:at + 1].bitwise_xor_(0xFF)
