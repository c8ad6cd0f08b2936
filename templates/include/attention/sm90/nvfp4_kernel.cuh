// The Hopper NVFP4 attention kernel (docs/spec.md section 3): the SageAttention3 recipe on FP16
// wgmma, whose products of exactly dequantised E2M1 x UE4M3 operands are the recipe's own
// (SPEC 3, last paragraph). Backend wgmma_fp16_nvfp4.
//
// CTA = 4 warpgroups, persistent over the items of tile_scheduler.cuh (in its dynamic order; one
// CTA per SM), the pipeline and ping-pong of the FP8 kernel (fp8_kernel.cuh):
//   TMA       (warpgroup 0)   one thread: TMA loads of the Q block and the ring of K and V^T
//                             tiles (FP16, written by the pre-pass's FP16 output policy,
//                             quantize/prepass.cuh);
//   delta     (warpgroup 1)   the delta term of every K tile, wgmma m64n8k16 on the K tile in
//                             shared memory (nvfp4_delta.cuh tile_delta_wgmma);
//                             both give most of their registers away (setmaxnreg)
//   consumer c (warpgroups 2, 3)  64 query rows each; per KV tile
//                 S = delta + Q' K'^T               wgmma SS m64n128k16 x 8, accumulator preloaded
//                                                   with delta (-inf past the segment: the mask)
//                 softmax + P quantisation          nvfp4_softmax.cuh: S -> P (f16x2 registers)
//                 O = alpha O + P V                 wgmma RS m64n128k16 x 8 into O (FP32
//                                                   accumulation: no second level needed here)
//              and the epilogue out = bf16(O / l) for the block's real rows.
// The consumers alternate on named barriers: a GEMM phase issues PV of tile t - 1 and QK^T of
// tile t back to back, then hands the tensor cores to the other consumer and runs its softmax.
// (The delta_mma_sync benchmark build, production until 2026-12-06: 3 warpgroups, the delta by
// mma.sync on warps 1-3 of the producer warpgroup, produce_delta.)
//
// Operands (flashinfer_h3/layout.py, nvfp4_fp16 layout): Q' as [H][T][128] f16, K' as
// [H][padded keys][128] f16 and V^T as [H][128][padded keys] f16, keys in the window key order
// (nvfp4_key_order.cuh), read through tensor maps with the 128-byte swizzle. Rows and columns past
// a tensor map's end read as zeros; positions past a segment's keys are masked by delta (K) and
// meet P = 0 (V).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "../epilogue.cuh"
#include "../../common.cuh"  // opaque_pointer
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/tma.cuh"
#include "../../ptx/warpgroup.cuh"
#include "../../ptx/wgmma.cuh"
#include "background_traffic.cuh"
#include "fragment_coords.cuh"
#include "nvfp4_delta.cuh"
#include "nvfp4_shared_storage.cuh"
#include "nvfp4_softmax.cuh"
#include "tile_scheduler.cuh"

