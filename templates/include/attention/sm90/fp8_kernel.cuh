// The Hopper FP8 attention kernel (docs/spec.md section 4): warp-specialised, E4M3 wgmma for both
// products, FP32 softmax, BF16 output.
//
// CTA = 3 warpgroups, persistent over the items of tile_scheduler.cuh (a static order the host
// balances, ItemSchedule; the dynamic order measured 2-4 % slower here, benchmarks/RESULTS.md),
// one CTA per SM:
//   producer   (warpgroup 0, one thread)  TMA loads of the Q block and the ring of K and V^T tiles,
//              completing on mbarriers; gives most of its registers away (setmaxnreg). In the
//              q_in_kernel benchmark build it stages the BF16 Q block instead, and warps 1-3 of
//              the warpgroup quantise it (fp8_q_quantizer.cuh)
//   consumer c (warpgroups 1, 2)          64 query rows each; per KV tile of 256 keys (two
//              128-key halves, one K-scale block each; consume_256)
//                 QK^T  S = Q K^T                   wgmma SS, m64n128k32 x 4 per half
//                 softmax (fp8_softmax.cuh)         S -> P (E4M3, in registers), m, l: one max
//                                                   and one rescale per 256 keys
//                 PV    Otmp = P V                  wgmma RS (A = P from registers) x 8, fresh per tile
//                 O = alpha O + Otmp                two-level accumulation in FP32 (spec 4.4)
//              and the epilogue O * sv / l -> bf16 for the block's real rows.
// The consumers alternate on named barriers: a "GEMM phase" of consumer c issues PV of tile t - 1
// and QK^T of tile t, then hands the tensor cores to the other consumer and does its softmax while
// the other's GEMMs run. The 128-key tiles of before (consume; benchmark build tile_keys=128)
// measured 2-3.5 % slower: cuDNN's FP8 kernel on this GPU takes 256 keys a tile too
// (benchmarks/RESULTS.md, seventh session).
//
// Operands are the FP8 workspace regions (flashinfer_h3/layout.py) written by the pre-pass, read
// through three tensor maps built by the binding with the 128-byte swizzle that wgmma's K-major
// descriptors expect: Q and K as [H][T][128] bytes (box 128 rows), V^T as [H][128][V columns] (box
// 128 columns). Rows past the tensor are zero-filled by TMA; keys past the segment are masked;
// V columns past the segment's padded end hold finite codes of the next segment (or TMA zeros past
// the last one) and meet P = 0.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>

#include "../epilogue.cuh"
#include "../../ptx/cluster.cuh"
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/sreg.cuh"
#include "../../ptx/tma.cuh"
#include "../../ptx/warpgroup.cuh"
#include "../../ptx/wgmma.cuh"
#include "background_traffic.cuh"
#include "fp8_q_quantizer.cuh"
#include "fp8_softmax.cuh"
#include "fragment_coords.cuh"
#include "shared_storage.cuh"
#include "tile_scheduler.cuh"

