"""CPU pack/unpack: gathers and scatters of whole rows, close to the speed of ``copy_``.

The runs of a rectangle (``kvlab.layout.runs``) are cut into rows of one *unit*: the
largest size dividing every run's length, every run's offset inside its block and the
block stride. The pool is then a [rows, unit] matrix and pack is one ``index_select`` of
row numbers, unpack one row scatter; the wire is the same rows back to back. The
unit is a run or a large share of one in practice (a tile of token rows: KiBs), and the
rows are viewed as the widest integer the unit and the buffers' alignment allow.

The row numbers of a chunk split into a part fixed by the chunk's shape and a part
fixed by its blocks: the first is computed once per shape (``_template``, cached), the
second is one gather of the block table per chunk. ``kvlab.ops.reference`` stays the
definition of correct; tests compare the two on random rectangles and layouts.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from kvlab.layout import Rect, runs
from kvlab.ops.reference import check_buffers
from kvlab.state import RankPool

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class _Template:
    unit: int  # bytes per row
    rows: torch.Tensor  # int64 [n]: pool row of each wire row if the rect's blocks were 0, 1, 2, ...
    block: torch.Tensor  # int64 [n]: block of each wire row, relative to the rect's first block
    block_rows: int  # rows per block stride


def _shape(pool: RankPool, rect: Rect) -> tuple[Rect, int]:
    """(the rect moved to start in block 0, its first logical block): chunks that differ only by
    whole blocks share one template."""
    first = rect.t0 // pool.tokens_per_block
    shift = first * pool.tokens_per_block
    return replace(rect, pool="", t0=rect.t0 - shift, t1=rect.t1 - shift), first


@functools.lru_cache(maxsize=64)  # a segment's chunks share one or two shapes; rows can be MiBs
def _template(pool: RankPool, num_blocks: int, shape: Rect) -> _Template:
    tpb, T = pool.tokens_per_block, shape.tile
    n_blocks = (shape.t1 - 1) // tpb + 1
    r = runs(pool, num_blocks, shape, torch.arange(n_blocks, dtype=torch.int64), 0)
    # block of each run: runs come tile by tile, n_layers * components * heads per tile
    u = torch.arange(shape.t0 // T, (shape.t1 - 1) // T + 1, dtype=torch.int64)
    tile_block = torch.clamp(u * T, min=shape.t0) // tpb
    per_tile = r.length.numel() // u.numel()
    block = tile_block.repeat_interleave(per_tile)
    bs = pool.strides(num_blocks)[0]
    rel = r.mem - block * bs
    unit = functools.reduce(math.gcd, torch.cat([r.length, rel]).unique().tolist(), bs)
    n = r.length // unit
    starts = torch.cumsum(n, 0) - n
    total = int(n.sum())
    within = torch.arange(total, dtype=torch.int64) - starts.repeat_interleave(n)
    rows = (rel // unit).repeat_interleave(n) + within
    return _Template(unit, rows, block.repeat_interleave(n), bs // unit)


def _rows(pool: RankPool, num_blocks: int, rect: Rect, block_ids: torch.Tensor, block_base: int
          ) -> tuple[int, torch.Tensor]:
    shape, first = _shape(pool, rect)
    t = _template(pool, num_blocks, shape)
    ids = block_ids[first - block_base:].to(torch.int64)
    return t.unit, t.rows + ids[t.block] * t.block_rows


def _matrices(pool_bytes: torch.Tensor, buf: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, unit] views of the pool and the wire buffer, as wide integers where both are aligned."""
    size, dtype = next((n, d) for n, d in _WIDE
                       if unit % n == 0 and pool_bytes.data_ptr() % n == 0 and buf.data_ptr() % n == 0)
    n = pool_bytes.numel() // unit * unit  # every run ends inside this prefix: its end is a multiple of unit
    pool_m = pool_bytes[:n].view(dtype).view(-1, unit // size)
    return pool_m, buf.view(dtype).view(-1, unit // size)


def pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out) -> None:
    check_buffers(pool_bytes, pool, num_blocks, rect, out)
    unit, rows = _rows(pool, num_blocks, rect, block_ids, block_base)
    pool_m, wire_m = _matrices(pool_bytes, out, unit)
    torch.index_select(pool_m, 0, rows, out=wire_m)


def unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes) -> None:
    check_buffers(pool_bytes, pool, num_blocks, rect, wire_buf)
    unit, rows = _rows(pool, num_blocks, rect, block_ids, block_base)
    pool_m, wire_m = _matrices(pool_bytes, wire_buf, unit)
    # numpy's row scatter copies whole rows; torch's index_copy_ ran at half its speed on rows of KiBs
    pool_m.numpy()[rows.numpy()] = wire_m.numpy()
