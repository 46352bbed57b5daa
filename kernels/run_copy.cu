// Copy runs from one pool straight into another: run r is len[r] bytes from src + src_off[r] to
// dst + dst_off[r]. The source may be another process's pool opened through CUDA IPC. One warp per
// run at a time (grid-stride over runs), 16-byte vectors when both ends and the length allow (4-byte
// words, else bytes, otherwise), KV_RUN_UNROLL vectors in flight per lane: a KV run is a few KiB, so
// warps, not CTAs, keep enough runs in flight. No #include: NVRTC needs no include path.
typedef long long i64;
typedef unsigned long long u64;

#ifndef KV_RUN_UNROLL
#define KV_RUN_UNROLL 4
#endif

template <typename V>
__device__ __forceinline__ void warp_copy(const V* __restrict__ s, V* __restrict__ d, i64 n, int lane) {
  for (i64 k = lane; k < n; k += 32 * KV_RUN_UNROLL) {
    V v[KV_RUN_UNROLL];
#pragma unroll
    for (int u = 0; u < KV_RUN_UNROLL; ++u) {
      const i64 j = k + 32 * u;
      if (j < n) v[u] = s[j];
    }
#pragma unroll
    for (int u = 0; u < KV_RUN_UNROLL; ++u) {
      const i64 j = k + 32 * u;
      if (j < n) d[j] = v[u];
    }
  }
}

extern "C" __global__ void kv_copy_runs(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                        const i64* __restrict__ src_off, const i64* __restrict__ dst_off,
                                        const i64* __restrict__ len, i64 nruns) {
  const int lane = threadIdx.x & 31;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < nruns; r += nwarps) {
    const unsigned char* s = src + src_off[r];
    unsigned char* d = dst + dst_off[r];
    const i64 n = len[r];
    const u64 a = ((u64)s) | ((u64)d) | (u64)n;
    if ((a & 15) == 0) {
      warp_copy<uint4>((const uint4*)s, (uint4*)d, n >> 4, lane);
    } else if ((a & 3) == 0) {
      warp_copy<unsigned int>((const unsigned int*)s, (unsigned int*)d, n >> 2, lane);
    } else {
      warp_copy<unsigned char>(s, d, n, lane);
    }
  }
}