namespace flashinfer_h3 {
namespace sm90 {

// setmaxnreg moves registers inside the CTA's own allocation: __launch_bounds__(384, 1) gives each
// thread 168 (65536 / 384 rounded down to a multiple of 8), and the consumers' increase waits until
// the producer's decrease has freed enough, so the split must fit exactly that pool (a larger
// request deadlocks the CTA).
constexpr uint32_t kLaunchRegs = 168;
constexpr uint32_t kProducerRegs = 24;
constexpr uint32_t kConsumerRegs = 240;
static_assert(kProducerRegs * kWarpgroupThreads + kConsumerRegs * kConsumers * kWarpgroupThreads <=
                  kLaunchRegs * kThreads,
              "the consumers' registers must come from the producer's");

struct Fp8Params {
  PlanTables plan;
  const float* q_scales;  // [H, T]
  const float* k_scales;  // [H, k_scale_stride] (canonical 128-key blocks)
  const float* v_scales;  // [S, H, 128]
  __nv_bfloat16* out;     // [T, H, 128]
  int* item_counter;      // the dynamic item order's counter, zero at launch (tile_scheduler.cuh)
  ItemSchedule schedule;  // the static order: each CTA's list of items (tile_scheduler.cuh)
  int tokens;
  int k_scale_stride;
  float c;  // fp32(softmax_scale) * fp32(log2 e)
  // [H, T, 128], what tm_q maps (background_traffic builds; last, so production's offsets are unchanged)
  const uint8_t* q_codes;
};

// head * stride as an unsigned 32 x 32 -> 64-bit product (both are >= 0): the int64 product needs
// the stride's sign word, which the compiler hoists out of the item loop and keeps in a register
// across the tile loop.
__device__ __forceinline__ uint64_t head_offset(int head, int stride) {
  return static_cast<uint64_t>(static_cast<uint32_t>(head)) * static_cast<uint32_t>(stride);
}

// ---- producer ----------------------------------------------------------------------------------

// The copies of one item: its Q block, then its K and V^T tiles as ring slots free up.
// kWaitSleepNs: the suspend-time hint of the producer's waits for free slots (0: plain polling;
// ptx::mbarrier_wait_suspend). kRolled: the tile loop not unrolled (the dynamic order's producer,
// whose four unrolled copies, ptxas's choice, need more than its 24 registers). kCopyKv = false
// (benchmark builds): K and V are copied into each ring slot once, later tiles reuse what the slot
// holds (the output is not attention): what the K/V tiles' way from L2 costs, energy included.
// kCtas = 2 (clusters, tile_scheduler.cuh schedule_item): each CTA copies one 128-key half of
// every tile, its rank's, into the slot of both CTAs, whose full barriers each expect the whole
// tile; the empty barriers it waits on count both CTAs' consumers (init_barriers).
// kQRaw (kQInKernel builds): tm_q maps the BF16 q itself, and the item's block goes to the
// staging area `qs` (two 64-channel boxes) for the quantizer warps instead of its codes to sm.q.
template <uint32_t kWaitSleepNs, bool kRolled, bool kCopyKv, int kCtas, bool kQRaw = false, class Smem>
__device__ __forceinline__ void produce_item(Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                             const CUtensorMap* tm_v, const WorkItem& it, RingSlot& slot) {
  if constexpr (kQRaw) {
    QStaging& qs = q_staging(sm);
    ptx::mbarrier_arrive_expect_tx(&qs.full, 2 * QStaging::kAtomBytes);
    ptx::tma_load_3d(qs.atoms[0], tm_q, &qs.full, 0, it.row_begin, it.head);
    ptx::tma_load_3d(qs.atoms[1], tm_q, &qs.full, 64, it.row_begin, it.head);
  } else {
    ptx::mbarrier_arrive_expect_tx(&sm.q_full, kBlockRows * kHeadDim);
    ptx::tma_load_3d(sm.q, tm_q, &sm.q_full, 0, it.row_begin, it.head);
  }
  constexpr int kKeys = Smem::kTileKeysOf, kHalves = kKeys / kTileKeys;  // 128-key boxes per tile
  const int tiles = (it.seg_len + kKeys - 1) / kKeys;
  auto tile = [&](int t) {
    const int st = slot.stage<Smem::kStages>();
    ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.k_empty[st], slot.parity<Smem::kStages>() ^ 1u);
    if (!kCopyKv && slot.index >= Smem::kStages) {
      ptx::mbarrier_arrive(&sm.k_full[st]);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.v_empty[st], slot.parity<Smem::kStages>() ^ 1u);
      ptx::mbarrier_arrive(&sm.v_full[st]);
      return;
    }
    ptx::mbarrier_arrive_expect_tx(&sm.k_full[st], kHalves * kTileBytes);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      ptx::tma_load_3d(sm.k[st][h], tm_k, &sm.k_full[st], 0, it.seg_begin + t * kKeys + h * kTileKeys, it.head);
    }
    ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.v_empty[st], slot.parity<Smem::kStages>() ^ 1u);
    ptx::mbarrier_arrive_expect_tx(&sm.v_full[st], kHalves * kTileBytes);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      ptx::tma_load_3d(sm.v[st][h], tm_v, &sm.v_full[st], it.vcol0 + t * kKeys + h * kTileKeys, 0, it.head);
    }
  };
  if constexpr (kCtas == 2) {
    // This CTA's half of every tile: its keys and V columns from 128 rank on, into half `rank`
    // of the slot in both CTAs. The tile loop rolled: the producer's 24 registers.
    const uint32_t rank = ptx::cluster_ctarank();
    const int k_row = it.seg_begin + kTileKeys * static_cast<int>(rank);
    const int v_col = it.vcol0 + kTileKeys * static_cast<int>(rank);
#pragma unroll 1
    for (int t = 0; t < tiles; ++t, ++slot.index) {
      const int st = slot.stage<Smem::kStages>();
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.k_empty[st], slot.parity<Smem::kStages>() ^ 1u);
      ptx::mbarrier_arrive_expect_tx(&sm.k_full[st], kHalves * kTileBytes);
      ptx::tma_load_3d_multicast(sm.k[st][rank], tm_k, &sm.k_full[st], 0, k_row + t * kKeys, it.head, 0x3);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.v_empty[st], slot.parity<Smem::kStages>() ^ 1u);
      ptx::mbarrier_arrive_expect_tx(&sm.v_full[st], kHalves * kTileBytes);
      ptx::tma_load_3d_multicast(sm.v[st][rank], tm_v, &sm.v_full[st], v_col + t * kKeys, 0, it.head, 0x3);
    }
    return;
  }
  if constexpr (kRolled) {
#pragma unroll 1
    for (int t = 0; t < tiles; ++t, ++slot.index) tile(t);
  } else {
    for (int t = 0; t < tiles; ++t, ++slot.index) tile(t);
  }
}

// The producer thread. kDynamic: the dynamic item order (tile_scheduler.cuh): it draws each next
// item and publishes it in sm.item with the q_full arrival, once every reader has read the last
// one (sm.item.empty).
// kQRaw: the kQInKernel builds' Q path (produce_item); the producer then waits for the staging
// area (q_staging), not sm.q, which the quantizer warps fill.
// (Measured and removed after 2ecf91a: the static order's next item's Q block and Q scales
// prefetched into L2 once this item's copies are issued, prefetch_next_item: -2.6 % at h3-10s
// within a 4 % spread, +3.2 % on 333-token segments; benchmarks/RESULTS.md, thirty-fourth session.)
template <uint32_t kWaitSleepNs, bool kDynamic, bool kCopyKv, int kCtas, bool kQRaw = false, class Smem>
__device__ __forceinline__ void produce(Smem& sm, const CUtensorMap* tm_q, const CUtensorMap* tm_k,
                                        const CUtensorMap* tm_v, const Fp8Params& p) {
  RingSlot slot;
  uint32_t items = 0;
  if constexpr (!kDynamic) {
    // The list's end read again at each item (L1): the producer's 24 registers hold no more.
    for (int i = p.schedule.begin(); i < p.schedule.end(); ++i, ++items) {
      const WorkItem it = schedule_item<kCtas>(p.plan, p.schedule, i);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(kQRaw ? &q_staging(sm).empty : &sm.q_empty, (items & 1u) ^ 1u);
      // kQRaw: the tile loop rolled (unrolled as production's, it spilled 56 bytes of the
      // producer warpgroup's 24 registers once the quantizer warps' code shared the region).
      produce_item<kWaitSleepNs, kQRaw, kCopyKv, kCtas, kQRaw>(sm, tm_q, tm_k, tm_v, it, slot);
    }
  } else {
    for (int w = blockIdx.x;; ++items) {
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.q_empty, (items & 1u) ^ 1u);
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(&sm.item.empty, (items & 1u) ^ 1u);
      sm.item.publish(w);
      if (w >= num_items(p.plan)) {
        ptx::mbarrier_arrive(&sm.q_full);  // the terminator: no copy
        break;
      }
      produce_item<kWaitSleepNs, true, kCopyKv, 1>(sm, tm_q, tm_k, tm_v, work_item(p.plan, w), slot);
      // The next item: drawn once this one's copies are issued, while the consumers still have
      // about a ring's depth of its tiles to go (the atomic's latency hides there, and no value
      // is held across the tile loop).
      w = draw_item(sm.item);
    }
  }
}

