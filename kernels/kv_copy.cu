// Pack (pool -> wire) and unpack (wire -> pool) of one rectangle of one rank's pool.
//
// The runs are those of kvlab.layout.runs, enumerated in wire order
// (tile -> layer -> component -> head), each a contiguous range of tile tokens' rows on
// both sides. Runs range from a few bytes (a tile of 4-byte indexer scales) to tens of KiB
// (a tile of 1152-byte MLA rows), so warps do not take runs: they take work items of about
// one warp step (32 lanes x KV_UNROLL vectors of 16 bytes, 4 KiB at unroll 8). A long run
// is cut into equal pieces of at most a step, one item each; runs shorter than a step go to
// lane groups, several runs per item. Every item then costs a warp about the same, whatever
// the runs look like, and the grid-stride loop over items balances with few CTAs: the launch
// can be held to a few CTAs and leave NCCL's kernels the rest of the SMs.
//
// No #include: NVRTC has no default include path, and builtin types plus __ldg are enough.

#ifndef KV_UNROLL
#define KV_UNROLL 8  // vectors per lane in flight: a 32-lane warp moves 4 KiB per step with uint4
#endif

typedef long long i64;
typedef unsigned long long u64;

// All loads of a step are issued before its stores so that each lane has KV_UNROLL requests
// in flight: with few CTAs, bytes in flight per SM, not instruction count, bounds the
// bandwidth. What is left after the whole steps takes one more step with clamped loads, not
// a remainder loop, which would wait out one memory latency per vector.
//
// A whole warp interleaves its lanes (coalesced). A group of G < 32 lanes gives each lane
// KV_UNROLL consecutive vectors instead: with G only known at run time, interleaving would
// take a 64-bit address register per vector in flight and spill.
template <typename V, bool WARP>
__device__ __forceinline__ void group_copy_vec(char* __restrict__ dst, const char* __restrict__ src, int n, int gl,
                                               int G) {
    const V* s = reinterpret_cast<const V*>(src);
    V* d = reinterpret_cast<V*>(dst);
    const int apart = WARP ? 32 : 1;  // vectors between a lane's consecutive ones
    int i = WARP ? gl : gl * KV_UNROLL;
    const int adv = KV_UNROLL * (WARP ? 32 : G);
    for (; i + (KV_UNROLL - 1) * apart < n; i += adv) {
        V r[KV_UNROLL];
#pragma unroll
        for (int k = 0; k < KV_UNROLL; ++k) r[k] = __ldg(s + i + k * apart);
#pragma unroll
        for (int k = 0; k < KV_UNROLL; ++k) d[i + k * apart] = r[k];
    }
    if (i < n) {
        // a partial step: the loads past the end reread the last vector so that none needs a predicate
        V r[KV_UNROLL];
#pragma unroll
        for (int k = 0; k < KV_UNROLL; ++k) r[k] = __ldg(s + min(i + k * apart, n - 1));
#pragma unroll
        for (int k = 0; k < KV_UNROLL; ++k)
            if (i + k * apart < n) d[i + k * apart] = r[k];
    }
}

