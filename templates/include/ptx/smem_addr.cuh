// The shared-state-space address of a generic pointer into shared memory (cvta.to.shared, PTX
// ISA 9.7.9.19 "cvta"): what every shared-memory operand of cp.async, ldmatrix, mbarrier, TMA and
// the wgmma descriptors takes.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace ptx
}  // namespace flashinfer_h3
