// mbarrier: the shared-memory barriers that bulk copies complete on and that the roles of a
// warp-specialised kernel hand tiles over with (PTX ISA 9.7.13.15, "Parallel Synchronization and
// Communication Instructions: mbarrier"). sm_90 and later.
//
// A barrier counts arrivals (set at init) and, for bulk copies, transaction bytes: a phase
// completes when both reach zero, and waiters test the parity of the phase they wait for. A fresh
// barrier is in phase 0, so waiting for parity 1 ("the phase before") returns at once: a
// producer's first wait on an empty-slot barrier passes without a consumer arrival.
#pragma once

#include <stdint.h>

#include "smem_addr.cuh"

namespace flashinfer_h3 {
namespace ptx {

// mbarrier.init (9.7.13.15.9): `count` arrivals complete a phase.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// fence.mbarrier_init (9.7.13.4, membar/fence): makes the inits visible to the async proxy (bulk
// copies) before any copy completes on them; a __syncthreads() after it publishes them to threads.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// mbarrier.arrive (9.7.13.15.13): one arrival of this thread.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// mbarrier.arrive.expect_tx (9.7.13.15.13 with 9.7.13.15.11): one arrival that also announces
// `bytes` of transactions, which the bulk copies completing on this barrier then count down.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

// mbarrier.try_wait.parity (9.7.13.15.16) in a loop: returns once the phase of `parity` completed
// (acquire: what the arrivals and copies of that phase wrote is visible afterwards).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// The same loop with try_wait's suspend-time hint (9.7.13.15.16, PTX ISA 7.8): a thread whose
// phase has not completed may be suspended for up to kSuspendNs nanoseconds (or until the phase
// completes) before try_wait returns, instead of coming back at once and polling again. For
// waiters off the critical path (the producer warpgroup's waits for a free ring slot or a loaded
// tile): their polling loop issues two instructions per round on the SM sub-partition that
// consumer warps share with them. kSuspendNs = 0 is mbarrier_wait.
template <uint32_t kSuspendNs>
__device__ __forceinline__ void mbarrier_wait_suspend(uint64_t* bar, uint32_t parity) {
  if constexpr (kSuspendNs == 0) {
    mbarrier_wait(bar, parity);
  } else {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "wait_loop:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
        "@!done bra wait_loop;\n"
        "}\n" ::"r"(smem_addr(bar)),
        "r"(parity), "n"(kSuspendNs)
        : "memory");
  }
}

}  // namespace ptx
}  // namespace flashinfer_h3
