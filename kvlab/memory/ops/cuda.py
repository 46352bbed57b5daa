"""CUDA pack/unpack: ``kernels/kv_copy.cu`` compiled with NVRTC, launched on torch's current stream; copy_rect:
``kernels/run_copy.cu``; another KV dtype converted in the copy: ``kernels/fp8_rows.cu`` (the choice of kernel per
pair of pools: kvlab.memory.ops.paths).

Same signature as :mod:`kvlab.memory.ops.reference`, plus ``ctas``: the kernels walk work items of
about one warp step (pieces of long runs, batches of short ones) in a grid-stride loop, so a
launch on 8-32 CTAs moves the bytes while leaving NCCL's kernels the other SMs (docs/design.md),
whatever the run lengths of the cache kind. The cubin is cached on disk per source, options
and NVRTC version, so ranks after the first start without compiling.

The kernel source has no ``#include``: NVRTC then needs no include path, and no header
package on the GPU machine.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import tempfile
import threading
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import torch

from kvlab.core.paths import KERNELS_DIR
from kvlab.memory.ops import convert, paths, reference
from kvlab.memory.ops.paths import ConvertShape
from kvlab.memory.ops.reference import check_buffers, check_rect_pair
from kvlab.model import kv_dtype
from kvlab.model.layout import Rect, as_stored, converts, mem_tokens
from kvlab.model.state import RankPool, in_format, pool_format

KERNEL_SOURCE = KERNELS_DIR / "kv_copy.cu"
RUN_COPY_SOURCE = KERNELS_DIR / "run_copy.cu"
FP8_ROWS_SOURCE = KERNELS_DIR / "fp8_rows.cu"
DEFAULT_CTAS = 16
_INT_MAX = 2**31 - 1


@dataclass(frozen=True)
class Tuning:
    """Shape of the kernels.

    Warp path: ``threads`` per CTA (also the compiled launch bound), ``unroll`` vectors per
    lane in flight. ``bulk`` (sm_90+): each warp streams its runs through ``stages``
    shared-memory buffers of ``piece`` bytes with cp.async.bulk, for more bytes in flight per
    SM than registers hold; runs that are not 16-byte aligned still take the warp path.
    """

    threads: int = 1024
    unroll: int = 8
    bulk: bool = False
    stages: int = 4
    piece: int = 12288

    def __post_init__(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"Tuning.threads={self.threads}: use a multiple of 32 in [32, 1024]")
        if self.unroll < 1:
            raise ValueError(f"Tuning.unroll={self.unroll}: must be >= 1")
        if self.bulk:
            if self.stages < 2:
                raise ValueError(f"Tuning.stages={self.stages}: the bulk ring needs >= 2 buffers")
            if self.piece % 16 or not 16 <= self.piece < 2**20:
                raise ValueError(f"Tuning.piece={self.piece}: use a multiple of 16 below 1 MiB")

    def defines(self) -> tuple[tuple[str, str], ...]:
        return (("KV_THREADS", str(self.threads)), ("KV_UNROLL", str(self.unroll)))

    def smem_bytes(self) -> int:
        """Dynamic shared memory of a bulk launch (layout in kernels/kv_copy.cu)."""
        if not self.bulk:
            return 0
        slots = self.threads // 32 * self.stages
        return (slots * 20 + 127) // 128 * 128 + slots * self.piece


DEFAULT_TUNING = Tuning()


def _source(path: Path = KERNEL_SOURCE) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"CUDA kernel source {path} not found (a checkout has it in kernels/, a "
                                "wheel installs it under kvlab/_data/kernels of the package: reinstall kvlab)")
    return path.read_text()


@lru_cache(maxsize=1)
def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


def _options(arch: str, tuning: Tuning, name: str = "kv_copy"):
    from cuda.core import ProgramOptions

    return ProgramOptions(arch=arch, std="c++17", name=name, define_macro=list(tuning.defines()))


def cache_dir() -> Path:
    """Where cubins are kept: $KVLAB_CACHE_DIR, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab."""
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvlab"


def _cache_key(src: str, arch: str, tuning: Tuning) -> str:
    import cuda.core

    h = hashlib.sha256()
    for part in (src, arch, "c++17", repr(tuning.defines()), _nvrtc_version(), cuda.core.__version__):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def compile_for_arch(arch: str, tuning: Tuning = DEFAULT_TUNING, *, use_cache: bool = True,
                     source: Path = KERNEL_SOURCE) -> bytes:
    """Cubin of ``source`` (``kernels/kv_copy.cu`` by default) for ``arch`` (e.g. ``sm_90``); needs NVRTC,
    not a GPU."""
    from cuda.core import Program

    src = _source(source)
    path = cache_dir() / f"{source.stem}-{arch}-{_cache_key(src, arch, tuning)}.cubin"
    if use_cache and path.is_file():
        return path.read_bytes()
    log = io.StringIO()
    try:
        cubin = bytes(Program(src, "c++", options=_options(arch, tuning, source.stem)).compile("cubin", logs=log).code)
    except Exception as e:
        raise RuntimeError(f"NVRTC failed on {source} for {arch}: {e}\n{log.getvalue()}") from e
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # ranks starting together may compile at once: publish whole files only
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs a recompile next time
    return cubin


def device_arch(index: int) -> str:
    from cuda.core import Device

    cc = Device(index).compute_capability
    return f"sm_{cc.major}{cc.minor}"


_loaded: dict[tuple[int, str | None, tuple], tuple] = {}
_lock = threading.Lock()


@cache
def _smem_optin(index: int) -> int:
    from cuda.core import Device

    return Device(index).properties.max_shared_memory_per_block_optin


def _allow_large_smem(kernel, index: int) -> None:
    """Let a bulk kernel take the device's opt-in shared memory, beyond the default 48 KiB."""
    from cuda.bindings import driver

    optin = _smem_optin(index)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    h = kernel.handle
    if isinstance(h, driver.CUfunction):  # module-loaded (older cuda.core) rather than library-loaded
        (err,) = driver.cuFuncSetAttribute(h, attr, optin)
    else:
        (err,) = driver.cuKernelSetAttribute(attr, optin, h, driver.CUdevice(index))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuKernelSetAttribute(max dynamic shared memory={optin}) failed: {err}")


