// cp.async: asynchronous copies global -> shared memory, tracked per thread by commit groups.
// PTX ISA 9.0 §9.7.9.25.3 ("Data Movement and Conversion Instructions: Non-bulk copy"):
// §9.7.9.25.3.1 cp.async, §9.7.9.25.3.2 cp.async.commit_group, §9.7.9.25.3.3
// cp.async.wait_group. sm_80 and later.
#pragma once

#include <stdint.h>

#include "smem_addr.cuh"

namespace flashinfer_h3 {
namespace ptx {

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: 16 bytes through L2 only (.cg takes
// only 16); the 16 - src_bytes trailing bytes are zero-filled, so src_bytes = 0 reads nothing
// and writes 16 zero bytes.
__device__ __forceinline__ void cp_async_cg_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// cp.async.ca.shared.global [dst], [src], 4, src_bytes: 4 bytes through L1 (.ca allows 4, 8,
// 16), zero-filled past src_bytes.
__device__ __forceinline__ void cp_async_ca_4(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

// cp.async.ca.shared.global [dst], [src], 4: 4 bytes through L1, no zero fill.
__device__ __forceinline__ void cp_async_ca_4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// cp.async.commit_group: closes the group of this thread's cp.async issued since the last one.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// cp.async.wait_group N: waits until at most N of this thread's committed groups are pending.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
