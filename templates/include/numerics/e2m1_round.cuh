// rn_e2m1 as a value, for the in-register P quantisation of the Hopper NVFP4 kernel (SPEC 3.7):
// the E2M1 grid point nearest to y >= 0, ties to the even code, saturated to 6, returned as a
// float (the kernel needs the dequantised value s * code, not the code).
//
// Why not formats.cuh's encoders: they produce codes (then a decode is needed) and cost ~10 ALU
// ops an element; P quantisation runs on 64 elements per thread per KV tile, next to the softmax,
// and the kernel is issue-bound there. This is 5 FP32-pipe ops.
//
// How: the grid step is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]. With a = min(y, 6) and
// u = 2^e, e = the exponent of max(a, 1) (0, 1 or 2, since a <= 6), the float C = 1.5 * 2^22 * u
// has spacing 0.5 u, exactly the grid step at a. fl(a + C) rounds a to that step with ties to
// even, and in each range the even multiples of the step are the grid values with even codes
// (0, 1 of step 0.5; 2 of step 1; 4 of step 2), so fl(a + C) - C (exact) is rn_e2m1(y).
// Examples: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, 6.9 -> 6.
//
// Domain: y >= 0 (-0.0 gives +0), +inf gives 6. P is never negative; a NaN y gives 6 (fminf
// returns the other operand), but a NaN P only comes from NaN inputs, which make the row's max
// and sum NaN too. The CPU test checks every non-negative float bit pattern against an
// independent grid search (tests/kernels/test_nvfp4_wgmma_build.py), e2m1_round_below7 every one
// below 7.
//
// The f16x2 forms (e2m1_round_*_h2) round two FP16 values at once with the same construction on
// FP16's grid: C = 1.5 * 2^9 = 768, whose FP16 spacing is 0.5, and u from the FP16 exponent
// field. They are 5 (4 without the saturation) f16x2 ops per pair where the FP32 forms take 8
// (6) FP32 ops, for the kernel's P, which is carried as FP16 from the exponential on (see
// attention/sm90/nvfp4_softmax.cuh, kF16Rounding). Each is exact for every FP16 input:
// fma.rn.f16x2 rounds once, u * 768 and the subtraction are exact (3072 + 6 < 2^12).
//
// Users: the Hopper NVFP4 kernel's P (attention/sm90/nvfp4_softmax.cuh) and the FP16 output mode
// of the NVFP4 pre-pass (numerics/group_quantize.cuh, nvfp4_group_fp16).
//
// Host builds (the CPU tests) supply __fmaf_rn, the bit casts and, where they use the f16x2
// forms, the three f16x2 operations (h2_fma_rn, h2_max, h2_min on f16x2 bits) themselves.
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

namespace flashinfer_h3 {

constexpr float kE2M1RoundMagic = 6291456.0f;  // 1.5 * 2^22: the float spacing there is 0.5

__device__ __forceinline__ float e2m1_round_nonneg(float y) {
  const float a = fminf(y, 6.0f);
  const float u = __uint_as_float(__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u);  // 1, 2 or 4
  const float t = __fmaf_rn(u, kE2M1RoundMagic, a);  // a + C, one rounding (u C is exact)
  return __fmaf_rn(u, -kE2M1RoundMagic, t);          // t - C, exact
}

// The same for 0 <= y < 7 (callers guarantee it), without the saturation: there the step at y
// is already right (y in [6, 7) rounds to 6 with step 2), so min(y, 6) is not needed.
__device__ __forceinline__ float e2m1_round_below7(float y) {
  const float u = __uint_as_float(__float_as_uint(fmaxf(y, 1.0f)) & 0x7F800000u);  // 1, 2 or 4
  const float t = __fmaf_rn(u, kE2M1RoundMagic, y);
  return __fmaf_rn(u, -kE2M1RoundMagic, t);
}

// ---------------------------------------------------------------------------------------------
// f16x2: two FP16 values (the low and high halves of a 32-bit word) at once
// ---------------------------------------------------------------------------------------------

#ifdef __CUDACC__
// fma.rn.f16x2 / max.f16x2 / min.f16x2 on f16x2 bits (PTX ISA 9.7.5, "Half Precision Floating
// Point Instructions"): HFMA2 and HMNMX2. max / min return the other operand for a NaN one, as
// FMNMX does.
__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<const uint32_t*>(&h); }
__device__ __forceinline__ __half2 h2_value(uint32_t b) { return *reinterpret_cast<const __half2*>(&b); }
__device__ __forceinline__ uint32_t h2_fma_rn(uint32_t a, uint32_t b, uint32_t c) {
  return h2_bits(__hfma2(h2_value(a), h2_value(b), h2_value(c)));
}
__device__ __forceinline__ uint32_t h2_max(uint32_t a, uint32_t b) { return h2_bits(__hmax2(h2_value(a), h2_value(b))); }
__device__ __forceinline__ uint32_t h2_min(uint32_t a, uint32_t b) { return h2_bits(__hmin2(h2_value(a), h2_value(b))); }
#else
// Host builds: a CPU test that uses the f16x2 forms defines these (tests/kernels/
// test_nvfp4_wgmma_build.py); one that includes this header for the FP32 forms only (the
// pre-pass's, tests/kernels/test_quantize_build.py) never calls them.
uint32_t h2_fma_rn(uint32_t a, uint32_t b, uint32_t c);
uint32_t h2_max(uint32_t a, uint32_t b);
uint32_t h2_min(uint32_t a, uint32_t b);
#endif

constexpr uint32_t kH2One = 0x3C003C00u;       // (1, 1)
constexpr uint32_t kH2Six = 0x46004600u;       // (6, 6)
constexpr uint32_t kH2Magic = 0x62006200u;     // (768, 768): 1.5 * 2^9, the FP16 spacing there is 0.5
constexpr uint32_t kH2MinusMagic = 0xE200E200u;
constexpr uint32_t kH2ExponentMask = 0x7C007C00u;

// rn_e2m1 of two FP16 values y >= 0 (f16x2 bits in, f16x2 bits of the grid values out).
__device__ __forceinline__ uint32_t e2m1_round_nonneg_h2(uint32_t y) {
  const uint32_t a = h2_min(y, kH2Six);
  const uint32_t u = h2_max(a, kH2One) & kH2ExponentMask;  // (1, 2 or 4) per half
  const uint32_t t = h2_fma_rn(u, kH2Magic, a);           // a + C u, one rounding
  return h2_fma_rn(u, kH2MinusMagic, t);                  // t - C u, exact
}

// The same for 0 <= y < 7 per half (callers guarantee it), without the saturation.
__device__ __forceinline__ uint32_t e2m1_round_below7_h2(uint32_t y) {
  const uint32_t u = h2_max(y, kH2One) & kH2ExponentMask;
  const uint32_t t = h2_fma_rn(u, kH2Magic, y);
  return h2_fma_rn(u, kH2MinusMagic, t);
}

}  // namespace flashinfer_h3
