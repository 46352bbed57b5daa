// Copy one rectangle of a KV cache straight from one pool into another (transport=ipc): the source
// may be another process's pool opened through CUDA IPC, and the two pools may differ in heads,
// layers, tokens per block and layout. Each side's run addresses are computed here from its block
// table and geometry, exactly as kvlab.layout.runs does on the host, so a chunk costs the host one
// launch and no index tensors: run r (wire order: tile, layer, component, head) is ntok * row bytes
// from src + mem_src(r) to dst + mem_dst(r). One warp per run (grid-stride), 16-byte vectors when
// both ends and the length allow (4-byte words, else bytes, otherwise), KV_UNROLL vectors in flight
// per lane: a KV run is a few KiB, so warps, not CTAs, keep enough bytes in flight. Runs of at most
// 512 bytes (one row: vLLM's NHD cache into TensorRT-LLM's moves 256-byte runs) would leave a warp
// per run mostly idle and one run in flight: there lane groups take runs, KV_UNROLL runs in flight
// per group (the short-run path).
// No #include: NVRTC needs no include path.
typedef long long i64;
typedef unsigned long long u64;

#ifndef KV_THREADS
#define KV_THREADS 256
#endif
#ifndef KV_UNROLL
#define KV_UNROLL 8
#endif
// runs in flight per lane group on the short-run path (four spill out of 64 registers)
#define KV_SHORT (KV_UNROLL < 3 ? KV_UNROLL : 3)
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