def _kernels(index: int, tuning: Tuning = DEFAULT_TUNING, arch: str | None = None):
    """(pack, unpack, ObjectCode) for device ``index``: the warp or the bulk kernels, as ``tuning`` says."""
    key = (index, arch, tuning.defines(), tuning.bulk)
    got = _loaded.get(key)
    if got is None:
        from cuda.core import Device, ObjectCode

        with _lock:
            got = _loaded.get(key)
            if got is None:
                Device(index).set_current()
                arch = arch or device_arch(index)
                if tuning.bulk and int(arch.removeprefix("sm_").rstrip("a")) < 90:
                    raise RuntimeError(f"bulk kernels need sm_90 or newer, the device is {arch}")
                obj = ObjectCode.from_cubin(compile_for_arch(arch, tuning), name="kv_copy")
                suffix = "_bulk" if tuning.bulk else ""
                got = (obj.get_kernel("kv_pack" + suffix), obj.get_kernel("kv_unpack" + suffix), obj)
                if tuning.bulk:
                    for k in got[:2]:
                        _allow_large_smem(k, index)
                _loaded[key] = got
    return got


def ensure_compiled(device: int | None = None, arch: str | None = None, tuning: Tuning = DEFAULT_TUNING) -> None:
    """Compile (or load from the disk cache) and load on a CUDA device every kernel the ops launch: pack/unpack as
    ``tuning`` says and, for the device's own architecture, the rectangle copy and the converting copy, so that
    no first use (an NVRTC compile of seconds on a fresh machine) falls inside a timed transfer; raises without
    a device."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    index = torch.cuda.current_device() if device is None else device
    _kernels(index, tuning, arch)
    if arch is None:
        _rect_kernel(index, RECT_TUNING)
        _convert_object(index, convert_tuning())


def _work_items(tile: int, rows: tuple[int, ...], runs_per_tile: int, ntiles: int, unroll: int) -> int:
    """Work items of a launch: ``plan`` in kernels/kv_copy.cu, item for item (it sizes the grid)."""
    lane_step = 16 * unroll
    per_tile = 0
    for row in rows:
        run = tile * row
        lg = 0
        while lg < 5 and lane_step << lg < run:
            lg += 1
        if lg == 5:
            per_tile += runs_per_tile * -(-run // (32 * lane_step))
        else:
            per_tile += -(-runs_per_tile // (32 >> lg))
    return ntiles * per_tile


def _check_cuda(pool_bytes: torch.Tensor, pool: RankPool, rect: Rect, block_ids: torch.Tensor, block_base: int,
                buf: torch.Tensor, comps: int | None = paths.KERNEL_COMPONENTS) -> None:
    """``rect`` lies in the pool's held layers, heads and block table, within the kernels' limits (``comps``:
    the components the kernel addresses; None: the span kernel's launch per component)."""
    dev = pool_bytes.device
    if dev.type != "cuda":
        raise ValueError(f"CUDA pack/unpack need CUDA tensors; the pool is on {dev}")
    for what, t in (("wire buffer", buf), ("block_ids", block_ids)):
        if t.device != dev:
            raise ValueError(f"{what} is on {t.device}, the pool on {dev}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_ids must be int32 or int64, not {block_ids.dtype}")
    tpb, T = pool.tokens_per_block, rect.tile
    if T <= 0 or tpb % T:
        raise ValueError(f"tile {T} must divide tokens_per_block {tpb}: a run never crosses a block")
    if not (pool.layers.start <= rect.l0 and rect.l1 <= pool.layers.stop):
        raise ValueError(f"rect layers [{rect.l0}, {rect.l1}) outside the held layers {pool.layers}")
    if not (pool.heads.start <= rect.h0 and rect.h1 <= pool.heads.stop):
        raise ValueError(f"rect heads [{rect.h0}, {rect.h1}) outside the held heads {pool.heads}")
    # the pool's own positions of the rectangle's first and last tokens (global ones for a DCP rank's rectangle)
    first, last = rect.t0, rect.t1 - 1
    if rect.local != pool.tokens.local:
        first, last = (int(t) for t in mem_tokens(pool, rect, torch.tensor([first, last])))
    if first < block_base * tpb:
        raise ValueError(f"rect starts at token {first}, before the block table's first block {block_base}")
    need = last // tpb - block_base + 1
    if block_ids.numel() < need:
        raise ValueError(f"block table has {block_ids.numel()} blocks, tokens [{first}, {last + 1}) need {need}")
    ntiles = (rect.t1 - 1) // T - rect.t0 // T + 1
    nruns = ntiles * rect.n_layers * len(pool.rows) * rect.n_heads * _sub_runs(pool, T)
    # pieces of a run may overshoot it by up to 15 bytes each: 2^30-byte runs keep their offsets in int
    too_many = comps is not None and len(pool.rows) > comps
    if nruns > _INT_MAX or T * max(pool.rows) > 2**30 or max(tpb, last) > _INT_MAX or too_many:
        raise ValueError(f"rect {rect} exceeds the kernel's limits (2^31 runs and tokens, 2^30-byte runs, "
                         f"{comps} components)")


def _launch(pack_dir: bool, pool_bytes, pool, num_blocks, rect, block_ids, block_base, buf, ctas, tuning):
    check_buffers(pool_bytes, pool, num_blocks, rect, buf)
    _check_cuda(pool_bytes, pool, rect, block_ids, block_base, buf)
    if buf.numel() == 0:
        return
    if ctas < 1:
        raise ValueError(f"ctas={ctas}: must be >= 1")
    from cuda.core import Device, LaunchConfig, Stream, launch

    index = pool_bytes.device.index
    # cuda.core launches in the calling thread's current context, which a fresh thread lacks
    Device(index).set_current()
    k_pack, k_unpack, _ = _kernels(index, tuning)
    block_ids = block_ids.contiguous()

    rows = pool.rows
    T = rect.tile
    S = _sub_runs(pool, T)
    ntiles = (rect.t1 - 1) // T - rect.t0 // T + 1
    warps = tuning.threads // 32
    if tuning.bulk:
        work = ntiles * rect.n_layers * len(rows) * rect.n_heads * S  # the bulk kernels take whole runs
    else:
        work = _work_items(T if S == 1 else 1, rows, rect.n_layers * rect.n_heads * S, ntiles, tuning.unroll)
    # the kernel's item counter and its stride (all warps of the grid) stay below 2^32 together
    if work > _INT_MAX:
        raise ValueError(f"rect {rect} makes {work} work items, more than the kernel's 2^31")
    grid = max(1, min(ctas, -(-work // warps)))
    smem = tuning.smem_bytes()
    if smem > 48 * 1024 and smem > _smem_optin(index):
        raise ValueError(f"{tuning} needs {smem} bytes of shared memory per CTA, more than the device has")
    i32, i64 = np.int32, np.int64
    extra = (i32(tuning.stages), i32(tuning.piece)) if tuning.bulk else ()
    row1 = rows[1] if len(rows) > 1 else 0
    # a non-owning wrapper of torch's stream: cuda.core deprecates passing foreign stream objects to launch
    stream = Stream.from_handle(torch.cuda.current_stream(pool_bytes.device).cuda_stream)
    # pointers as Python ints (cuda.core passes them as pointers), every scalar with its C type
    launch(stream, LaunchConfig(grid=grid, block=tuning.threads, shmem_size=smem), k_pack if pack_dir else k_unpack,
           pool_bytes.data_ptr(), buf.data_ptr(), block_ids.data_ptr(), i32(block_ids.element_size()),
           i64(num_blocks), i64(block_base), i32(pool.tokens_per_block), i32(T), i64(rect.t0), i64(rect.t1),
           i32(rect.l0 - pool.layers.start), i32(rect.n_layers), i32(rect.h0 - pool.heads.start), i32(rect.n_heads),
           i32(len(rows)), i32(rows[0]), i32(row1), i32(S), *_comp_params(pool, num_blocks), *extra)


def _sub_runs(*pools_and_tile) -> int:
    """Runs per (tile, layer, component, head) in the kernels: 1 where every pool keeps a head's token rows
    back to back, else the tile's rows one by one (kvlab.model.layout.runs)."""
    *pools, T = pools_and_tile
    return 1 if all(p.token_runs for p in pools) else T


def _comp_params(pool: RankPool, num_blocks: int) -> tuple:
    """off0, off1, bs0, bs1, ls0, ls1, hs0, hs1, ns0, ns1: both components' strides (RankPool.comp_strides;
    zeros for a pool of one component), as ``Runs`` in kernels/kv_copy.cu takes them."""
    s = pool.comp_strides(num_blocks)
    two = (s[0], s[1] if len(s) > 1 else s[0])
    return tuple(np.int64(getattr(x, f)) for f in ("offset", "block", "layer", "head", "token") for x in two)


def _strided(pool: RankPool, rect: Rect) -> bool:
    """Rectangles the pack/unpack kernels cannot address, moved by the torch reference's runs (slower, not yet a
    kernel's work): a DCP rank's positions on a pool that keeps global tokens (kvlab.model.tokens: the kernels
    address a pool by the rectangle's own token positions), and pools of more components than the kernels' two (a
    recurrent state's conv parts and state: ``_comp_params`` passes two strides, so a third would be left unmoved).
    ``copy_rect`` takes such pools on the span kernel, a launch per component, where they are aligned."""
    return rect.local != pool.tokens.local or len(pool.rows) > paths.KERNEL_COMPONENTS


def pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, *, ctas: int = DEFAULT_CTAS,
         tuning: Tuning = DEFAULT_TUNING) -> None:
    if _strided(pool, rect):
        return reference.pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out)
    if converts(pool, rect):  # another KV dtype on the wire: converted in the copy where the kernel takes it
        if _convert_pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, ctas):
            return
        return convert.pack(pack, pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, convert_rows,
                            ctas=ctas, tuning=tuning)
    _launch(True, pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, ctas, tuning)


def unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes, *, ctas: int = DEFAULT_CTAS,
           tuning: Tuning = DEFAULT_TUNING) -> None:
    if _strided(pool, rect):
        return reference.unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes)
    if converts(pool, rect):
        if _convert_unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes, ctas):
            return
        return convert.unpack(unpack, wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes,
                              convert_rows, ctas=ctas, tuning=tuning)
    _launch(False, pool_bytes, pool, num_blocks, rect, block_ids, block_base, wire_buf, ctas, tuning)


