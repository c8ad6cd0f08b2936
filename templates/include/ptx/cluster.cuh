// Thread-block clusters (sm_90 and later): the cluster-wide barrier and a peer CTA's shared
// memory (PTX ISA: barrier.cluster; mapa; mbarrier.arrive on a shared::cluster address). The
// CTA's rank in its cluster is a special register (sreg.cuh cluster_ctarank).
//
// A kernel launched with a cluster dimension runs its CTAs of one cluster at the same time on
// one GPC; each can address the others' shared memory (distributed shared memory), which is what
// lets one bulk copy fill the same tile in two CTAs (tma_load_3d_multicast, tma.cuh).
#pragma once

#include <stdint.h>

#include "smem_addr.cuh"

namespace flashinfer_h3 {
namespace ptx {

// barrier.cluster.arrive.release + barrier.cluster.wait.acquire (PTX ISA 9.7.13.3,
// "barrier.cluster"): every non-exited thread of the cluster arrives before any passes; what a
// thread wrote before its arrival (its CTA's mbarrier inits included) is visible to the threads
// of every CTA after their wait. Not .aligned: the callers need not be warp-converged.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The same with .aligned: every thread of the warp executes it together (a converged warp).
__device__ __forceinline__ void cluster_sync_aligned() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// mapa.shared::cluster.u32 (PTX ISA 9.7.9.21, "mapa"): the shared::cluster address of the
// variable at `local` (this CTA's shared memory) in the CTA of rank `rank`.
__device__ __forceinline__ uint32_t map_to_cta(const void* local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  return remote;
}

// mbarrier.arrive.shared::cluster (PTX ISA 9.7.13.15.13): one arrival on the barrier at
// shared::cluster address `bar` (another CTA's, from map_to_cta), with the default semantics
// (.release at .cta scope). What it publishes is that the caller's wgmma reads of a tile are
// done, and those completed at the wgmma wait before it; .release.cluster would put a GPU-scope
// MEMBAR (and error barriers) before every arrival, in the consumers' critical path: with it the
// clustered kernel measured 17 % slower than without clusters (benchmarks/RESULTS.md).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(bar) : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