// ---- consumers ---------------------------------------------------------------------------------

// Descriptor units (>> 4) of k32 step k inside a tile: its 32-byte slice of every 128-byte row,
// a constant added to the tile's descriptor (the start-address field has room: shared memory is
// below 2^18 bytes), so no descriptor is built between two wgmmas.
__host__ __device__ constexpr uint32_t k32_step_offset(int k) { return static_cast<uint32_t>(32 * k) >> 4; }

// S = Q K^T over the 128 channels: four k32 steps along the 128-byte rows of both tiles.
__device__ __forceinline__ void issue_qk(float (&s)[64], const uint8_t* q_rows, const uint8_t* k_tile) {
  const uint32_t q_desc = ptx::wgmma_desc_sw128_low(q_rows), k_desc = ptx::wgmma_desc_sw128_low(k_tile);
  ptx::wgmma_fence();  // the softmax read s: order that before the wgmma writes it
#pragma unroll
  for (int k = 0; k < kHeadDim / 32; ++k) {
    ptx::wgmma_m64n128k32_e4m3_ss(s, ptx::wgmma_desc_from_low(q_desc + k32_step_offset(k)),
                                  ptx::wgmma_desc_from_low(k_desc + k32_step_offset(k)), k > 0);
  }
  ptx::wgmma_commit();
}

// Otmp = P V over the tile's 128 keys (k32 steps along the 128-byte V^T rows), a fresh
// accumulator.
__device__ __forceinline__ void issue_pv(float (&o)[64], const uint32_t (&pa)[16], const uint8_t* v_tile) {
  const uint32_t v_desc = ptx::wgmma_desc_sw128_low(v_tile);
  ptx::wgmma_fence();  // the softmax wrote pa and the O update read o: order both before the wgmma
#pragma unroll
  for (int k = 0; k < kTileKeys / 32; ++k) {
    const uint32_t a[4] = {pa[4 * k], pa[4 * k + 1], pa[4 * k + 2], pa[4 * k + 3]};
    ptx::wgmma_m64n128k32_e4m3_rs(o, a, ptx::wgmma_desc_from_low(v_desc + k32_step_offset(k)), k > 0);
  }
  ptx::wgmma_commit();
}

// Waits for the K tile of `slot` and issues S = Q K^T on it.
template <class Smem>
__device__ __forceinline__ void issue_qk_when_ready(float (&s)[64], const uint8_t* q_rows, Smem& sm,
                                                    const RingSlot& slot) {
  const int stage = slot.stage<Smem::kStages>();
  ptx::mbarrier_wait(&sm.k_full[stage], slot.parity<Smem::kStages>());
  issue_qk(s, q_rows, sm.k[stage][0]);
}

// Waits for the V tile of the slot before `slot` (the tile of the last softmax) and issues P V.
template <class Smem>
__device__ __forceinline__ void issue_pv_when_ready(float (&otmp)[64], const uint32_t (&pa)[16],
                                                    Smem& sm, const RingSlot& slot) {
  const int stage = slot.previous_stage<Smem::kStages>();
  ptx::mbarrier_wait(&sm.v_full[stage], slot.previous_parity<Smem::kStages>());
  issue_pv(otmp, pa, sm.v[stage][0]);
}

// O = alpha O + Otmp, alpha per row (the two-level accumulation, spec 4.4).
__device__ __forceinline__ void update_o(float (&o)[64], const float (&otmp)[64], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = fmaf(o[i], alpha[(i >> 1) & 1], otmp[i]);
}

// After the PV wgmma completed: release its V tile, O = alpha O + Otmp (alpha: the rescale of
// the tile that PV multiplied).
template <bool kOUpdate, class Smem>
__device__ __forceinline__ void finish_pv(float (&o)[64], float (&otmp)[64], uint32_t (&pa)[16],
                                          const float (&alpha)[2], Smem& sm, int stage) {
  ptx::fence_operands(otmp);
  ptx::fence_operands(pa);
  if (signals_for_warpgroup()) ptx::mbarrier_arrive(&sm.v_empty[stage]);
  if constexpr (kOUpdate) {
    update_o(o, otmp, alpha);
  } else {
    // Benchmark builds: one element only, which keeps every PV's result read (ptxas empties a
    // wgmma whose accumulators nothing reads) and frees O's other registers: the update's cost,
    // instructions and registers, as an upper bound.
    o[0] += otmp[0];
  }
}

// After the QK^T wgmma of tile t completed: release its K tile (and the Q block after the last
// tile), then the softmax step that makes P of tile t.
template <int kPolyExp2Every, bool kSoftmax, class Smem>
__device__ __forceinline__ void finish_qk(float (&s)[64], uint32_t (&pa)[16], Fp8RowState& st,
                                          Smem& sm, RingSlot& slot, const WorkItem& it, int t, int tiles,
                                          float sk, float c, int quad_col) {
  ptx::fence_operands(s);
  if (signals_for_warpgroup()) {
    ptx::mbarrier_arrive(&sm.k_empty[slot.stage<Smem::kStages>()]);
    if (t == tiles - 1) ptx::mbarrier_arrive(&sm.q_empty);
  }
  const int valid = it.seg_len - t * kTileKeys;
  if constexpr (!kSoftmax) {  // benchmark builds: S packed as P, what the GEMMs and the ring cost
    st.alpha[0] = st.alpha[1] = 1.0f;
    pack_p(s, pa);
  } else if (valid < kTileKeys) {
    fp8_softmax_tile<true, kPolyExp2Every>(s, pa, st, valid, sk, c, quad_col);
  } else {
    fp8_softmax_tile<false, kPolyExp2Every>(s, pa, st, valid, sk, c, quad_col);
  }
  ++slot.index;
}

