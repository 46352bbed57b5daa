"""Pack (pool blocks -> wire bytes) and unpack (wire bytes -> pool blocks) of one rectangle.

Three implementations with one signature: ``reference`` (torch indexing; any device, the
definition of correct), ``cpu`` (gathers and scatters of whole rows, near ``copy_`` speed) and
``cuda`` (NVRTC kernels from ``kernels/``). ``get_ops`` picks one: ``kernels=torch`` always
the reference, ``cuda`` the kernels (error without a GPU), ``auto`` the kernels for CUDA
tensors when they compile (else the reference, with one line on stderr that says why: the run's figures are
then torch's copies, ``kernels: torch`` in its records) and the row path for CPU tensors.

Signature of all three::

    pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out)
    unpack(wire, pool, num_blocks, rect, block_ids, block_base, pool_bytes)
    copy_rect(src_pool_bytes, src_pool, src_num_blocks, src_block_ids, src_block_base,
              dst_pool_bytes, dst_pool, dst_num_blocks, dst_block_ids, dst_block_base, rect)

``copy_rect`` moves one rectangle straight from one pool into another (``transport=ipc``),
resharding on the way: run ``i`` of the rectangle on the source side (``kvlab.model.layout.runs``)
into run ``i`` on the destination side; the runs of one rectangle share wire offsets and
lengths in every layout. The CUDA kernel computes both sides' runs itself, from the block
tables, so a chunk costs one launch and no host sync.

``pool_bytes`` is the pool's uint8 storage, ``block_ids[i]`` the physical block of logical
block ``block_base + i`` (int32 or int64, on the pool's device), ``out``/``wire`` a uint8
tensor of exactly ``rect.nbytes(pool.rows)`` bytes (a staging slot view or, in place, a
view of the pool itself).

Where a rectangle's wire carries another KV dtype than the pool (``Rect.wire``, kvlab.model.kv_dtype), each
implementation hands the call to ``kvlab.memory.ops.convert``: its own move of the pool's rows, and the conversion
in torch on the buffers' device.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace

from kvlab.core.errors import install_hint
from kvlab.memory.ops import cpu, reference


def _stderr(line: str) -> None:
    print(f"kvlab: {line}", file=sys.stderr)


def get_ops(kernels: str = "auto", device: str = "cpu", say: Callable[[str], object] = _stderr):
    """``say``: where the fallback's line goes (a run's ranks pass one that lets one process of a host say it)."""
    if kernels == "auto" and device != "cuda":
        return SimpleNamespace(name="cpu", pack=cpu.pack, unpack=cpu.unpack, copy_rect=cpu.copy_rect)
    torch_ops = SimpleNamespace(name="torch", pack=reference.pack, unpack=reference.unpack,
                                copy_rect=reference.copy_rect)
    if kernels == "torch":
        return torch_ops
    try:
        from kvlab.memory.ops import cuda as cuda_ops
        cuda_ops.ensure_compiled()
    except Exception as e:
        why = install_hint("gpu", "NVRTC (cuda-core)") if isinstance(e, ImportError) else str(e)
        if kernels == "cuda":
            raise RuntimeError(f"kernels=cuda: the CUDA kernels are unavailable here ({why}); use kernels=torch") from e
        first = why.splitlines()[0] if why else repr(e)  # a compiler's log is many lines: its first says what
        say(f"kernels=auto: the CUDA kernels are unavailable here ({first}); "
            "this process copies with torch, kernels=cuda would stop instead")
        return torch_ops
    return SimpleNamespace(name="cuda", pack=cuda_ops.pack, unpack=cuda_ops.unpack, copy_rect=cuda_ops.copy_rect)