RECT_TUNING = Tuning(threads=256, unroll=8)  # 64 registers, 1024 threads per SM; see scripts/ipc_bench.py


@lru_cache(maxsize=8)
def _rect_kernel(index: int, tuning: Tuning):
    """(kernel, CTAs that are resident at once on the device, ObjectCode): a grid of exactly the resident
    CTAs walks the runs in one wave, with no tail of late CTAs."""
    from cuda.core import Device, ObjectCode

    Device(index).set_current()
    cubin = compile_for_arch(device_arch(index), tuning, source=RUN_COPY_SOURCE)
    obj = ObjectCode.from_cubin(cubin, name="run_copy")
    kernel = obj.get_kernel("kv_copy_rect")
    per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(tuning.threads, 0)
    return kernel, max(1, per_sm) * _sm_count(index), obj


def _side(pool: RankPool, num_blocks: int, rect: Rect, block_ids: torch.Tensor, block_base: int) -> tuple:
    """One side's kernel parameters (``RUN_AT`` in kernels/run_copy.cu)."""
    i32, i64 = np.int32, np.int64
    return (block_ids.data_ptr(), i32(block_ids.dtype == torch.int64), i32(pool.tokens_per_block), i64(block_base),
            *_comp_params(pool, num_blocks), i32(rect.l0 - pool.layers.start), i32(rect.h0 - pool.heads.start))


