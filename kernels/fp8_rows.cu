// Rows of bf16 or fp16 values into kvlab's fp8 rows (kvlab.model.kv_dtype, whose `quantize` is the
// definition): per row, its first q values in groups of `group` as float8 e4m3 (e4m3fn) codes, then
// one fp32 scale per group, then the row's remaining values as they are (MLA's RoPE part). Per group
// s = amax(|x|) / 448 (1 where the group is all zeros), code = the e4m3 value nearest x / s clamped to
// [-448, 448], ties to the even code. One pass over the rows: torch's form of the same rule takes
// about a dozen passes over fp32 temporaries. Divisions are IEEE (NVRTC's default -prec-div=true), so
// the scale and the codes are torch's bit for bit; e4m3 rounding is written out (sm_80 has no cvt to
// it). One warp per (row, group).
// No #include: NVRTC needs no include path.
typedef long long i64;

__device__ __forceinline__ float load_value(const unsigned short* p, int fp16) {
  const unsigned short u = *p;
  if (!fp16) return __uint_as_float(((unsigned)u) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
  return f;
}

// |y| <= 448: the e4m3fn code of y, round to nearest, ties to even.
__device__ __forceinline__ unsigned char e4m3(float y) {
  const unsigned sign = (__float_as_uint(y) >> 31) << 7;
  const float a = fabsf(y);
  unsigned code;
  if (a < 0.015625f) {  // below 2^-6: subnormal codes m * 2^-9, m = 0..7 (8 is the smallest normal)
    code = (unsigned)__float2int_rn(a * 512.0f);
  } else {  // keep 3 mantissa bits of the float, rounding to even; a carry moves into the exponent
    unsigned b = __float_as_uint(a);
    b += 0x7FFFFu + ((b >> 20) & 1u);
    code = ((((b >> 23) - 127u + 7u) << 3) | ((b >> 20) & 7u));
  }
  return (unsigned char)(sign | code);
}

extern "C" __global__ void kv_quantize_rows(const unsigned short* __restrict__ in, unsigned char* __restrict__ out,
                                            i64 nrows, int elems, int q, int group, int fp16) {
  const int lane = threadIdx.x & 31;
  const int ngroups = (q + group - 1) / group;
  const int out_row = q + 4 * ngroups + 2 * (elems - q);
  const i64 items = nrows * ngroups;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
#pragma unroll 1
  for (i64 it = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; it < items; it += nwarps) {
    const i64 row = it / ngroups;
    const int gi = (int)(it - row * ngroups);
    const int g0 = gi * group, n = q - g0 < group ? q - g0 : group;
    const unsigned short* src = in + row * elems + g0;
    unsigned char* dst = out + row * out_row;
    float amax = 0.0f;
    for (int i = lane; i < n; i += 32) amax = fmaxf(amax, fabsf(load_value(src + i, fp16)));
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = lane; i < n; i += 32) {
      const float y = load_value(src + i, fp16) / s;
      dst[g0 + i] = e4m3(fminf(fmaxf(y, -448.0f), 448.0f));
    }
    if (lane < 4) dst[q + 4 * gi + lane] = (unsigned char)(__float_as_uint(s) >> (8 * lane));
    if (gi == 0) {  // the values kept as they are, after the scales
      const unsigned char* rest = (const unsigned char*)(in + row * elems + q);
      for (int i = lane; i < 2 * (elems - q); i += 32) dst[q + 4 * ngroups + i] = rest[i];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// kv_convert_rect: one component of a rectangle moved and converted in one pass, bf16/fp16 rows into fp8 rows
// (to_fp8) or back, between two sides that are each a pool (its block table and strides: RUN_AT in
// kernels/run_copy.cu) or a wire buffer (kvlab.model.layout.runs' wire order). This is the transport's copy with
// the conversion inside it: each value is read once and its code and scale written once, where the staged form
// copies the rows out, converts them through scratch and copies them in.
// The rule is kv_quantize_rows' (above) bit for bit; reading back is e4m3 * s in fp32, rounded to the base
// dtype to nearest even (kvlab.model.kv_dtype.to_values then from_values). A team of L lanes (a power of two,
// 8 * L >= group) takes a row: each lane holds 8 values of a group (one 16-byte load on the values' side, two
// 4-byte words on the codes' side), the group's amax is a shuffle within the team, and each team keeps
// KV_ROWS rows in flight (loads before the first store; kvlab.memory.ops.cuda.CONVERT_ROWS sets it). The
// launcher takes this path only where groups and the quantized part hold whole 8-value pieces, group <= 256, and
// both sides are aligned (16 bytes on the values' side, 4 on the codes'); the rest goes the staged way.
#ifndef KV_ROWS
#define KV_ROWS 4
#endif

__device__ __forceinline__ float f16_to_f32(unsigned short u) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
  return f;
}

__device__ __forceinline__ unsigned short f32_to_base(float x, int fp16) {
  unsigned short u;
  if (fp16) {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(u) : "f"(x));
  } else {
    // round to nearest even (finite values: the products of codes and scales)
    const unsigned b = __float_as_uint(x);
    u = (unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  }
  return u;
}

// two codes in the low bytes of a 16-bit word, a first: |a|, |b| <= 448
__device__ __forceinline__ unsigned e4m3x2(float a, float b) {
#if __CUDA_ARCH__ >= 890
  unsigned short d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(b), "f"(a));  // a in the low byte
  return d;
#else
  return (unsigned)e4m3(a) | ((unsigned)e4m3(b) << 8);
#endif
}

// x / s clamped to [-448, 448] as the rule says: the conversion's satfinite clamps by itself on sm_89+
#if __CUDA_ARCH__ >= 890
#define CLAMP448(y) (y)
#else
#define CLAMP448(y) fminf(fmaxf((y), -448.0f), 448.0f)
#endif

__device__ __forceinline__ float e4m3_value(unsigned c) {
  const unsigned e = (c >> 3) & 15u, m = c & 7u;
  const float a = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
  return (c & 0x80u) ? -a : a;
}

// One side of the conversion: a pool (wire == 0) or a wire buffer (wire != 0: wbpl bytes per token per layer
// for all heads and components, wcomp the component's first byte within them, wrow its row).
#define CSIDE(P)                                                                                        \
  const void *P##ids, int P##ids64, int P##tpb, i64 P##base, i64 P##off, i64 P##bs, i64 P##ls, i64 P##hs, \
      i64 P##ns, int P##loff, int P##hoff, int P##wire, i64 P##wbpl, i64 P##wcomp, i64 P##wrow

// Where the item's rows lie on one side: row (layer l + i, h, k) at B + i * LS + h * HS + k * NS, for the span of
// g tokens from ss. A wire's span is one wire tile (g = the rectangle's tile): [tile][layer][component][head][token
// rows], the first and last tiles cut to [t0, t1).
#define CSIDE_ITEM(P, ss, l, B, LS, HS, NS)                                                             \
  if (P##wire) {                                                                                        \
    const int a_ = (ss) > t0 ? (ss) : t0, e_ = (ss) + g < t1 ? (ss) + g : t1;                          \
    NS = P##wrow;                                                                                       \
    HS = (i64)(e_ - a_) * P##wrow;                                                                      \
    LS = (i64)(e_ - a_) * P##wbpl;                                                                      \
    B = (i64)(a_ - t0) * nl * P##wbpl + (i64)(e_ - a_) * ((i64)(l) * P##wbpl + P##wcomp) -              \
        (i64)(a_ - (ss)) * P##wrow;                                                                     \
  } else {                                                                                              \
    NS = P##ns;                                                                                         \
    HS = P##hs;                                                                                         \
    LS = P##ls;                                                                                         \
    B = (P##ids64 ? ((const i64*)P##ids)[(ss) / P##tpb - P##base]                                       \
                  : (i64)((const int*)P##ids)[(ss) / P##tpb - P##base]) * P##bs +                       \
        (i64)((l) + P##loff) * P##ls + P##off + (i64)P##hoff * P##hs + (i64)((ss) % P##tpb) * P##ns;   \
  }

#define FDIV(n, M, l) ((int)((__umulhi((unsigned)(n), (M)) + (unsigned)(n)) >> (l)))

#define CSIDE_ARGS(P)                                                                                  \
  P##ids, P##ids64, P##tpb, P##base, P##off, P##bs, P##ls, P##hs, P##ns, P##loff, P##hoff, P##wire, P##wbpl,   \
      P##wcomp, P##wrow

// the value e (0-7) of a lane's 8 values (4 words, the first value in the low half of the first)
template <int F16>
__device__ __forceinline__ float value8(const unsigned (&w)[4], int e) {
  const unsigned u = w[e >> 1];
  if (F16) return f16_to_f32((unsigned short)((e & 1) ? u >> 16 : u & 0xFFFFu));
  return __uint_as_float((e & 1) ? u & 0xFFFF0000u : u << 16);
}

// x / s, IEEE's quotient (see below): by y = 1/s correctly rounded and two residual corrections
__device__ __forceinline__ float quotient(float x, float s, float y) {
  float t = x * y;
  t = fmaf(fmaf(-s, t, x), y, t);
  return copysignf(fmaf(fmaf(-s, t, x), y, t), x);  // a residual's +0 would lose -0's sign
}

// A lane's 8 values of a group as 4 codes pairs in two words, by the rule with the group's scale s: the form for
// every scale (s or 1/s outside the normals: a division per value). The fast form below covers all but the rarest
// rows (amax below 2^-100 or infinite) and falls back to this one.
template <int F16>
__device__ __forceinline__ uint3 codes_by_division(const uint4 v, float amax) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
  float x[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = value8<F16>(w, e);
  const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
  if (s >= 0x1p-125f && s <= 0x1p125f) {
    const float y = __frcp_rn(s);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = quotient(x[e], s, y);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = x[e] / s;
  }
  unsigned c[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] = e4m3x2(CLAMP448(x[2 * e]), CLAMP448(x[2 * e + 1]));
  return make_uint3(c[0] | (c[1] << 16), c[2] | (c[3] << 16), __float_as_uint(s));
}

#define Y448 0x1.24924ap-9f  // 1/448 rounded to nearest (fp32)

// The fast form for one row's 8 values of a group with amax a, no branches: the scale s = a / 448 and the codes. A
// code needs only RN_e4m3(RN_f32(x / s)), and x * (y + yl), with 1/s = y + yl to about 2^-46 (y the reciprocal
// rounded down, yl >= 0 its residual times y), rounds to RN_f32(x / s) wherever that matters: x / s lies near an fp32 midpoint only
// where x * 448 = a * (an e4m3 rounding boundary) exactly, and there at least 2^-11 ulp from it for every bf16 and
// fp16 a (tests/test_fp8_scale_rule.py emulates the whole form over every bf16 pair). A product and an fma per
// value, where the correctly rounded quotient takes five dependent operations and a sign fix. Exact where
// fast_range(a) holds (the rule below).
template <int F16>
__device__ __forceinline__ void codes_fast(const unsigned (&w)[4], float a, unsigned (&c)[2], float& sc) {
  float t = a * Y448;
  t = fmaf(fmaf(-448.0f, t, a), Y448, t);
  t = fmaf(fmaf(-448.0f, t, a), Y448, t);
  const float s = a > 0.0f ? t : 1.0f;
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(s));
  y = fmaf(fmaf(-s, y, 1.0f), y, y);
  float e = fmaf(-s, y, 1.0f);
  if (e < 0.0f) {  // y below 1/s, so that yl >= 0 and x * yl keeps the sign of x: -0 must stay -0 (code 0x80)
    y = __uint_as_float(__float_as_uint(y) - 1u);
    e = fmaf(-s, y, 1.0f);
  }
  const float yl = e * y;
  unsigned cc[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float x0 = value8<F16>(w, 2 * e), x1 = value8<F16>(w, 2 * e + 1);
    cc[e] = e4m3x2(CLAMP448(fmaf(x0, y, x0 * yl)), CLAMP448(fmaf(x1, y, x1 * yl)));
  }
  c[0] = cc[0] | (cc[1] << 16);
  c[1] = cc[2] | (cc[3] << 16);
  sc = s;
}

// A lane's 8 codes (two words) at p, 4-byte aligned: one 8-byte store where p allows it (a row of codes and a scale
// is 4-byte aligned only where the engine packs them so, as TensorRT-LLM's 132-byte K/V rows): two 4-byte stores
// would write each sector's halves in two passes.
__device__ __forceinline__ void store_codes(unsigned char* p, const unsigned (&c)[2]) {
  if (!((size_t)p & 7)) {
    *(uint2*)p = make_uint2(c[0], c[1]);
  } else {
    ((unsigned*)p)[0] = c[0];
    ((unsigned*)p)[1] = c[1];
  }
}

// the fast form's range: amax 0 (s = 1) or in [2^-100, 2^127] (s in [2^-109, 2^119])
__device__ __forceinline__ bool fast_range(float a) { return a == 0.0f || (a >= 0x1p-100f && a <= 0x1p127f); }

// Where item ``item`` lies: its layers (ml from layer l) and its span's tokens [klo, khi), rows = its rows, and both
// sides' bases and strides from CSIDE_ITEM (the register form's loop and the ring's producer).
#define ITEM_PLACE(item)                                     \
  do {                                                       \
    const int qq_ = FDIV(item, nlgM, nlgL);                  \
    const int l_ = ((item) - qq_ * nlg) * lm, ss_ = (qq_ + s0) * g; \
    ml = nl - l_ < lm ? nl - l_ : lm;                        \
    rows = ml * hg;                                          \
    klo = t0 - ss_ > 0 ? t0 - ss_ : 0;                       \
    khi = t1 - ss_ < g ? t1 - ss_ : g;                       \
    CSIDE_ITEM(s_, ss_, l_, sB, sL, sH, sN);                 \
    CSIDE_ITEM(d_, ss_, l_, dB, dL, dH, dN);                 \
  } while (0)

// Where a pass's rows lie on both sides (sp, dp): row r0 + r * teams + team of the item (the warp's teams on
// neighbouring rows at each r) is layer li, head h, token k of it; 0 where the row is past the item's or its token
// outside [klo, khi).
#define PASS_ROWS(r0)                                                   \
  _Pragma("unroll") for (int r = 0; r < KV_ROWS; ++r) {                 \
    const int row = (r0) + r * teams + team;                            \
    const int li = ml > 1 ? FDIV(row, hgM, hgL) : 0, lr = row - li * hg; \
    const int h = FDIV(lr, gM, gL), k = lr - h * g;                     \
    sp[r] = 0;                                                          \
    dp[r] = 0;                                                          \
    if (row < rows && k >= klo && k < khi) {                            \
      sp[r] = src + sB + li * sL + h * sH + k * sN;                     \
      dp[r] = dst + dB + li * dL + h * dH + k * dN;                     \
    }                                                                   \
  }

// A team's KV_ROWS rows of one group: every live row's 16 bytes of the lane (``load(r)``) first, zeros for the rest
// (their amax is 0), then the group's amax over the team's lanes and each row's codes and scale by the fast form, by
// division for a live row outside its range (its bytes loaded again: rare, and registers stay free meanwhile).
template <int L, int F16, class Load>
__device__ __forceinline__ void group_codes(const bool (&live)[KV_ROWS], Load load, unsigned (&c)[KV_ROWS][2],
                                            float (&sc)[KV_ROWS]) {
  unsigned w[KV_ROWS][4];
#pragma unroll
  for (int r = 0; r < KV_ROWS; ++r) {
    const uint4 v = live[r] ? load(r) : make_uint4(0u, 0u, 0u, 0u);
    w[r][0] = v.x;
    w[r][1] = v.y;
    w[r][2] = v.z;
    w[r][3] = v.w;
  }
  float amax[KV_ROWS];
#pragma unroll
  for (int r = 0; r < KV_ROWS; ++r) {
    amax[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax[r] = fmaxf(amax[r], fabsf(value8<F16>(w[r], e)));
  }
#pragma unroll
  for (int o = L >> 1; o; o >>= 1)
#pragma unroll
    for (int r = 0; r < KV_ROWS; ++r) amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], o));
#pragma unroll
  for (int r = 0; r < KV_ROWS; ++r) codes_fast<F16>(w[r], amax[r], c[r], sc[r]);
#pragma unroll
  for (int r = 0; r < KV_ROWS; ++r)
    if (live[r] && !fast_range(amax[r])) {
      const uint3 k = codes_by_division<F16>(load(r), amax[r]);
      c[r][0] = k.x;
      c[r][1] = k.y;
      sc[r] = __uint_as_float(k.z);
    }
}

// Items: a span of g tokens (one block on each pool side, one wire tile on a wire side) by every head of lm
// consecutive layers (lm > 1 where one layer's rows would leave a warp's teams idle: kvlab.memory.ops.cuda.
// layers_per_item); a warp takes an item, reads the block tables and computes both sides' bases once, and its
// teams walk the item's rows (layer, head, token) with multiplications by precomputed reciprocals (FDIV).
// x / s is IEEE's quotient without a division per value: with y = 1/s correctly rounded, q0 = x * y, and two
// residual corrections q += (x - s * q) * y (Markstein: the second is the correctly rounded quotient where s, 1/s
// and the quotient are normal floats; a quotient below the normals is zero in e4m3 either way, its sign kept); a
// scale outside that range divides. The scale amax / 448 is the same construction with 1/448 (exact for every
// bf16 and fp16 amax in [2^-100, 2^127], checked against IEEE's division over all of them), and 1/s the
// hardware reciprocal and one Newton step, as __frcp_rn computes it for s in [2^-126, 2^126).
// The team's size L and the base dtype are compile-time (a switch in kv_convert_rect): the team's shuffles
// unroll, and a team's KV_ROWS rows go through the conversion as straight-line code, their loads, amax
// reductions, reciprocals and quotients interleaved, with the rare rows outside the fast form fixed up after.
// (Where each row took the shuffles in a loop and the divisions' slow-path branches one row after the other, the
// rows in flight were converted one at a time: 0.49-0.60 of copy_, and 8 rows in flight slower than 4. A form
// that flattened (row, group) units and held 8 or 16 of them in flight per team ran at 0.34-0.49 of copy_:
// docs/results/kernels.md.)
template <int L, int F16>
__device__ __forceinline__ void convert_rect(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                             CSIDE(s_), CSIDE(d_), int g, int t0, int t1, int nl, int nh, int elems,
                                             int q, int group, int to_fp8, unsigned gM, int gL, int lm, unsigned hgM,
                                             int hgL, unsigned nlgM, int nlgL, int items) {
  const int lane = threadIdx.x & 31, team = lane / L, j = lane % L, teams = 32 / L;
  const int ngroups = (q + group - 1) / group;
  const int rope = elems - q;  // values after the quantized part, kept as they are (MLA's RoPE part)
  const int hg = nh * g, s0 = t0 / g, nlg = (nl + lm - 1) / lm;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
#pragma unroll 1
  for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < items; item += nwarps) {
    int ml, rows, klo, khi;
    i64 sB, sL, sH, sN, dB, dL, dH, dN;
    ITEM_PLACE(item);
#pragma unroll 1
    for (int r0 = 0; r0 < rows; r0 += teams * KV_ROWS) {
      const unsigned char* sp[KV_ROWS];
      unsigned char* dp[KV_ROWS];
      PASS_ROWS(r0);
#pragma unroll 1
      for (int gi = 0; gi < ngroups; ++gi) {
        const int g0 = gi * group, n = q - g0 < group ? q - g0 : group;
        const bool mine = j * 8 < n;  // this lane's 8 values of the group
        if (to_fp8) {
          unsigned c[KV_ROWS][2];
          float sc[KV_ROWS];
          bool live[KV_ROWS];
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r) live[r] = sp[r] && mine;
          group_codes<L, F16>(live, [&](int r) { return *(const uint4*)(sp[r] + 2 * (g0 + 8 * j)); }, c, sc);
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r) {
            if (!(sp[r] && mine)) continue;
            store_codes(dp[r] + g0 + 8 * j, c[r]);
            if (j == 0) *(unsigned*)(dp[r] + q + 4 * gi) = __float_as_uint(sc[r]);
          }
        } else {
          uint2 v[KV_ROWS];
          float s[KV_ROWS];
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r)
            if (sp[r] && mine) {
              const unsigned* p = (const unsigned*)(sp[r] + g0 + 8 * j);
              v[r] = make_uint2(p[0], p[1]);
              s[r] = *(const float*)(sp[r] + q + 4 * gi);
            }
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r) {
            if (!(sp[r] && mine)) continue;
            unsigned o[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const unsigned w = e < 2 ? v[r].x : v[r].y, sh = (e & 1) * 16;
              const unsigned lo = f32_to_base(e4m3_value((w >> sh) & 0xFFu) * s[r], F16);
              const unsigned hi = f32_to_base(e4m3_value((w >> (sh + 8)) & 0xFFu) * s[r], F16);
              o[e] = lo | (hi << 16);
            }
            *(uint4*)(dp[r] + 2 * (g0 + 8 * j)) = make_uint4(o[0], o[1], o[2], o[3]);
          }
        }
      }
      if (rope) {  // the values kept as they are: 2-byte words after the scales (fp8) or the quantized part (base)
        const int sa = to_fp8 ? 2 * q : q + 4 * ngroups, da = to_fp8 ? q + 4 * ngroups : 2 * q;
        // every row's words of a chunk loaded before the first store: the rows' loads in flight together
#pragma unroll 1
        for (int b0 = j; b0 < rope; b0 += 2 * L) {
          unsigned short t[KV_ROWS][2];
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r)
#pragma unroll
            for (int u = 0; u < 2; ++u)
              if (sp[r] && b0 + u * L < rope) t[r][u] = ((const unsigned short*)(sp[r] + sa))[b0 + u * L];
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r)
#pragma unroll
            for (int u = 0; u < 2; ++u)
              if (sp[r] && b0 + u * L < rope) ((unsigned short*)(dp[r] + da))[b0 + u * L] = t[r][u];
        }
      }
    }
  }
}

