// ldmatrix: warp-collective loads of 8x8 b16 matrices from shared memory into MMA fragments.
// PTX ISA 9.0 §9.7.14.5.15 ("ldmatrix"), sm_75 and later.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

// ldmatrix.sync.aligned.m8n8.x2.shared.b16: two 8x8 b16 matrices; lanes 0-7 and 8-15 give the
// row addresses of matrix 0 and 1, and lane 4g+t receives bytes 4t..4t+3 of row g of each.
// With a "row" of 16 bytes (32 E2M1 codes of one column) that is exactly an m16n8k64 B fragment
// register.
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

}  // namespace ptx
}  // namespace flashinfer_h3