// len bytes by the G lanes (gl = 0..G-1) of a group, at the widest vector that both
// addresses can share: peel the head bytes until src is aligned to it (dst then is too, as
// they agree modulo the width), vectors for the body, bytes for the tail. Any row size and
// any buffer offset work; 16-byte accesses whenever the two addresses agree modulo 16, which
// every pool and slot view of whole rows does. The launcher keeps runs to 2^30 bytes, so that
// lengths and piece offsets are int.
template <bool WARP>
__device__ __forceinline__ void copy_part(char* __restrict__ dst, const char* __restrict__ src, int len, int gl,
                                          int G) {
    const u64 mis = reinterpret_cast<u64>(dst) ^ reinterpret_cast<u64>(src);
    const int w = (mis & 15) == 0 ? 16 : (mis & 7) == 0 ? 8 : (mis & 3) == 0 ? 4 : (mis & 1) == 0 ? 2 : 1;
    int head = (int)((w - (reinterpret_cast<u64>(src) & (u64)(w - 1))) & (u64)(w - 1));
    if (head > len) head = len;
    for (int i = gl; i < head; i += G) dst[i] = __ldg(src + i);
    dst += head;
    src += head;
    len -= head;
    const int n = len / w;
    switch (w) {
        case 16: group_copy_vec<uint4, WARP>(dst, src, n, gl, G); break;
        case 8: group_copy_vec<uint2, WARP>(dst, src, n, gl, G); break;
        case 4: group_copy_vec<unsigned int, WARP>(dst, src, n, gl, G); break;
        case 2: group_copy_vec<unsigned short, WARP>(dst, src, n, gl, G); break;
        default: group_copy_vec<unsigned char, WARP>(dst, src, n, gl, G); break;
    }
    const int done = n * w;
    for (int i = gl; i < len - done; i += G) dst[done + i] = __ldg(src + done + i);
}

// A whole run by a whole warp: the bulk kernels' path for runs they cannot stream.
__device__ __forceinline__ void copy_run(char* __restrict__ dst, const char* __restrict__ src, int len, int lane) {
    copy_part<true>(dst, src, len, lane, 32);
}

// The runs of one rectangle. Every size and offset is in bytes. ids_bytes: 4 (int32 block
// table) or 8 (int64). l_off/h_off: the rectangle's first layer/head relative to the rank's
// first held one. Each component has its own strides (RankPool.comp_strides: the layout's
// order of block, layer, component, head and token made strides): byte x of the row of
// (block b, layer l, head h, token n) lies at off + b*bs + l*ls + h*hs + n*ns + x. S is 1 where
// every component keeps a head's token rows back to back (a run is a tile's rows), else T: each
// run is then cut into S runs of one row (kvlab.layout.runs), those past a partial tile's end
// empty. Counts and per-run sizes are int (the launcher checks they fit); memory and wire offsets
// are 64-bit. 32-bit division keeps the run decoding cheap and off the register budget. Tiles are
// numbered from the rectangle's first one (u = 0).
struct Runs {
    char* pool;
    char* wire;
    const void* ids;
    int ids_bytes;
    i64 num_blocks, block_base;
    int tpb, T;
    i64 t0, t1;
    int l_off, nl, h_off, nh, ncomp, row0, row1, S;
    i64 off0, off1, bs0, bs1, ls0, ls1, hs0, hs1, ns0, ns1;

    __device__ __forceinline__ unsigned tiles() const { return (unsigned)((t1 - 1) / T - t0 / T + 1); }

    __device__ __forceinline__ unsigned count() const { return tiles() * (unsigned)(nl * ncomp * nh * S); }

    __device__ __forceinline__ i64 tile_start(unsigned u) const {
        const i64 ts = ((i64)u + t0 / T) * T;
        return ts > t0 ? ts : t0;
    }

    // Physical block of tile u; checked where it is used, so that it can be loaded ahead.
    __device__ __forceinline__ i64 block(unsigned u) const {
        const i64 bi = tile_start(u) / tpb - block_base;
        return ids_bytes == 8 ? (i64)__ldg(static_cast<const long long*>(ids) + bi)
                              : (i64)__ldg(static_cast<const int*>(ids) + bi);
    }