// out = bf16(fp32(O * sv) / l) for the thread's two rows, if they are rows of the block; one
// reciprocal a row (attention/epilogue.cuh RowDivisor), the correctly rounded quotients.
__device__ __forceinline__ void store_output(const float (&o)[64], const Fp8RowState& st, const WorkItem& it,
                                             int row0, const Fp8Params& p, int quad_col) {
  const float* sv = p.v_scales + (static_cast<int64_t>(it.segment) * p.plan.heads + it.head) * kHeadDim;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(st.l[r]);
    const int row = row0 + 8 * r;
    if (row >= it.row_end) continue;
    __nv_bfloat16* dst = p.out + (static_cast<int64_t>(row) * p.plan.heads + it.head) * kHeadDim + quad_col;
    attention::store_row_bf16<true, true>(dst, sv + quad_col, l,
                                          [&](int i) { return make_float2(o[4 * i + 2 * r], o[4 * i + 2 * r + 1]); });
  }
}

// The consumers' schedule with 128-key tiles (the tile_keys=128 build; production's 256-key tiles
// are consume_256 below): one GEMM phase per tile issues PV(t - 1) and QK^T(t) back to back and
// waits for both before the softmax of tile t; O, S, Otmp and P hold 208 of the 240 registers,
// without local memory and with no register to spare: a value held across the tile loop (an
// invariant of the item loop too) is one the loop lacks, hence the item loop's condition and
// head_offset. Measured and removed (benchmarks/RESULTS.md): QK^T(t) first, so that the
// exponentials of tile t run under PV(t - 1) (FA3's intra-warpgroup overlap), with P(t) in
// registers (100 bytes of spills, 5-9 % slower) or through two shared-memory P tiles (8-11 %
// slower); QK^T and PV in phases of their own (8-10 % slower); O = alpha O + Otmp in the next
// tile's exponential loop (3 % slower); one PV accumulator per 2 or 4 tiles (9 % slower); the
// whole softmax (maxima, frame, exponentials) one row after the other (3 % slower; the row
// maxima alone in that order is production, fp8_softmax.cuh); the tiles of a CTA's items as one
// sequence, an item's last PV and the next item's first QK^T in one phase (1-5 % slower); the
// V-tile wait before turn.wait() (1.4-1.8 % slower); the two consumers' exponential phases in
// alternation on a second barrier pair (1-3 % slower). The losses without a change to the
// softmax were per cycle: the consumers' exponential phases collided more (mio_throttle on
// MUFU.EX2, docs/design.md).

// A build's compile-time choices: production takes the defaults, the benchmark-only builds
// (KernelConfig flags, templates/attention_fp8_wgmma.cu.jinja) change some.
template <int PolyExp2Every = 64, bool PingPongOn = true, int Stages = kFp8Stages, bool SoftmaxOn = true,
          bool OUpdateOn = true, uint32_t WaitSleepNs = kProducerWaitSleepNs, bool DynamicOrder = false,
          int TileKeys = 2 * kTileKeys, bool CopyKvOn = true, int ClusterCtas = 1, int QInKernel = 0,
          int BackgroundTraffic = 0, bool InterleavedPackOn = (TileKeys == 2 * kTileKeys)>
struct Fp8Options {
  // Every n-th exponential of a thread's 64 per 128 keys on the FMA pipe (0: none). With 256-key
  // tiles 64 (elements 63 of each half: 2 of 128) measured best of 0, 16, 32, 36 to 62 and 64,
  // by 2-3.5 % (a ptxas-schedule effect: 36 to 62 measured as 32 or slower); with 128-key tiles
  // 32 was best (benchmarks/RESULTS.md).
  static constexpr int kPolyExp2Every = PolyExp2Every;
  static constexpr bool kPingPong = PingPongOn;         // the consumers' GEMM phases alternate (PingPong)
  static constexpr int kStages = Stages;                // the depth of the K and V rings
  static constexpr bool kSoftmax = SoftmaxOn;           // false: S packed as P (not attention)
  static constexpr bool kOUpdate = OUpdateOn;           // false: no O = alpha O + Otmp (not attention)
  static constexpr uint32_t kWaitSleepNs = WaitSleepNs; // the producer's suspend-time hint (produce)
  static constexpr bool kDynamic = DynamicOrder;        // the dynamic item order (production: static striding)
  // Keys of a KV tile: 128, or 256 (consume_256: one max, one rescale and one O update per 256
  // keys; the two K-scale blocks of a tile scale its halves).
  // (Inside the struct kTileKeys names this member: the checks spell the 128-key constant out.)
  static constexpr int kTileKeys = TileKeys;
  static constexpr bool kCopyKv = CopyKvOn;  // false: K/V copied once per ring slot (not attention)
  // CTAs of a cluster: 1 = each CTA copies its own tiles; 2 (benchmark builds) = pairs of query
  // blocks sharing every K/V tile copy (multicast; tile_scheduler.cuh schedule_item): half the
  // bytes from L2 and a 2.5 % higher clock, lost again to the two CTAs' lockstep on the ring
  // (within 1 % of production; benchmarks/RESULTS.md, twelfth session).
  static constexpr int kClusterCtas = ClusterCtas;
  // Q quantised in the kernel from the BF16 q (benchmark builds for now, fp8_q_quantizer.cuh):
  // the producer stages each item's BF16 block, warps 1-3 of its warpgroup write the codes and
  // scales, and the consumers read their rows' scales after the q_full wait. The pre-pass may
  // then skip Q.
  // 1: one hand-off of the whole block (q_full, q_empty); 2: one per consumer, each consumer's rows
  // written as soon as it released them (QStaging::q_full / q_empty).
  static constexpr bool kQInKernel = QInKernel != 0;
  // Benchmark builds (background_traffic.cuh): warps 1-3 of the producer warpgroup stream the
  // pre-pass's DRAM traffic and arithmetic while the consumers run (the output is production's).
  // 1: on; 2: the same code, skipped at run time (what its presence alone costs: ptxas allocates
  // the producer warpgroup's 24 registers anew, and the TMA thread spills 76 bytes).
  static constexpr int kBackgroundTraffic = BackgroundTraffic;
  static_assert(BackgroundTraffic >= 0 && BackgroundTraffic <= 2, "background_traffic: 0 (off), 1 or 2 (skipped)");
  static_assert(BackgroundTraffic == 0 || QInKernel == 0, "background_traffic: warps 1-3 are the Q quantizer's");
  static constexpr bool kQPerConsumer = QInKernel == 2;
  // 256-key tiles: P packed into the PV operand as its exponentials complete (fp8_exp_half), in
  // the issue slots the MUFU-bound tail of the exponentials leaves free; false (benchmark builds;
  // production until 2026-12-07): after the last one (pack_p), 2 % slower on the H100, the same
  // output bit for bit (benchmarks/RESULTS.md, forty-first session).
  static constexpr bool kInterleavedPack = InterleavedPackOn;
  static_assert(!InterleavedPackOn || TileKeys == 2 * sm90::kTileKeys, "interleaved_pack: 256-key tiles");
  static_assert(QInKernel >= 0 && QInKernel <= 2, "q_in_kernel: 0 (off), 1 or 2 (per-consumer hand-off)");
  static_assert(QInKernel == 0 || (TileKeys == 2 * sm90::kTileKeys && !DynamicOrder),
                "Q quantised in the kernel: 256-key tiles and the static item order");
  static_assert(ClusterCtas == 1 || (ClusterCtas == 2 && TileKeys == 2 * sm90::kTileKeys && !DynamicOrder && CopyKvOn),
                "clusters of two CTAs: 256-key tiles (one half a CTA), the static item order and every copy");
  static_assert(TileKeys == sm90::kTileKeys || TileKeys == 2 * sm90::kTileKeys, "KV tiles of 128 or 256 keys");
  static_assert(TileKeys == sm90::kTileKeys || (SoftmaxOn && OUpdateOn && !DynamicOrder),
                "256-key tiles: production arithmetic and the static item order only");
};