namespace flashinfer_h3 {
namespace sm90 {

// The register split (see fp8_kernel.cuh). The delta_mma_sync build (3 warpgroups; not
// production's, below): 168 a thread at launch; the producer warpgroup keeps 96 (the delta warps: qbar fragments, three accumulation
// chains, loop state), the consumers get 200 (they use about 192: S, O and P are 160).
constexpr uint32_t kNvfp4ProducerRegs = 96;
constexpr uint32_t kNvfp4ConsumerRegs = 200;
static_assert(kNvfp4ProducerRegs * kWarpgroupThreads + kNvfp4ConsumerRegs * kConsumers * kWarpgroupThreads <=
                  168 * kThreads,
              "the consumers' registers must come from the producer's");
// Production (kDeltaOnWgmma): four warpgroups (TMA, delta, two consumers), 128 registers a thread
// at launch, the whole register file. The SS delta warpgroup (8 accumulators) keeps 40 like the
// TMA one, and the consumers get 216 (kWideConsumers): with the 16 more, ptxas schedules their
// code for 1.6-3.5 % less time and 2-3 % fewer joules (benchmarks/RESULTS.md, twenty-fifth
// session). The RS delta build's ldmatrix fragments need 72, which leaves the consumers 200.
// (Measured and removed: 224 for the consumers, the TMA and delta warpgroups at 32 with the TMA
// tile loop rolled and the delta's two m64 blocks in turn so that neither spills: +4 to +9 %
// time and joules, twenty-sixth session.)
constexpr uint32_t kNvfp4TmaRegs = 40;  // the TMA thread's item and tile loops (24 and 32 spill them)
constexpr uint32_t kNvfp4DeltaWgRegs = 40;
constexpr uint32_t kNvfp4WideConsumerRegs = 216;
constexpr uint32_t kNvfp4DeltaWgRegsNarrow = 72;  // wide_consumers=False (RS delta: its ldmatrix fragments)
static_assert((kNvfp4TmaRegs + kNvfp4DeltaWgRegs + kNvfp4WideConsumerRegs * kConsumers) * kWarpgroupThreads <=
                      (65536 / (4 * kWarpgroupThreads)) * (4 * kWarpgroupThreads) &&
                  (kNvfp4TmaRegs + kNvfp4DeltaWgRegsNarrow + kNvfp4ConsumerRegs * kConsumers) * kWarpgroupThreads <=
                      (65536 / (4 * kWarpgroupThreads)) * (4 * kWarpgroupThreads),
              "the four warpgroups' registers must come from the launch's 128 a thread");


// What a build computes (KernelConfig flags of benchmark-only builds switch parts off to measure
// their cost, benchmarks/bench_wgmma_variants.py; production = kNvfp4Production).
enum Nvfp4Variant : int {
  kQuantizeP = 1,    // P quantised to NVFP4 (off: Ptil packed to FP16 as it is)
  kComputeDelta = 2, // the delta products (off: delta = 0 inside the segment, the mask only)
  kSoftmax = 4,      // the softmax (off: S packed to FP16 as P, no exponentials)
  kFastRounding = 8, // rn_e2m1 without its saturation where no group needs it (off: always)
  kPingPongOrder = 16,  // the consumers' GEMM phases alternate (off: unordered; PingPong)
  kFoldPScale = 32,     // 1 / s of the P groups folded into the exponentials (off: Ptil * r; nvfp4_softmax.cuh)
  kDynamicOrder = 64,   // the dynamic item order (off: static striding; tile_scheduler.cuh)
  kCopyKvTiles = 128,   // K and V copied for every tile (off: once per ring slot, later tiles reuse it)
  kF16Rounding = 256,   // rn_e2m1 of P on f16x2 pairs (off: on FP32 values; nvfp4_softmax.cuh)
  // The delta products as wgmma m64n8k16 by a warpgroup of their own (produce_delta_wg; 512 threads
  // a CTA). Off (benchmark build delta_mma_sync, production until 2026-12-06): mma.sync m16n8k16
  // on warps 1-3 of the producer warpgroup (produce_delta; 384 threads).
  kDeltaOnWgmma = 1024,
  // With kDeltaOnWgmma: its wgmmas read the K tile from shared memory through a descriptor (SS).
  // Off (benchmark build delta_wgmma_regs): each warp's 16 rows by ldmatrix into registers (RS),
  // the same shared-memory bytes and a register-file round trip. On the H100, kernel alone,
  // against delta_mma_sync: SS -2.2 % at h3-mix (-2.6 % J), -0.2 to +1.3 % at h3-10s (the same
  // J), RS -1 to -2 % at h3-mix and +0.8 to +2.6 % at h3-10s (benchmarks/RESULTS.md,
  // twenty-fifth session).
  kDeltaWgmmaSmemA = 2048,
  // With kDeltaWgmmaSmemA: the delta warpgroup at 40 registers, the consumers at 216. Off
  // (benchmark build wide_consumers=False, production until 2026-12-06): 72 and 200.
  kWideConsumers = 4096,
  // Not in production (benchmark builds background_traffic=1 / 2): warps 1-3 of the TMA
  // warpgroup stream the pre-pass's DRAM traffic and a proxy of its arithmetic while the
  // consumers run (background_traffic.cuh: what a pre-pass fused into those warps would cost);
  // kBackgroundTrafficSkipped: the same code behind a run-time condition that never holds.
  kBackgroundTraffic = 8192,
  kBackgroundTrafficSkipped = 16384,
  // (Measured, not kept, and removed after 2ecf91a, where their builds and tests are; each is in
  // benchmarks/RESULTS.md with its numbers: the epilogue through one reciprocal a row,
  // row_divisor, 0.7-2.3 % slower, 1.8-7 % on short segments (twenty-third, thirty-first,
  // thirty-fourth sessions); the storage as shared-space LDS / STS, shared_space and
  // shared_delta_loads, 1.4-4.9 % (twenty-eighth, twenty-ninth); the delta from a table written
  // by a kernel of its own, delta_table and table_prefetch, 1.7-1.9 % a call (thirtieth); QK^T(t)
  // first and the exponential part of tile t's softmax under PV(t - 1), pv_under_softmax, +2.8 to
  // +7.9 % (thirty-first); at the item boundary, the next item's Q block and qbar prefetched into
  // L2 and the item published to the delta warpgroup before its Q copy, prefetch_next_item and
  // early_item_publish, -3.1 % on 3-tile items with row_divisor but +0.6 to +2.5 % at h3-10s and
  // h3-mix, and the output stored under the next item's first QK^T, store_under_qk, +1.5 to
  // +10.8 % (thirty-second to thirty-fourth).)
  kNvfp4Production = kQuantizeP | kComputeDelta | kSoftmax | kFastRounding | kPingPongOrder | kFoldPScale |
                     kDynamicOrder | kCopyKvTiles | kF16Rounding | kDeltaOnWgmma | kDeltaWgmmaSmemA | kWideConsumers,
};
// Threads a CTA of the build kVariant.
template <int kVariant>
constexpr int nvfp4_threads() {
  return (kVariant & kDeltaOnWgmma) != 0 ? (2 + kConsumers) * kWarpgroupThreads : kThreads;
}

// (Measured and removed, benchmarks/RESULTS.md: QK^T(t) first and PV(t - 1) under the softmax
// of tile t, with PV issued outside the turn (+3.7 to +5.6 %) or in it from a shared-memory P
// block (+7.7 %), or in the turn with the exponential part under the PV (+2.8 to +7.9 %); the
// softmax one row after the other (+0.4 to +0.7 %).) Measured, not built:
// three consumer warpgroups on 64-key tiles in a round-robin turn (the register budget's only
// three-consumer shape) do 0.97x the row-keys per cycle of this ping-pong on resident operands,
// benchmarks/sm90_pipes.cu "nvfp4 loop" rows: a 64-key softmax costs 57 % of a 128-key one and
// three of them share the sub-partitions.)

struct Nvfp4Params {
  PlanTables plan;
  const float* qbar;  // [q_blocks_cap, H, 128], canonical block order
  __nv_bfloat16* out;  // [T, H, 128]
  int* item_counter;   // the dynamic item order's counter, zero at launch (tile_scheduler.cuh)
  float c;             // fp32(softmax_scale) * fp32(log2 e)
};

// The Q operand tm_q maps, as a pointer: what the background_traffic builds' warps rewrite. The
// kernel's last parameter, so that production's parameters and code are those of before it.
struct QOperandRef {
  const __half* q_f16;  // [H, tokens, 128]
  int64_t tokens;
};

// ---- producer warpgroup --------------------------------------------------------------------

// kWaitSleepNs (here, in produce_delta_wg and produce_delta): the suspend-time hint of the
// producer warpgroups' waits (0: plain polling; ptx::mbarrier_wait_suspend).
// The copies of one item: its Q block (two atoms), then its K and V^T tiles as slots free up.
// kCopyKv = false (benchmark builds): each ring slot copied once (fp8_kernel.cuh produce_item).
template <uint32_t kWaitSleepNs, bool kCopyKv, class Smem>
__device__ __forceinline__ void produce_item(Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                             const CUtensorMap* tm_v, const WorkItem& it, RingSlot& slot) {
  ptx::mbarrier_arrive_expect_tx(&sm.q_full, kFp16TileBytes);
  ptx::tma_load_3d(sm.q[0], tm_q, &sm.q_full, 0, it.row_begin, it.head);
  ptx::tma_load_3d(sm.q[1], tm_q, &sm.q_full, 64, it.row_begin, it.head);
  const int tiles = (it.seg_len + kTileKeys - 1) / kTileKeys;
  for (int t = 0; t < tiles; ++t, ++slot.index) {
    const int ks = slot.stage<Smem::kKStages>(), vs = slot.stage<Smem::kVStages>();
    const int pos = it.vcol0 + t * kTileKeys;  // K rows and V^T columns share positions
    ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.k_empty[ks], slot.parity<Smem::kKStages>() ^ 1u);
    if (!kCopyKv && slot.index >= (Smem::kKStages > Smem::kVStages ? Smem::kKStages : Smem::kVStages)) {
      ptx::mbarrier_arrive(&sm.k_full[ks]);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.v_empty[vs], slot.parity<Smem::kVStages>() ^ 1u);
      ptx::mbarrier_arrive(&sm.v_full[vs]);
      continue;
    }
    ptx::mbarrier_arrive_expect_tx(&sm.k_full[ks], kFp16TileBytes);
    ptx::tma_load_3d(sm.k[ks][0], tm_k, &sm.k_full[ks], 0, pos, it.head);
    ptx::tma_load_3d(sm.k[ks][1], tm_k, &sm.k_full[ks], 64, pos, it.head);
    ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.v_empty[vs], slot.parity<Smem::kVStages>() ^ 1u);
    ptx::mbarrier_arrive_expect_tx(&sm.v_full[vs], kFp16TileBytes);
    ptx::tma_load_3d(sm.v[vs][0], tm_v, &sm.v_full[vs], pos, 0, it.head);
    ptx::tma_load_3d(sm.v[vs][1], tm_v, &sm.v_full[vs], pos + 64, 0, it.head);
  }
}

