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

template <typename V>
__device__ __forceinline__ void warp_copy(const V* __restrict__ s, V* __restrict__ d, i64 n, int lane) {
  for (i64 k = lane; k < n; k += 32 * KV_UNROLL) {
    V v[KV_UNROLL];
#pragma unroll
    for (int u = 0; u < KV_UNROLL; ++u) {
      const i64 j = k + 32 * u;
      if (j < n) v[u] = s[j];
    }
#pragma unroll
    for (int u = 0; u < KV_UNROLL; ++u) {
      const i64 j = k + 32 * u;
      if (j < n) d[j] = v[u];
    }
  }
}

// One side of the copy: its block table (int32 or int64, logical block base + i at index i) and the
// strides of its pool (kvlab.state.RankPool.strides / comp_offsets), with the rectangle's first layer
// and head relative to the layers and heads this rank holds.
struct Side {
  const void* ids;
  int ids64;
  int tpb;
  i64 base;
  i64 bs;
  i64 ls;
  i64 coff0;
  i64 coff1;
  int loff;
  int hoff;
};

__device__ __forceinline__ i64 run_at(const Side& s, i64 ts, int l, int c, int h, int row) {
  const i64 i = ts / s.tpb - s.base;
  const i64 blk = s.ids64 ? ((const i64*)s.ids)[i] : (i64)((const int*)s.ids)[i];
  return blk * s.bs + (i64)(l + s.loff) * s.ls + (c ? s.coff1 : s.coff0) + (i64)(h + s.hoff) * s.tpb * row +
         (ts % s.tpb) * row;
}

// The two sides' parameters come flat (cuda.core passes scalars and pointers, not structs).
extern "C" __global__ void __launch_bounds__(KV_THREADS)
kv_copy_rect(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
             const void* s_ids, int s_ids64, int s_tpb, i64 s_base, i64 s_bs, i64 s_ls, i64 s_coff0, i64 s_coff1,
             int s_loff, int s_hoff,
             const void* d_ids, int d_ids64, int d_tpb, i64 d_base, i64 d_bs, i64 d_ls, i64 d_coff0, i64 d_coff1,
             int d_loff, int d_hoff,
             int tile, i64 t0, i64 t1, int nl, int nh, int ncomp, int row0, int row1, i64 nruns) {
  const Side s = {s_ids, s_ids64, s_tpb, s_base, s_bs, s_ls, s_coff0, s_coff1, s_loff, s_hoff};
  const Side d = {d_ids, d_ids64, d_tpb, d_base, d_bs, d_ls, d_coff0, d_coff1, d_loff, d_hoff};
  const int lane = threadIdx.x & 31;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  const i64 u0 = t0 / tile;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < nruns; r += nwarps) {
    const int h = (int)(r % nh);
    i64 x = r / nh;
    const int c = (int)(x % ncomp);
    x /= ncomp;
    const int l = (int)(x % nl);
    const i64 u = x / nl + u0;
    const i64 ts = u * tile > t0 ? u * tile : t0;
    const i64 te = (u + 1) * tile < t1 ? (u + 1) * tile : t1;
    const int row = c ? row1 : row0;
    const i64 n = (te - ts) * row;
    const unsigned char* sp = src + run_at(s, ts, l, c, h, row);
    unsigned char* dp = dst + run_at(d, ts, l, c, h, row);
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