template <class Opt, int consumer, class Smem>
__device__ __forceinline__ void consume(Smem& sm, const Fp8Params& p) {
  constexpr int kPolyExp2Every = Opt::kPolyExp2Every;
  constexpr bool kSoftmax = Opt::kSoftmax, kOUpdate = Opt::kOUpdate;
  const FragmentCoords at(consumer);
  const int quad_col = at.quad_col, row_in_block = at.row_in_block;
  const uint8_t* q_rows = sm.q + 64 * consumer * kHeadDim;  // 8 KB: still 1024-byte aligned

  float s[64], otmp[64], o[64];
  uint32_t pa[16];
#pragma unroll
  for (int i = 0; i < 64; ++i) s[i] = otmp[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) pa[i] = 0u;
  Fp8RowState st;

  const PingPong<Opt::kPingPong> turn(consumer);
  turn.start();

  RingSlot slot;
  uint32_t items = 0;
  int i = Opt::kDynamic ? 0 : p.schedule.begin();
  for (int w = blockIdx.x;; ++items, ++i) {
    WorkItem it;
    if constexpr (Opt::kDynamic) {
      // The producer's item, published by the q_full arrival (tile_scheduler.cuh).
      ptx::mbarrier_wait(&sm.q_full, items & 1u);
      w = sm.item.read();  // and arrive on sm.item.empty
      if (w >= num_items(p.plan)) break;
      it = work_item(p.plan, w);
    } else {
      // The static order: the CTA's list (i counts through it); the end and the item are read
      // again at each item (L1-resident) rather than held across the tile loop.
      if (i >= p.schedule.end()) break;
      w = p.schedule.item(i);
      it = work_item(p.plan, w);
    }
    const int row0 = it.row_begin + row_in_block;
    const float* qs = p.q_scales + head_offset(it.head, p.tokens);
    st.reset(row0 < it.row_end ? __ldg(qs + row0) : 0.0f, row0 + 8 < it.row_end ? __ldg(qs + row0 + 8) : 0.0f);
    const float* ks = p.k_scales + head_offset(it.head, p.k_scale_stride) + it.kblock0;
#pragma unroll
    for (int j = 0; j < 64; ++j) o[j] = 0.0f;
    const int tiles = (it.seg_len + kTileKeys - 1) / kTileKeys;
    if constexpr (!Opt::kDynamic) ptx::mbarrier_wait(&sm.q_full, items & 1u);

    // The first GEMM phase issues QK^T of tile 0 alone, the last one PV of the last tile alone:
    // no wgmma sits in a branch (ptxas would serialise every wgmma of the kernel otherwise).
    {
      const float sk = __ldg(ks + 0);  // in flight across the barrier and the GEMMs
      turn.wait();
      issue_qk_when_ready(s, q_rows, sm, slot);
      turn.pass();
      ptx::wgmma_wait<0>();
      finish_qk<kPolyExp2Every, kSoftmax>(s, pa, st, sm, slot, it, 0, tiles, sk, p.c, quad_col);
    }
    for (int t = 1; t < tiles; ++t) {
      const int pv_stage = slot.previous_stage<Smem::kStages>();
      const float sk = __ldg(ks + t);  // in flight across the barrier and the GEMMs
      turn.wait();
      issue_pv_when_ready(otmp, pa, sm, slot);
      issue_qk_when_ready(s, q_rows, sm, slot);
      turn.pass();
      ptx::wgmma_wait<1>();
      finish_pv<kOUpdate>(o, otmp, pa, st.alpha, sm, pv_stage);
      ptx::wgmma_wait<0>();
      finish_qk<kPolyExp2Every, kSoftmax>(s, pa, st, sm, slot, it, t, tiles, sk, p.c, quad_col);
    }
    {
      const int pv_stage = slot.previous_stage<Smem::kStages>();
      turn.wait();
      issue_pv_when_ready(otmp, pa, sm, slot);
      turn.pass();
      ptx::wgmma_wait<0>();
      finish_pv<kOUpdate>(o, otmp, pa, st.alpha, sm, pv_stage);
    }
    // The item's head, segment and row range again (L1-resident table reads; the dynamic
    // order's slot may hold the next item by now): keeping them live across the tile loop costs
    // registers the loop needs.
    store_output(o, st, work_item(p.plan, w), row0, p, quad_col);
  }
  turn.finish();
}

