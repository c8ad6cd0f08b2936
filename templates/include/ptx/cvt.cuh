// cvt: conversions to and from the low-precision formats of the recipes.
// PTX ISA 9.0 §9.7.9.21 ("cvt"): .e4m3x2 from f32 and to f16x2 exist from sm_89 on; .e2m1x2
// from f32 only on the sm_100a / sm_120a family (FLASHINFER_H3_NATIVE_FP4 in
// numerics/formats.cuh guards its callers).
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

// cvt.rn.satfinite.e4m3x2.f32 d, a, b: two floats -> two E4M3 bytes, a in the upper byte; RN-even,
// subnormals kept, |x| > 448 saturated to +-448.
__device__ __forceinline__ uint16_t cvt_e4m3x2_rn_satfinite(float lo, float hi) {
  uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// cvt.rn.satfinite.e2m1x2.f32 d, a, b (a -> upper nibble) widened to 32 bits: `lo` in bits
// [3:0], `hi` in bits [7:4].
__device__ __forceinline__ uint32_t cvt_e2m1x2_rn_satfinite(float lo, float hi) {
  uint32_t out;
  asm("{\n\t.reg .b8 packed;\n\t"
      "cvt.rn.satfinite.e2m1x2.f32 packed, %1, %2;\n\t"
      "cvt.u32.u8 %0, packed;\n\t}"
      : "=r"(out)
      : "f"(hi), "f"(lo));
  return out;
}

// cvt.rn.f16x2.e4m3x2 d, a: two E4M3 bytes -> f16x2 bits, the low byte into the low half; exact
// (every E4M3 value is an f16).
__device__ __forceinline__ uint32_t cvt_f16x2_e4m3x2(uint16_t pair) {
  uint32_t h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(pair));
  return h;
}

}  // namespace ptx
}  // namespace flashinfer_h3
