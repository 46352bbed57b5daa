"""Pack, unpack and copy_rect where the wire carries another KV dtype than a pool (``Rect.wire``, kvlab.model.kv_dtype).

Each implementation (reference, cpu, cuda) calls these first thing when ``kvlab.model.layout.converts`` says so,
passing its own function: the pool's rows move as that implementation moves them (through a scratch piece of
the chunk's size in the pool's format), and the rows are converted between the piece and the wire in torch, on
the buffers' device. The rounding is kvlab.model.kv_dtype's; the kernels move bytes of one format only.
"""
from __future__ import annotations

import torch

from kvlab.model.layout import as_stored, convert_wire
from kvlab.model.state import in_format


def pack(impl, pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, **kw) -> None:
    """The pool's rows of ``rect`` into a piece, converted into ``out`` in the wire's format."""
    own = as_stored(rect)
    tmp = torch.empty(own.nbytes(pool.rows), dtype=torch.uint8, device=out.device)
    impl(pool_bytes, pool, num_blocks, own, block_ids, block_base, tmp, **kw)
    convert_wire(tmp, own, pool.spec, in_format(pool.spec, rect.wire), out)


def unpack(impl, wire, pool, num_blocks, rect, block_ids, block_base, pool_bytes, **kw) -> None:
    """``wire`` converted into the pool's format, then unpacked as the pool's own rows."""
    own = as_stored(rect)
    impl(convert_wire(wire, own, in_format(pool.spec, rect.wire), pool.spec), pool, num_blocks, own, block_ids,
         block_base, pool_bytes, **kw)


def copy_rect(pack_impl, unpack_impl, src_bytes, src_pool, src_nb, src_ids, src_base, dst_bytes, dst_pool, dst_nb,
              dst_ids, dst_base, rect, **kw) -> None:
    """A pull between pools of two formats: the source's rows packed, converted, unpacked into the destination
    (the conversion happens in the copy, on the destination's device)."""
    own = as_stored(rect)
    tmp = torch.empty(own.nbytes(src_pool.rows), dtype=torch.uint8, device=dst_bytes.device)
    pack_impl(src_bytes, src_pool, src_nb, own, src_ids, src_base, tmp, **kw)
    unpack_impl(convert_wire(tmp, own, src_pool.spec, dst_pool.spec), dst_pool, dst_nb, own, dst_ids, dst_base,
                dst_bytes, **kw)