// The TMA thread (warp 0 of the producer warpgroup). kDynamic: the dynamic item order
// (tile_scheduler.cuh), as the FP8 kernel's producer.
template <uint32_t kWaitSleepNs, bool kDynamic, bool kCopyKv, class Smem>
__device__ __forceinline__ void produce_tiles(Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                              const CUtensorMap* tm_v, const Nvfp4Params& p) {
  RingSlot slot;
  uint32_t items = 0;
  if constexpr (!kDynamic) {
    for (int w = blockIdx.x; has_item(p.plan, w); w += gridDim.x, ++items) {
      const WorkItem it = work_item(p.plan, w);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.q_empty, (items & 1u) ^ 1u);
      produce_item<kWaitSleepNs, kCopyKv>(sm, tm_q, tm_k, tm_v, it, slot);
    }
  } else {
    for (int w = blockIdx.x;; ++items) {
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.q_empty, (items & 1u) ^ 1u);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.item.empty, (items & 1u) ^ 1u);
      sm.item.publish(w);
      if (!has_item(p.plan, w)) {
        ptx::mbarrier_arrive(&sm.q_full);  // the terminator: no copy
        break;
      }
      const WorkItem it = work_item(p.plan, w);
      produce_item<kWaitSleepNs, kCopyKv>(sm, tm_q, tm_k, tm_v, it, slot);
      w = draw_item(sm.item);  // once this item's copies are issued (fp8_kernel.cuh produce)
    }
  }
}

