// Special registers (PTX ISA 10, "Special Registers").
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

// %nctaid.x (PTX ISA 10.6, %nctaid), read where it is used: volatile, so the compiler cannot
// hoist it and keep the value live across a loop (gridDim.x is one constant load that ptxas may
// hoist and then spill; the FP8 kernel's 256-key consumer loop spilled it across every item).
__device__ __forceinline__ uint32_t grid_ctas_x() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(n));
  return n;
}

// %cluster_ctarank (PTX ISA 10, "Special Registers"): this CTA's rank in its cluster (0 without
// clusters), read where it is used like grid_ctas_x (the FP8 producer's 24 registers).
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

}  // namespace ptx
}  // namespace flashinfer_h3