    // Run (tile u in block blk, j = (l * nh + h) * S + k for layer l, head h and row k of the
    // run when S > 1, component c): its bytes at pool + *m and at wire + *w; 0 bytes for a row
    // past a partial tile's end.
    __device__ __forceinline__ int locate(unsigned u, i64 blk, unsigned j, unsigned c, i64* m, i64* w) const {
        // A bad block id would scatter into memory the pool does not own; fail loudly as torch's index checks do.
        if ((u64)blk >= (u64)num_blocks) __trap();
        const unsigned k = j % (unsigned)S, lh = j / (unsigned)S;
        const unsigned l = lh / (unsigned)nh, h = lh - l * (unsigned)nh;
        const i64 ts = tile_start(u);
        const i64 te = ((i64)u + t0 / T + 1) * T < t1 ? ((i64)u + t0 / T + 1) * T : t1;
        const int ntok = (int)(te - ts);
        const int row = c ? row1 : row0;
        const i64 bpl = (i64)nh * (row0 + (ncomp > 1 ? row1 : 0));  // wire bytes per token per layer
        *w = (ts - t0) * nl * bpl + (i64)ntok * ((i64)l * bpl + (c ? (i64)nh * row0 : 0) + (i64)h * row) +
             (i64)k * row;
        *m = blk * (c ? bs1 : bs0) + (i64)(l + l_off) * (c ? ls1 : ls0) + (c ? off1 : off0) +
             (i64)(h + h_off) * (c ? hs1 : hs0) + ((ts % tpb) + k) * (c ? ns1 : ns0);
        return S == 1 ? ntok * row : ((int)k < ntok ? row : 0);
    }

    // Run r (in wire order).
    __device__ __forceinline__ int get(unsigned r, i64* m, i64* w) const {
        const unsigned k = r % (unsigned)S;
        r /= (unsigned)S;
        const unsigned h = r % (unsigned)nh;
        unsigned q = r / (unsigned)nh;
        const unsigned c = q % (unsigned)ncomp;
        q /= (unsigned)ncomp;
        const unsigned l = q % (unsigned)nl;
        const unsigned u = q / (unsigned)nl;
        return locate(u, block(u), (l * (unsigned)nh + h) * (unsigned)S + k, c, m, w);
    }
};

// How the runs of one component become items; the same for every tile, from the run length
// of a whole tile (a partial first or last tile has shorter runs: some of its pieces are
// empty, some lanes idle). kvlab/ops/cuda.py (_work_items) mirrors it to size the grid.
// lg < 5: runs of at most 2^lg lane steps, 32 >> lg runs per item, 2^lg lanes each.
// lg == 5: k pieces of `piece` bytes (a multiple of 16, so that every piece has the
// alignment of its run) per run, one item each.
struct Plan {
    int lg, piece;
    unsigned k, items;  // items per tile
};

__device__ __forceinline__ Plan plan(int T, int row, unsigned runs_per_tile) {
    const int lane_step = 16 * KV_UNROLL, step = 32 * lane_step;
    const int L = T * row;
    Plan p;
    p.lg = 0;
    while (p.lg < 5 && (lane_step << p.lg) < L) ++p.lg;
    if (p.lg == 5) {
        p.k = (unsigned)((L + step - 1) / step);
        p.piece = ((L + (int)p.k - 1) / (int)p.k + 15) & ~15;
        p.items = runs_per_tile * p.k;
    } else {
        p.k = 1;
        p.piece = L;
        p.items = (runs_per_tile + (32u >> p.lg) - 1) >> (5 - p.lg);
    }
    return p;
}