// ---- 256-key tiles ---------------------------------------------------------------------------

// S = Q K^T over one 128-key half of a tile, a fresh accumulator: the first k32 step overwrites
// (so S's old values are dead before it and their registers may hold P or Otmp meanwhile).
__device__ __forceinline__ void issue_qk_half(float (&s)[64], const uint8_t* q_rows, const uint8_t* k_half) {
  const uint32_t q_desc = ptx::wgmma_desc_sw128_low(q_rows), k_desc = ptx::wgmma_desc_sw128_low(k_half);
  ptx::wgmma_fence();  // the softmax and the O update read these registers: order that first
  ptx::wgmma_m64n128k32_e4m3_ss_overwrite(s, ptx::wgmma_desc_from_low(q_desc), ptx::wgmma_desc_from_low(k_desc));
#pragma unroll
  for (int k = 1; k < kHeadDim / 32; ++k) {
    ptx::wgmma_m64n128k32_e4m3_ss(s, ptx::wgmma_desc_from_low(q_desc + k32_step_offset(k)),
                                  ptx::wgmma_desc_from_low(k_desc + k32_step_offset(k)), 1u);
  }
  ptx::wgmma_commit();
}

// Otmp = P V over a 256-key tile (eight k32 steps: four on each V^T half), a fresh accumulator.
__device__ __forceinline__ void issue_pv_256(float (&otmp)[64], const uint32_t (&pa_lo)[16],
                                             const uint32_t (&pa_hi)[16], const uint8_t* v_lo, const uint8_t* v_hi) {
  const uint32_t lo_desc = ptx::wgmma_desc_sw128_low(v_lo), hi_desc = ptx::wgmma_desc_sw128_low(v_hi);
  ptx::wgmma_fence();  // the softmax wrote P: order that before the wgmma reads it
#pragma unroll
  for (int k = 0; k < kTileKeys / 32; ++k) {
    const uint32_t a[4] = {pa_lo[4 * k], pa_lo[4 * k + 1], pa_lo[4 * k + 2], pa_lo[4 * k + 3]};
    const uint64_t desc = ptx::wgmma_desc_from_low(lo_desc + k32_step_offset(k));
    if (k == 0) {
      ptx::wgmma_m64n128k32_e4m3_rs_overwrite(otmp, a, desc);
    } else {
      ptx::wgmma_m64n128k32_e4m3_rs(otmp, a, desc, 1u);
    }
  }
#pragma unroll
  for (int k = 0; k < kTileKeys / 32; ++k) {
    const uint32_t a[4] = {pa_hi[4 * k], pa_hi[4 * k + 1], pa_hi[4 * k + 2], pa_hi[4 * k + 3]};
    ptx::wgmma_m64n128k32_e4m3_rs(otmp, a, ptx::wgmma_desc_from_low(hi_desc + k32_step_offset(k)), 1u);
  }
  ptx::wgmma_commit();
}

// One consumer warpgroup's release of a ring slot's tile: an arrival on its empty barrier in
// each CTA whose copies fill the slot (kCtas = 2: both CTAs of the cluster; the peer's through
// its shared::cluster address). Called by one thread of the warpgroup.
template <int kCtas>
__device__ __forceinline__ void release_slot(uint64_t* empty) {
  ptx::mbarrier_arrive(empty);
  if constexpr (kCtas == 2) ptx::mbarrier_arrive_cluster(ptx::map_to_cta(empty, ptx::cluster_ctarank() ^ 1u));
}

// After PV over a 256-key tile completed: its operands (Otmp, P) become the compiler's again and
// its V tile is released.
template <int kCtas, class Smem>
__device__ __forceinline__ void release_pv_256(float (&otmp)[64], uint32_t (&pa_lo)[16], uint32_t (&pa_hi)[16],
                                               Smem& sm, int stage) {
  ptx::fence_operands(otmp);
  ptx::fence_operands(pa_lo);
  ptx::fence_operands(pa_hi);
  if (signals_for_warpgroup()) release_slot<kCtas>(&sm.v_empty[stage]);
}

// The full (kFull) or empty barrier of the Q rows a consumer reads: the block's (kHandoff < 0),
// or consumer kHandoff's own pair in the staging area (the q_in_kernel = 2 build's per-consumer
// hand-off).
template <int kHandoff, bool kFull, class Smem>
__device__ __forceinline__ uint64_t* q_barrier(Smem& sm) {
  if constexpr (kHandoff < 0) {
    return kFull ? &sm.q_full : &sm.q_empty;
  } else {
    return kFull ? &q_staging(sm).q_full[kHandoff] : &q_staging(sm).q_empty[kHandoff];
  }
}

// After QK^T of 256-key tile t completed: release its K tile (and the Q rows after the last
// tile), then the softmax that makes P of tile t, both halves.
template <int kPolyExp2Every, int kCtas, int kHandoff = -1, bool kPack = false, class Smem>
__device__ __forceinline__ void finish_qk_256(float (&s_lo)[64], float (&s_hi)[64], uint32_t (&pa_lo)[16],
                                              uint32_t (&pa_hi)[16], Fp8RowState& st, Smem& sm, RingSlot& slot,
                                              const WorkItem& it, int t, int tiles, float sk0, float sk1, float c,
                                              int quad_col) {
  ptx::fence_operands(s_lo);
  ptx::fence_operands(s_hi);
  if (signals_for_warpgroup()) {
    release_slot<kCtas>(&sm.k_empty[slot.stage<Smem::kStages>()]);
    if (t == tiles - 1) ptx::mbarrier_arrive(q_barrier<kHandoff, false>(sm));
  }
  const int valid = it.seg_len - t * 2 * kTileKeys;
  if (valid < 2 * kTileKeys) {
    fp8_softmax_exp_256<true, kPolyExp2Every, kPack>(s_lo, s_hi, st, valid, sk0, sk1, c, quad_col, pa_lo, pa_hi);
  } else {
    fp8_softmax_exp_256<false, kPolyExp2Every, kPack>(s_lo, s_hi, st, valid, sk0, sk1, c, quad_col, pa_lo, pa_hi);
  }
  if constexpr (!kPack) {
    pack_p(s_lo, pa_lo);
    pack_p(s_hi, pa_hi);
  }
  ++slot.index;
}