def copy_rect(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool, dst_num_blocks, dst_ids,
              dst_base, rect, *, ctas: int | None = None, tuning: Tuning = RECT_TUNING,
              path: str | None = None) -> None:
    """``kernels/run_copy.cu`` on the current stream: every run of ``rect`` from the source pool into the
    destination pool in one launch, both sides' addresses computed on the device from their block tables
    (no index tensors, no host sync). ``src_bytes`` may be another process's pool opened through CUDA IPC."""
    dev = dst_bytes.device
    # a DCP rank's positions on one side, global tokens on the other: the span kernel maps them, others do not
    dcp = rect.local != src_pool.tokens.local or rect.local != dst_pool.tokens.local
    if dcp and ((path or paths.copy_path(src_pool, dst_pool)[0]) != "span"
                or pool_format(src_pool.spec) != pool_format(dst_pool.spec)):
        return reference.copy_rect(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool,
                                   dst_num_blocks, dst_ids, dst_base, rect)
    if pool_format(src_pool.spec) != pool_format(dst_pool.spec):  # another KV dtype: converted in the copy
        if _convert_pools(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool, dst_num_blocks,
                          dst_ids, dst_base, rect, ctas):
            return
        return convert.copy_rect(pack, unpack, src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes,
                                 dst_pool, dst_num_blocks, dst_ids, dst_base, rect, convert_rows)
    rect = as_stored(rect)
    check_rect_pair(src_bytes, src_pool, src_num_blocks, dst_bytes, dst_pool, dst_num_blocks, rect)
    for side, (pool_bytes, pool, ids, base) in (("source", (src_bytes, src_pool, src_ids, src_base)),
                                                ("destination", (dst_bytes, dst_pool, dst_ids, dst_base))):
        if pool_bytes.device != dev:
            raise ValueError(f"copy_rect needs both pools on one CUDA device: the {side} is on {pool_bytes.device}, "
                             f"the destination on {dev}")
        _check_cuda(pool_bytes, pool, rect, ids, base, dst_bytes, comps=None)
    if not (src_ids.is_contiguous() and dst_ids.is_contiguous()):
        raise ValueError("copy_rect needs contiguous block tables")
    T = rect.tile
    S = _sub_runs(src_pool, dst_pool, T)
    ntiles = (rect.t1 - 1) // T - rect.t0 // T + 1
    rows = src_pool.rows
    nruns = ntiles * rect.n_layers * len(rows) * rect.n_heads * S
    if nruns > _INT_MAX:
        raise ValueError(f"rect {rect} makes {nruns} runs, more than the rectangle copy's 2^31")
    if rect.n_tokens <= 0:
        return
    # the kernel indexes tokens with int too (_check_cuda bounds the runs and their lengths)
    if rect.t1 > _INT_MAX:
        raise ValueError(f"rect {rect} exceeds the rectangle copy's limits (2^31 tokens)")
    path = path or paths.copy_path(src_pool, dst_pool)[0]
    if path == "span" and _copy_spans(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool,
                                      dst_num_blocks, dst_ids, dst_base, rect, ctas, tuning):
        return
    if dcp or max(len(src_pool.rows), len(dst_pool.rows)) > paths.KERNEL_COMPONENTS:  # what the span kernel left
        return reference.copy_rect(src_bytes, src_pool, src_num_blocks, src_ids, src_base, dst_bytes, dst_pool,
                                   dst_num_blocks, dst_ids, dst_base, rect)
    from cuda.core import Device, LaunchConfig, Stream, launch

    Device(dev.index).set_current()
    kernel, resident, _ = _rect_kernel(dev.index, tuning)
    ctas = ctas or resident
    grid = max(1, min(ctas, -(-nruns // (tuning.threads // 32))))
    stream = Stream.from_handle(torch.cuda.current_stream(dev).cuda_stream)
    i32, i64 = np.int32, np.int64
    launch(stream, LaunchConfig(grid=grid, block=tuning.threads), kernel, src_bytes.data_ptr(), dst_bytes.data_ptr(),
           *_side(src_pool, src_num_blocks, rect, src_ids, src_base),
           *_side(dst_pool, dst_num_blocks, rect, dst_ids, dst_base),
           i32(T), i64(rect.t0), i64(rect.t1), i32(rect.n_layers), i32(rect.n_heads), i32(len(rows)), i32(rows[0]),
           i32(rows[1] if len(rows) > 1 else 0), i32(S), i64(nruns))


def _span_side(pool: RankPool, num_blocks: int, rect: Rect, ids: torch.Tensor, base: int, c: int) -> tuple:
    """One side's ``SPAN_SIDE`` parameters for component ``c`` (kernels/run_copy.cu)."""
    i32, i64 = np.int32, np.int64
    s = pool.comp_strides(num_blocks)[c]
    # a DCP rank's local positions on a side that keeps global tokens: the kernel maps them (kvlab.model.tokens)
    dcp, rank, il = rect.local if rect.local is not None and pool.tokens.local is None else (1, 0, 0)
    return (ids.data_ptr(), i32(ids.dtype == torch.int64), i32(pool.tokens_per_block), i64(base), i64(s.offset),
            i64(s.block), i64(s.layer), i64(s.head), i64(s.token), i32(rect.l0 - pool.layers.start),
            i32(rect.h0 - pool.heads.start), i32(il), i32(dcp), i32(rank))


def _copy_spans(src_bytes, src_pool, src_nb, src_ids, src_base, dst_bytes, dst_pool, dst_nb, dst_ids, dst_base, rect,
                ctas, tuning) -> bool:
    """``kv_copy_span`` once per component, or False (nothing launched) where a pool's storage is not 16-byte
    aligned or the rectangle has more vectors than the kernel's int indexes."""
    if (src_bytes.data_ptr() | dst_bytes.data_ptr()) % 16:
        return False
    for s in src_pool.comp_strides(src_nb) + dst_pool.comp_strides(dst_nb):
        if math.gcd(s.offset, s.block, s.layer, s.head, s.token, s.row) % 16:
            return False
    # a span lies in one block on each side and, for a DCP rank's positions, in one run of the interleave
    g = math.gcd(src_pool.tokens_per_block, dst_pool.tokens_per_block, rect.local[2] if rect.local else 0)
    lm = layers_per_item(rect.n_layers, rect.n_heads * g * max(src_pool.rows) // 16, 32 * min(tuning.unroll, 5))
    nlg = -(-rect.n_layers // lm)
    items = ((rect.t1 - 1) // g - rect.t0 // g + 1) * nlg
    if items > _INT_MAX or lm * rect.n_heads * g * max(src_pool.rows) // 16 > _INT_MAX - (1 << 16):
        return False
    from cuda.core import Device, LaunchConfig, Stream, launch

    dev = dst_bytes.device
    Device(dev.index).set_current()
    kernel, resident = _span_kernel(dev.index, tuning)
    stream = Stream.from_handle(torch.cuda.current_stream(dev).cuda_stream)
    i32 = np.int32
    warps = tuning.threads // 32
    grid = max(1, min(ctas or resident, -(-items // warps)))
    for c, row in enumerate(src_pool.rows):
        m = row // 16
        launch(stream, LaunchConfig(grid=grid, block=tuning.threads), kernel, src_bytes.data_ptr(),
               dst_bytes.data_ptr(), *_span_side(src_pool, src_nb, rect, src_ids, src_base, c),
               *_span_side(dst_pool, dst_nb, rect, dst_ids, dst_base, c), i32(g), i32(rect.t0), i32(rect.t1),
               i32(rect.n_layers), i32(rect.n_heads), i32(m), *fast_div(m), *fast_div(g), i32(lm),
               *fast_div(rect.n_heads * g), *fast_div(nlg), i32(items))
    return True


# An item (a span of tokens by every head of one layer) whose rows fill fewer than LAYER_PASSES passes of a warp's
# loads in flight takes several consecutive layers (kv_copy_span, kv_convert_rect): DeepSeek's one MLA row per token
# into SGLang's one-token blocks otherwise leaves most of a warp's loads empty. 0: one layer per item (the bench's
# comparison, scripts/rect_bench.py --layer-passes).
LAYER_PASSES = 4
# the same for kv_convert_rect's items of one token (a side in blocks of one token: SGLang's), whose fixed work (the
# block tables, both sides' bases) is paid per token: Llama-3.1-8B into SGLang's layout in fp8 reads 0.785-0.789 of
# copy_ at 4 passes and 0.837-0.847 at 16. Items of a block of tokens keep LAYER_PASSES: at 16, DeepSeek-V3.2's
# vLLM HND -> TensorRT-LLM lost 0.02-0.04 (scripts/rect_bench.py --convert-layer-passes, two runs)
CONVERT_LAYER_PASSES = 16


def layers_per_item(n_layers: int, per_layer: int, per_pass: int, passes: int | None = None) -> int:
    """Layers an item takes: ``per_layer`` units of work (vectors, rows) per layer, ``per_pass`` a warp's units in
    flight at once, at least ``passes`` passes (``LAYER_PASSES`` by default) where the layers allow it."""
    passes = LAYER_PASSES if passes is None else passes
    if passes <= 0 or per_layer <= 0:
        return 1
    return min(n_layers, max(1, -(-passes * per_pass // per_layer)))


def fast_div(d: int) -> tuple:
    """(M, l) with n // d == (umulhi(n, M) + n) >> l for 0 <= n < 2^31 (``FDIV`` in kernels/run_copy.cu)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"fast_div: divisor {d} outside [1, 2^31)")
    l = (d - 1).bit_length()
    return np.uint32((2**32 * (2**l - d)) // d + 1), np.int32(l)


@lru_cache(maxsize=8)
def _span_kernel(index: int, tuning: Tuning):
    kernel, _, obj = _rect_kernel(index, tuning)
    span = obj.get_kernel("kv_copy_span")
    per_sm = span.occupancy.max_active_blocks_per_multiprocessor(tuning.threads, 0)
    return span, max(1, per_sm) * _sm_count(index)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@lru_cache(maxsize=8)
def _fp8_kernel(index: int):
    """``kv_quantize_rows`` from the converting copy's object: its code uses none of that object's constants (the
    sm_90 SASS is the same as from a compile of its own), and kernels/fp8_rows.cu is compiled once."""
    obj = _convert_object(index, convert_tuning())
    return obj.get_kernel("kv_quantize_rows"), obj


def quantize_rows(rows: torch.Tensor, kind: str, elems: int, base: str) -> torch.Tensor:
    """``kernels/fp8_rows.cu`` on the current stream: uint8 rows ``[n, elems * 2]`` of ``base`` values (bf16 or
    fp16) as fp8 rows (kvlab.model.kv_dtype.from_values' bytes, bit for bit) in one pass."""
    q, group = kv_dtype.groups(kind, elems)
    n = rows.shape[0]
    out = torch.empty((n, kv_dtype.row_bytes(kind, elems, base, "fp8")), dtype=torch.uint8, device=rows.device)
    if n == 0:
        return out
    from cuda.core import LaunchConfig, Stream, launch

    rows = rows.contiguous()
    kernel, _ = _fp8_kernel(rows.device.index)
    warps = n * -(-q // group)
    grid = max(1, min(_sm_count(rows.device.index) * 8, -(-warps // 8)))
    stream = Stream.from_handle(torch.cuda.current_stream(rows.device).cuda_stream)
    launch(stream, LaunchConfig(grid=grid, block=256), kernel, rows.data_ptr(), out.data_ptr(), np.int64(n),
           np.int32(elems), np.int32(q), np.int32(group), np.int32(base == "fp16"))
    return out


def convert_rows(rows: torch.Tensor, kind: str, elems: int, base: str, src: str, dst: str) -> torch.Tensor:
    """kvlab.model.kv_dtype.convert_rows with the quantizing direction (bf16 or fp16 into fp8) on the kernel."""
    if rows.is_cuda and dst == "fp8" and src == base and src in kv_dtype.BASES:
        return quantize_rows(rows, kind, elems, base)
    return kv_dtype.convert_rows(rows, kind, elems, base, src, dst)


# ---- the KV dtype converted inside the copy (kv_convert_rect in kernels/fp8_rows.cu) ----

def _pool_cside(pool: RankPool, num_blocks: int, rect: Rect, ids: torch.Tensor, base: int, c: int):
    """(kernel parameters ``CSIDE`` of one pool's component ``c``, the alignment every row start keeps)."""
    i32, i64 = np.int32, np.int64
    s = pool.comp_strides(num_blocks)[c]
    params = (ids.data_ptr(), i32(ids.dtype == torch.int64), i32(pool.tokens_per_block), i64(base), i64(s.offset),
              i64(s.block), i64(s.layer), i64(s.head), i64(s.token), i32(rect.l0 - pool.layers.start),
              i32(rect.h0 - pool.heads.start), i32(0), i64(0), i64(0), i64(0))
    return params, math.gcd(s.offset, s.block, s.layer, s.head, s.token)


def _wire_cside(rows: tuple[int, ...], rect: Rect, ids: torch.Tensor, c: int):
    """The same for a wire buffer of ``rect`` whose components' rows are ``rows`` (kvlab.model.layout.runs)."""
    i32, i64 = np.int32, np.int64
    bpl, comp = rect.n_heads * sum(rows), rect.n_heads * sum(rows[:c])
    params = (ids.data_ptr(), i32(0), i32(1), i64(0), *(i64(0),) * 5, i32(0), i32(0), i32(1), i64(bpl), i64(comp),
              i64(rows[c]))
    return params, math.gcd(bpl, comp, rows[c])


@lru_cache(maxsize=8)
def _convert_object(index: int, tuning: ConvertTuning):
    """kernels/fp8_rows.cu compiled with ``tuning``'s constants, loaded on device ``index``."""
    from cuda.core import Device, ObjectCode

    Device(index).set_current()
    return ObjectCode.from_cubin(compile_for_arch(device_arch(index), tuning, source=FP8_ROWS_SOURCE), name="fp8_rows")


@lru_cache(maxsize=64)
def _convert_kernel(index: int, tuning: ConvertTuning, lanes: int, base: str, smem: int):
    """(kernel, CTAs resident at once, ObjectCode) of ``kv_convert_rect`` for teams of ``lanes`` lanes and ``base``
    values (bf16 or fp16): a kernel of its own per form, ``kv_convert_rect_<lanes>_<base>``, launched with ``smem``
    bytes of dynamic shared memory (the ring's in the quantizing direction, none in the other), which the resident
    CTAs count."""
    obj = _convert_object(index, tuning)
    kernel = obj.get_kernel(f"kv_convert_rect_{lanes}_{base}")
    if smem > 48 * 1024:
        if smem > _smem_optin(index):
            raise ValueError(f"{tuning}: its cp.async ring needs {smem} bytes of shared memory per CTA, the device "
                             f"has {_smem_optin(index)}: fewer rows or slots")
        _allow_large_smem(kernel, index)
    per_sm = kernel.occupancy.max_active_blocks_per_multiprocessor(CONVERT_THREADS, smem)
    return kernel, max(1, per_sm) * _sm_count(index), obj


CONVERT_THREADS = 256  # the kernel's launch bound
# rows in flight per team (KV_ROWS in kernels/fp8_rows.cu), the quantizing direction's ring of cp.async slots per
# warp (KV_RING, 0: loads in registers) and the CTAs per SM the registers are bounded for (KV_MIN_CTAS; 0: the
# kernel's own rule, 2 for 4 rows or fewer, else 1): scripts/rect_bench.py --convert-rows/--convert-ring/--convert-ctas
# time others
CONVERT_ROWS = 4
CONVERT_RING = 4
CONVERT_MIN_CTAS = 0


@dataclass(frozen=True)
class ConvertTuning(Tuning):
    """The compile-time constants of ``kv_convert_rect``: ``Tuning``'s, its rows in flight per team, the slots of
    its cp.async ring per warp (0: none) and the CTAs per SM its registers are bounded for (0: the kernel's rule)."""

    rows: int = CONVERT_ROWS
    ring: int = CONVERT_RING
    min_ctas: int = CONVERT_MIN_CTAS

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.rows <= 16:  # each row in flight holds a 16-byte load and two pointers in registers
            raise ValueError(f"ConvertTuning.rows={self.rows}: use 1 to 16")
        if self.ring == 1 or not 0 <= self.ring <= 8:
            raise ValueError(f"ConvertTuning.ring={self.ring}: use 0 (no ring) or 2 to 8 slots")
        if not 0 <= self.min_ctas <= 8:
            raise ValueError(f"ConvertTuning.min_ctas={self.min_ctas}: use 1 to 8, or 0 for the kernel's rule")

    def defines(self) -> tuple[tuple[str, str], ...]:
        own = (("KV_ROWS", str(self.rows)), ("KV_RING", str(self.ring)))
        return super().defines() + own + ((("KV_MIN_CTAS", str(self.min_ctas)),) if self.min_ctas else ())

    def ring_bytes(self) -> int:
        """Dynamic shared memory of a quantizing launch: ``ConvertSlot`` in kernels/fp8_rows.cu per slot and warp."""
        slot = 32 * (16 + 8) * self.rows + 4 * 32
        return CONVERT_THREADS // 32 * self.ring * slot


def convert_tuning() -> ConvertTuning:
    """The tuning the launches take now (the module's constants, which a bench may change between cases)."""
    return ConvertTuning(rows=CONVERT_ROWS, ring=CONVERT_RING, min_ctas=CONVERT_MIN_CTAS)


def _convert_sides(spec_src, spec_dst, rect: Rect) -> list[ConvertShape] | None:
    """Every component's shape from ``spec_src``'s format to ``spec_dst``'s (kvlab.memory.ops.paths), or None where
    one is not the kernel's or the rectangle is beyond its int indexes."""
    shapes = paths.convert_shapes(spec_src, spec_dst)
    if shapes is None or rect.n_tokens <= 0:
        return None
    if rect.n_tokens * rect.n_layers * rect.n_heads > _INT_MAX or rect.t1 > _INT_MAX:
        return None
    return shapes


def _convert_launch(src_bytes, src_sides, dst_bytes, dst_sides, rect: Rect, shapes, ctas: int | None,
                    g: int) -> bool:
    """One ``kv_convert_rect`` per component, or False (nothing launched) where an alignment does not hold."""
    for c, sh in enumerate(shapes):
        (_, sa), (_, da) = src_sides[c], dst_sides[c]
        need_src, need_dst = (16, 4) if sh.to_fp8 else (4, 16)  # the values' side loads or stores 16 bytes
        if math.gcd(sa, src_bytes.data_ptr()) % need_src or math.gcd(da, dst_bytes.data_ptr()) % need_dst:
            return False
    from cuda.core import Device, LaunchConfig, Stream, launch

    dev = dst_bytes.device
    Device(dev.index).set_current()
    stream = Stream.from_handle(torch.cuda.current_stream(dev).cuda_stream)
    i32 = np.int32
    # items: a span of g tokens (one block on a pool side, one wire tile on a wire side) by every head of lm layers;
    # a warp's teams keep KV_ROWS rows each in flight (the teams are the fewest lanes of any component)
    tuning = convert_tuning()
    lm = layers_per_item(rect.n_layers, rect.n_heads * g, 32 // min(sh.lanes for sh in shapes) * tuning.rows,
                         CONVERT_LAYER_PASSES if g == 1 else None)
    nlg = -(-rect.n_layers // lm)
    items = ((rect.t1 - 1) // g - rect.t0 // g + 1) * nlg
    if items > _INT_MAX or lm * rect.n_heads * g > _INT_MAX // 2:
        return False
    for c, sh in enumerate(shapes):
        smem = tuning.ring_bytes() if sh.to_fp8 else 0
        kernel, resident, _ = _convert_kernel(dev.index, tuning, sh.lanes, sh.base, smem)
        grid = max(1, min(ctas or resident, -(-items // (CONVERT_THREADS // 32))))
        launch(stream, LaunchConfig(grid=grid, block=CONVERT_THREADS, shmem_size=smem), kernel, src_bytes.data_ptr(),
               dst_bytes.data_ptr(), *src_sides[c][0], *dst_sides[c][0], i32(g), i32(rect.t0), i32(rect.t1),
               i32(rect.n_layers), i32(rect.n_heads), i32(sh.elems), i32(sh.q), i32(sh.group), i32(sh.lanes),
               i32(sh.to_fp8), i32(sh.base == "fp16"), *fast_div(g), i32(lm), *fast_div(rect.n_heads * g),
               *fast_div(nlg), i32(items))
    return True


def _convert_pools(src_bytes, src_pool, src_nb, src_ids, src_base, dst_bytes, dst_pool, dst_nb, dst_ids, dst_base,
                   rect, ctas) -> bool:
    """copy_rect between pools of two formats in one pass per component; False where the kernel does not take it."""
    own = as_stored(rect)
    shapes = _convert_sides(src_pool.spec, dst_pool.spec, own)
    if shapes is None:
        return False
    for what, b, pool, nb, ids, base in (("source", src_bytes, src_pool, src_nb, src_ids, src_base),
                                         ("destination", dst_bytes, dst_pool, dst_nb, dst_ids, dst_base)):
        if b.dtype != torch.uint8 or b.numel() != pool.pool_bytes(nb) or not b.is_contiguous():
            raise ValueError(f"copy_rect: the {what} storage has {b.numel()} bytes of {b.dtype}, its layout needs "
                             f"{pool.pool_bytes(nb)} contiguous uint8")
        if b.device != dst_bytes.device:
            raise ValueError(f"copy_rect needs both pools on one CUDA device: the {what} is on {b.device}")
        if pool.tokens_per_block % own.tile:
            raise ValueError(f"copy_rect: tile {own.tile} does not divide the {what}'s tokens_per_block "
                             f"{pool.tokens_per_block}")
        _check_cuda(b, pool, own, ids, base, dst_bytes)
        if not ids.is_contiguous():
            raise ValueError("copy_rect needs contiguous block tables")
    n = len(shapes)
    return _convert_launch(src_bytes, [_pool_cside(src_pool, src_nb, own, src_ids, src_base, c) for c in range(n)],
                           dst_bytes, [_pool_cside(dst_pool, dst_nb, own, dst_ids, dst_base, c) for c in range(n)],
                           own, shapes, ctas, math.gcd(src_pool.tokens_per_block, dst_pool.tokens_per_block))


def _wire_rows(pool: RankPool, rect: Rect) -> tuple[int, ...]:
    return in_format(pool.spec, rect.wire).comp_row_bytes()


def _check_wire(pool_bytes, pool, num_blocks, rect, block_ids, block_base, buf) -> Rect:
    own = as_stored(rect)
    if pool_bytes.dtype != torch.uint8 or buf.dtype != torch.uint8:
        raise TypeError("pack/unpack work on uint8 tensors")
    if pool_bytes.numel() != pool.pool_bytes(num_blocks) or not pool_bytes.is_contiguous() or not buf.is_contiguous():
        raise ValueError(f"pool {pool.name}: storage has {pool_bytes.numel()} bytes, layout needs "
                         f"{pool.pool_bytes(num_blocks)} contiguous ones")
    need = rect.nbytes(_wire_rows(pool, rect))
    if buf.numel() != need:
        raise ValueError(f"pool {pool.name}: wire buffer has {buf.numel()} bytes, the rectangle in {rect.wire} "
                         f"needs {need}")
    _check_cuda(pool_bytes, pool, own, block_ids, block_base, buf)
    return own


def _convert_pack(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out, ctas) -> bool:
    """A converting pack in one pass (the pool's rows into the wire's format), or False."""
    wire = in_format(pool.spec, rect.wire)
    shapes = _convert_sides(pool.spec, wire, rect)
    if shapes is None:
        return False
    own = _check_wire(pool_bytes, pool, num_blocks, rect, block_ids, block_base, out)
    block_ids = block_ids.contiguous()
    n, rows = len(shapes), wire.comp_row_bytes()
    return _convert_launch(pool_bytes, [_pool_cside(pool, num_blocks, own, block_ids, block_base, c) for c in range(n)],
                           out, [_wire_cside(rows, own, block_ids, c) for c in range(n)], own, shapes, ctas,
                           own.tile)


def _convert_unpack(wire_buf, pool, num_blocks, rect, block_ids, block_base, pool_bytes, ctas) -> bool:
    """A converting unpack in one pass (the wire's rows into the pool's format), or False."""
    wire = in_format(pool.spec, rect.wire)
    shapes = _convert_sides(wire, pool.spec, rect)
    if shapes is None:
        return False
    own = _check_wire(pool_bytes, pool, num_blocks, rect, block_ids, block_base, wire_buf)
    block_ids = block_ids.contiguous()
    n, rows = len(shapes), wire.comp_row_bytes()
    return _convert_launch(wire_buf, [_wire_cside(rows, own, block_ids, c) for c in range(n)], pool_bytes,
                           [_pool_cside(pool, num_blocks, own, block_ids, block_base, c) for c in range(n)], own,
                           shapes, ctas, own.tile)