template <bool PACK>
__device__ __forceinline__ void kv_copy(const Runs& R) {
    const int lane = threadIdx.x & 31;
    const unsigned runs_per_tile = (unsigned)(R.nl * R.nh * R.S);
    const int run_tokens = R.S == 1 ? R.T : 1;  // rows of a whole tile's run
    const Plan p0 = plan(run_tokens, R.row0, runs_per_tile);
    const Plan p1 = R.ncomp > 1 ? plan(run_tokens, R.row1, runs_per_tile) : Plan{0, 0, 0, 0};
    const unsigned per_tile = p0.items + p1.items;
    const unsigned n = R.tiles() * per_tile;
    const unsigned nwarps = (gridDim.x * blockDim.x) >> 5;
    unsigned i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (i >= n) return;
    unsigned u = i / per_tile;
    i64 blk = R.block(u);
    for (;;) {
        // the next item's block id is loaded now so that its latency hides behind this copy
        const unsigned next = i + nwarps;  // no wrap: the launcher keeps n + nwarps below 2^32
        const bool more = next < n;
        unsigned u_next = u;
        i64 blk_next = blk;
        if (more) {
            u_next = next / per_tile;
            if (u_next != u) blk_next = R.block(u_next);
        }
        unsigned q = i - u * per_tile;
        const unsigned c = q >= p0.items;
        const int lg = c ? p1.lg : p0.lg;
        q -= c ? p0.items : 0u;
        unsigned j;
        int off = 0, cap, gl, G;
        if (lg == 5) {
            const unsigned k = c ? p1.k : p0.k;
            j = q / k;
            cap = c ? p1.piece : p0.piece;
            off = (int)(q - j * k) * cap;
            gl = lane;
            G = 32;
        } else {
            j = (q << (5 - lg)) + ((unsigned)lane >> lg);
            cap = 0x7fffffff;
            G = 1 << lg;
            gl = lane & (G - 1);
        }
        if (j < runs_per_tile) {
            i64 m, w;
            const int len = R.locate(u, blk, j, c, &m, &w) - off;
            if (len > 0) {
                const int nb = len < cap ? len : cap;
                char* d = PACK ? R.wire + w + off : R.pool + m + off;
                const char* s = PACK ? R.pool + m + off : R.wire + w + off;
                if (G == 32) {
                    copy_part<true>(d, s, nb, lane, 32);
                } else {
                    copy_part<false>(d, s, nb, gl, G);
                }
            }
        }
        if (!more) break;
        i = next;
        u = u_next;
        blk = blk_next;
    }
}

#ifndef KV_THREADS
#define KV_THREADS 1024  // the launch bound: the launcher never uses more threads per CTA
#endif

#define KV_PARAMS                                                                                                   \
    char *pool, char *wire, const void *ids, int ids_bytes, i64 num_blocks, i64 block_base, int tpb, int T, i64 t0, \
        i64 t1, int l_off, int nl, int h_off, int nh, int ncomp, int row0, int row1, int S, i64 off0, i64 off1,     \
        i64 bs0, i64 bs1, i64 ls0, i64 ls1, i64 hs0, i64 hs1, i64 ns0, i64 ns1
#define KV_RUNS                                                                                                  \
    Runs {                                                                                                       \
        pool, wire, ids, ids_bytes, num_blocks, block_base, tpb, T, t0, t1, l_off, nl, h_off, nh, ncomp, row0, \
            row1, S, off0, off1, bs0, bs1, ls0, ls1, hs0, hs1, ns0, ns1                                         \
    }

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kv_pack(KV_PARAMS) { kv_copy<true>(KV_RUNS); }

extern "C" __global__ void __launch_bounds__(KV_THREADS, 1) kv_unpack(KV_PARAMS) { kv_copy<false>(KV_RUNS); }

// ---------------------------------------------------------------------------------------
// Bulk variant (sm_90+): each warp's lane 0 streams its runs through a ring of `stages`
// shared-memory buffers of `piece` bytes with cp.async.bulk (global -> shared, then
// shared -> global), keeping stages-1 loads in flight. One thread then holds tens of KiB in
// flight where registers hold a few: what a few CTAs need to approach the bandwidth of the
// whole GPU. Runs whose addresses or length are not 16-byte multiples take the warp path.
//
// Measured on H200: the variant scales with warps per CTA, not with stages (about 16 GB/s
// per warp), slower than the warp path. The likely cause: the buffer issue() reuses was
// stored one step earlier, so every piece waits for a store to read out. Letting more stores
// stay pending (stages/2 loads in flight, wait_group.read stages/2-1) is the next thing to try.
//
// Dynamic shared memory per CTA: warps * stages * (8 mbarrier + 8 dst + 4 len) bytes, padded
// to 128, then warps * stages * piece bytes of buffers (kv_bulk_smem in kvlab/ops/cuda.py).
// ---------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ u64 globaltimer() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