// The next item of a reader (a delta thread or a consumer thread), its `items`-th: in the dynamic
// order the producer's (after its q_full arrival), else w as the static loop has it. False at
// the end. kWaitSleepNs: the reader's suspend-time hint (0: polling).
template <bool kDynamic, uint32_t kWaitSleepNs, class Smem>
__device__ __forceinline__ bool take_item(Smem& sm, const PlanTables& plan, uint32_t items, int& w, WorkItem& it) {
  if constexpr (kDynamic) {
    ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.q_full, items & 1u);
    w = sm.item.read();
  }
  if (!has_item(plan, w)) return false;
  it = work_item(plan, w);
  return true;
}

// The item and tile loop of both delta forms (a delta warp, or a thread of the delta warpgroup):
// for each item this reader takes (in the dynamic order the producer's, after its q_full
// arrival), on_item(qbar of the item's (block, head)); then for each of its K tiles, once the
// tile is in and the consumers loaded the slot's last delta, on_tile(stage, the segment's keys
// left from the tile's first). Each warp then releases the tile after its own reads (ldmatrix,
// or the wait for its wgmmas' completion: __syncwarp, then lane 0; the warpgroup-wide wgmma
// completion would order the ldmatrix reads too, but racecheck cannot see that), and each
// thread publishes its own delta writes.
template <int kVariant, uint32_t kWaitSleepNs, class Smem, class OnItem, class OnTile>
__device__ __forceinline__ void delta_tile_loop(Smem& sm, const Nvfp4Params& p, int lane, OnItem&& on_item,
                                                OnTile&& on_tile) {
  constexpr bool kDynamic = (kVariant & kDynamicOrder) != 0;
  RingSlot slot;
  for (int w = blockIdx.x, items = 0;; ++items) {
    WorkItem it;
    if (!take_item<kDynamic, kWaitSleepNs>(sm, p.plan, static_cast<uint32_t>(items), w, it)) break;
    if constexpr (!kDynamic) w += gridDim.x;
    // (block, head) < 2^31 (the binding checks): an unsigned 32-bit index, no sign word held.
    const uint32_t qbar_row = static_cast<uint32_t>(it.canonical) * p.plan.heads + it.head;
    on_item(p.qbar + static_cast<uint64_t>(qbar_row) * kHeadDim);
    const int tiles = (it.seg_len + kTileKeys - 1) / kTileKeys;
    for (int t = 0; t < tiles; ++t, ++slot.index) {
      const int st = slot.stage<Smem::kKStages>();
      const uint32_t parity = slot.parity<Smem::kKStages>();
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.k_full[st], parity);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.delta_empty[st], parity ^ 1u);  // the consumers loaded its last delta
      on_tile(st, it.seg_len - t * kTileKeys);
      __syncwarp();
      if (lane == 0) ptx::mbarrier_arrive(&sm.k_empty[st]);
      ptx::mbarrier_arrive(&sm.delta_full[st]);
    }
  }
}

