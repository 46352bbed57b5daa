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

// Items: a span of g tokens (one block on each pool side, one wire tile on a wire side) by every head of lm
// consecutive layers (lm > 1 where one layer's rows would leave a warp's teams idle: kvlab.memory.ops.cuda.
// layers_per_item); a warp takes an item, reads the block tables and computes both sides' bases once, and its
// teams walk the item's rows (layer, head, token) with multiplications by precomputed reciprocals (FDIV).
// x / s is IEEE's quotient without a division per value: with y = 1/s correctly rounded, q0 = x * y, and two
// residual corrections q += (x - s * q) * y (Markstein: the second is the correctly rounded quotient where s, 1/s
// and the quotient are normal floats; a quotient below the normals is zero in e4m3 either way, its sign kept); a
// scale outside that range divides. (A form that flattened (row, group) units and held 8 or 16 of them in flight
// per team ran at 0.34-0.49 of copy_ where this one runs at 0.49-0.60: docs/results/kernels.md.)
extern "C" __global__ void __launch_bounds__(256)
kv_convert_rect(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst, CSIDE(s_), CSIDE(d_),
                int g, int t0, int t1, int nl, int nh, int elems, int q, int group, int L, int to_fp8, int fp16,
                unsigned gM, int gL, int lm, unsigned hgM, int hgL, unsigned nlgM, int nlgL, int items) {
  const int lane = threadIdx.x & 31, team = lane / L, j = lane % L, teams = 32 / L;
  const int ngroups = (q + group - 1) / group;
  const int rope = elems - q;  // values after the quantized part, kept as they are (MLA's RoPE part)
  const int hg = nh * g, s0 = t0 / g, nlg = (nl + lm - 1) / lm;
  const int nwarps = (gridDim.x * blockDim.x) >> 5;
#pragma unroll 1
  for (int item = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; item < items; item += nwarps) {
    const int qq = FDIV(item, nlgM, nlgL);
    const int l = (item - qq * nlg) * lm, ss = (qq + s0) * g;
    const int ml = nl - l < lm ? nl - l : lm, rows = ml * hg;
    const int klo = t0 - ss > 0 ? t0 - ss : 0, khi = t1 - ss < g ? t1 - ss : g;
    i64 sB, sL, sH, sN, dB, dL, dH, dN;
    CSIDE_ITEM(s_, ss, l, sB, sL, sH, sN);
    CSIDE_ITEM(d_, ss, l, dB, dL, dH, dN);
#pragma unroll 1
    for (int r0 = 0; r0 < rows; r0 += teams * KV_ROWS) {
      const unsigned char* sp[KV_ROWS];
      unsigned char* dp[KV_ROWS];
#pragma unroll
      for (int r = 0; r < KV_ROWS; ++r) {
        const int row = r0 + r * teams + team;  // the warp's teams on neighbouring rows at each r
        const int li = ml > 1 ? FDIV(row, hgM, hgL) : 0, lr = row - li * hg;
        const int h = FDIV(lr, gM, gL), k = lr - h * g;
        sp[r] = 0;
        dp[r] = 0;
        if (row < rows && k >= klo && k < khi) {
          sp[r] = src + sB + li * sL + h * sH + k * sN;
          dp[r] = dst + dB + li * dL + h * dH + k * dN;
        }
      }
#pragma unroll 1
      for (int gi = 0; gi < ngroups; ++gi) {
        const int g0 = gi * group, n = q - g0 < group ? q - g0 : group;
        const bool mine = j * 8 < n;  // this lane's 8 values of the group
        if (to_fp8) {
          uint4 v[KV_ROWS];
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r)
            if (sp[r] && mine) v[r] = *(const uint4*)(sp[r] + 2 * (g0 + 8 * j));
#pragma unroll
          for (int r = 0; r < KV_ROWS; ++r) {
            float x[8];
            const unsigned w[4] = {v[r].x, v[r].y, v[r].z, v[r].w};
            float amax = 0.0f;
            if (sp[r] && mine) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                if (fp16) {
                  x[2 * e] = f16_to_f32((unsigned short)(w[e] & 0xFFFFu));
                  x[2 * e + 1] = f16_to_f32((unsigned short)(w[e] >> 16));
                } else {
                  x[2 * e] = __uint_as_float(w[e] << 16);
                  x[2 * e + 1] = __uint_as_float(w[e] & 0xFFFF0000u);
                }
              }
#pragma unroll
              for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(x[e]));
            }
            for (int o = L >> 1; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            if (!(sp[r] && mine)) continue;
            const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
            unsigned c[4];
            if (s >= 0x1p-125f && s <= 0x1p125f) {  // s and 1/s normal: the quotients by reciprocal and residuals
              const float y = __frcp_rn(s);
#pragma unroll
              for (int e = 0; e < 8; ++e) {
                float t = x[e] * y;
                t = fmaf(fmaf(-s, t, x[e]), y, t);
                x[e] = copysignf(fmaf(fmaf(-s, t, x[e]), y, t), x[e]);  // a residual's +0 would lose -0's sign
              }
            } else {
#pragma unroll
              for (int e = 0; e < 8; ++e) x[e] = x[e] / s;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) c[e] = e4m3x2(CLAMP448(x[2 * e]), CLAMP448(x[2 * e + 1]));
            unsigned* o = (unsigned*)(dp[r] + g0 + 8 * j);
            o[0] = c[0] | (c[1] << 16);
            o[1] = c[2] | (c[3] << 16);
            if (j == 0) *(unsigned*)(dp[r] + q + 4 * gi) = __float_as_uint(s);
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
              const unsigned lo = f32_to_base(e4m3_value((w >> sh) & 0xFFu) * s[r], fp16);
              const unsigned hi = f32_to_base(e4m3_value((w >> (sh + 8)) & 0xFFu) * s[r], fp16);
              o[e] = lo | (hi << 16);
            }
            *(uint4*)(dp[r] + 2 * (g0 + 8 * j)) = make_uint4(o[0], o[1], o[2], o[3]);
          }
        }
      }
      if (rope) {  // the values kept as they are: 2-byte words after the scales (fp8) or the quantized part (base)
        const int sa = to_fp8 ? 2 * q : q + 4 * ngroups, da = to_fp8 ? q + 4 * ngroups : 2 * q;
#pragma unroll
        for (int r = 0; r < KV_ROWS; ++r)
          if (sp[r])
            for (int b = j; b < rope; b += L)
              ((unsigned short*)(dp[r] + da))[b] = ((const unsigned short*)(sp[r] + sa))[b];
      }
    }
  }
}
