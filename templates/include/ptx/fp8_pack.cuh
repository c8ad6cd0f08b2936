// Packing FP32 values into E4M3 codes, four to a 32-bit register (the A-operand format of the
// E4M3 MMAs), PTX ISA 9.7.9.21 ("cvt", .e4m3x2 destination), sm_89 and later.
#pragma once

#include <stdint.h>

#include "ptx/cvt.cuh"

namespace flashinfer_h3 {
namespace ptx {

// cvt.rn.satfinite.e4m3x2.f32 (ptx/cvt.cuh) widened to 32 bits: `lo` in bits [7:0], `hi` in
// [15:8], round to nearest even, saturating to +-448 (never NaN for finite inputs).
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  return cvt_e4m3x2_rn_satfinite(lo, hi);
}

// Four values, x0 in the lowest byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
  return cvt_e4m3x2(x0, x1) | (cvt_e4m3x2(x2, x3) << 16);
}

}  // namespace ptx
}  // namespace flashinfer_h3
