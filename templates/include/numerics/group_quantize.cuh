// The exact group quantizers of both recipes (SPEC 3 "quantize a group", SPEC 4.1), bit-exact
// to flashinfer_h3/formats.py: the NVFP4 group encoder of the pre-pass (nvfp4_group: scale
// s = rn_e4m3(amax / 6), codes rn_e2m1(x * 1/s), with the FP32-pipe shortcuts that the CPU test
// checks for every float) and the FP8 codes rn_e4m3(x * 1/s). numerics/formats.cuh holds the
// element conversions they reduce to.
//
// Host builds: e4m3x2_word (quantize/host_hooks.cuh) is the one conversion a host build of the
// pre-pass supplies itself; everything else here is plain arithmetic.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "numerics/e2m1_round.cuh"
#include "numerics/formats.cuh"
#include "quantize/host_hooks.cuh"

namespace flashinfer_h3 {
namespace quantize {

constexpr int kGroup = 16;  // elements per NVFP4 scale (layout.GROUP)

// fl(a / 6) for finite a >= 0 (SPEC 3: s = rn_e4m3(amax / 6), the quotient rounded to FP32
// first). Three FMA-pipe ops instead of __fdiv_rn's ~10 and its slow-path branch: q0 = a fl(1/6)
// is within an ulp of a / 6, so the remainder a - 6 q0 is exact in one FMA and one correction
// step rounds correctly. The CPU test checks every finite float: equal to fl(a / 6) whenever that
// is normal; a subnormal quotient may be an ulp off, but its E4M3 code is 0 either way.
__device__ __forceinline__ float div6_rn(float a) {
  constexpr float kSixth = 1.0f / 6.0f;
  const float q0 = __fmul_rn(a, kSixth);
  const float rem = __fmaf_rn(-kE2M1Max, q0, a);
  return __fmaf_rn(rem, kSixth, q0);
}

// The NVFP4 element encoder of Hopper (no E2M1 cvt there), written for the FP32 pipe: the
// integer encoder of formats.cuh costs ~10 ALU-pipe ops an element, and ALU issue is what
// bounded this kernel.
//
// With a = |x r|, the E2M1 index is a sum of three clamped, rounded pieces,
//     rn(2 min(a, 2)) + rn(clamp(a - 2, 0, 2)) + rn(clamp(a / 2 - 2, 0, 1)),
// rn = round to an integer, ties to even: the grid step is 0.5 on [0, 2], 1 on [2, 4] and 2 on
// [4, 6] (and everything past 6 saturates to 7). a lies in one piece's range, the others being
// at their integer bounds, and the even codes are the even integers of every piece, so RN-even
// of the piece is RN-even of the code. Each clamp is one FMUL/FFMA with .SAT (exact: a / 2 and
// a / 2 - 1 or - 2 are exact where they are not clamped), and the pieces are rounded into
// M = 1.5 * 2^23 (where the FP32 step is 1) by a chain of FFMAs: fl(piece + M + partial) rounds
// exactly as the piece since M + partial is even wherever the piece is not an integer. The
// result is M + index.
//
// The sign and the packing use the product y' = x (r 2^-110) instead of x r. Scaling by a power
// of two is exact unless y' is subnormal, i.e. |x r| < 2^-16, where the index is 0 either way and
// y' still carries x's sign (so -0.0 and tiny negatives give code 8, as cvt and formats.py do).
// For |x r| < 2^15 the biased exponent of y' is below 32, so bits 30..28 of y' are zero and
// (M + index) 2^28 + bits(y') has sign << 3 | index in its top nibble (M's low nibble is 0); a
// funnel shift then appends that nibble to the word. Per element: FMUL, FMUL.SAT, 2 FFMA.SAT,
// 2 FFMA, FADD on the FP32 pipe, IMAD (or LEA) and SHF. Callers guarantee |x r| < 2^15
// (kFastProductLimit below).
constexpr float kLineMagic = 12582912.0f;  // 1.5 * 2^23
constexpr float kRecipScale = 0x1p-110f;   // r' = r * 2^-110 (normal for every UE4M3 r)
constexpr float kFastProductLimit = 0x1p-95f;  // |x r'| < 2^-95  <=>  |x r| < 2^15

__device__ __forceinline__ uint32_t e2m1_top_nibble(float yp) {
  const float a = fabsf(yp);                                    // |x r| 2^-110
  const float lo = __saturatef(__fmul_rn(a, 0x1p109f));         // min(a/2, 1) of |x r|
  const float mid = __saturatef(__fmaf_rn(a, 0x1p109f, -1.0f));  // clamp(|x r|/2 - 1, 0, 1)
  const float hi = __saturatef(__fmaf_rn(a, 0x1p109f, -2.0f));   // clamp(|x r|/2 - 2, 0, 1)
  float t = __fmaf_rn(lo, 4.0f, kLineMagic);
  t = __fmaf_rn(mid, 2.0f, t);
  t = __fadd_rn(hi, t);
  return __float_as_uint(t) * (1u << 28) + __float_as_uint(yp);
}

// Eight elements -> one word of codes, element 0 in bits [3:0] (the MMA fragment order).
__device__ __forceinline__ uint32_t e2m1x8_scaled(const float* x, float r_scaled) {
  uint32_t word = 0;
#pragma unroll
  for (int e = 7; e >= 0; --e) word = __funnelshift_l(e2m1_top_nibble(__fmul_rn(x[e], r_scaled)), word, 4);
  return word;
}

struct Nvfp4Group {
  uint2 codes;    // 16 E2M1 codes, element 0 in bits [3:0] of .x
  uint32_t scale; // UE4M3 byte
};

// r 2^-110 of UE4M3 code b (r = the correctly rounded 1 / value), 0 for the zero code: the
// per-CTA table the group quantizer reads instead of decoding the scale and dividing.
__device__ __forceinline__ float nvfp4_recip_scaled(uint32_t b) {
  const float s = e4m3_to_float(static_cast<uint8_t>(b));
  return b == 0 || b >= 0x7F ? 0.0f : __fmul_rn(__frcp_rn(s), kRecipScale);
}

// The 16 codes of x r through formats.cuh's encoder (the hardware cvt on sm_120a), r = the
// correctly rounded 1 / s recovered exactly from the table entry r 2^-110.
__device__ __forceinline__ uint2 nvfp4_codes_exact(const float (&x)[kGroup], float recip_scaled) {
  const float r = __fmul_rn(recip_scaled, 0x1p110f);
  float lo[8], hi[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    lo[e] = __fmul_rn(x[e], r);
    hi[e] = __fmul_rn(x[8 + e], r);
  }
  return make_uint2(e2m1x8_from_float(lo), e2m1x8_from_float(hi));
}

// max |x_i| of a group, as a 4-level tree: the scale, and so every element of the group, waits on
// this chain. NaN elements are left out (fmaxf returns the other operand). An infinite amax
// (x - mean overflowed) would make div6_rn NaN; it is clamped to FLT_MAX, which has the same
// scale code (448, saturated).
__device__ __forceinline__ float nvfp4_group_amax(const float (&x)[kGroup]) {
  float m8[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) m8[e] = fmaxf(fabsf(x[e]), fabsf(x[e + 8]));
#pragma unroll
  for (int e = 0; e < 4; ++e) m8[e] = fmaxf(m8[e], m8[e + 4]);
  const float amax = fmaxf(fmaxf(m8[0], m8[2]), fmaxf(m8[1], m8[3]));
  return fminf(amax, 3.40282347e38f);
}

// SPEC 3 "quantize a group": s = rn_e4m3(amax / 6); s == 0 -> all codes 0; else rn_e2m1(x * 1/s).
// `recip_scaled` is the table of nvfp4_recip_scaled (shared memory).
__device__ __forceinline__ Nvfp4Group nvfp4_group(const float (&x)[kGroup], const float* recip_scaled) {
  const float amax = nvfp4_group_amax(x);
  Nvfp4Group g;
  g.scale = e4m3x2_word(div6_rn(amax), 0.0f);
  const float rs = recip_scaled[g.scale];
#if FLASHINFER_H3_NATIVE_FP4
  g.codes = nvfp4_codes_exact(x, rs);
#else
  // Right whenever every |x r| < 2^15; fl(amax r') bounds every |x r'| (monotone) and tells.
  g.codes = make_uint2(e2m1x8_scaled(x, rs), e2m1x8_scaled(x + 8, rs));
  if (!(__fmul_rn(amax, rs) < kFastProductLimit)) {
    // An unsaturated scale keeps amax / s below 9 (6 times the rounding ratio of the coarsest
    // subnormal scale), so only a scale saturated at 448 with amax >= 448 * 2^15 (or an
    // overflowed x - mean) gets here: formats.cuh's general encoder, off the straight-line path.
    g.codes = nvfp4_codes_exact(x, rs);
  }
#endif
  // A zero scale maps the group to +0 (SPEC 3), whatever the signs of x.
  if (g.scale == 0) g.codes = make_uint2(0, 0);
  return g;
}

// ---------------------------------------------------------------------------------------------
// The FP16 output mode (the Hopper wgmma backend): the values s * code instead of the codes
// ---------------------------------------------------------------------------------------------

// rn_e2m1(y) as a float, for every float y: the grid value nearest |y| with ties to the even code,
// saturated to 6 (e2m1_round_nonneg; +inf and NaN give 6, as formats.cuh's encoders give index 7
// for them), carrying y's sign bit where `sign` is 0x80000000 (0 drops it). This is the decode of
// the code formats.cuh's encoders (and nvfp4_group, which the CPU test proves equal to them)
// store for y, sign of zero included: -0.1 gives -0, the decode of code 8.
// tests/kernels/test_quantize_build.py checks it on every float bit pattern.
__device__ __forceinline__ float e2m1_value(float y, uint32_t sign) {
  const float a = e2m1_round_nonneg(fabsf(y));
  return __uint_as_float(__float_as_uint(a) | (__float_as_uint(y) & sign));
}

// nvfp4_group's dequantised values s * code_i as FP16, computed without forming the codes:
// out[i] holds elements 2i (low half) and 2i + 1. Every step is the code path's or exact: the same
// scale s and reciprocal r, the same product y = fl(x r) (fl(x r 2^-110) 2^110 in nvfp4_group's
// fast path, equal wherever the code is not 0 either way), e2m1_value(y) = the decode of the code
// (to FP16: exact, a grid value), then the product with s in FP16, which is exact (a grid value
// has 2 significant bits and s 4, in [2^-10, 2688], all normal FP16 values) and is the operation
// the code path's decode does (e2m1x2_to_half2 times the scale, __hmul2): so the bits are those of
// decoding nvfp4_group's codes, signed zeros included. A zero scale gives +0 everywhere (SPEC 3).
// About 8 instructions an element (FMUL, 2 FMNMX, LOP3, 2 FFMA, LOP3 for the sign; F2FP and
// HMUL2 per pair) against nvfp4_group's ~9 plus a decode.
__device__ __forceinline__ void nvfp4_group_fp16(const float (&x)[kGroup], const float* recip_scaled,
                                                 uint32_t (&out)[kGroup / 2]) {
  const float amax = nvfp4_group_amax(x);
  const uint32_t scale = e4m3x2_word(div6_rn(amax), 0.0f);
  const float r = __fmul_rn(recip_scaled[scale], 0x1p110f);  // exact: the table holds r 2^-110 (0 for s = 0)
  const uint32_t sign = scale == 0 ? 0u : 0x80000000u;
  const uint32_t s2 = ue4m3_f16x2(scale);
#pragma unroll
  for (int i = 0; i < kGroup / 2; ++i) {
    const float lo = e2m1_value(__fmul_rn(x[2 * i], r), sign);
    const float hi = e2m1_value(__fmul_rn(x[2 * i + 1], r), sign);
    out[i] = f16x2_mul(f16x2_bits(lo, hi), s2);
  }
}

// SPEC 4.1: an FP8 scale below 2^-126 is 0: the reciprocal of such a subnormal scale can
// overflow to inf, and 0 * inf would make the group's zeros NaN codes (a NaN output row).
constexpr float kFp32MinNormal = 1.17549435e-38f;  // 2^-126

__device__ __forceinline__ float fp8_flush_scale(float s) { return s < kFp32MinNormal ? 0.0f : s; }

// The scale s = fl(amax / 448) of an FP8 group (a Q row, a K' block, a V channel of a segment),
// flushed as above.
__device__ __forceinline__ float fp8_group_scale(float amax) { return fp8_flush_scale(__fdiv_rn(amax, kE4M3Max)); }

// SPEC 4: codes rn_e4m3(x * (1/s)), all 0 when s == 0 (then 1/s would be inf and 0*inf NaN).
struct Fp8Scale {
  float recip;    // 1 / s, correctly rounded (0 when s == 0)
  uint32_t keep;  // all ones, or 0 when s == 0
};

__device__ __forceinline__ Fp8Scale fp8_scale(float s) {
  return s == 0.0f ? Fp8Scale{0.0f, 0u} : Fp8Scale{__frcp_rn(s), ~0u};
}

// Four elements -> one little-endian word, element 0 in the low byte.
__device__ __forceinline__ uint32_t fp8_codes4(float x0, float x1, float x2, float x3, const Fp8Scale& s) {
  const uint32_t lo = e4m3x2_word(__fmul_rn(x0, s.recip), __fmul_rn(x1, s.recip));
  const uint32_t hi = e4m3x2_word(__fmul_rn(x2, s.recip), __fmul_rn(x3, s.recip));
  return (lo | hi << 16) & s.keep;
}

__device__ __forceinline__ uint4 fp8_codes16(const float (&x)[kGroup], const Fp8Scale& s) {
  return make_uint4(fp8_codes4(x[0], x[1], x[2], x[3], s), fp8_codes4(x[4], x[5], x[6], x[7], s),
                    fp8_codes4(x[8], x[9], x[10], x[11], s), fp8_codes4(x[12], x[13], x[14], x[15], s));
}

}  // namespace quantize
}  // namespace flashinfer_h3
