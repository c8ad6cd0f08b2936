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

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 b16 matrices; lanes 8m..8m+7 give the row
// addresses of matrix m, and lane 4g+t receives bytes 4t..4t+3 of row g of matrix m in r[m].
// With a "row" of 16 bytes (16 E4M3 codes of one key or channel), two matrices of chunks 2s,
// 2s + 1 of the same 8 rows are the b0, b1 of an m16n8k32 E4M3 B fragment (k32 step s).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace ptx
}  // namespace flashinfer_h3
