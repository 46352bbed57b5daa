// Copy one rectangle of a KV cache straight from one pool into another (transport=ipc): the source
// may be another process's pool opened through CUDA IPC, and the two pools may differ in heads,
// layers, tokens per block and layout. Each side's run addresses are computed here from its block
// table and geometry, exactly as kvlab.layout.runs does on the host, so a chunk costs the host one
// launch and no index tensors: run r (wire order: tile, layer, component, head) is ntok * row bytes
// from src + mem_src(r) to dst + mem_dst(r). One warp per run (grid-stride), 16-byte vectors when
// both ends and the length allow (4-byte words, else bytes, otherwise), KV_UNROLL vectors in flight
// per lane: a KV run is a few KiB, so warps, not CTAs, keep enough bytes in flight.
// No #include: NVRTC needs no include path.
typedef long long i64;
typedef unsigned long long u64;

#ifndef KV_THREADS
#define KV_THREADS 256
#endif
#ifndef KV_UNROLL
#define KV_UNROLL 8
#endif
// CTAs per SM the compiler must fit in registers: the copy needs warps in flight, not registers
#ifndef KV_MIN_BLOCKS
#define KV_MIN_BLOCKS (1024 / KV_THREADS)
#endif

// n vectors (a run is below 2^30 bytes, so int indexes it): full steps of KV_UNROLL vectors per lane
// with no bounds checks, KV_UNROLL loads in flight before the first store; then the tail.
template <typename V>
__device__ __forceinline__ void warp_copy(const V* __restrict__ s, V* __restrict__ d, int n, int lane) {
  int k = lane;
#pragma unroll 1
  for (; k + 32 * (KV_UNROLL - 1) < n; k += 32 * KV_UNROLL) {
    V v[KV_UNROLL];
#pragma unroll
    for (int u = 0; u < KV_UNROLL; ++u) v[u] = s[k + 32 * u];
#pragma unroll
    for (int u = 0; u < KV_UNROLL; ++u) d[k + 32 * u] = v[u];
  }
#pragma unroll 1
  for (; k < n; k += 32) d[k] = s[k];
}

// Pool offset of a run on one side (kvlab.layout.runs): its block from the side's block table (int32
// or int64; logical block base + i at index i), then the component's strides (RankPool.comp_strides:
// the layout's order of block, layer, component, head and token), with the rectangle's first layer and
// head relative to those the rank holds. The parameters stay in the kernel's parameter space: copied
// into registers they would spill.
#define RUN_AT(P, ts, k, l, c, h)                                                                       \
  ((P##ids64 ? ((const i64*)P##ids)[(ts) / P##tpb - P##base]                                         \
             : (i64)((const int*)P##ids)[(ts) / P##tpb - P##base]) * ((c) ? P##bs1 : P##bs0) +       \
   (i64)((l) + P##loff) * ((c) ? P##ls1 : P##ls0) + ((c) ? P##off1 : P##off0) +                       \
   (i64)((h) + P##hoff) * ((c) ? P##hs1 : P##hs0) + (i64)((ts) % P##tpb + (k)) * ((c) ? P##ns1 : P##ns0))

#define SIDE_PARAMS(P)                                                                                  \
  const void *P##ids, int P##ids64, int P##tpb, i64 P##base, i64 P##off0, i64 P##off1, i64 P##bs0,    \
      i64 P##bs1, i64 P##ls0, i64 P##ls1, i64 P##hs0, i64 P##hs1, i64 P##ns0, i64 P##ns1, int P##loff, \
      int P##hoff

// The two sides' parameters come flat (cuda.core passes scalars and pointers, not structs). S: 1 where
// both sides keep a head's token rows back to back (a run is a tile's rows), else the tile: each run is
// then S runs of one row, those past a partial tile's end empty.
extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MIN_BLOCKS)
kv_copy_rect(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, SIDE_PARAMS(s_),
             SIDE_PARAMS(d_), int tile, i64 t0, i64 t1, int nl, int nh, int ncomp, int row0, int row1, int S,
             i64 nruns) {
  // runs, tokens, layers and heads fit in int (the launcher checks): 32-bit division, no 64-bit subroutine
  const int lane = threadIdx.x & 31;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
  const int tt0 = (int)t0, tt1 = (int)t1, u0 = tt0 / tile;
#pragma unroll 1
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (int)nruns; r += nwarps) {
    const int k = r % S;
    int x = r / S;
    const int h = x % nh;
    x /= nh;
    const int c = x % ncomp;
    x /= ncomp;
    const int l = x % nl;
    const int u = x / nl + u0;
    const int ts = u * tile > tt0 ? u * tile : tt0;
    const int te = (u + 1) * tile < tt1 ? (u + 1) * tile : tt1;
    const int row = c ? row1 : row0;
    const int n = S == 1 ? (te - ts) * row : (k < te - ts ? row : 0);
    if (n == 0) continue;
    const unsigned char* sp = src + RUN_AT(s_, ts, k, l, c, h);
    unsigned char* dp = dst + RUN_AT(d_, ts, k, l, c, h);
    const u64 a = ((u64)sp) | ((u64)dp) | (u64)n;
    if ((a & 15) == 0) {
      warp_copy<uint4>((const uint4*)sp, (uint4*)dp, n >> 4, lane);
    } else if ((a & 3) == 0) {
      warp_copy<unsigned int>((const unsigned int*)sp, (unsigned int*)dp, n >> 2, lane);
    } else {
      warp_copy<unsigned char>(sp, dp, n, lane);
    }
  }
}
