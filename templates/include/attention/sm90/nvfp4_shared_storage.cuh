// Shared memory of the Hopper NVFP4 kernel (nvfp4_kernel.cuh): the FP16 tile ring, the delta
// term of each K tile, and the two tables of the P scales (reciprocals; log2 and value). The rings' pipeline (RingSlot,
// the named barriers of the ping-pong) is the FP8 kernel's (shared_storage.cuh); the K ring (and
// the delta buffers, one per K tile) and the V ring have depths of their own, since 227 KB hold
// the Q block and five FP16 tiles, not six.
//
// FP16 tiles are 128 rows of 128 channels (or keys): 256 bytes a row, stored as two "atoms" of
// 128 rows x 128 bytes (64 values) in the 128-byte swizzle that TMA writes and the wgmma K-major
// descriptors read (ptx/wgmma.cuh); a k16 slice of a row is 32 bytes inside one atom.
#pragma once

#include <stdint.h>

#include "../../ptx/mbarrier.cuh"
#include "shared_storage.cuh"

namespace flashinfer_h3 {
namespace sm90 {

constexpr int kFp16AtomBytes = 128 * 128;              // 128 rows x 64 f16
constexpr uint32_t kFp16TileBytes = 2 * kFp16AtomBytes;  // one 128 x 128 f16 tile
constexpr int kDeltaWarps = 3;  // delta_mma_sync build: warps 1-3 of the producer warpgroup (nvfp4_delta.cuh)
constexpr int kScaleCodes = 128;                        // UE4M3 codes 0x00..0x7F

// An entry of the P scales' fold table (nvfp4_softmax.cuh, kFoldPScale), per UE4M3 code: log2 s
// and the row-sum weight s of a group with scale s; (0, 1) for s = 0 and the NaN code.
struct alignas(8) PScaleFold {  // one 8-byte load an entry
  float log2s;
  float weight;
};

// Default ring depths. A third K (or V) stage measured slower (benchmarks/RESULTS.md), although
// with two of each the consumers wait for a V tile, a K tile or its delta in about 9 % of their
// samples.
constexpr int kNvfp4KStages = 2;
constexpr int kNvfp4VStages = 2;
// (One Q block: a second one, loaded during the previous item, measured 2-3 % slower.)
template <int kKDepth, int kVDepth>
struct alignas(1024) Nvfp4SharedStorage {
  static constexpr int kKStages = kKDepth;
  static constexpr int kVStages = kVDepth;
  uint8_t q[2][kFp16AtomBytes];           // Q' of the block: atom a = channels 64a..; rows 64c.. of consumer c
  uint8_t k[kKDepth][2][kFp16AtomBytes];  // K' tile: row = key position, atom a = channels 64a..
  uint8_t v[kVDepth][2][kFp16AtomBytes];  // V^T tile: row = channel, atom a = key positions 64a..
  float delta[kKDepth][kTileKeys];        // delta (or -inf) of the K tile's positions
  float recip[kScaleCodes];               // correctly rounded 1 / value of a UE4M3 code (0 for 0); unfolded builds
  PScaleFold p_fold[kScaleCodes];         // the fold table (PScaleFold); production
  uint32_t qbar_parts[kDeltaWarps][2 * 64];  // delta_mma_sync build: each delta warp's qbar hi / lo parts
  uint64_t q_full, q_empty;
  uint64_t k_full[kKDepth], k_empty[kKDepth];
  uint64_t v_full[kVDepth], v_empty[kVDepth];
  uint64_t delta_full[kKDepth], delta_empty[kKDepth];
  ItemSlot item;  // the dynamic order's current item (tile_scheduler.cuh)
};

// The delta warpgroup's B operand (kDeltaOnWgmma, production; nvfp4_delta.cuh): qbar's FP16 hi
// and lo parts as rows 0 and 1 of 8 K-major rows (rows 2-7 zero) in the 128-byte swizzle, one
// 1 KB atom per 64 channels. It follows the storage in dynamic shared memory (delta_qbar_rows),
// which the delta_mma_sync benchmark build lays out without it.
struct alignas(1024) DeltaQbarRows {
  uint8_t atoms[2][1024];
};

template <class Smem>
__device__ __forceinline__ DeltaQbarRows& delta_qbar_rows(Smem& sm) {
  static_assert(sizeof(Smem) % 1024 == 0, "the qbar rows start 1024-byte aligned after the storage");
  return *reinterpret_cast<DeltaQbarRows*>(reinterpret_cast<uint8_t*>(&sm) + sizeof(Smem));
}

// Dynamic shared memory to request (+ slack to align the start to 1024 bytes); kDeltaWg: with the
// delta warpgroup's qbar rows after the storage.
template <int kKDepth, int kVDepth, bool kDeltaWg = false>
constexpr int nvfp4_smem_bytes() {
  return static_cast<int>(sizeof(Nvfp4SharedStorage<kKDepth, kVDepth>) + (kDeltaWg ? sizeof(DeltaQbarRows) : 0)) +
         1024;
}
static_assert(nvfp4_smem_bytes<kNvfp4KStages, kNvfp4VStages, true>() <= 227 * 1024,
              "Hopper allows 227 KB of shared memory per block");

// Arrivals that complete each phase: `full` barriers the producer's arrive.expect_tx plus the
// bytes (delta_full: every thread of the delta warpgroup, or every lane of the three delta warps,
// each after its own writes); empty barriers: K tiles on each consumer warpgroup (its wgmma read
// them) and each delta warp, the delta buffer on every consumer thread (after its own loads: a
// direct consumer -> delta-thread handoff, which compute-sanitizer's racecheck can follow; the indirect
// one through k_empty, the producer's copy and k_full is as safe but not visible to it), V tiles
// and the Q block on each consumer warpgroup.
constexpr uint32_t kDeltaThreads = kDeltaWarps * 32;
constexpr uint32_t kConsumerThreads = kConsumers * kWarpgroupThreads;

// kDeltaWg (kDeltaOnWgmma, production): the delta products of a whole warpgroup instead of three
// warps; each of its four warps releases a K tile once its reads are done (its wgmmas' completion,
// or its ldmatrix in the RS build), and every one of its threads publishes its own delta writes
// and reads the item.
template <bool kDeltaWg = false, int kKDepth, int kVDepth>
__device__ __forceinline__ void init_barriers(Nvfp4SharedStorage<kKDepth, kVDepth>& s) {
  constexpr uint32_t kDeltaReaders = kDeltaWg ? kWarpgroupThreads : kDeltaThreads;
  constexpr uint32_t kDeltaReleases = kDeltaWg ? kWarpgroupThreads / 32 : kDeltaWarps;
  ptx::mbarrier_init(&s.q_full, 1);
  ptx::mbarrier_init(&s.q_empty, kConsumers);
  for (int i = 0; i < kKDepth; ++i) {
    ptx::mbarrier_init(&s.k_full[i], 1);
    ptx::mbarrier_init(&s.k_empty[i], kConsumers + kDeltaReleases);
    ptx::mbarrier_init(&s.delta_full[i], kDeltaReaders);
    ptx::mbarrier_init(&s.delta_empty[i], kConsumerThreads);
  }
  for (int i = 0; i < kVDepth; ++i) {
    ptx::mbarrier_init(&s.v_full[i], 1);
    ptx::mbarrier_init(&s.v_empty[i], kConsumers);
  }
  ptx::mbarrier_init(&s.item.empty, kConsumerThreads + kDeltaReaders);  // the item's readers
  ptx::fence_mbarrier_init();
}

}  // namespace sm90
}  // namespace flashinfer_h3
