"""CPU pack/unpack: gathers and scatters of whole rows, close to the speed of ``copy_``.

The runs of a rectangle (``kvlab.model.layout.runs``) are cut into rows of one *unit*: the
largest size dividing every run's length, every run's offset inside its block and the
block stride. The pool is then a [rows, unit] matrix and pack is one ``index_select`` of
row numbers, unpack one row scatter; the wire is the same rows back to back. The
unit is a run or a large share of one in practice (a tile of token rows: KiBs), and the
rows are viewed as the widest integer the unit and the buffers' alignment allow.

The row numbers of a chunk split into a part fixed by the chunk's shape and a part
fixed by its blocks: the first is computed once per shape (``_template``, cached), the
second is one gather of the block table per chunk. ``kvlab.memory.ops.reference`` stays the
definition of correct; tests compare the two on random rectangles and layouts.

``copy_rect`` (``transport=ipc``: one pool straight into another) uses both sides' templates,
at a unit that divides both: a row gather from the source pool into a scratch piece that
stays in cache, and a row scatter from there into the destination pool.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from kvlab.memory.ops import convert
from kvlab.memory.ops.reference import check_buffers, check_rect_pair
from kvlab.model.layout import Rect, as_stored, converts, runs
from kvlab.model.state import RankPool, pool_format

_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
_PIECE_BYTES = 1 << 20  # copy_rect moves rows through a scratch piece of this size: it stays in L2
_DIRECT_ROW_BYTES = 256 << 10  # rows at least this long are copied one by one, with no scratch (<= the piece)


@dataclass(frozen=True)
class _Template:
    unit: int  # bytes per row
    rows: torch.Tensor  # int64 [n]: pool row of each wire row if the rect's blocks were 0, 1, 2, ...
    block: torch.Tensor  # int64 [n]: block of each wire row, relative to the rect's first block
    block_rows: torch.Tensor  # int64 [n]: rows per block stride of each wire row's component


def _shape(pool: RankPool, rect: Rect) -> tuple[Rect, int]:
    """(the rect moved to start in block 0, its first logical block): chunks that differ only by
    whole blocks share one template."""
    first = rect.t0 // pool.tokens_per_block
    shift = first * pool.tokens_per_block
    return replace(rect, pool="", t0=rect.t0 - shift, t1=rect.t1 - shift), first


@functools.lru_cache(maxsize=64)  # a segment's chunks share one or two shapes; rows can be MiBs
def _template(pool: RankPool, num_blocks: int, shape: Rect) -> _Template:
    tpb = pool.tokens_per_block
    n_blocks = (shape.t1 - 1) // tpb + 1
    ar = torch.arange(n_blocks, dtype=torch.int64)
    # each run's block and its component's block stride, from where it lands for three block tables
    # (the runs' count and order do not depend on the table; their strides differ by layout and component)
    r = runs(pool, num_blocks, shape, ar, 0)
    one = runs(pool, num_blocks, shape, ar + 1, 0).mem - r.mem  # the block stride of each run
    block = (runs(pool, num_blocks, shape, 2 * ar + 1, 0).mem - r.mem - one) // torch.clamp(one, min=1)
    rel = r.mem - block * one
    unit = functools.reduce(math.gcd, torch.cat([r.length, rel, one]).unique().tolist())
    n = r.length // unit
    starts = torch.cumsum(n, 0) - n
    total = int(n.sum())
    within = torch.arange(total, dtype=torch.int64) - starts.repeat_interleave(n)
    rows = (rel // unit).repeat_interleave(n) + within
    return _Template(unit, rows, block.repeat_interleave(n), (one // unit).repeat_interleave(n))


def _rows(pool: RankPool, num_blocks: int, rect: Rect, block_ids: torch.Tensor, block_base: int
          ) -> tuple[int, torch.Tensor]:
    if rect.local != pool.tokens.local:
        # a DCP rank's positions on the prefill side: its tiles lie at strided global tokens, so the rows do not
        # move with the first block alone; the runs give them for this table
        r = runs(pool, num_blocks, rect, block_ids.to(torch.int64), block_base)
        unit = functools.reduce(math.gcd, torch.cat([r.length, r.mem]).unique().tolist())
        n = r.length // unit
        within = torch.arange(int(n.sum()), dtype=torch.int64) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
        return unit, (r.mem // unit).repeat_interleave(n) + within
    shape, first = _shape(pool, rect)
    t = _template(pool, num_blocks, shape)
    ids = block_ids[first - block_base:].to(torch.int64)
    return t.unit, t.rows + ids[t.block] * t.block_rows


def _word(unit: int, *bufs: torch.Tensor) -> tuple[int, torch.dtype]:
    """The widest integer that divides the unit and to which every buffer is aligned."""
    return next((n, d) for n, d in _WIDE if unit % n == 0 and all(b.data_ptr() % n == 0 for b in bufs))


def _as_rows(buf: torch.Tensor, unit: int, word: tuple[int, torch.dtype]) -> torch.Tensor:
    n = buf.numel() // unit * unit  # every run ends inside this prefix: its end is a multiple of unit
    return buf[:n].view(word[1]).view(-1, unit // word[0])


def _matrices(pool_bytes: torch.Tensor, buf: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, unit] views of the pool and the wire buffer, as wide integers where both are aligned."""
    word = _word(unit, pool_bytes, buf)
    return _as_rows(pool_bytes, unit, word), _as_rows(buf, unit, word)


def pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out) -> None:
    if converts(pool, rect):
        return convert.pack(pack, pool_bytes, pool, num_blocks, rect, block_ids, block_base, out)
    check_buffers(pool_bytes, pool, num_blocks, rect, out)
    unit, rows = _rows(pool, num_blocks, rect, block_ids, block_base)
    pool_m, wire_m = _matrices(pool_bytes, out, unit)
    torch.index_select(pool_m, 0, rows, out=wire_m)


def unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes) -> None:
    if converts(pool, rect):
        return convert.unpack(unpack, wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes)
    check_buffers(pool_bytes, pool, num_blocks, rect, wire_buf)
    unit, rows = _rows(pool, num_blocks, rect, block_ids, block_base)
    pool_m, wire_m = _matrices(pool_bytes, wire_buf, unit)
    # numpy's row scatter copies whole rows; torch's index_copy_ ran at half its speed on rows of KiBs
    pool_m.numpy()[rows.numpy()] = wire_m.numpy()


_scratch: torch.Tensor | None = None  # copy_rect's piece, allocated once per process


def _split(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of one unit as rows of a ``k`` times smaller one: each becomes ``k`` consecutive rows."""
    return rows if k == 1 else (rows[:, None] * k + torch.arange(k, dtype=torch.int64)).reshape(-1)


def copy_rect(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool, dst_num_blocks, dst_ids,
              dst_base, rect) -> None:
    """``rect`` straight from one pool into another (see ``kvlab.memory.ops``), in rows of a unit that divides both
    sides' row templates: per chunk two block-table gathers, no run computation, never an index per byte."""
    if pool_format(src_pool.spec) != pool_format(dst_pool.spec):  # another KV dtype: converted in the copy
        return convert.copy_rect(pack, unpack, src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes,
                                 dst_pool, dst_num_blocks, dst_ids, dst_base, rect)
    rect = as_stored(rect)
    check_rect_pair(src_bytes, src_pool, src_num_blocks, dst_bytes, dst_pool, dst_num_blocks, rect)
    su, src_rows = _rows(src_pool, src_num_blocks, rect, src_ids, src_base)
    du, dst_rows = _rows(dst_pool, dst_num_blocks, rect, dst_ids, dst_base)
    unit = math.gcd(su, du)  # both templates list the wire's rows in order: at one unit, row i is row i
    _copy_rows(src_bytes, _split(src_rows, su // unit), dst_bytes, _split(dst_rows, du // unit), unit)


def _copy_rows(src_bytes: torch.Tensor, src_rows: torch.Tensor, dst_bytes: torch.Tensor, dst_rows: torch.Tensor,
               unit: int) -> None:
    global _scratch
    if unit >= _DIRECT_ROW_BYTES:  # few long rows: each one copy_, straight from pool to pool
        word = _word(unit, src_bytes, dst_bytes)
        src_m, dst_m = _as_rows(src_bytes, unit, word), _as_rows(dst_bytes, unit, word)
        for s, d in zip(src_rows.tolist(), dst_rows.tolist()):
            dst_m[d].copy_(src_m[s])
        return
    if _scratch is None or _scratch.numel() != _PIECE_BYTES:
        _scratch = torch.empty(_PIECE_BYTES, dtype=torch.uint8)
    word = _word(unit, src_bytes, dst_bytes, _scratch)
    src_m, dst_m, tmp = (_as_rows(b, unit, word) for b in (src_bytes, dst_bytes, _scratch))
    dst_np, tmp_np, dst_idx = dst_m.numpy(), tmp.numpy(), dst_rows.numpy()
    step = tmp.shape[0]
    for a in range(0, src_rows.numel(), step):
        m = min(step, src_rows.numel() - a)
        # the gather with torch, the scatter with numpy: each the faster of the two for rows of KiBs (see unpack)
        torch.index_select(src_m, 0, src_rows[a:a + m], out=tmp[:m])
        dst_np[dst_idx[a:a + m]] = tmp_np[:m]
