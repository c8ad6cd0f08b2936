// Shared memory and synchronisation of the Hopper attention kernels: the tile ring that the
// producer fills with bulk copies and the consumer warpgroups drain, and the named barriers of the
// consumers' ping-pong.
#pragma once

#include <stdint.h>

#include "../../ptx/mbarrier.cuh"
#include "../../ptx/smem_addr.cuh"
#include "../../ptx/warpgroup.cuh"
#include "tile_scheduler.cuh"

namespace flashinfer_h3 {
namespace sm90 {

constexpr int kHeadDim = 128;
constexpr int kBlockRows = 128;  // query rows of an item: two consumer warpgroups x 64
constexpr int kTileKeys = 128;   // keys of a KV tile (= the FP8 K-scale block and the reference's tile)
// K and V tiles in flight: the FP8 kernel's default ring depth. Deeper rings measured slower or
// at best equal (benchmarks/RESULTS.md: 3 to 5 stages; depth 4 equal in the sixth session),
// although with 2 the consumers wait for a V tile in about 3 % of their samples.
constexpr int kFp8Stages = 2;
constexpr int kConsumers = 2;
constexpr int kWarpgroupThreads = 128;
constexpr int kThreads = (1 + kConsumers) * kWarpgroupThreads;  // producer + two consumers
constexpr uint32_t kTileBytes = kTileKeys * kHeadDim;            // one E4M3 tile: 128 rows x 128 bytes

// Every tile is 1024-byte aligned: the 128-byte swizzle repeats every 8 rows of 128 bytes, and
// both TMA and the wgmma descriptors assume the pattern starts at the tile.
// (One Q block: a second one, loaded during the previous item, measured 4-5 % slower, per cycle:
// the two consumers' exponential phases then overlap more, benchmarks/RESULTS.md.)
// kKeys: keys of a KV tile, 128 or 256. A 256-key tile is two 128-key halves of kTileBytes each
// (two TMA boxes): K half h holds keys 128h.., V^T half h their columns, so every wgmma operand
// is a 128-byte-row tile as above.
template <int kDepth, int kKeys = kTileKeys>
struct alignas(1024) SharedStorage {
  static constexpr int kStages = kDepth;
  static constexpr int kTileKeysOf = kKeys;
  uint8_t q[kBlockRows * kHeadDim];          // rows 64c..64c+63 belong to consumer c
  uint8_t k[kDepth][kKeys / kTileKeys][kTileBytes];  // K tile: row = key, 128 channel bytes
  uint8_t v[kDepth][kKeys / kTileKeys][kTileBytes];  // V^T tile: row = channel, 128 key bytes (FP8 key order)
  uint64_t q_full, q_empty;
  uint64_t k_full[kDepth], k_empty[kDepth];
  uint64_t v_full[kDepth], v_empty[kDepth];
  ItemSlot item;  // the dynamic order's current item (tile_scheduler.cuh)
};

// The BF16 Q block of the item ahead, for the FP8 builds that quantise Q in the kernel
// (Fp8Options::kQInKernel, fp8_q_quantizer.cuh): channels 0..63 and 64..127 of its 128 rows as
// two atoms of 128 rows x 128 bytes in the 128-byte swizzle, as the TMA thread's two boxes land.
// It follows the SharedStorage in dynamic shared memory (whose size is a multiple of 1024), so
// production's storage and addresses stay as they are.
struct alignas(1024) QStaging {
  static constexpr uint32_t kAtomBytes = kBlockRows * 128;
  uint8_t atoms[2][kAtomBytes];
  float amax[kBlockRows];   // the rows' amax, then their scales s
  float recip[kBlockRows];  // and 1 / s (0 for s = 0 or inf)
  uint64_t full;   // the TMA thread's arrive.expect_tx plus the two boxes' bytes
  uint64_t empty;  // one arrival per quantizer thread once it read the block
  // Per-consumer hand-off (q_in_kernel = 2): consumer c's 64 rows of sm.q are written once it
  // released them and published on their own barrier, instead of the block's q_full / q_empty.
  uint64_t q_full[2];   // one arrival per quantizer thread
  uint64_t q_empty[2];  // consumer c's release (one arrival)
};

// The QStaging after a SharedStorage `sm` (of a kQStaging build's dynamic shared memory).
template <class Storage>
__device__ __forceinline__ QStaging& q_staging(Storage& sm) {
  return *reinterpret_cast<QStaging*>(reinterpret_cast<uint8_t*>(&sm) + sizeof(Storage));
}

// Dynamic shared memory to request: the storage (and the Q staging area of kQStaging builds) plus
// slack to align its start to 1024 bytes.
template <int kDepth, int kKeys = kTileKeys, bool kQStaging = false>
constexpr int smem_bytes() {
  return static_cast<int>(sizeof(SharedStorage<kDepth, kKeys>) + (kQStaging ? sizeof(QStaging) : 0)) + 1024;
}

// The (1024-byte aligned) storage inside the dynamic shared memory; `Storage` is a SharedStorage
// or the NVFP4 kernel's (nvfp4_shared_storage.cuh).
template <class Storage>
__device__ __forceinline__ Storage& aligned_storage(uint8_t* dynamic_smem) {
  const uintptr_t p = (reinterpret_cast<uintptr_t>(dynamic_smem) + 1023) & ~uintptr_t{1023};
  return *reinterpret_cast<Storage*>(p);
}

// Arrivals that complete each barrier's phase: `full` barriers complete on the producer's one
// arrive.expect_tx plus the copy's bytes; `empty` barriers on one arrival per consumer warpgroup
// of each of the kClusterCtas CTAs that a slot's copies fill (the FP8 kernel's clusters: a CTA
// copies half of every tile into both, so a slot is free once both CTAs' consumers released it).
// q_full_arrivals: 1 (the Q block's copy), or the quantizer threads of kQInKernel builds, each of
// which arrives once it wrote its rows' codes.
template <int kClusterCtas = 1, int kDepth, int kKeys>
__device__ __forceinline__ void init_barriers(SharedStorage<kDepth, kKeys>& s, uint32_t q_full_arrivals = 1) {
  ptx::mbarrier_init(&s.q_full, q_full_arrivals);
  ptx::mbarrier_init(&s.q_empty, kConsumers);
  for (int i = 0; i < kDepth; ++i) {
    ptx::mbarrier_init(&s.k_full[i], 1);
    ptx::mbarrier_init(&s.k_empty[i], kConsumers * kClusterCtas);
    ptx::mbarrier_init(&s.v_full[i], 1);
    ptx::mbarrier_init(&s.v_empty[i], kConsumers * kClusterCtas);
  }
  ptx::mbarrier_init(&s.item.empty, kConsumers * kWarpgroupThreads);  // every consumer thread reads the item
  ptx::fence_mbarrier_init();
}

// Position in the rings: the producer and each consumer count KV tiles the same way. Tile `index`
// sits in stage index % kDepth of a ring of kDepth buffers, and that buffer's mbarrier phases
// alternate every kDepth tiles (the NVFP4 kernel's K and V rings have different depths and share
// one count).
struct RingSlot {
  uint32_t index = 0;  // tiles handled so far
  template <int kDepth>
  __device__ __forceinline__ int stage() const {
    return static_cast<int>(index % kDepth);
  }
  template <int kDepth>
  __device__ __forceinline__ uint32_t parity() const {
    return (index / kDepth) & 1u;
  }
  // The tile before this one (index >= 1).
  template <int kDepth>
  __device__ __forceinline__ int previous_stage() const {
    return static_cast<int>((index - 1) % kDepth);
  }
  template <int kDepth>
  __device__ __forceinline__ uint32_t previous_parity() const {
    return ((index - 1) / kDepth) & 1u;
  }
};

// Named barriers (id 0 is __syncthreads). kTurn + c: consumer c may issue its GEMMs; the other
// consumer arrives on it after issuing its own, so the two alternate and one's softmax overlaps
// the other's tensor-core work.
// kQuantizers: the FP8 kernel's Q quantizer warps (fp8_q_quantizer.cuh) between their phases.
// kDeltaWarpgroup: the NVFP4 delta warpgroup (nvfp4_delta.cuh write_qbar_rows) around writing an
// item's qbar operand into shared memory.
enum NamedBarrier : uint32_t { kTurn = 1, kQuantizers = 3, kDeltaWarpgroup = 4 };
constexpr uint32_t kPingPongThreads = 2 * kWarpgroupThreads;

// Consumer c's side of the ping-pong: wait() before its GEMM phase, pass() once its GEMMs are
// issued. Consumer 0 goes first: consumer 1 passes once at the start (start()), and consumer 0
// takes that extra turn at the end (finish()), so both barriers end balanced. kEnabled = false
// (benchmark-only builds, to measure what the ordering gives) leaves the consumers unordered.
template <bool kEnabled>
struct PingPong {
  uint32_t mine, other;  // kTurn + this consumer, kTurn + the other one
  __device__ __forceinline__ explicit PingPong(int consumer)
      : mine(kTurn + static_cast<uint32_t>(consumer)), other(kTurn + 1u - static_cast<uint32_t>(consumer)) {}
  __device__ __forceinline__ bool goes_first() const { return mine == kTurn; }
  __device__ __forceinline__ void start() const {
    if constexpr (kEnabled) {
      if (!goes_first()) ptx::named_barrier_arrive(other, kPingPongThreads);
    }
  }
  __device__ __forceinline__ void wait() const {
    if constexpr (kEnabled) ptx::named_barrier_sync(mine, kPingPongThreads);
  }
  __device__ __forceinline__ void pass() const {
    if constexpr (kEnabled) ptx::named_barrier_arrive(other, kPingPongThreads);
  }
  __device__ __forceinline__ void finish() const {
    if constexpr (kEnabled) {
      if (goes_first()) ptx::named_barrier_sync(mine, kPingPongThreads);
    }
  }
};

// The suspend-time hint (ns) of the producer warpgroup's mbarrier waits, for a free ring slot or
// a loaded tile (ptx::mbarrier_wait_suspend). Polling without it, the producer thread executed
// ~10 % of the FP8 kernel's instructions (two per round, on the SM sub-partition that two
// consumer warps share with it) and the NVFP4 delta warps ~8 % of that kernel's; suspended, the
// FP8 kernel runs 0.8-1.3 % faster, the NVFP4 one 0-0.4 % (benchmarks/RESULTS.md). 100 ns and
// 10 us measured the same (the wait ends when the phase completes); the shorter bound is kept.
constexpr uint32_t kProducerWaitSleepNs = 100;

// The thread that arrives on `empty` barriers for its warpgroup (read from %tid when needed: a
// register kept for it across the tile loop is one the loop lacks).
__device__ __forceinline__ bool signals_for_warpgroup() { return threadIdx.x % kWarpgroupThreads == 0; }

}  // namespace sm90
}  // namespace flashinfer_h3