struct BulkRing {
    u64* bar;     // [stages] mbarriers, one per buffer
    char** dst;   // [stages] where each loaded piece goes
    int* len;     // [stages]
    char* buf;    // [stages][piece]
    int stages, piece;
    unsigned k, j;  // pieces issued (loads), pieces retired (stores issued)

    __device__ __forceinline__ void init() {
        for (int s = 0; s < stages; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        k = j = 0;
    }

    __device__ __forceinline__ void wait(unsigned s, unsigned parity) {
        const unsigned a = smem_u32(bar + s);
        const u64 start = globaltimer();
        for (;;) {
            unsigned done;
            asm volatile(
                "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                : "=r"(done)
                : "r"(a), "r"(parity)
                : "memory");
            if (done) return;
            // a load that never lands would hang the stream and every NCCL peer behind it
            if (globaltimer() - start > 5000000000ull) __trap();
        }
    }

    // Wait for the oldest load, send its buffer on to global memory.
    __device__ __forceinline__ void retire() {
        const unsigned s = j % (unsigned)stages;
        wait(s, (j / (unsigned)stages) & 1u);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst[s]),
                     "r"(smem_u32(buf + (i64)s * piece)), "r"(len[s])
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        ++j;
    }

    __device__ __forceinline__ void issue(char* d, const char* src, int n) {
        if (k - j == (unsigned)stages - 1) retire();
        const unsigned s = k % (unsigned)stages;
        // The buffer last held piece k - stages; exactly one store (piece j - 1) was committed after
        // that one's, so letting one group stay pending is enough for its buffer to be free.
        if (k >= (unsigned)stages) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
        dst[s] = d;
        len[s] = n;
        const unsigned b = smem_u32(bar + s);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(n) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         smem_u32(buf + (i64)s * piece)),
                     "l"(src), "r"(n), "r"(b)
                     : "memory");
        ++k;
    }

    __device__ __forceinline__ void drain() {
        while (j < k) retire();
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
};

extern __shared__ __align__(128) unsigned char kv_smem[];

template <bool PACK>
__device__ __forceinline__ void kv_copy_bulk(const Runs& R, int stages, int piece) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int slots = warps * stages;
    const int hdr = (slots * 20 + 127) / 128 * 128;
    BulkRing ring;
    ring.bar = reinterpret_cast<u64*>(kv_smem) + warp * stages;
    ring.dst = reinterpret_cast<char**>(kv_smem + slots * 8) + warp * stages;
    ring.len = reinterpret_cast<int*>(kv_smem + slots * 16) + warp * stages;
    ring.buf = reinterpret_cast<char*>(kv_smem + hdr) + (i64)warp * stages * piece;
    ring.stages = stages;
    ring.piece = piece;
    if (lane == 0) ring.init();
    __syncwarp();

    const unsigned nruns = R.count();
    const unsigned nwarps = (gridDim.x * blockDim.x) >> 5;
    for (unsigned r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < nruns; r += nwarps) {
        i64 m, w;
        const int len = R.get(r, &m, &w);
        char* d = PACK ? R.wire + w : R.pool + m;
        const char* s = PACK ? R.pool + m : R.wire + w;
        if (((reinterpret_cast<u64>(d) | reinterpret_cast<u64>(s) | (u64)len) & 15) == 0) {
            if (lane == 0)
                for (int off = 0; off < len; off += piece) ring.issue(d + off, s + off, min(piece, len - off));
        } else {
            copy_run(d, s, len, lane);
        }
    }
    if (lane == 0) ring.drain();
}

#define KV_BULK_BODY(PACK) kv_copy_bulk<PACK>(KV_RUNS, stages, piece)
#else
#define KV_BULK_BODY(PACK) __trap()
#endif

extern "C" __global__ void kv_pack_bulk(KV_PARAMS, int stages, int piece) { KV_BULK_BODY(true); }

extern "C" __global__ void kv_unpack_bulk(KV_PARAMS, int stages, int piece) { KV_BULK_BODY(false); }