// The quantizing direction through a ring of shared-memory slots (KV_RING > 0): each lane copies its 16 source
// bytes of every row of a step (one group, or one piece of the RoPE values, of a pass's rows) into its own slot with
// cp.async, KV_RING - 1 steps ahead of the step it converts. Loads in flight no longer cost registers: the register
// form above keeps its loads in registers, so a warp has one pass's rows in flight only while it is not converting,
// and two CTAs of 128-register threads per SM hold too few bytes in flight to cover the memory's latency (0.73-0.77
// of copy_ for Llama, 0.63-0.72 for DeepSeek-V3.2: docs/results/kernels.md). Each lane reads back only what it
// copied itself, so no barrier is needed between a slot's copy and its use; the slot refilled is the one converted
// the step before, whose values are in registers by then (the conversion depends on them).
#ifndef KV_RING
#define KV_RING 0
#endif
#if KV_RING
struct ConvertSlot {
  uint4 v[KV_ROWS][32];           // each lane's 16 source bytes of each of its team's rows (zeros where none)
  unsigned char* d[KV_ROWS][32];  // the row's destination (0: the lane's team has no row there)
  int tag[32];                    // the step: a group 0..ngroups-1, a RoPE piece ngroups.., -1 the warp's last
};

__device__ __forceinline__ void cp_async16(void* s, const void* g, int n) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)__cvta_generic_to_shared(s)), "l"(g),
               "r"(n)
               : "memory");
}

