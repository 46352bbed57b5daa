"""What few CTAs can move at all, beside the pack/unpack kernels (scripts/kernel_bench.py ``--ceilings``).

- ``linear copy``: the plainest copy a kernel can make, one contiguous buffer, 16-byte vectors, ``unroll``
  loads in flight per thread before their stores, grid-stride over the given CTAs. No table, no runs: what the
  SMs themselves can read and write, the ceiling of any kernel's pack or unpack on that many CTAs.
- ``copy engines``: the chunk's runs (merged where adjacent on both sides) as one ``cuMemcpyBatchAsync``
  asking for the copy engines (``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``), which take no SM at all. Timed
  by events around the call, so the host's marshalling of the descriptors counts where it is the longer part
  (a CUDA graph cannot hold the batch: its capture is refused); ``host_ms`` is the call's own time on the host.
  Verified against the reference pack.
- ``converting copy``: the least traffic a conversion into a smaller format can make, one contiguous buffer:
  every source byte read once and every delivered byte written once (``d[j] = s[j] ^ s[m + j]``, the second
  where the source has it), 16-byte vectors, ``unroll`` of each in flight per thread. A bf16 -> fp8 copy reads
  the source rows and writes codes and scales; none can beat a copy with its reads and writes and no layout, so
  this, not ``copy_`` of the source bytes (which writes twice what fp8 delivers), is its ceiling.
- ``scattered pieces`` (scripts/rect_bench.py ``--ceilings``): the bytes of a request cut into pieces of one size,
  each piece moved whole from a random place on one side to a random place on the other (or to the same place,
  where that side is contiguous): the plainest copy with a paged cache's access pattern, no block table and no
  layout. What the memory gives for pieces of that size, the ceiling of a layout pair whose contiguous pieces are
  that long, where ``copy_`` is the ceiling for one contiguous buffer.
- ``scattered converting copy`` (scripts/rect_bench.py, gen fp8 pairs whose rows are whole vectors): the
  converting copy's traffic with the pair's own access pattern and no layout: one piece per token row, each side's
  pieces in runs as long as that side keeps a block's token rows together, the runs at random places; each source
  piece read once and its delivered piece written once (``shrink_copy`` within the piece). The ceiling of a
  converting pair such as DeepSeek-V3.2 into SGLang, which writes one 656-byte row per token to scattered blocks.
"""
from __future__ import annotations

import torch

from kvlab.model.layout import runs
from kvlab.transports.direct import coalesce

LINEAR_SRC = r"""
extern "C" __global__ void lin_copy(const uint4* __restrict__ s, uint4* __restrict__ d, long long n) {
    const long long step = (long long)gridDim.x * blockDim.x * UNROLL;
    for (long long i = (long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; i < n; i += step) {
        uint4 r[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            long long j = i + (long long)k * blockDim.x;
            r[k] = j < n ? __ldg(s + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            long long j = i + (long long)k * blockDim.x;
            if (j < n) d[j] = r[k];
        }
    }
}
"""
LINEAR_TUNINGS = ((1024, 8), (512, 16), (1024, 16))  # (threads, unroll)


def compiled(source: str, name: str, arch: str, unroll: int):
    """One of these kernels compiled by NVRTC for ``arch`` (cuda.core's ObjectCode; no GPU needed until a
    kernel is taken from it)."""
    from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(arch=arch, std="c++17", name=name, define_macro=[("UNROLL", str(unroll))])
    return Program(source, "c++", options=opts).compile("cubin")


def linear_copy(arch: str, unroll: int):
    """The linear copy kernel compiled for ``arch`` with ``unroll`` vectors in flight per thread."""
    return compiled(LINEAR_SRC, "lin_copy", arch, unroll).get_kernel("lin_copy")