// RUN_AT with the run's block and its first token's offset in the block already read (blk, tok).
#define RUN_IN(P, blk, tok, k, l, c, h)                                                                 \
  ((blk) * ((c) ? P##bs1 : P##bs0) + (i64)((l) + P##loff) * ((c) ? P##ls1 : P##ls0) +                 \
   ((c) ? P##off1 : P##off0) + (i64)((h) + P##hoff) * ((c) ? P##hs1 : P##hs0) +                        \
   (i64)((tok) + (k)) * ((c) ? P##ns1 : P##ns0))

#define SIDE_PARAMS(P)                                                                                  \
  const void *P##ids, int P##ids64, int P##tpb, i64 P##base, i64 P##off0, i64 P##off1, i64 P##bs0,    \
      i64 P##bs1, i64 P##ls0, i64 P##ls1, i64 P##hs0, i64 P##hs1, i64 P##ns0, i64 P##ns1, int P##loff, \
      int P##hoff

// Runs of at most 32 * 16 bytes: groups of G lanes (a power of two, 16 * G bytes at least the longest
// run) each take KV_SHORT consecutive runs, loaded before the first store, so that a warp keeps
// 32 / G * KV_SHORT runs in flight instead of one. The group decodes its first run's coordinates
// and steps to the next ones by counting (sub-run, head, component, layer, tile), not by dividing
// again, and reads a tile's blocks from the tables once: with 256-byte runs the divisions and the
// table reads of a decode per run cost about as much as the copy. A run
// that is not 16-byte aligned at both ends is copied by its group a byte at a time after the others.
#define DECODE_RUN(r, sp, dp, n)                                                                        \
  {                                                                                                     \
    const int k_ = (r) % S;                                                                             \
    int x_ = (r) / S;                                                                                   \
    const int h_ = x_ % nh;                                                                             \
    x_ /= nh;                                                                                           \
    const int c_ = x_ % ncomp;                                                                          \
    x_ /= ncomp;                                                                                        \
    const int l_ = x_ % nl;                                                                             \
    const int u_ = x_ / nl + u0;                                                                        \
    const int ts_ = u_ * tile > tt0 ? u_ * tile : tt0;                                                  \
    const int te_ = (u_ + 1) * tile < tt1 ? (u_ + 1) * tile : tt1;                                      \
    const int row_ = c_ ? row1 : row0;                                                                  \
    n = S == 1 ? (te_ - ts_) * row_ : (k_ < te_ - ts_ ? row_ : 0);                                      \
    sp = src + (n ? RUN_AT(s_, ts_, k_, l_, c_, h_) : 0);                                               \
    dp = dst + (n ? RUN_AT(d_, ts_, k_, l_, c_, h_) : 0);                                               \
  }

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
  const int longest = (S == 1 ? tile : 1) * (row0 > row1 ? row0 : row1);
  if (longest <= 32 * 16) {  // the short-run path
    int G = 1;
    while (G * 16 < longest) G <<= 1;
    const int per_warp = (32 / G) * KV_SHORT;  // runs a warp takes per step
    const int g = lane / G, j = lane % G;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
#pragma unroll 1
    for (i64 r0 = (i64)warp * per_warp; r0 < nruns; r0 += (i64)nwarps * per_warp) {
      const i64 rb = r0 + (i64)g * KV_SHORT;  // this group's first run
      uint4 v[KV_SHORT];
      unsigned char* to[KV_SHORT];
      int odd = 0;  // runs of this group's step that are not 16-byte aligned: bit q
      int k = 0, h = 0, c = 0, l = 0, u = 0;
      int at = -1, stok = 0, dtok = 0;  // the tile whose blocks are read: its first token, offsets in the blocks
      i64 sblk = 0, dblk = 0;
      if (rb < nruns) {
        k = (int)rb % S;
        int x = (int)rb / S;
        h = x % nh;
        x /= nh;
        c = x % ncomp;
        x /= ncomp;
        l = x % nl;
        u = x / nl + u0;
      }
#pragma unroll
      for (int q = 0; q < KV_SHORT; ++q) {
        to[q] = 0;
        if (rb + q < nruns) {
          const int ts = u * tile > tt0 ? u * tile : tt0;
          const int te = (u + 1) * tile < tt1 ? (u + 1) * tile : tt1;
          const int row = c ? row1 : row0;
          const int n = S == 1 ? (te - ts) * row : (k < te - ts ? row : 0);
          if (ts != at) {  // a new tile: its blocks on both sides, read once for the runs that follow in it
            at = ts;
            sblk = s_ids64 ? ((const i64*)s_ids)[ts / s_tpb - s_base] : (i64)((const int*)s_ids)[ts / s_tpb - s_base];
            dblk = d_ids64 ? ((const i64*)d_ids)[ts / d_tpb - d_base] : (i64)((const int*)d_ids)[ts / d_tpb - d_base];
            stok = ts % s_tpb;
            dtok = ts % d_tpb;
          }
          if (n) {
            const unsigned char* sp = src + RUN_IN(s_, sblk, stok, k, l, c, h);
            unsigned char* dp = dst + RUN_IN(d_, dblk, dtok, k, l, c, h);
            if (((((u64)sp) | ((u64)dp) | (u64)n) & 15) != 0) {
              odd |= 1 << q;
            } else if (j * 16 < n) {
              v[q] = ((const uint4*)sp)[j];
              to[q] = dp + j * 16;
            }
          }
          if (++k == S) {  // the next run in wire order: sub-run, head, component, layer, tile
            k = 0;
            if (++h == nh) {
              h = 0;
              if (++c == ncomp) {
                c = 0;
                if (++l == nl) {
                  l = 0;
                  ++u;
                }
              }
            }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < KV_SHORT; ++q)
        if (to[q]) *(uint4*)to[q] = v[q];
#pragma unroll 1
      for (int q = 0; q < KV_SHORT; ++q) {
        if (!(odd & (1 << q))) continue;
        const unsigned char* sp;
        unsigned char* dp;
        int n;
        DECODE_RUN((int)(rb + q), sp, dp, n);
        for (int b = j; b < n; b += G) dp[b] = sp[b];
      }
    }
    return;
  }
#pragma unroll 1
  for (int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (int)nruns; r += nwarps) {
    const unsigned char* sp;
    unsigned char* dp;
    int n;
    DECODE_RUN(r, sp, dp, n);
    if (n == 0) continue;
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

// kv_copy_span: one component of a rectangle, pool to pool, as items of one span of g tokens (g = the gcd of both
// sides' tokens_per_block, so a span lies in one block on each side) by all the rectangle's heads of one layer.
// Within an item every row's address on each side is affine in (head, token): base + h * hs + k * ns, whatever the
// two layouts (token-major NHD or head-major HND, any block sizes). A warp takes an item, reads both block tables
// and computes both bases once, then walks the item's 16-byte vectors (head, token, vector of the row) with
// neighbouring lanes on neighbouring bytes of a row on both sides, KV_SPAN vectors in flight per lane; a vector's
// row and head come from multiplications by precomputed reciprocals (FDIV), not divisions. Runs of one row (vLLM
// NHD into TensorRT-LLM HND: 256 bytes) and runs of one block of one head (4 KiB) then cost what long runs cost:
// no per-run decode and no lanes idle at a run's end. Where one layer's span holds fewer vectors than a warp keeps
// in flight (DeepSeek's one 1152-byte MLA row per token into SGLang's one-token blocks: 72 vectors for 160 lane
// slots), an item takes lm consecutive layers (row addresses are affine in the layer too), so a warp's loads are
// not left half empty. The launcher takes this path where rows, strides and both pools are 16-byte aligned
// (kvlab.memory.ops.paths); the rest takes kv_copy_rect above.
// A side's il, id, ir: where the rectangle counts a decode-context-parallel rank's local positions (vLLM's DCP:
// runs of il tokens dealt over id ranks, this one ir) and this side keeps global tokens (the prefill's pool), the
// span at local position u lies at global token u / il * il * id + ir * il + u % il (kvlab.model.tokens); a span
// divides il, so its tokens stay consecutive. il = 0: the side counts the rectangle's own positions.
#define SPAN_SIDE(P)                                                                                    \
  const void *P##ids, int P##ids64, int P##tpb, i64 P##base, i64 P##off, i64 P##bs, i64 P##ls, i64 P##hs, \
      i64 P##ns, int P##loff, int P##hoff, int P##il, int P##id, int P##ir

__device__ __forceinline__ int span_token(int u, int il, int id, int ir) {
  return il ? u / il * il * id + ir * il + u % il : u;
}

// where token ts (a span's first, in the rectangle's positions) of layer l, head 0 of the rectangle lies on one side
#define SPAN_BASE(P, ts, l) span_base((ts), (l), P##ids, P##ids64, P##tpb, P##base, P##off, P##bs, P##ls, P##hs, \
                                      P##ns, P##loff, P##hoff, P##il, P##id, P##ir)

__device__ __forceinline__ i64 span_base(int ts, int l, const void* ids, int ids64, int tpb, i64 base, i64 off,
                                         i64 bs, i64 ls, i64 hs, i64 ns, int loff, int hoff, int il, int id,
                                         int ir) {
  const int t = span_token(ts, il, id, ir);
  const i64 blk = ids64 ? ((const i64*)ids)[t / tpb - base] : (i64)((const int*)ids)[t / tpb - base];
  return blk * bs + (i64)(l + loff) * ls + off + (i64)hoff * hs + (i64)(t % tpb) * ns;
}

// n / d for 0 <= n < 2^31 from d's magic (M, l) (kvlab.memory.ops.cuda.fast_div): the quotient without a division
#define FDIV(n, M, l) ((int)((__umulhi((unsigned)(n), (M)) + (unsigned)(n)) >> (l)))

// vectors in flight per lane
#ifndef KV_SPAN
#define KV_SPAN (KV_UNROLL < 5 ? KV_UNROLL : 5)
#endif

extern "C" __global__ void __launch_bounds__(KV_THREADS, KV_MIN_BLOCKS)
kv_copy_span(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, SPAN_SIDE(s_), SPAN_SIDE(d_),
             int g, int t0, int t1, int nl, int nh, int m, unsigned mM, int mL, unsigned gM, int gL, int lm,
             unsigned hgM, int hgL, unsigned nlgM, int nlgL, int items) {
  const int lane = threadIdx.x & 31;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
  const int nlg = (nl + lm - 1) / lm, hg = nh * g;  // layer groups of lm layers; rows of one layer's span
  const int s0 = t0 / g;
#pragma unroll 1
  for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < items; item += nwarps) {
    const int q = FDIV(item, nlgM, nlgL);
    const int l = (item - q * nlg) * lm, ts = (q + s0) * g;
    const int ml = nl - l < lm ? nl - l : lm;
    const int V = ml * hg * m;  // vectors of an item (< 2^31: the launcher)
    const int klo = t0 - ts > 0 ? t0 - ts : 0, khi = t1 - ts < g ? t1 - ts : g;
    const unsigned char* sb = src + SPAN_BASE(s_, ts, l);
    unsigned char* db = dst + SPAN_BASE(d_, ts, l);
#pragma unroll 1
    for (int v0 = lane; v0 < V; v0 += 32 * KV_SPAN) {
      uint4 v[KV_SPAN];
      uint4* to[KV_SPAN];
#pragma unroll
      for (int u = 0; u < KV_SPAN; ++u) {
        const int w = v0 + 32 * u;
        to[u] = 0;
        if (w < V) {
          const int row = FDIV(w, mM, mL), o = w - row * m;
          const int li = ml > 1 ? FDIV(row, hgM, hgL) : 0, lr = row - li * hg;
          const int h = FDIV(lr, gM, gL), k = lr - h * g;
          if (k >= klo && k < khi) {
            v[u] = ((const uint4*)(sb + li * s_ls + h * s_hs + k * s_ns))[o];
            to[u] = (uint4*)(db + li * d_ls + h * d_hs + k * d_ns) + o;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < KV_SPAN; ++u)
        if (to[u]) *to[u] = v[u];
    }
  }
}
