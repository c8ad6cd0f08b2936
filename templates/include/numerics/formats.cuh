// Low-precision number formats of the NVFP4 and FP8 recipes: encode and decode, bit-exact.
//
// The rounding here is part of the contract (SPEC 3, 4): every encoder rounds to nearest with
// ties to the even code and saturates. flashinfer_h3/formats.py is the torch twin of this file
// and the tests compare the two bit for bit. Never build this with --use_fast_math, and keep the
// explicit __f*_rn intrinsics: they stop nvcc from contracting a product into an FMA.
//
// Arch split: E2M1 cvt exists only on sm_100a/sm_120a-class targets (PTX ISA 9.0 §9.7.9.21,
// "cvt"); Hopper gets an exact software encoder. E4M3 cvt exists from sm_89 on, so both archs use
// it for the UE4M3 scales. The instructions themselves are wrapped in ptx/cvt.cuh.
//
// One E2M1 decode: e2m1x2_f16_bits (two codes -> f16x2 bits of value * 2^-14) is what every
// decoder here and in the emulated MMA layer builds on.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "ptx/cvt.cuh"

#if defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1200 && \
    __CUDA_ARCH_FAMILY_SPECIFIC__ < 1300
#define FLASHINFER_H3_NATIVE_FP4 1
#else
#define FLASHINFER_H3_NATIVE_FP4 0
#endif

namespace flashinfer_h3 {

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;

// ---------------------------------------------------------------------------------------------
// E4M3 (with sign) and UE4M3 (sign bit 0)
// ---------------------------------------------------------------------------------------------

// Two floats -> two E4M3 bytes, RN-even, subnormals kept, |x| > 448 saturated to +-448
// (`lo` in the low byte).
using ptx::cvt_e4m3x2_rn_satfinite;

__device__ __forceinline__ uint8_t e4m3_from_float(float x) {
  return static_cast<uint8_t>(cvt_e4m3x2_rn_satfinite(x, 0.0f) & 0xFF);
}

// Exact decode of an E4M3 byte. 0x7F/0xFF are NaN in E4M3FN; no encoder here produces them, so
// decoding them as NaN (as formats.py does) makes a stray byte fail a test instead of passing as 480.
__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  const uint32_t exp = (b >> 3) & 0xF, man = b & 0x7;
  if (exp == 0xF && man == 0x7) return __uint_as_float(0x7FC00000u);
  // Subnormal: man * 2^-9; normal: (8 + man) * 2^(exp - 10). Both products are exact.
  const float mag = exp == 0 ? __uint_as_float((127u - 9u) << 23) * static_cast<float>(man)
                             : __uint_as_float((exp + 127u - 10u) << 23) * static_cast<float>(8u + man);
  return (b & 0x80) ? -mag : mag;
}

// ---------------------------------------------------------------------------------------------
// E2M1: code = sign << 3 | index in {0, 0.5, 1, 1.5, 2, 3, 4, 6}
// ---------------------------------------------------------------------------------------------

// Software RN-even encoder (Hopper has no E2M1 cvt), branch-free so a warp never diverges.
// Below 1 the grid is {0, 0.5, 1}: adding 1.5 * 2^22 (where the float spacing is 0.5) rounds 2a
// to an integer with ties to even, i.e. 0.25 -> 0 and 0.75 -> 1.0. From 1 on the grid values are
// exactly the floats with one mantissa bit, so rounding the bit pattern to one mantissa bit
// (ties to even: 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) gives (exponent, bit) =
// index + 252; anything past 6 (inf too) saturates to index 7. The sign is the float's sign bit,
// so -0.1 encodes as 0x8 (negative zero), as cvt does. Checked against formats.py's rn_e2m1 on
// every float of [2^-30, 16) at 16-bit mantissa steps and around every tie.
__device__ __forceinline__ uint32_t e2m1_from_float_soft(float x) {
  const float a = fabsf(x);
  const uint32_t small = __float_as_uint(__fadd_rn(a, 6291456.0f)) - 0x4AC00000u;
  const uint32_t u = __float_as_uint(a);
  const uint32_t rounded = u + 0x1FFFFFu + ((u >> 22) & 1u);
  const uint32_t big = min((rounded >> 22) - 252u, 7u);
  const uint32_t idx = a < 1.0f ? small : big;
  return (__float_as_uint(x) >> 28 & 0x8u) | idx;
}

