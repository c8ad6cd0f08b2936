// The shared-state-space address of a generic pointer into shared memory (cvta.to.shared, PTX
// ISA 9.7.9.19 "cvta"): what every shared-memory operand of cp.async, ldmatrix, mbarrier, TMA and
// the wgmma descriptors takes; and a store through such an address.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// st.shared.b32 (PTX ISA 9.7.9.9, "st") at a shared-state-space address: a 32-bit address where
// a generic pointer would take a 64-bit register pair (the FP8 kernel's P tiles).
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(value) : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