template <int L, int F16>
__device__ __forceinline__ void convert_rect_ring(const unsigned char* __restrict__ src,
                                                  unsigned char* __restrict__ dst, CSIDE(s_), CSIDE(d_), int g,
                                                  int t0, int t1, int nl, int nh, int elems, int q, int group,
                                                  unsigned gM, int gL, int lm, unsigned hgM, int hgL, unsigned nlgM,
                                                  int nlgL, int items) {
  extern __shared__ __align__(16) unsigned char ring_smem[];
  ConvertSlot* ring = (ConvertSlot*)ring_smem + (threadIdx.x >> 5) * KV_RING;
  const int lane = threadIdx.x & 31, team = lane / L, j = lane % L, teams = 32 / L;
  const int ngroups = (q + group - 1) / group;
  const int rope = elems - q;
  const int steps = ngroups + (2 * rope + 16 * L - 1) / (16 * L);  // per pass: the groups, then the RoPE pieces
  const int hg = nh * g, s0 = t0 / g, nlg = (nl + lm - 1) / lm;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
  const int da = q + 4 * ngroups;  // the RoPE values' first byte in an fp8 row
  // the producer: the item, pass and step it copies next, and where the pass's rows lie
  int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, r0 = 0, st = 0, rows = 0, ml = 1, klo = 0, khi = 0;
  i64 sB = 0, sL = 0, sH = 0, sN = 0, dB = 0, dL = 0, dH = 0, dN = 0;
  const unsigned char* sp[KV_ROWS];
  unsigned char* dp[KV_ROWS];
  auto begin_item = [&]() { ITEM_PLACE(item); };
  auto begin_pass = [&]() { PASS_ROWS(r0); };
  if (item < items) {
    begin_item();
    begin_pass();
  }
  auto issue = [&](ConvertSlot& sl) {
    if (item >= items) {
      sl.tag[lane] = -1;
    } else {
      int off, n;
      if (st < ngroups) {
        const int g0 = st * group;
        off = 2 * (g0 + 8 * j);
        n = 8 * j < (q - g0 < group ? q - g0 : group) ? 16 : 0;
      } else {
        const int b = 16 * ((st - ngroups) * L + j);
        off = 2 * q + b;
        n = 2 * rope - b < 16 ? 2 * rope - b : 16;
        n = n > 0 ? n : 0;
      }
#pragma unroll
      for (int r = 0; r < KV_ROWS; ++r) {
        const int nr = sp[r] ? n : 0;
        cp_async16(&sl.v[r][lane], nr ? sp[r] + off : src, nr);  // n = 0: zeros, nothing read
        sl.d[r][lane] = dp[r];
      }
      sl.tag[lane] = st;
      if (++st == steps) {
        st = 0;
        r0 += teams * KV_ROWS;
        if (r0 >= rows) {
          r0 = 0;
          item += nwarps;
          if (item < items) begin_item();
        }
        if (item < items) begin_pass();
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  float kept[KV_ROWS];  // lane j: its team's rows' scales of group j, until the rows' last group
#pragma unroll
  for (int k = 0; k < KV_RING - 1; ++k) issue(ring[k]);
#pragma unroll 1
  for (int k = 0;; k = k + 1 == KV_RING ? 0 : k + 1) {
    asm volatile("cp.async.wait_group %0;" ::"n"(KV_RING - 2) : "memory");
    ConvertSlot& sl = ring[k];
    const int tag = sl.tag[lane];  // the same in every lane: the warp's steps are the warp's
    if (tag < 0) break;
    unsigned char* drow[KV_ROWS];
#pragma unroll
    for (int r = 0; r < KV_ROWS; ++r) drow[r] = sl.d[r][lane];
    if (tag < ngroups) {
      const int g0 = tag * group, n = q - g0 < group ? q - g0 : group;
      const bool mine = 8 * j < n;
      unsigned c[KV_ROWS][2];
      float sc[KV_ROWS];
      bool live[KV_ROWS];
#pragma unroll
      for (int r = 0; r < KV_ROWS; ++r) live[r] = drow[r] && mine;
      group_codes<L, F16>(live, [&](int r) { return sl.v[r][lane]; }, c, sc);
#pragma unroll
      for (int r = 0; r < KV_ROWS; ++r) {
        if (mine && drow[r]) store_codes(drow[r] + g0 + 8 * j, c[r]);
        // a row's scales go out together after its last group (lane j keeps group j's), one piece of the row rather
        // than a 4-byte store per group step; a row of one group, or of more groups than lanes, stores each as it comes
        if (ngroups == 1 || ngroups > L) {
          if (j == 0 && drow[r]) *(unsigned*)(drow[r] + q + 4 * tag) = __float_as_uint(sc[r]);
        } else {
          if (j == tag) kept[r] = sc[r];
          if (tag == ngroups - 1 && j < ngroups && drow[r]) *(float*)(drow[r] + q + 4 * j) = kept[r];
        }
      }
    } else {  // RoPE values as they are: 2-byte values, at a 4-byte aligned place in the fp8 row
      const int b = 16 * ((tag - ngroups) * L + j);
      const int n = 2 * rope - b < 16 ? 2 * rope - b : 16;
#pragma unroll
      for (int r = 0; r < KV_ROWS; ++r) {
        if (!drow[r] || n <= 0) continue;
        const uint4 v = sl.v[r][lane];
        const unsigned wd[4] = {v.x, v.y, v.z, v.w};
        unsigned* o = (unsigned*)(drow[r] + da + b);
        if (n == 16 && !((size_t)o & 15)) {
          *(uint4*)o = v;
          continue;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (4 * e + 4 <= n) o[e] = wd[e];
        if (n & 2) ((unsigned short*)(drow[r] + da + b))[n >> 1 & ~1] = (unsigned short)wd[n >> 2];
      }
    }
    issue(ring[k == 0 ? KV_RING - 1 : k - 1]);
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#endif

// kv_convert_rect_<L>_<base>: one kernel per team size L (a power of two, at most 32: groups of at most 256
// values) and base dtype, each compiled for its own registers (one kernel switching between all twelve forms takes
// the registers of the largest, 176 where each needs 128); kvlab.memory.ops.cuda._convert_launch picks it by name.
// The parameters are the same for all (L and fp16 are those of the name).
// Two CTAs of 256 threads per SM (128 registers) where KV_ROWS <= 4: ptxas left alone takes 171-176 for some forms,
// one CTA per SM.
#ifndef KV_MIN_CTAS
#if KV_ROWS <= 4
#define KV_MIN_CTAS 2
#else
#define KV_MIN_CTAS 1
#endif
#endif
#define KV_CONVERT_KERNEL(LL, F, NAME)                                                                          \
  extern "C" __global__ void __launch_bounds__(256, KV_MIN_CTAS)                                                \
  NAME(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, CSIDE(s_), CSIDE(d_), int g, int t0, \
       int t1, int nl, int nh, int elems, int q, int group, int L, int to_fp8, int fp16, unsigned gM, int gL, int lm, \
       unsigned hgM, int hgL, unsigned nlgM, int nlgL, int items) {                                               \
    if (KV_RING && to_fp8)                                                                                        \
      CONVERT_RING(LL, F);                                                                                          \
    else                                                                                                            \
      convert_rect<LL, F>(src, dst, CSIDE_ARGS(s_), CSIDE_ARGS(d_), g, t0, t1, nl, nh, elems, q, group, to_fp8, gM,  \
                          gL, lm, hgM, hgL, nlgM, nlgL, items);                                                     \
  }
#if KV_RING
#define CONVERT_RING(LL, F)                                                                                     \
  convert_rect_ring<LL, F>(src, dst, CSIDE_ARGS(s_), CSIDE_ARGS(d_), g, t0, t1, nl, nh, elems, q, group, gM, gL, lm, \
                           hgM, hgL, nlgM, nlgL, items)
#else
#define CONVERT_RING(LL, F) ((void)0)
#endif
// every team size of one base dtype
#define KV_CONVERT_KERNELS(F, BASE)                  \
  KV_CONVERT_KERNEL(1, F, kv_convert_rect_1_##BASE)   \
  KV_CONVERT_KERNEL(2, F, kv_convert_rect_2_##BASE)   \
  KV_CONVERT_KERNEL(4, F, kv_convert_rect_4_##BASE)   \
  KV_CONVERT_KERNEL(8, F, kv_convert_rect_8_##BASE)   \
  KV_CONVERT_KERNEL(16, F, kv_convert_rect_16_##BASE) \
  KV_CONVERT_KERNEL(32, F, kv_convert_rect_32_##BASE)
KV_CONVERT_KERNELS(0, bf16)
KV_CONVERT_KERNELS(1, fp16)
