// The shared-state-space address of a generic pointer into shared memory (cvta.to.shared, PTX
// ISA 9.7.9.19 "cvta"): what every shared-memory operand of cp.async, ldmatrix, mbarrier, TMA and
// the wgmma descriptors takes; and 32-bit (and vector) loads and stores by that address.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A 32-bit word of shared memory by its shared-state-space address (PTX ISA 9.7.9.8 "ld", 9.7.9.11
// "st", .shared state space): one LDS / STS on a 32-bit address, where a plain access through a
// generic pointer the compiler cannot place becomes a generic LD / ST on a 64-bit one. Volatile and
// ordered with the surrounding memory operations (a "memory" clobber): the hand-offs that use them
// are ordered by mbarriers, not by the compiler's view of the data.
__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t value;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(value) : "r"(addr) : "memory");
  return value;
}

// Four words (16 bytes, 16-byte aligned) and two words (8 bytes, 8-byte aligned) by
// shared-state-space address (the same sections, .v4 / .v2 vectors): LDS.128 and STS.64.
__device__ __forceinline__ uint4 ld_shared_v4_b32(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v2_b32(uint32_t addr, uint2 v) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