def launch_linear(kernel, src: torch.Tensor, dst: torch.Tensor, ctas: int, threads: int) -> None:
    import numpy as np
    from cuda.core import LaunchConfig, Stream, launch

    stream = Stream.from_handle(torch.cuda.current_stream(src.device).cuda_stream)
    launch(stream, LaunchConfig(grid=ctas, block=threads), kernel, src.data_ptr(), dst.data_ptr(),
           np.int64(src.numel() // 16))


SHRINK_SRC = r"""
// n source vectors read once each, m <= n <= 2m destination vectors written once each: the traffic of a
// conversion that delivers m vectors for n, at the memory's speed (the xor keeps every read needed)
extern "C" __global__ void shrink_copy(const uint4* __restrict__ s, uint4* __restrict__ d, long long n, long long m) {
    const long long step = (long long)gridDim.x * blockDim.x * UNROLL;
    for (long long i = (long long)blockIdx.x * blockDim.x * UNROLL + threadIdx.x; i < m; i += step) {
        uint4 a[UNROLL], b[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const long long j = i + (long long)k * blockDim.x;
            a[k] = j < m ? __ldg(s + j) : make_uint4(0, 0, 0, 0);
            b[k] = j < m && m + j < n ? __ldg(s + m + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const long long j = i + (long long)k * blockDim.x;
            if (j < m) d[j] = make_uint4(a[k].x ^ b[k].x, a[k].y ^ b[k].y, a[k].z ^ b[k].z, a[k].w ^ b[k].w);
        }
    }
}
"""


SHRINK_UNROLLS = (4, 8)  # the benches time both and keep the faster: a ceiling must not be the slower tuning


def shrink_copy(arch: str, unroll: int = 4):
    """The converting-copy ceiling kernel compiled for ``arch`` with ``unroll`` vector pairs in flight per thread."""
    return compiled(SHRINK_SRC, "shrink_copy", arch, unroll).get_kernel("shrink_copy")


def launch_shrink(kernel, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst`` (m 16-byte vectors) from all of ``src`` (n vectors, m <= n <= 2m), on 1,024 threads per SM."""
    import numpy as np
    from cuda.core import LaunchConfig, Stream, launch

    n, m = src.numel() // 16, dst.numel() // 16
    if not (m <= n <= 2 * m and src.numel() % 16 == 0 and dst.numel() % 16 == 0):
        raise ValueError(f"shrink_copy: {src.numel()} source bytes into {dst.numel()}: needs whole 16-byte vectors, "
                         "and the source between one and two times the destination")
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    stream = Stream.from_handle(torch.cuda.current_stream(src.device).cuda_stream)
    launch(stream, LaunchConfig(grid=sms * 4, block=256), kernel, src.data_ptr(), dst.data_ptr(), np.int64(n),
           np.int64(m))


def shrink_reference(src: torch.Tensor, dst_bytes: int) -> torch.Tensor:
    """What ``shrink_copy`` writes, by torch: the first ``dst_bytes`` of ``src`` xor the rest (zero-padded); of
    each row of ``src`` where it has more than one dimension (the pieces of ``piece_shrink``)."""
    a = src[..., :dst_bytes].contiguous().view(torch.int32)
    b = torch.zeros_like(a)
    rest = src[..., dst_bytes:].contiguous().view(torch.int32)
    b[..., :rest.shape[-1]] = rest
    return (a ^ b).view(torch.uint8)


PIECES_SRC = r"""
// blockDim.x lanes over a piece's m vectors, blockDim.y pieces side by side, UNROLL pieces in flight per thread:
// piece p goes from s + ps[p] * m to d + pd[p] * m (16-byte vectors), no division per vector
extern "C" __global__ void piece_copy(const uint4* __restrict__ s, uint4* __restrict__ d, const int* __restrict__ ps,
                                      const int* __restrict__ pd, int n, int m) {
    const int per = blockDim.y * UNROLL;
    for (int p0 = blockIdx.x * per; p0 < n; p0 += gridDim.x * per) {
        for (int x = threadIdx.x; x < m; x += blockDim.x) {
            uint4 r[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const int p = p0 + threadIdx.y + k * blockDim.y;
                if (p < n) r[k] = s[(long long)ps[p] * m + x];
            }
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const int p = p0 + threadIdx.y + k * blockDim.y;
                if (p < n) d[(long long)pd[p] * m + x] = r[k];
            }
        }
    }
}
"""


def piece_copy(arch: str, unroll: int = 8):
    """The scattered-pieces kernel compiled for ``arch`` with ``unroll`` pieces in flight per thread."""
    return compiled(PIECES_SRC, "piece_copy", arch, unroll).get_kernel("piece_copy")


def launch_pieces(kernel, src: torch.Tensor, dst: torch.Tensor, ps: torch.Tensor, pd: torch.Tensor,
                  piece: int) -> None:
    """``dst``'s piece ``pd[i]`` = ``src``'s piece ``ps[i]`` for every i, pieces of ``piece`` bytes (a multiple of
    16), on 1,024 threads per SM as kvlab's copy kernels are."""
    import numpy as np
    from cuda.core import LaunchConfig, Stream, launch

    m = piece // 16
    bx = min(m, 128)
    by = max(1, 256 // bx)
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    stream = Stream.from_handle(torch.cuda.current_stream(src.device).cuda_stream)
    launch(stream, LaunchConfig(grid=sms * max(1, 1024 // (bx * by)), block=(bx, by)), kernel, src.data_ptr(),
           dst.data_ptr(), ps.data_ptr(), pd.data_ptr(), np.int32(ps.numel()), np.int32(m))


PIECE_SHRINK_SRC = r"""
// the converting copy with a paged cache's access pattern: piece p's ms source vectors at s + ps[p] * ms read once,
// its md (md <= ms <= 2 md) delivered vectors written once at d + pd[p] * md, as shrink_copy does within a piece;
// blockDim.x lanes over a piece's vectors, blockDim.y pieces side by side, UNROLL pieces in flight per thread
extern "C" __global__ void piece_shrink(const uint4* __restrict__ s, uint4* __restrict__ d, const int* __restrict__ ps,
                                        const int* __restrict__ pd, int n, int ms, int md) {
    const int per = blockDim.y * UNROLL;
    for (int p0 = blockIdx.x * per; p0 < n; p0 += gridDim.x * per) {
        for (int x = threadIdx.x; x < md; x += blockDim.x) {
            uint4 a[UNROLL], b[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const int p = p0 + threadIdx.y + k * blockDim.y;
                const uint4* q = s + (long long)(p < n ? ps[p] : 0) * ms;
                a[k] = p < n ? __ldg(q + x) : make_uint4(0, 0, 0, 0);
                b[k] = p < n && md + x < ms ? __ldg(q + md + x) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const int p = p0 + threadIdx.y + k * blockDim.y;
                if (p < n) d[(long long)pd[p] * md + x] =
                    make_uint4(a[k].x ^ b[k].x, a[k].y ^ b[k].y, a[k].z ^ b[k].z, a[k].w ^ b[k].w);
            }
        }
    }
}
"""


def piece_shrink(arch: str, unroll: int = 4):
    """The scattered converting-copy ceiling kernel compiled for ``arch`` with ``unroll`` pieces in flight per
    thread."""
    return compiled(PIECE_SHRINK_SRC, "piece_shrink", arch, unroll).get_kernel("piece_shrink")


def run_places(n: int, run: int, gen: torch.Generator) -> torch.Tensor:
    """Where each of ``n`` pieces lies on a side that keeps ``run`` consecutive pieces together (a block of ``run``
    token rows) and puts its runs at random places: a permutation of range(n), int32, in which pieces ``i`` and
    ``i + 1`` of one run are neighbours."""
    if run < 1 or n % run:
        raise ValueError(f"run_places: {n} pieces do not split into runs of {run}; use a run that divides them")
    slots = torch.randperm(n // run, generator=gen, dtype=torch.int64)
    return (slots[:, None] * run + torch.arange(run)).reshape(-1).to(torch.int32)


def launch_piece_shrink(kernel, src: torch.Tensor, dst: torch.Tensor, ps: torch.Tensor, pd: torch.Tensor,
                        src_piece: int, dst_piece: int) -> None:
    """``dst``'s piece ``pd[i]`` (``dst_piece`` bytes) from all of ``src``'s piece ``ps[i]`` (``src_piece``
    bytes), as ``piece_shrink_reference`` says, on 1,024 threads per SM as kvlab's copy kernels are."""
    import numpy as np
    from cuda.core import LaunchConfig, Stream, launch

    ms, md = src_piece // 16, dst_piece // 16
    if not (src_piece % 16 == 0 and dst_piece % 16 == 0 and md <= ms <= 2 * md):
        raise ValueError(f"piece_shrink: pieces of {src_piece} source bytes into {dst_piece}: needs whole 16-byte "
                         "vectors, and the source piece between one and two times the delivered one")
    bx = min(md, 128)
    by = max(1, 256 // bx)
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    stream = Stream.from_handle(torch.cuda.current_stream(src.device).cuda_stream)
    launch(stream, LaunchConfig(grid=sms * max(1, 1024 // (bx * by)), block=(bx, by)), kernel, src.data_ptr(),
           dst.data_ptr(), ps.data_ptr(), pd.data_ptr(), np.int32(ps.numel()), np.int32(ms), np.int32(md))


def piece_shrink_reference(src: torch.Tensor, ps: torch.Tensor, pd: torch.Tensor, src_piece: int,
                           dst_piece: int) -> torch.Tensor:
    """What ``piece_shrink`` writes into a buffer of ``len(pd)`` delivered pieces, by torch: each piece as
    ``shrink_reference`` makes it from its source piece."""
    out = torch.empty(len(pd), dst_piece, dtype=torch.uint8, device=src.device)
    out[pd.long()] = shrink_reference(src.view(-1, src_piece)[ps.long()], dst_piece)
    return out.view(-1)


class CopyEngines:
    """The pack of one kernel_bench Chunk as one batch of copy-engine copies (pool runs -> wire)."""

    def __init__(self, ch):
        from cuda.bindings import driver as drv

        self.drv = drv
        r = runs(ch.pool, ch.num_blocks, ch.rect, ch.ids, 0)
        flat = [t.reshape(-1).cpu().numpy() for t in (r.mem, r.wire, r.length)]
        mem, wire, lens = (a.tolist() for a in coalesce(*flat))
        self.count = len(lens)
        base_s, base_d = ch.pool_bytes.data_ptr(), ch.wire.data_ptr()
        self.srcs = [drv.CUdeviceptr(base_s + m) for m in mem]
        self.dsts = [drv.CUdeviceptr(base_d + w) for w in wire]
        self.sizes = lens
        attr = drv.CUmemcpyAttributes()
        attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.flags = drv.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        loc = drv.CUmemLocation()
        loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = ch.wire.device.index or 0
        attr.srcLocHint, attr.dstLocHint = loc, loc
        self.attrs = [attr]
        self.side = torch.cuda.Stream(ch.wire.device)  # the batch API refuses the legacy default stream

    def __call__(self) -> None:
        here = torch.cuda.current_stream()
        stream = self.side if here.cuda_stream == 0 else here  # torch's default is the legacy one: ours, in order
        if stream is not here:
            stream.wait_stream(here)
        out = self.drv.cuMemcpyBatchAsync(self.dsts, self.srcs, self.sizes, self.count, self.attrs, [0], 1,
                                          stream.cuda_stream)
        err = out[0] if isinstance(out, tuple) else out
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync of {self.count} copies: {err}")
        if stream is not here:
            here.wait_stream(stream)

    def host_ms(self, iters: int) -> float:
        """The call's time on the host (marshalling the descriptors and enqueueing), per call."""
        import time

        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            self()
        spent = time.perf_counter() - t
        torch.cuda.synchronize()
        return spent / iters * 1e3
