"""What few CTAs can move at all, beside the pack/unpack kernels (scripts/kernel_bench.py ``--ceilings``).

- ``linear copy``: the plainest copy a kernel can make, one contiguous buffer, 16-byte vectors, ``unroll``
  loads in flight per thread before their stores, grid-stride over the given CTAs. No table, no runs: what the
  SMs themselves can read and write, the ceiling of any kernel's pack or unpack on that many CTAs.
- ``copy engines``: the chunk's runs (merged where adjacent on both sides) as one ``cuMemcpyBatchAsync``
  asking for the copy engines (``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``), which take no SM at all. Timed
  by events around the call, so the host's marshalling of the descriptors counts where it is the longer part
  (a CUDA graph cannot hold the batch: its capture is refused); ``host_ms`` is the call's own time on the host.
  Verified against the reference pack.
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


def linear_copy(arch: str, unroll: int):
    """The linear copy kernel compiled for ``arch`` with ``unroll`` vectors in flight per thread."""
    from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(arch=arch, std="c++17", name="lin_copy", define_macro=[("UNROLL", str(unroll))])
    return Program(LINEAR_SRC, "c++", options=opts).compile("cubin").get_kernel("lin_copy")


def launch_linear(kernel, src: torch.Tensor, dst: torch.Tensor, ctas: int, threads: int) -> None:
    import numpy as np
    from cuda.core import LaunchConfig, Stream, launch

    stream = Stream.from_handle(torch.cuda.current_stream(src.device).cuda_stream)
    launch(stream, LaunchConfig(grid=ctas, block=threads), kernel, src.data_ptr(), dst.data_ptr(),
           np.int64(src.numel() // 16))


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