// Two floats -> one byte, `lo` in the low nibble.
__device__ __forceinline__ uint32_t e2m1x2_from_float(float lo, float hi) {
#if FLASHINFER_H3_NATIVE_FP4
  return ptx::cvt_e2m1x2_rn_satfinite(lo, hi);
#else
  return e2m1_from_float_soft(lo) | (e2m1_from_float_soft(hi) << 4);
#endif
}

// Eight floats -> one 32-bit word of codes, element 0 in bits [3:0] (the MMA fragment order).
__device__ __forceinline__ uint32_t e2m1x8_from_float(const float (&x)[8]) {
  return e2m1x2_from_float(x[0], x[1]) | e2m1x2_from_float(x[2], x[3]) << 8 |
         e2m1x2_from_float(x[4], x[5]) << 16 | e2m1x2_from_float(x[6], x[7]) << 24;
}

// The E2M1 decode. `w` holds two codes, in bits [3:0] and [19:16] (other bits are ignored);
// returns the f16x2 bits of their values times 2^-14, the first code in the low half. The code's
// sign goes to bit 15 and its three magnitude bits to bits [11:9]: E2M1's exponent then sits in
// the f16 exponent field and its mantissa bit in the top mantissa bit, and E2M1's subnormal (0.5)
// lands on the f16 subnormal, so every code maps to value * 2^-14 exactly; one multiply by 2^14
// (exact) restores the value.
__device__ __forceinline__ uint32_t e2m1x2_f16_bits(uint32_t w) {
  return ((w & 0x00080008u) << 12) | ((w & 0x00070007u) << 9);
}

// Two E2M1 codes (one byte) -> half2 (low nibble -> .x), exact. The mapping of e2m1x2_f16_bits,
// written per nibble: e2m1x2_f16_bits(lo | hi << 16) is the same value, but this spelling is the
// one the NVFP4 kernel's tested SASS was compiled from (the other schedules differently).
__device__ __forceinline__ __half2 e2m1x2_to_half2(uint32_t byte) {
  const uint32_t lo = byte & 0xF, hi = (byte >> 4) & 0xF;
  const uint32_t bits = ((lo & 7u) << 9) | ((lo & 8u) << 12) | ((hi & 7u) << 25) | ((hi & 8u) << 28);
  __half2 h = *reinterpret_cast<const __half2*>(&bits);
  return __hmul2(h, __half2half2(__ushort_as_half(0x7400)));  // 0x7400 = 2^14
}

// One E2M1 code (bits [3:0]) -> float, exact (through the same decode).
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  return __low2float(e2m1x2_to_half2(code & 0xFu));
}

// ---------------------------------------------------------------------------------------------
// The NVFP4 group quantizer's scalar steps (SPEC 3: s = rn_e4m3(amax / 6), r = 1 / s)
// ---------------------------------------------------------------------------------------------

struct Nvfp4Scale {
  uint8_t code;   // UE4M3 byte
  float value;    // its exact value
  float recip;    // correctly rounded 1 / value, 0 when value == 0
};

__device__ __forceinline__ Nvfp4Scale nvfp4_scale_from_amax(float amax) {
  Nvfp4Scale s;
  s.code = e4m3_from_float(__fdiv_rn(amax, kE2M1Max));
  s.value = e4m3_to_float(s.code);
  s.recip = s.value == 0.0f ? 0.0f : __frcp_rn(s.value);
  return s;
}

// The value whose E2M1 code is stored: x * r, correctly rounded (no FMA contraction). A zero
// scale maps every element to +0 so that the group's codes are all 0 (no negative zeros).
__device__ __forceinline__ float nvfp4_scaled(float x, const Nvfp4Scale& s) {
  return s.recip == 0.0f ? 0.0f : __fmul_rn(x, s.recip);
}

}  // namespace flashinfer_h3
