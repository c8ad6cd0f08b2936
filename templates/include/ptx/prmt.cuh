// prmt: byte permute of a pair of 32-bit registers.
// PTX ISA 9.0 §9.7.8.7 ("prmt"): result byte k = byte sel[4k+3:4k] of the 8-byte value {b:a}
// (a = bytes 0-3, b = bytes 4-7). CUDA's __byte_perm is this instruction (one PRMT in SASS).
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

}  // namespace ptx
}  // namespace flashinfer_h3