// The consumers with 256-key tiles. A GEMM phase (holding the turn) issues PV(t - 1), waits for
// it, issues QK^T of tile t's first half, does O = alpha O + Otmp while that runs, then issues
// the second half into the registers Otmp held: S (128), Otmp (64) and P (32) are never all live
// at once, so O, S and the rest fit the 240 registers. (The first half issued before the PV wait
// needs P, Otmp and half of S at once: ptxas then spilled 200 bytes and serialised the wgmmas.
// With O in shared memory instead, 64 KB, the first half fits before the wait: 8-10 % slower,
// the O round trip's shared-memory latency in the GEMM phase and 6 % more instructions cost
// more than the waits it removed. Waiting for the first half alone and taking its row maxima
// while the second half runs, the same numbers: 2.4-3.7 % slower; benchmarks/RESULTS.md,
// eighth session. O in shared memory with one PV accumulator per 2 to 64 tiles, so that PV and
// the first half issue back to back as in cuDNN's kernel: 6-9 % slower, the two consumers'
// exponentials then queue on MUFU; QK^T as one m64n256k32 chain, the O update before it:
// 2-3 % slower; ninth session. QK^T of the tile's first 64 keys (m64n64k32) issued right
// behind PV(t - 1), before its wait: 6-7 % slower, the waits it removed came back as MIO
// throttle (x4) of the two consumers' MUFU.EX2; eleventh session. FA3's intra-warpgroup overlap
// on 128-key tiles, PV(t - 1) under the softmax of tile t, its accumulator added into an FP32 O
// in shared memory every 4 or 8 tiles: 8-13 % slower than this kernel, 4.5-10 % slower than
// 128-key tiles without it; its tile loop encodes 20 % more stall cycles a key than this one's;
// forty-first session, in the tree up to b1ee1cb.)
template <class Opt, int consumer, class Smem>
__device__ __forceinline__ void consume_256(Smem& sm, const Fp8Params& p) {
  constexpr int kPolyExp2Every = Opt::kPolyExp2Every, kCtas = Opt::kClusterCtas;
  constexpr int kKeys = 2 * kTileKeys;
  const FragmentCoords at(consumer);
  const int quad_col = at.quad_col, row_in_block = at.row_in_block;
  const uint8_t* q_rows = sm.q + 64 * consumer * kHeadDim;
  constexpr int kHandoff = Opt::kQPerConsumer ? consumer : -1;  // whose Q barriers (q_barrier)
  constexpr bool kPack = Opt::kInterleavedPack;

  float s_lo[64], s_hi[64], otmp[64], o[64];
  uint32_t pa_lo[16], pa_hi[16];
  Fp8RowState st;

  const PingPong<Opt::kPingPong> turn(consumer);
  turn.start();

  RingSlot slot;
  uint32_t items = 0;
  for (int i = p.schedule.begin();; ++i, ++items) {
    // The list's end and the item again from the (L1-resident) table, as the item loop's
    // condition of before: no value but i is held across the tile loop.
    if (i >= p.schedule.end()) break;
    const WorkItem it = schedule_item<kCtas>(p.plan, p.schedule, i);
    const int row0 = it.row_begin + row_in_block;
    const float* qs = p.q_scales + head_offset(it.head, p.tokens);
    if constexpr (Opt::kQInKernel) {
      // The scales are this kernel's own writes (the quantizer warps'), visible after the q_full
      // wait, and read through L2 (ld.global.cg), not the non-coherent path.
      ptx::mbarrier_wait(q_barrier<kHandoff, true>(sm), items & 1u);
      st.reset(row0 < it.row_end ? __ldcg(qs + row0) : 0.0f, row0 + 8 < it.row_end ? __ldcg(qs + row0 + 8) : 0.0f);
    } else {
      st.reset(row0 < it.row_end ? __ldg(qs + row0) : 0.0f, row0 + 8 < it.row_end ? __ldg(qs + row0 + 8) : 0.0f);
    }
    const float* ks = p.k_scales + head_offset(it.head, p.k_scale_stride) + it.kblock0;
    const int last_block = (it.seg_len - 1) / kTileKeys;  // the segment's last 128-key block
#pragma unroll
    for (int j = 0; j < 64; ++j) o[j] = 0.0f;
    const int tiles = (it.seg_len + kKeys - 1) / kKeys;
    if constexpr (!Opt::kQInKernel) ptx::mbarrier_wait(&sm.q_full, items & 1u);

    {
      const float sk0 = __ldg(ks + 0), sk1 = __ldg(ks + min(1, last_block));
      turn.wait();
      const int stage = slot.stage<Smem::kStages>();
      ptx::mbarrier_wait(&sm.k_full[stage], slot.parity<Smem::kStages>());
      issue_qk_half(s_lo, q_rows, sm.k[stage][0]);
      issue_qk_half(s_hi, q_rows, sm.k[stage][1]);
      turn.pass();
      ptx::wgmma_wait<0>();
      finish_qk_256<kPolyExp2Every, kCtas, kHandoff, kPack>(s_lo, s_hi, pa_lo, pa_hi, st, sm, slot, it, 0, tiles, sk0,
                                                            sk1, p.c, quad_col);
    }
    for (int t = 1; t < tiles; ++t) {
      const int pv_stage = slot.previous_stage<Smem::kStages>();
      const int stage = slot.stage<Smem::kStages>();
      // A half past the segment's last block reads that block's scale (its keys are masked).
      const float sk0 = __ldg(ks + 2 * t), sk1 = __ldg(ks + min(2 * t + 1, last_block));
      turn.wait();
      ptx::mbarrier_wait(&sm.v_full[pv_stage], slot.previous_parity<Smem::kStages>());
      issue_pv_256(otmp, pa_lo, pa_hi, sm.v[pv_stage][0], sm.v[pv_stage][1]);
      ptx::wgmma_wait<0>();
      release_pv_256<kCtas>(otmp, pa_lo, pa_hi, sm, pv_stage);
      ptx::mbarrier_wait(&sm.k_full[stage], slot.parity<Smem::kStages>());
      issue_qk_half(s_lo, q_rows, sm.k[stage][0]);
      update_o(o, otmp, st.alpha);
      issue_qk_half(s_hi, q_rows, sm.k[stage][1]);
      turn.pass();
      ptx::wgmma_wait<0>();
      finish_qk_256<kPolyExp2Every, kCtas, kHandoff, kPack>(s_lo, s_hi, pa_lo, pa_hi, st, sm, slot, it, t, tiles, sk0,
                                                            sk1, p.c, quad_col);
    }
    {
      const int pv_stage = slot.previous_stage<Smem::kStages>();
      turn.wait();
      ptx::mbarrier_wait(&sm.v_full[pv_stage], slot.previous_parity<Smem::kStages>());
      issue_pv_256(otmp, pa_lo, pa_hi, sm.v[pv_stage][0], sm.v[pv_stage][1]);
      turn.pass();
      ptx::wgmma_wait<0>();
      release_pv_256<kCtas>(otmp, pa_lo, pa_hi, sm, pv_stage);
      update_o(o, otmp, st.alpha);
    }
    store_output(o, st, schedule_item<kCtas>(p.plan, p.schedule, i), row0, p, quad_col);
  }
  turn.finish();
}

