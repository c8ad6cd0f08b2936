// The FP8 Q block of each item quantised inside the Hopper kernel (Fp8Options::kQInKernel, a
// benchmark build for now): warps 1-3 of the producer warpgroup, idle otherwise, turn the BF16
// block that the TMA thread staged (QStaging, one item ahead) into the E4M3 codes that the
// consumers' QK^T reads from sm.q, and write the rows' scales to q_scales.
//
// Why: the pre-pass is DRAM-bound, and its Q work (BF16 read, codes and scales written) is ~1.3 GB
// of its ~5.7 GB at 61,440 x 56 (-0.33 ms a call without it, benchmarks/RESULTS.md, ninth
// session). The kernel then reads the BF16 block (0.88 GB in all) instead of the codes (0.44 GB),
// but while the tensor cores, not DRAM, are its bound. The ninth session's consumers quantising
// their own rows cost 1-4 % (their tile loop's schedule moved); here the consumers only read their
// scales after the q_full wait, which the fifteenth session measured as production's speed.
//
// Arithmetic: the pre-pass's (quantize/prepass.cuh fp8_rows, docs/spec.md 4.1), so the codes and
// scales are bit-identical to the workspace's: per token s = fl(amax / 448) (__fdiv_rn), 0 below
// 2^-126, codes rn_e4m3(fl(x * rcp_rn(s))) with saturation, all zero for s = 0. Rows past the
// tensor are TMA zeros (codes 0); rows of the next segment in a segment's last block are quantised
// like any row (the consumers give them a zero scale and store nothing), and only the item's own
// rows' scales are written.
//
// Ordering: the codes are generic-proxy shared-memory writes that wgmma (the async proxy) reads,
// so each thread fences (fence.proxy.async) before its arrival on q_full; the consumers' q_full
// wait then acquires both the codes and the global scale stores.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "../../numerics/formats.cuh"
#include "../../numerics/group_quantize.cuh"
#include "../../ptx/math.cuh"
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/smem_addr.cuh"
#include "../../ptx/warpgroup.cuh"  // named_barrier_sync
#include "../../ptx/wgmma.cuh"  // fence_proxy_async_shared
#include "shared_storage.cuh"
#include "tile_scheduler.cuh"

