"""Pack, unpack and copy_rect where the wire carries another KV dtype than a pool (``Rect.wire``, kvlab.model.kv_dtype).

Each implementation (reference, cpu, cuda) calls these first thing when ``kvlab.model.layout.converts`` says so,
passing its own function (and ``rows_fn``, its form of kvlab.model.kv_dtype.convert_rows, where it has one: the
GPU's ``kernels/fp8_rows.cu``): the pool's rows move as that implementation moves them (through scratch pieces of
whole tiles, at most ``layout.CONVERT_PIECE`` bytes in the pool's format), and the rows are converted between
the piece and the wire on the buffers' device (in torch unless ``rows_fn`` says otherwise). The rounding is
kvlab.model.kv_dtype's. On GPUs this is the fallback: the CUDA ops convert in one pass (``kv_convert_rect``) wherever
kvlab.memory.ops.paths says the kernel takes the rows.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kvlab.model import kv_dtype, layout
from kvlab.model.layout import Rect, as_stored, convert_wire
from kvlab.model.state import in_format


def pieces(rect: Rect, rows: tuple[int, ...]) -> list[Rect]:
    """``rect`` cut at tile boundaries into sub-rects of at most ``layout.CONVERT_PIECE`` bytes of ``rows`` (one tile
    at least; a chunk's scratch is this size whatever the chunk),
    in wire order: each one's bytes follow the previous one's on the wire, in either format (the schedule's
    ``cut_rect`` groups layers first, and its pieces are not consecutive on the wire)."""
    tiles = max(1, layout.CONVERT_PIECE // (rect.n_layers * rect.n_heads * rect.tile * sum(rows)))
    out, t0 = [], rect.t0
    while t0 < rect.t1:
        t1 = min(rect.t1, (t0 // rect.tile + tiles) * rect.tile)
        out.append(replace(rect, t0=t0, t1=t1))
        t0 = t1
    return out


def _scratch(subs: list[Rect], rows: tuple[int, ...], device) -> torch.Tensor:
    return torch.empty(max(as_stored(r).nbytes(rows) for r in subs), dtype=torch.uint8, device=device)


def _walk(pool, rect: Rect, device):
    """Per piece of ``rect``: (the piece as the pool stores it, scratch of its bytes in the pool's format, its
    bytes' span on the wire, the wire's format)."""
    wire, subs, at = in_format(pool.spec, rect.wire), pieces(rect, pool.rows), 0
    tmp = _scratch(subs, pool.rows, device)
    for sub in subs:
        own = as_stored(sub)
        w = sub.nbytes(wire.comp_row_bytes())
        yield own, tmp[:own.nbytes(pool.rows)], slice(at, at + w), wire
        at += w


def pack(impl, pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, rows_fn=kv_dtype.convert_rows,
         **kw) -> None:
    """The pool's rows of ``rect`` into a piece, converted into ``out`` in the wire's format, a piece at a time."""
    for own, tmp, span, wire in _walk(pool, rect, out.device):
        impl(pool_bytes, pool, num_blocks, own, block_ids, block_base, tmp, **kw)
        convert_wire(tmp, own, pool.spec, wire, out[span], rows_fn)


def unpack(impl, wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes, rows_fn=kv_dtype.convert_rows,
           **kw) -> None:
    """``wire_buf`` converted into the pool's format, then unpacked as the pool's own rows, a piece at a time."""
    for own, tmp, span, wire in _walk(pool, rect, wire_buf.device):
        impl(convert_wire(wire_buf[span], own, wire, pool.spec, tmp, rows_fn), pool, num_blocks, own, block_ids,
             block_base, pool_bytes, **kw)


def copy_rect(pack_impl, unpack_impl, src_bytes, src_pool, src_nb, src_ids, src_base, dst_bytes, dst_pool, dst_nb,
              dst_ids, dst_base, rect, rows_fn=kv_dtype.convert_rows, **kw) -> None:
    """A pull between pools of two formats: the source's rows packed, converted, unpacked into the destination
    (the conversion happens in the copy, on the destination's device), a piece at a time."""
    subs = pieces(rect, src_pool.rows)
    src, dst = _scratch(subs, src_pool.rows, dst_bytes.device), _scratch(subs, dst_pool.rows, dst_bytes.device)
    for sub in subs:
        own = as_stored(sub)
        n, m = own.nbytes(src_pool.rows), own.nbytes(dst_pool.rows)
        pack_impl(src_bytes, src_pool, src_nb, own, src_ids, src_base, src[:n], **kw)
        unpack_impl(convert_wire(src[:n], own, src_pool.spec, dst_pool.spec, dst[:m], rows_fn), dst_pool, dst_nb,
                    own, dst_ids, dst_base, dst_bytes, **kw)