// Opt: Fp8Options (production: Fp8Options<>, the defaults); dynamic shared memory:
// smem_bytes<Opt::kStages, Opt::kTileKeys, Opt::kQInKernel>(). kQInKernel builds: tm_q maps the
// BF16 q [T, H, 128] in boxes of 64 channels x 128 tokens (128-byte swizzle), not the codes.
template <class Opt>
__global__ void __launch_bounds__(kThreads, 1)
    attention_fp8_wgmma_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                               const __grid_constant__ CUtensorMap tm_v, const Fp8Params p) {
  extern __shared__ uint8_t dynamic_smem[];
  using Smem = SharedStorage<Opt::kStages, Opt::kTileKeys>;
  Smem& sm = aligned_storage<Smem>(dynamic_smem);
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (threadIdx.x == 0) {
    if constexpr (Opt::kQInKernel) {  // the Q staging area after the storage (QStaging)
      ptx::mbarrier_init(&q_staging(sm).full, 1);
      ptx::mbarrier_init(&q_staging(sm).empty, kQQuantizerThreads);
      for (int c = 0; c < kConsumers; ++c) {
        ptx::mbarrier_init(&q_staging(sm).q_full[c], kQQuantizerThreads);
        ptx::mbarrier_init(&q_staging(sm).q_empty[c], 1);
      }
      init_barriers<Opt::kClusterCtas>(sm, kQQuantizerThreads);  // fences these inits too
    } else {
      init_barriers<Opt::kClusterCtas>(sm);
    }
    sm.item.counter = p.item_counter;  // the dynamic item order's (tile_scheduler.cuh)
    ptx::prefetch_tensormap(&tm_q);
    ptx::prefetch_tensormap(&tm_k);
    ptx::prefetch_tensormap(&tm_v);
  }
  // With clusters the peer's copies and arrivals reach these barriers: both CTAs' inits first.
  if constexpr (Opt::kClusterCtas > 1) {
    ptx::cluster_sync_aligned();
  } else {
    __syncthreads();
  }
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      produce<Opt::kWaitSleepNs, Opt::kDynamic, Opt::kCopyKv, Opt::kClusterCtas, Opt::kQInKernel>(sm, &tm_q, &tm_k,
                                                                                                 &tm_v, p);
    } else if (Opt::kQInKernel && threadIdx.x >= 32) {
      // q_scales is the workspace region the binding passes (writable; Fp8Params keeps it const
      // for the consumers' reads).
      quantize_q_blocks<Opt::kClusterCtas, Opt::kWaitSleepNs, Opt::kQPerConsumer>(
          sm, p.plan, p.schedule, const_cast<float*>(p.q_scales), p.tokens, static_cast<int>(threadIdx.x) - 32);
    } else if (Opt::kBackgroundTraffic != 0 && threadIdx.x >= 32) {
      // The Q codes rewritten with their own bytes (the region is the workspace's, writable). The
      // skipped form's condition (c < 0) never holds, and the compiler cannot know it.
      const bool on = Opt::kBackgroundTraffic == 1 ? p.c > 0.0f : p.c < 0.0f;
      // The FP8 pre-pass's traffic in passes over the Q codes (T H 128 bytes): 10 read, 3 written.
      stream_background_traffic<10, 6, 3>(const_cast<uint8_t*>(p.q_codes),
                                          on ? static_cast<int64_t>(p.tokens) * p.plan.heads * kHeadDim : 0, p.c,
                                          p.tokens < 0, reinterpret_cast<uint32_t*>(p.out),
                                          static_cast<int>(threadIdx.x) - 32);
    }
    // A CTA's shared memory must outlive the peer's last copies into it and arrivals on its
    // barriers. The producer warpgroup keeps the CTA alive until every thread of the cluster
    // has arrived here or exited (barrier.cluster waits for the non-exited threads only): the
    // consumers exit after their last arrival, so the peer's have made theirs when this passes.
    if constexpr (Opt::kClusterCtas > 1) ptx::cluster_sync();
  } else {
    ptx::setmaxnreg_inc<kConsumerRegs>();
    // The consumer index as a template argument: barrier ids and row offsets become immediates
    // (a runtime index kept them in registers and pushed the fused schedule into spills).
    if constexpr (Opt::kTileKeys == 2 * kTileKeys) {
      if (warpgroup == 1) {
        consume_256<Opt, 0>(sm, p);
      } else {
        consume_256<Opt, 1>(sm, p);
      }
    } else if (warpgroup == 1) {
      consume<Opt, 0>(sm, p);
    } else {
      consume<Opt, 1>(sm, p);
    }
  }
}

}  // namespace sm90
}  // namespace flashinfer_h3
