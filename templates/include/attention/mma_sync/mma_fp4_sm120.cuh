// The block-scaled FP4 MMA layer, native SM120 implementation (sm_120a / sm_121a).
//
// One warp-wide product D = (A * SF_A) (B * SF_B) + C of shape m16n8k64, E2M1 operands, one UE4M3
// scale per 16 K-elements (NVFP4), FP32 accumulation: PTX ISA 9.0 §9.7.14.5.14 ("mma",
// kind::mxf4nvf4 .block_scale .scale_vec::4X) with the fragment layouts of §9.7.14.5.11
// (m16n8k64) and the scale-lane rules of §9.7.14.3 ("Block Scaling for mma.sync"). The layout is
// summarised here; per lane (g = lane / 4, t = lane % 4):
//
//   A  a[0]: row g,   k 8t..8t+7      a[1]: row g+8, k 8t..8t+7
//      a[2]: row g,   k 32+8t..+7     a[3]: row g+8, k 32+8t..+7   (element k in nibble k % 8)
//   B  b0:   col g,   k 8t..8t+7      b1:   col g,   k 32+8t..+7
//   C/D d[0] (g, 2t)  d[1] (g, 2t+1)  d[2] (g+8, 2t)  d[3] (g+8, 2t+1)
//   SF_A row m comes from lane 4 (m % 8) + 2 kThreadIdA + m / 8,
//   SF_B col n comes from lane 4 n + kThreadIdB; byte j of a scale word scales k in [16j, 16j+16).
//
// mma_fp4_sm90_emulated.cuh implements the same interface on Hopper; mma_fp4.cuh includes
// whichever matches the target, so the kernel source is identical on both.
//
// Interface (both implementations; every call is warp-collective, like mma.sync itself):
//   FragA<kThreadIdA> make_frag_a<kThreadIdA>(const uint32_t (&a)[4], uint32_t sfa)
//   void mma_nvfp4<kThreadIdB>(float (&d)[4], const FragA<kThreadIdA>&, uint32_t b0, uint32_t b1,
//                              uint32_t sfb)                         // d = A B + d
// The A operand is wrapped once so that an implementation that must transform it (the Hopper
// emulation decodes it) does so once per operand rather than once per product.
#pragma once

#include <stdint.h>

#include "ptx/mma_sync.cuh"

namespace flashinfer_h3 {
namespace mma {

template <int kThreadIdA>
struct FragA {
  static_assert(kThreadIdA == 0 || kThreadIdA == 1, "thread-id-a selects a thread pair: 0 or 1");
  uint32_t codes[4];
  uint32_t sf;  // this lane's SF_A word (meaningful on the lanes kThreadIdA selects)
};

template <int kThreadIdA>
__device__ __forceinline__ FragA<kThreadIdA> make_frag_a(const uint32_t (&a)[4], uint32_t sfa) {
  return FragA<kThreadIdA>{{a[0], a[1], a[2], a[3]}, sfa};
}

// One mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64 (ptx/mma_sync.cuh).
template <int kThreadIdB, int kThreadIdA>
__device__ __forceinline__ void mma_nvfp4(float (&d)[4], const FragA<kThreadIdA>& a, uint32_t b0,
                                          uint32_t b1, uint32_t sfb) {
  static_assert(kThreadIdB >= 0 && kThreadIdB <= 3, "thread-id-b selects one lane of a quad");
  ptx::mma_m16n8k64_e2m1_block_scale<kThreadIdA, kThreadIdB>(d, a.codes, b0, b1, a.sf, sfb);
}

}  // namespace mma
}  // namespace flashinfer_h3
