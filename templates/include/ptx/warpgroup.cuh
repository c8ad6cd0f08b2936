// Warpgroup-level control: register reallocation between roles and named barriers.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

// setmaxnreg (PTX ISA 9.7.17.1, sm_90a): every warp of the warpgroup executes it. A producer
// lowers its register budget so that the consumers can raise theirs within the SM's 64K.
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg takes 24..256 in steps of 8");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(kRegs >= 24 && kRegs <= 256 && kRegs % 8 == 0, "setmaxnreg takes 24..256 in steps of 8");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// bar.sync / bar.arrive on a named barrier (PTX ISA 9.7.13.1, "bar, barrier"): `threads` (a
// multiple of 32) is the number that completes it, sync-ers and arrive-ers together. Id 0 is
// __syncthreads()'s; kernels give their barriers names in an enum.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
