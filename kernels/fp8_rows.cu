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
