"""Torch reference for pack/unpack: gathers and scatters of the runs ``kvlab.model.layout.runs`` defines."""
from __future__ import annotations

import torch

from kvlab.memory.ops import convert
from kvlab.model.layout import Rect, Runs, as_stored, converts, runs
from kvlab.model.state import RankPool, pool_format


def check_buffers(pool_bytes: torch.Tensor, pool: RankPool, num_blocks: int, rect: Rect, buf: torch.Tensor) -> None:
    if pool_bytes.dtype != torch.uint8 or buf.dtype != torch.uint8:
        raise TypeError("pack/unpack work on uint8 tensors")
    if pool_bytes.numel() != pool.pool_bytes(num_blocks):
        raise ValueError(f"pool {pool.name}: storage has {pool_bytes.numel()} bytes, layout needs "
                         f"{pool.pool_bytes(num_blocks)}")
    need = rect.nbytes(pool.rows)
    if buf.numel() != need:
        raise ValueError(f"pool {pool.name}: wire buffer has {buf.numel()} bytes, the rectangle needs {need}")
    if not buf.is_contiguous() or not pool_bytes.is_contiguous():
        raise ValueError("pack/unpack need contiguous tensors")


def _byte_index(r: Runs):
    """(memory index, wire index) per byte, grouped by run length so that each group is one 2-D gather."""
    for n in torch.unique(r.length).tolist():
        sel = r.length == n
        ar = torch.arange(n, device=r.mem.device)
        yield (r.mem[sel][:, None] + ar).reshape(-1), (r.wire[sel][:, None] + ar).reshape(-1)


def pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out) -> None:
    if converts(pool, rect):
        return convert.pack(pack, pool_bytes, pool, num_blocks, rect, block_ids, block_base, out)
    check_buffers(pool_bytes, pool, num_blocks, rect, out)
    for mem, wire in _byte_index(runs(pool, num_blocks, rect, block_ids, block_base)):
        out.index_copy_(0, wire, pool_bytes.index_select(0, mem))  # far faster than advanced indexing on CPU


def unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes) -> None:
    if converts(pool, rect):
        return convert.unpack(unpack, wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes)
    check_buffers(pool_bytes, pool, num_blocks, rect, wire_buf)
    for mem, wire in _byte_index(runs(pool, num_blocks, rect, block_ids, block_base)):
        pool_bytes.index_copy_(0, mem, wire_buf.index_select(0, wire))


def check_rect_pair(src_bytes: torch.Tensor, src_pool: RankPool, src_num_blocks: int, dst_bytes: torch.Tensor,
                    dst_pool: RankPool, dst_num_blocks: int, rect: Rect) -> None:
    """Both pools hold ``rect`` (one model's pool, the same row sizes) and are whole uint8 storages."""
    if src_bytes.dtype != torch.uint8 or dst_bytes.dtype != torch.uint8:
        raise TypeError("copy_rect works on uint8 tensors")
    if src_pool.rows != dst_pool.rows:
        raise ValueError(f"copy_rect: the pools' rows differ ({src_pool.rows} and {dst_pool.rows}): not one pool kind")
    for what, b, pool, nb in (("source", src_bytes, src_pool, src_num_blocks),
                              ("destination", dst_bytes, dst_pool, dst_num_blocks)):
        if b.numel() != pool.pool_bytes(nb) or not b.is_contiguous():
            raise ValueError(f"copy_rect: the {what} storage has {b.numel()} bytes, its layout needs "
                             f"{pool.pool_bytes(nb)} contiguous ones")
    for what, pool in (("source", src_pool), ("destination", dst_pool)):
        if rect.tile <= 0 or pool.tokens_per_block % rect.tile:
            raise ValueError(f"copy_rect: tile {rect.tile} does not divide the {what}'s tokens_per_block "
                             f"{pool.tokens_per_block}")


def _wire_bytes(r: Runs) -> torch.Tensor:
    """The memory index of every byte of the runs, in wire order (runs come in wire order, back to back)."""
    start = torch.repeat_interleave(r.mem, r.length)
    within = torch.arange(start.numel(), device=start.device) - torch.repeat_interleave(
        torch.cumsum(r.length, 0) - r.length, r.length)
    return start + within


def copy_runs(src_bytes: torch.Tensor, src: Runs, dst_bytes: torch.Tensor, dst: Runs) -> None:
    """The wire bytes of ``src`` into the same wire bytes of ``dst``: one rectangle straight from one pool into
    another. Runs of one rectangle share wire offsets and lengths where both layouts keep token rows
    together; where one cuts them into single rows, the bytes are matched by wire offset."""
    if int(src.length.sum()) != int(dst.length.sum()):
        raise ValueError("copy_runs: the two sides' runs are not of one rectangle")
    if not (torch.equal(src.wire, dst.wire) and torch.equal(src.length, dst.length)):
        dst_bytes.index_copy_(0, _wire_bytes(dst), src_bytes.index_select(0, _wire_bytes(src)))
        return
    for (src_mem, _), (dst_mem, _) in zip(_byte_index(src), _byte_index(dst)):  # equal lengths: equal groups
        dst_bytes.index_copy_(0, dst_mem, src_bytes.index_select(0, src_mem))


def copy_rect(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool, dst_num_blocks, dst_ids,
              dst_base, rect) -> None:
    """``rect`` straight from one pool into another (``transport=ipc``): the runs of both sides, then
    ``copy_runs``."""
    if pool_format(src_pool.spec) != pool_format(dst_pool.spec):  # another KV dtype: converted in the copy
        return convert.copy_rect(pack, unpack, src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes,
                                 dst_pool, dst_num_blocks, dst_ids, dst_base, rect)
    rect = as_stored(rect)
    check_rect_pair(src_bytes, src_pool, src_num_blocks, dst_bytes, dst_pool, dst_num_blocks, rect)
    copy_runs(src_bytes, runs(src_pool, src_num_blocks, rect, src_ids, src_base),
              dst_bytes, runs(dst_pool, dst_num_blocks, rect, dst_ids, dst_base))