// A delta warp of the delta_mma_sync benchmark build (warps 1..3 of the producer warpgroup): per
// item its qbar operand, per K tile its m16 blocks of delta into sm.delta[stage].
template <int kVariant, uint32_t kWaitSleepNs, class Smem>
__device__ __forceinline__ void produce_delta(Smem& sm, const Nvfp4Params& p, int delta_warp, int lane) {
  uint32_t* parts = sm.qbar_parts[delta_warp];
  QbarOperand qb;
  delta_tile_loop<kVariant, kWaitSleepNs>(
      sm, p, lane, [&](const float* qbar) { qb = load_qbar_operand(qbar, parts, lane); },
      [&](int st, int valid) {
        if constexpr ((kVariant & kComputeDelta) != 0) {
          tile_delta(qb, sm.k[st][0], sm.delta[st], valid, delta_warp, lane);
        } else {
          tile_delta_mask(sm.delta[st], valid, delta_warp, lane);
        }
      });
}

// The delta warpgroup (warpgroup 1 of the kDeltaOnWgmma builds, production; tid = its thread
// 0..127): per item its qbar rows, per K tile the delta of all 128 positions (tile_delta_wgmma);
// without kComputeDelta (benchmark builds) only the mask, thread tid writing position tid.
template <int kVariant, uint32_t kWaitSleepNs, class Smem>
__device__ __forceinline__ void produce_delta_wg(Smem& sm, const Nvfp4Params& p, int tid) {
  constexpr bool kProducts = (kVariant & kComputeDelta) != 0;
  const int warp = tid / 32, lane = tid % 32;
  uint8_t* rows = delta_qbar_rows(sm).atoms[0];
  const uint64_t b_desc = ptx::wgmma_desc_sw128(rows);
  if constexpr (kProducts) zero_qbar_rows(rows, tid);
  float unscale = 0.0f;
  delta_tile_loop<kVariant, kWaitSleepNs>(
      sm, p, lane,
      [&](const float* qbar) {
        // The last tile's wgmmas completed (tile_delta_wgmma waits): the rows may be rewritten.
        if constexpr (kProducts) unscale = write_qbar_rows(qbar, rows, warp, lane);
      },
      [&](int st, int valid) {
        if constexpr (kProducts) {
          tile_delta_wgmma<(kVariant & kDeltaWgmmaSmemA) != 0>(b_desc, unscale, sm.k[st][0], sm.delta[st], valid,
                                                                warp, lane);
        } else {
          tile_delta_mask_wg(sm.delta[st], valid, tid);
        }
      });
}

// ---- consumers ---------------------------------------------------------------------------------

// Byte offset of k16 step k inside a tile of two 64-element atoms, in descriptor units (>> 4):
// a compile-time constant added to the tile's descriptor (its start-address field has room: the
// whole of shared memory is below 2^18 bytes), so no descriptor is built between two wgmmas.
__host__ __device__ constexpr uint64_t k16_step_offset(int k) { return fp16_k16_offset(k, kFp16AtomBytes); }

// S = delta + Q' K'^T: eight k16 steps, two per 32 bytes of each atom's rows; S holds delta.
// q_desc: the descriptor of this consumer's rows of Q atom 0 (atom 1 is kFp16AtomBytes on).
__device__ __forceinline__ void issue_qk(float (&s)[64], uint64_t q_desc, const uint8_t* k_tile) {
  const uint64_t k_desc = ptx::wgmma_desc_sw128(k_tile);
  ptx::wgmma_fence();  // delta was just written into s: order it before the wgmma reads it
#pragma unroll
  for (int k = 0; k < kHeadDim / 16; ++k) {
    ptx::wgmma_m64n128k16_f16_ss(s, q_desc + k16_step_offset(k), k_desc + k16_step_offset(k), 1u);
  }
  ptx::wgmma_commit();
}

// O += P V over the tile's 128 key positions (eight k16 steps of P's registers).
__device__ __forceinline__ void issue_pv(float (&o)[64], const uint32_t (&pa)[32], const uint8_t* v_tile) {
  const uint64_t v_desc = ptx::wgmma_desc_sw128(v_tile);
  ptx::wgmma_fence();  // the softmax wrote pa and the rescale wrote o
#pragma unroll
  for (int k = 0; k < kTileKeys / 16; ++k) {
    const uint32_t a[4] = {pa[4 * k], pa[4 * k + 1], pa[4 * k + 2], pa[4 * k + 3]};
    ptx::wgmma_m64n128k16_f16_rs(o, a, v_desc + k16_step_offset(k), 1u);
  }
  ptx::wgmma_commit();
}

