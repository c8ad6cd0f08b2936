// Tensor-map bulk copies global -> shared (TMA), PTX ISA 9.7.9.25.5.1
// ("cp.async.bulk.tensor"), sm_90 and later.
//
// The copy reads a box of a tensor described by a CUtensorMap (built on the host with
// cuTensorMapEncodeTiled; passed to the kernel as a __grid_constant__ parameter), writes it to
// shared memory in the map's swizzle, zero-fills elements outside the tensor, and completes on an
// mbarrier by counting the box's bytes (out-of-range elements included).
#pragma once

#include <stdint.h>

#include "mbarrier.cuh"

namespace flashinfer_h3 {
namespace ptx {

// prefetch.tensormap (9.7.9.26, "prefetch"): bring the descriptor into the cache before the first copy.
__device__ __forceinline__ void prefetch_tensormap(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes: the box at
// coordinates (c0, c1, c2) (innermost first) into `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const void* tmap, uint64_t* bar, int32_t c0, int32_t c1,
                                            int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::
          "r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// The same copy with .multicast::cluster: the box lands at `dst`'s offset in the shared memory
// of every CTA of the cluster whose bit is set in `cta_mask`, and completes on the mbarrier at
// `bar`'s offset in each of them (each counts the box's bytes).
__device__ __forceinline__ void tma_load_3d_multicast(void* dst, const void* tmap, uint64_t* bar, int32_t c0,
                                                      int32_t c1, int32_t c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