namespace flashinfer_h3 {
namespace sm90 {

constexpr int kQQuantizerWarps = 3;  // warps 1..3 of the producer warpgroup
constexpr int kQQuantizerThreads = kQQuantizerWarps * 32;

// The BF16 pair `w` as floats (exact: a bf16 is the upper half of its float).
__device__ __forceinline__ float q_bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float q_bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ float amax_of(const uint4& x, float a) {
  a = fmaxf(a, fabsf(q_bf16_lo(x.x)));
  a = fmaxf(a, fabsf(q_bf16_hi(x.x)));
  a = fmaxf(a, fabsf(q_bf16_lo(x.y)));
  a = fmaxf(a, fabsf(q_bf16_hi(x.y)));
  a = fmaxf(a, fabsf(q_bf16_lo(x.z)));
  a = fmaxf(a, fabsf(q_bf16_hi(x.z)));
  a = fmaxf(a, fabsf(q_bf16_lo(x.w)));
  return fmaxf(a, fabsf(q_bf16_hi(x.w)));
}

// The row scale s = fl(amax / 448), 0 below 2^-126 (SPEC 4.1, quantize::fp8_flush_scale), and
// its reciprocal fl(1 / s) (0 for s = 0 or inf): the values the pre-pass gets from __fdiv_rn and
// __frcp_rn (quantize::fp8_group_scale, quantize::fp8_scale), without their slow-path calls,
// whose stack frame the producer warpgroup's 24 registers cannot spare. Each is computed in FP64
// and rounded once to FP32, which is exact here:
//  - amax is the largest |x| of BF16 values, so amax = A 2^k with an integer A < 2^8 and
//    k >= -133. Then amax / 448 = A / 7 2^(k - 6) is an FP32 value (7 divides A) or lies at
//    least a 14th of an FP32 grid step 2^g from every rounding midpoint: its distance to one is
//    (A 2^(k - 5 - g) - 7 (2m + 1)) 2^(g - 1) / 7, and g <= k - 24 (normal) or -149 (subnormal)
//    makes the bracket a non-zero integer. amax * fl64(1 / 448) is within 2^-52 of it,
//    relatively (under 2^-27 of a step), so both round to the same FP32.
//  - 1 / s = 2^-j / S for the integer significand S < 2^24 of s: an FP32 value (S a power of
//    two) or at least 2^-25 of a grid step from every midpoint (the same argument). Two Newton
//    steps from rcp.approx.f64 bring the FP64 reciprocal to ~2^-52 relative error, about 2^-28
//    of a grid step (and s >= 2^-126 keeps 1 / s <= 2^126, finite).
// tests/kernels/test_attention_fp8_wgmma_gpu.py (test_q_in_kernel_scales_on_every_bf16_magnitude)
// checks the scales against the pre-pass's on every BF16 magnitude.
__device__ __forceinline__ quantize::Fp8Scale fp8_q_scale(float amax, float& s) {
  s = quantize::fp8_flush_scale(__double2float_rn(static_cast<double>(amax) * (1.0 / 448.0)));
  if (!(s > 0.0f) || isinf(s)) return {0.0f, s == 0.0f ? 0u : ~0u};  // 1 / inf = 0 keeps its codes
  const double d = s;
  double y = ptx::rcp_approx_f64(d);
  y = fma(y, fma(-d, y, 1.0), y);
  y = fma(y, fma(-d, y, 1.0), y);
  return {__double2float_rn(y), ~0u};
}

// Eight channels' codes, channel 8j + e in byte e.
__device__ __forceinline__ uint2 codes8(const uint4& x, const quantize::Fp8Scale& sc) {
  return make_uint2(quantize::fp8_codes4(q_bf16_lo(x.x), q_bf16_hi(x.x), q_bf16_lo(x.y), q_bf16_hi(x.y), sc),
                    quantize::fp8_codes4(q_bf16_lo(x.z), q_bf16_hi(x.z), q_bf16_lo(x.w), q_bf16_hi(x.w), sc));
}

// A quantizer thread's loop over the CTA's items (the static order, schedule_item), in three
// phases a block, the 96 threads meeting on a named barrier between them:
//   amax    lane 8 sub + j of warp `warp` (0..2) reads 16-byte chunk j of both atoms (channels
//           8j..8j+7 and 64 + 8j..+7: the eight lanes of a row read 128 contiguous bytes of each
//           atom, conflict-free) of row quad_row(quad, sub) for quad = warp, warp + 3, ...; the
//           eight lanes of a row are consecutive, so xor-shuffles 1, 2, 4 give the row's amax
//   scales  thread t: rows t and t + 96, s = fl(amax / 448) and 1 / s, to shared memory, and s
//           to q_scales for the item's own rows (none for a cluster pair's kNoRows entry)
//   codes   once the consumers released sm.q (q_empty), the amax phase's rows again: byte c of
//           row r at 16-byte chunk (c / 16) ^ (r % 8), the 128-byte swizzle of the consumers'
//           descriptors. A warp's four rows (quad_row) are two with r % 8 < 4 and two with
//           r % 8 >= 4: each half of a row's codes then lands in the other 64-byte bank half
//           for the second pair, so an 8-byte store of the warp takes 2 wavefronts, not 4
// The producer warpgroup has 24 registers: the scales (fp8_q_scale, no slow-path calls) get a
// phase of their own, where little is live, and the staged block is read twice rather than held,
// through 32-bit shared addresses (a generic pointer costs two registers). kWaitSleepNs: the
// suspend-time hint of the quantizers' waits (the build's, as the producer's).
// Row `sub` (0..3) of the quantizers' row group `quad` (0..31): rows 8m + {0, 1, 4, 5} for even
// quad = 2m, 8m + {2, 3, 6, 7} for odd ones (every row once).
static_assert(kBlockRows % 8 == 0, "quad_row: whole periods of the 8-row swizzle");
__device__ __forceinline__ int quad_row(int quad, int sub) {
  return 8 * (quad >> 1) + 2 * (quad & 1) + (sub & 1) + 4 * (sub >> 1);
}

// kPerConsumer (q_in_kernel = 2): the codes phase in two halves, consumer c's 64 rows (quads
// 16c..16c + 15) once consumer c released them (QStaging::q_empty[c]), published on
// QStaging::q_full[c]; else the whole block after sm.q_empty, published on sm.q_full.
template <int kCtas, uint32_t kWaitSleepNs, bool kPerConsumer, class Smem>
__device__ __forceinline__ void quantize_q_blocks(Smem& sm, const PlanTables& plan, const ItemSchedule& schedule,
                                                  float* q_scales, int tokens, int thread) {
  QStaging& qs = q_staging(sm);
  const int warp = thread >> 5, j = thread & 7;
  // One register for all four shared regions: their offsets from the staged block are constants.
  static_assert(offsetof(QStaging, amax) == 2 * QStaging::kAtomBytes &&
                    offsetof(QStaging, recip) == offsetof(QStaging, amax) + 4 * kBlockRows,
                "amax and recip follow the two atoms");
  static_assert(offsetof(Smem, q) == 0, "sm.q starts the storage that QStaging follows");
  const uint32_t raw = ptx::smem_addr(qs.atoms[0]);
  const uint32_t codes = raw - static_cast<uint32_t>(sizeof(Smem));
  const uint32_t amax_at = raw + 2 * QStaging::kAtomBytes, recip_at = amax_at + 4 * kBlockRows;
  // The barriers' phase parity is the item's position in the CTA's list, recomputed from the
  // (L1-resident) list start where needed instead of held as a counter across the phases.
  auto parity = [&](int i) { return static_cast<uint32_t>(i - schedule.begin()) & 1u; };
#pragma unroll 1
  for (int i = schedule.begin(); i < schedule.end(); ++i) {
    ptx::mbarrier_wait_suspend<kWaitSleepNs>(&qs.full, parity(i));
#pragma unroll 1
    for (int quad = warp; quad < kBlockRows / 4; quad += kQQuantizerWarps) {
      const int r = quad_row(quad, (thread >> 3) & 3);
      const uint32_t in = raw + static_cast<uint32_t>(r * 128 + ((j ^ (r & 7)) << 4));
      float amax = amax_of(ptx::ld_shared_v4_b32(in + QStaging::kAtomBytes),
                           amax_of(ptx::ld_shared_v4_b32(in), 0.0f));
#pragma unroll
      for (int o = 1; o < 8; o *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      if (j == 0) ptx::st_shared_b32(amax_at + 4u * r, __float_as_uint(amax));
    }
    ptx::named_barrier_sync(kQuantizers, kQQuantizerThreads);
#pragma unroll 1
    for (int r = thread; r < kBlockRows; r += kQQuantizerThreads) {
      float s;
      const quantize::Fp8Scale sc = fp8_q_scale(__uint_as_float(ptx::ld_shared_b32(amax_at + 4u * r)), s);
      ptx::st_shared_b32(amax_at + 4u * r, __float_as_uint(s));
      ptx::st_shared_b32(recip_at + 4u * r, __float_as_uint(sc.recip));
      // The item's fields again from the (L1-resident) tables rather than held across the loop.
      const WorkItem it = schedule_item<kCtas>(plan, schedule, i);
      if (it.row_begin + r < it.row_end) q_scales[static_cast<int64_t>(it.head) * tokens + it.row_begin + r] = s;
    }
    ptx::named_barrier_sync(kQuantizers, kQQuantizerThreads);
    constexpr int kParts = kPerConsumer ? kConsumers : 1, kPartQuads = kBlockRows / 4 / kParts;
#pragma unroll 1
    for (int part = 0; part < kParts; ++part) {
      // The rows are free (the consumers' last QK^T of the last item completed).
      ptx::mbarrier_wait_suspend<kWaitSleepNs>(kPerConsumer ? &qs.q_empty[part] : &sm.q_empty, parity(i) ^ 1u);
#pragma unroll 1
      for (int quad = kPartQuads * part + warp; quad < kPartQuads * (part + 1); quad += kQQuantizerWarps) {
        const int r = quad_row(quad, (thread >> 3) & 3);
        const uint32_t in = raw + static_cast<uint32_t>(r * 128 + ((j ^ (r & 7)) << 4));
        const float s = __uint_as_float(ptx::ld_shared_b32(amax_at + 4u * r));
        const quantize::Fp8Scale sc{__uint_as_float(ptx::ld_shared_b32(recip_at + 4u * r)), s == 0.0f ? 0u : ~0u};
        // (s = inf: recip 0 and keep: the codes of x * 0, as the pre-pass's.)
        const uint32_t row = codes + static_cast<uint32_t>(r * 128 + 8 * (j & 1));
        ptx::st_shared_v2_b32(row + static_cast<uint32_t>(((j >> 1) ^ (r & 7)) << 4),
                              codes8(ptx::ld_shared_v4_b32(in), sc));
        ptx::st_shared_v2_b32(row + static_cast<uint32_t>(((4 + (j >> 1)) ^ (r & 7)) << 4),
                              codes8(ptx::ld_shared_v4_b32(in + QStaging::kAtomBytes), sc));
      }
      ptx::fence_proxy_async_shared();  // this thread's codes, before the consumers' wgmmas read them
      ptx::mbarrier_arrive(kPerConsumer ? &qs.q_full[part] : &sm.q_full);
    }
    ptx::mbarrier_arrive(&qs.empty);  // its reads of the block (and of amax / recip) are done
  }
}

}  // namespace sm90
}  // namespace flashinfer_h3
