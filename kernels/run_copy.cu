// Copy runs from one pool straight into another: run r is len[r] bytes from src + src_off[r] to
// dst + dst_off[r]. The source may be another process's pool opened through CUDA IPC. One CTA
// per run at a time (grid-stride over runs), 16-byte vectors when both ends and the length allow,
// KV_RUN_UNROLL vectors in flight per thread. No #include: NVRTC needs no include path.
typedef long long i64;
typedef unsigned long long u64;

#ifndef KV_RUN_UNROLL
#define KV_RUN_UNROLL 4
#endif

extern "C" __global__ void kv_copy_runs(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                        const i64* __restrict__ src_off, const i64* __restrict__ dst_off,
                                        const i64* __restrict__ len, i64 nruns) {
  for (i64 r = blockIdx.x; r < nruns; r += gridDim.x) {
    const unsigned char* s = src + src_off[r];
    unsigned char* d = dst + dst_off[r];
    const i64 n = len[r];
    if (((((u64)s) | ((u64)d) | (u64)n) & 15) == 0) {
      const uint4* s4 = (const uint4*)s;
      uint4* d4 = (uint4*)d;
      const i64 n4 = n >> 4;
      const i64 step = (i64)blockDim.x * KV_RUN_UNROLL;
      for (i64 k = threadIdx.x; k < n4; k += step) {
        uint4 v[KV_RUN_UNROLL];
#pragma unroll
        for (int u = 0; u < KV_RUN_UNROLL; ++u) {
          const i64 j = k + (i64)u * blockDim.x;
          if (j < n4) v[u] = s4[j];
        }
#pragma unroll
        for (int u = 0; u < KV_RUN_UNROLL; ++u) {
          const i64 j = k + (i64)u * blockDim.x;
          if (j < n4) d4[j] = v[u];
        }
      }
    } else {
      for (i64 k = threadIdx.x; k < n; k += blockDim.x) d[k] = s[k];
    }
  }
}
