// The FP8 (E4M3) warp-level MMA of the mma.sync attention family: D = A B + C, m16n8k32, E4M3
// operands, FP32 accumulation.
//
// PTX ISA 9.0 §9.7.14.5.14 ("mma"): mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32, sm_89
// and later. Fragment layouts, §9.7.14.5.10 ("Matrix Fragments for mma.m16n8k32", the
// .e4m3 rows of its tables), per lane (g = lane / 4, t = lane % 4), byte u of a register = the
// element with the next-higher k (element 0 in the low byte):
//
//   A  a[0]: row g,   k 4t..4t+3        a[1]: row g+8, k 4t..4t+3
//      a[2]: row g,   k 16+4t..16+4t+3  a[3]: row g+8, k 16+4t..16+4t+3
//   B  b0:   col g,   k 4t..4t+3        b1:   col g,   k 16+4t..16+4t+3
//   C/D d[0] (g, 2t)  d[1] (g, 2t+1)    d[2] (g+8, 2t)  d[3] (g+8, 2t+1)
//
// SASS: on sm_120a one QMMA.16832.F32.E4M3.E4M3; on sm_90a (no FP8 mma.sync in hardware) ptxas
// lowers the same instruction to exact E4M3 -> F16 unpacks (F2FP.F16.E4M3.UNPACK_B) and two
// HMMA.16816.F32 (the nvcc SASS tests of the FP8 kernel check both), so the Hopper build runs
// this kernel's real instruction stream: its layouts, scales and masking, with no emulation layer
// of ours.
#pragma once

#include <stdint.h>

#include "ptx/mma_sync.cuh"

namespace flashinfer_h3 {
namespace mma {

// d = A B + d (warp-collective), the fragments above.
__device__ __forceinline__ void mma_e4m3_m16n8k32(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  ptx::mma_m16n8k32_e4m3(d, a, b0, b1);
}

}  // namespace mma
}  // namespace flashinfer_h3