// A tile's delta (128 floats) as the initial scores: s[4i + 2r + e] = delta[8i + 2t + e]. Through
// an opaque base, so that the 16 loads take immediate offsets (common.cuh opaque_pointer).
// (ld.shared on the base's 32-bit shared address instead: 1.4-2.1 % slower, shared_delta_loads.)
__device__ __forceinline__ void delta_as_scores(float (&s)[64], const float* delta, int quad_col) {
  const float2* d = opaque_pointer(reinterpret_cast<const float2*>(delta + quad_col));
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const float2 v = d[4 * i];
    s[4 * i] = s[4 * i + 2] = v.x;
    s[4 * i + 1] = s[4 * i + 3] = v.y;
  }
}

// O *= alpha after a softmax, skipped when the warp's 16 rows all kept their max (alpha = 1
// exactly: the product would change nothing), which is most tiles once a row has seen a few.
__device__ __forceinline__ void rescale_o(float (&o)[64], const Nvfp4RowState& st) {
  if (__any_sync(0xffffffffu, st.alpha[0] != 1.0f || st.alpha[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= st.alpha[(i >> 1) & 1];
  }
}

// The delta of the tile of `slot` as the initial scores; then the warp hands the delta buffer
// back to the delta warpgroup (or warps).
template <class Smem>
__device__ __forceinline__ void load_delta(float (&s)[64], Smem& sm, const RingSlot& slot, int quad_col) {
  const int stage = slot.stage<Smem::kKStages>();
  ptx::mbarrier_wait(&sm.delta_full[stage], slot.parity<Smem::kKStages>());
  delta_as_scores(s, sm.delta[stage], quad_col);
  // Every lane releases its own loads (as every delta lane publishes its own writes): the
  // handoff is then a direct arrive -> wait pair per thread, which racecheck follows (one lane's
  // arrival after __syncwarp is as correct, but racecheck reports the other lanes' loads).
  ptx::mbarrier_arrive(&sm.delta_empty[stage]);
}

// Waits for the K tile of `slot` and issues S = delta + Q' K'^T.
template <class Smem>
__device__ __forceinline__ void issue_qk_when_ready(float (&s)[64], uint64_t q_desc, Smem& sm, const RingSlot& slot) {
  const int stage = slot.stage<Smem::kKStages>();
  ptx::mbarrier_wait(&sm.k_full[stage], slot.parity<Smem::kKStages>());
  issue_qk(s, q_desc, sm.k[stage][0]);
}

// Waits for the V tile before `slot` (the tile of the last softmax) and issues O += P V.
template <class Smem>
__device__ __forceinline__ void issue_pv_when_ready(float (&o)[64], const uint32_t (&pa)[32], Smem& sm,
                                                    const RingSlot& slot) {
  const int stage = slot.previous_stage<Smem::kVStages>();
  ptx::mbarrier_wait(&sm.v_full[stage], slot.previous_parity<Smem::kVStages>());
  issue_pv(o, pa, sm.v[stage][0]);
}

// Once a QK^T completed (one thread a consumer warpgroup): its K tile, and after the item's last
// tile the Q block, back to the TMA thread.
template <class Smem>
__device__ __forceinline__ void release_qk_operands(Smem& sm, const RingSlot& slot, bool last_tile) {
  ptx::mbarrier_arrive(&sm.k_empty[slot.stage<Smem::kKStages>()]);
  if (last_tile) ptx::mbarrier_arrive(&sm.q_empty);
}

// After the GEMMs of a phase completed: release the K tile of `slot` (the Q block after the last
// tile) and the previous V tile, then the softmax of the tile and the rescale of O.
template <int kVariant, int kPolyExp2Every, class Smem>
__device__ __forceinline__ void after_gemms(float (&s)[64], float (&o)[64], uint32_t (&pa)[32], Nvfp4RowState& st,
                                            Smem& sm, RingSlot& slot, bool last_tile, bool pv_done, float c) {
  ptx::fence_operands(s);
  ptx::fence_operands(o);
  ptx::fence_operands(pa);
  if (signals_for_warpgroup()) {
    release_qk_operands(sm, slot, last_tile);
    if (pv_done) ptx::mbarrier_arrive(&sm.v_empty[slot.previous_stage<Smem::kVStages>()]);
  }
  if constexpr ((kVariant & kSoftmax) != 0) {
    nvfp4_softmax_tile<(kVariant & kQuantizeP) != 0, (kVariant & kFastRounding) != 0, (kVariant & kFoldPScale) != 0,
                       (kVariant & kF16Rounding) != 0, 64, kPolyExp2Every>(
        s, pa, st, c, sm.recip, sm.p_fold);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const __half2 h = __floats2half2_rn(s[2 * i], s[2 * i + 1]);
      pa[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  rescale_o(o, st);
  ++slot.index;
}

// out = bf16_rn(O / l) for the thread's two rows of item w, if they are rows of its block (SPEC
// 3.8); l: those rows' shares of the sums. A div.rn an element: through one reciprocal a row (the
// FP8 kernel's RowDivisor) measured 0.7-2.3 % slower here, 1.8-7 % on short segments.
__device__ __forceinline__ void store_item_output(const float (&o)[64], const float (&l)[2], int w,
                                                  const Nvfp4Params& p, int row_in_block, int quad_col) {
  // The item's rows again (L1-resident table reads) instead of keeping them live across the loop.
  const WorkItem it = work_item(p.plan, w);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float row_l = quad_sum(l[r]);
    const int row = it.row_begin + row_in_block + 8 * r;
    if (row >= it.row_end) continue;
    __nv_bfloat16* dst = p.out + (static_cast<int64_t>(row) * p.plan.heads + it.head) * kHeadDim + quad_col;
    attention::store_row_bf16<false, false>(dst, nullptr, row_l,
                                            [&](int i) { return make_float2(o[4 * i + 2 * r], o[4 * i + 2 * r + 1]); });
  }
}

// `consumer` (0 or 1) is a runtime value: one copy of this code serves both warpgroups, which
// halves the kernel's instructions (two copies thrashed the instruction cache: "no instruction"
// stalls, benchmarks/RESULTS.md).
template <int kVariant, int kPolyExp2Every, class Smem>
__device__ __forceinline__ void consume(Smem& sm, const Nvfp4Params& p, int consumer) {
  const FragmentCoords at(consumer);
  const int quad_col = at.quad_col, row_in_block = at.row_in_block;
  // This consumer's 64 rows of Q atom 0 (8 KB in: still 1024-byte aligned); atom 1 follows it.
  const uint64_t q_desc = ptx::wgmma_desc_sw128(sm.q[0] + 64 * consumer * 128);

  float s[64], o[64];
  uint32_t pa[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) pa[i] = 0u;
  Nvfp4RowState st;

  const PingPong<(kVariant & kPingPongOrder) != 0> turn(consumer);
  turn.start();

  RingSlot slot;
  uint32_t items = 0;
  for (int w = blockIdx.x;; ++items) {
    WorkItem it;
    if (!take_item<(kVariant & kDynamicOrder) != 0, 0>(sm, p.plan, items, w, it)) break;
    st.reset();
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    const int tiles = (it.seg_len + kTileKeys - 1) / kTileKeys;
    if constexpr ((kVariant & kDynamicOrder) == 0) ptx::mbarrier_wait(&sm.q_full, items & 1u);

    // The first GEMM phase issues QK^T of tile 0 alone, the last one PV of the last tile alone:
    // no wgmma sits in a branch (ptxas would serialise every wgmma of the kernel otherwise).
    load_delta(s, sm, slot, quad_col);
    turn.wait();  // my GEMM phase
    issue_qk_when_ready(s, q_desc, sm, slot);
    turn.pass();
    ptx::wgmma_wait<0>();
    after_gemms<kVariant, kPolyExp2Every>(s, o, pa, st, sm, slot, tiles == 1, false, p.c);
    for (int t = 1; t < tiles; ++t) {
      load_delta(s, sm, slot, quad_col);
      turn.wait();  // my GEMM phase
      issue_pv_when_ready(o, pa, sm, slot);
      issue_qk_when_ready(s, q_desc, sm, slot);
      turn.pass();
      ptx::wgmma_wait<0>();
      after_gemms<kVariant, kPolyExp2Every>(s, o, pa, st, sm, slot, t == tiles - 1, true, p.c);
    }
    turn.wait();  // my GEMM phase
    issue_pv_when_ready(o, pa, sm, slot);
    turn.pass();
    ptx::wgmma_wait<0>();
    ptx::fence_operands(o);
    ptx::fence_operands(pa);
    if (signals_for_warpgroup()) ptx::mbarrier_arrive(&sm.v_empty[slot.previous_stage<Smem::kVStages>()]);
    // (the dynamic order's slot may hold the next item by now: w, not the slot, names this one)
    store_item_output(o, st.l, w, p, row_in_block, quad_col);
    if constexpr ((kVariant & kDynamicOrder) == 0) w += gridDim.x;
  }
  turn.finish();
}

// kVariant: kNvfp4Production, or fewer parts in benchmark-only builds (Nvfp4Variant); kKStages,
// kVStages: the depths of the K (and delta) and V rings (dynamic shared memory:
// nvfp4_smem_bytes<kKStages, kVStages, the delta warpgroup's builds>()); kWaitSleepNs: the producer
// warpgroups' suspend-time hint; kPolyExp2Every: every n-th exponential of a tile on the FMA pipe
// (0, production: none; nvfp4_softmax.cuh).
template <int kVariant, int kKStages = kNvfp4KStages, int kVStages = kNvfp4VStages,
          uint32_t kWaitSleepNs = kProducerWaitSleepNs, int kPolyExp2Every = 0>
__global__ void __launch_bounds__(nvfp4_threads<kVariant>(), 1)
    attention_nvfp4_wgmma_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                                 const __grid_constant__ CUtensorMap tm_v, const Nvfp4Params p, const QOperandRef qr) {
  using Smem = Nvfp4SharedStorage<kKStages, kVStages>;
  extern __shared__ uint8_t dynamic_smem[];
  Smem& sm = aligned_storage<Smem>(dynamic_smem);
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  constexpr bool kDeltaWg = (kVariant & kDeltaOnWgmma) != 0;
  constexpr bool kWide = (kVariant & kWideConsumers) != 0;
  static_assert((kVariant & (kDeltaWgmmaSmemA | kWideConsumers)) == 0 || kDeltaWg,
                "the SS delta and the wide consumers are parts of the delta warpgroup's builds");
  static_assert(!kWide || (kVariant & kDeltaWgmmaSmemA) != 0, "wide_consumers: with the SS delta warpgroup only");
  static_assert((kVariant & (kBackgroundTraffic | kBackgroundTrafficSkipped)) == 0 || kDeltaWg,
                "background_traffic: with the delta warpgroup (warps 1-3 of the TMA warpgroup idle)");
  if (threadIdx.x == 0) {
    init_barriers<kDeltaWg>(sm);
    sm.item.counter = p.item_counter;  // the dynamic item order's (tile_scheduler.cuh)
    ptx::prefetch_tensormap(&tm_q);
    ptx::prefetch_tensormap(&tm_k);
    ptx::prefetch_tensormap(&tm_v);
  }
  if (threadIdx.x < kScaleCodes) {
    fill_p_scale_table<(kVariant & kFoldPScale) != 0 && (kVariant & kQuantizeP) != 0>(threadIdx.x, sm.recip, sm.p_fold);
  }
  __syncthreads();
  constexpr bool kDynamic = (kVariant & kDynamicOrder) != 0, kCopyKv = (kVariant & kCopyKvTiles) != 0;
  if constexpr (kDeltaWg) {
    if (warpgroup == 0) {
      ptx::setmaxnreg_dec<kNvfp4TmaRegs>();
      if (threadIdx.x == 0) {
        produce_tiles<kWaitSleepNs, kDynamic, kCopyKv>(sm, &tm_q, &tm_k, &tm_v, p);
      } else if ((kVariant & (kBackgroundTraffic | kBackgroundTrafficSkipped)) != 0 && threadIdx.x >= 32) {
        // The NVFP4 pre-pass's traffic (10 B read, 6 B of FP16 operands written) in passes over
        // the FP16 Q operand (2 B), rewritten with its own bytes; the skipped form's condition
        // (tokens < 0) never holds.
        const bool on = (kVariant & kBackgroundTraffic) != 0 ? qr.tokens >= 0 : qr.tokens < 0;
        stream_background_traffic<5, 5, 3>(const_cast<__half*>(qr.q_f16),
                                           on ? qr.tokens * p.plan.heads * kHeadDim * 2 : 0, 1.0f, qr.tokens < 0,
                                           reinterpret_cast<uint32_t*>(p.out), static_cast<int>(threadIdx.x) - 32);
      }
    } else if (warpgroup == 1) {
      ptx::setmaxnreg_dec<kWide ? kNvfp4DeltaWgRegs : kNvfp4DeltaWgRegsNarrow>();
      produce_delta_wg<kVariant, kWaitSleepNs>(sm, p, static_cast<int>(threadIdx.x) - kWarpgroupThreads);
    } else {
      ptx::setmaxnreg_inc<kWide ? kNvfp4WideConsumerRegs : kNvfp4ConsumerRegs>();
      consume<kVariant, kPolyExp2Every>(sm, p, warpgroup - 2);
    }
    return;
  }
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kNvfp4ProducerRegs>();
    if (threadIdx.x == 0) {
      produce_tiles<kWaitSleepNs, kDynamic, kCopyKv>(sm, &tm_q, &tm_k, &tm_v, p);
    } else if (threadIdx.x >= 32) {
      produce_delta<kVariant, kWaitSleepNs>(sm, p, threadIdx.x / 32 - 1, threadIdx.x % 32);
    }
  } else {
    ptx::setmaxnreg_inc<kNvfp4ConsumerRegs>();
    consume<kVariant, kPolyExp2Every>(sm, p, warpgroup - 1);
  }
}

}  // namespace sm90
}  // namespace flashinfer_h3
