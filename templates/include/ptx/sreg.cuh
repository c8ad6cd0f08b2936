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

}  // namespace ptx
}  // namespace flashinfer_h3
