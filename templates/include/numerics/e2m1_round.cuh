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
// Host builds (the CPU test) supply __fmaf_rn and the bit casts themselves.
#pragma once

#include <stdint.h>

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

}  // namespace flashinfer_h3
