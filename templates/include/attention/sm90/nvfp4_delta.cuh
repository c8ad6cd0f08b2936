// The delta term of the NVFP4 scores (SPEC 3.4): delta_j = qbar . Khat_j for the 128 keys of a
// KV tile, computed while the consumers run their GEMMs: in production by a warpgroup of its own
// as wgmma m64n8k16 on the K tile in shared memory (tile_delta_wgmma, below); in the
// delta_mma_sync benchmark build (production until 2026-12-06) by three warps of the producer
// warpgroup as mma.sync (tile_delta).
//
// Why a tensor-core product: the dot products are 128 x 128 FMAs per tile (on the FP32 pipe,
// with the FP16 -> FP32 conversions, a tenth of the SM's issue slots, which the consumers need;
// measured and removed in the twenty-fifth session: one position a thread of the delta
// warpgroup, +2.9 to +4.2 % time and +2.1 to +3.4 % joules against the wgmma form).
// As mma.sync m16n8k16 (FP16 in, FP32 accumulate) with A = 16 keys of the K tile and B = qbar in
// columns 0 and 1 (the other six zero), a tile is 8 m16 blocks x 8 k16 steps = 64 HMMAs; in that
// form three warps (1, 2, 3: one per SM sub-partition other than the TMA warp's) share them, so
// each sub-partition's tensor core spends about 5 % of a tile's time on delta, and each warp runs
// two or three independent accumulation chains (one chain of 64 dependent HMMAs measured 3x
// slower than the consumers' GEMMs: benchmarks/RESULTS.md). The wgmma form is the same products
// as 2 m64 blocks x 8 k16 steps, read by the tensor cores straight from shared memory: 1.3-2.3 %
// less kernel time than the mma.sync form on the H100 (benchmarks/RESULTS.md, twenty-fifth
// session). N = 8 products bound by their 2 KB A operand hold the tensor pipe ~16 cycles each;
// the delta=False build measured 5.7-6.2 % faster in the twenty-fifth session and 1.9-2.0 % in
// the thirtieth, and a precomputed table (the delta_table build, removed) did not pay for itself.
//
// Exactness: Khat (s * code) is exact in FP16. qbar is FP32, so B holds it as two FP16 parts,
// hi = fp16(qbar 2^k) and lo = fp16(qbar 2^k - hi), with 2^k chosen per (block, head) so that the
// largest |qbar| 2^k lies in [2^14, 2^15): hi + lo carries 22 bits of every component relative
// to the largest, the products are exact and the tensor core accumulates in FP32, so delta =
// (column 0 + column 1) 2^-k is an FP32-accurate dot product (its order differs from the
// reference's).
//
// The tile's positions past the segment's keys get delta = -inf: the consumers load delta as the
// initial QK^T accumulator, so those scores are -inf (masked) with no work in the softmax.
#pragma once

#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "../../ptx/ldmatrix.cuh"
#include "../../ptx/mbarrier.cuh"
#include "../../ptx/mma_sync.cuh"
#include "../../ptx/warpgroup.cuh"
#include "../../ptx/wgmma.cuh"
#include "nvfp4_key_order.cuh"
#include "nvfp4_shared_storage.cuh"

namespace flashinfer_h3 {
namespace sm90 {

// qbar of one (block, head) as the B fragments of the eight k16 steps: lane 4g + t holds, for
// g = 0 (column 0, hi) and g = 1 (column 1, lo), channels 16 kk + 2t, +1 (b0) and
// 16 kk + 8 + 2t, +1 (b1); columns 2..7 are zero.
struct QbarOperand {
  uint32_t b0[8], b1[8];
  float unscale;  // 2^-k
};

// A lane's four channels of qbar (4 lane .. 4 lane + 3) times 2^k, with k over the warp's 128
// channels putting the largest |qbar| 2^k in [2^14, 2^15) (qbar_fp16_parts splits them; 2^-k
// undoes the scale: qbar_unscale).
struct QbarLaneValues {
  float x[4];
  int k;
};

__device__ __forceinline__ QbarLaneValues qbar_lane_values(const float* __restrict__ qbar, int lane) {
  // The largest |qbar|: four channels a lane, then the warp.
  const float4 x4 = __ldg(reinterpret_cast<const float4*>(qbar) + lane);
  float amax = fmaxf(fmaxf(fabsf(x4.x), fabsf(x4.y)), fmaxf(fabsf(x4.z), fabsf(x4.w)));
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  // amax = f 2^(E - 1), f in [1, 2): k = 15 - E puts it in [2^14, 2^15). Clamped so that 2^k and
  // 2^-k are normal floats (a subnormal or zero amax gets the largest k; inf/NaN inputs stay so).
  const int biased = static_cast<int>((__float_as_uint(amax) >> 23) & 0xFF);  // E + 126
  QbarLaneValues v;
  v.k = min(max(141 - biased, -126), 126);
  const float scale = __uint_as_float(static_cast<uint32_t>(127 + v.k) << 23);
  v.x[0] = x4.x * scale;  // exact: a power of two
  v.x[1] = x4.y * scale;
  v.x[2] = x4.z * scale;
  v.x[3] = x4.w * scale;
  return v;
}

// Two scaled channels as f16x2 words: hi = fp16(x), lo = fp16(x - hi).
__device__ __forceinline__ void qbar_fp16_parts(float x0, float x1, uint32_t& hi_word, uint32_t& lo_word) {
  const __half hi0 = __float2half_rn(x0), hi1 = __float2half_rn(x1);
  const __half2 hi = __halves2half2(hi0, hi1);
  const __half2 lo = __floats2half2_rn(x0 - __half2float(hi0), x1 - __half2float(hi1));
  hi_word = *reinterpret_cast<const uint32_t*>(&hi);
  lo_word = *reinterpret_cast<const uint32_t*>(&lo);
}

__device__ __forceinline__ float qbar_unscale(int k) { return __uint_as_float(static_cast<uint32_t>(127 - k) << 23); }

// `parts` (shared memory, the delta warp's own): 2 x 64 f16x2 words, the hi then the lo parts
// of the 128 channels, the A fragments' staging area (32 shuffled floats in registers would not
// fit the producer's budget).
__device__ __forceinline__ QbarOperand load_qbar_operand(const float* __restrict__ qbar, uint32_t* parts, int lane) {
  const QbarLaneValues v = qbar_lane_values(qbar, lane);
  __syncwarp();  // the previous item's fragments were read from `parts`
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    qbar_fp16_parts(v.x[2 * pair], v.x[2 * pair + 1], parts[2 * lane + pair], parts[64 + 2 * lane + pair]);
  }
  __syncwarp();
  // Fragment (kk, h) of lane 4g + t: channels 16 kk + 8h + 2t, +1 of column g, i.e. word
  // 8 kk + 4h + t of the hi parts (g = 0) or the lo parts (g = 1); 0 for g >= 2.
  const int g = lane >> 2, t = lane & 3;
  const uint32_t* mine = parts + (g == 1 ? 64 : 0) + t;
  QbarOperand op;
  op.unscale = qbar_unscale(v.k);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    op.b0[kk] = g < 2 ? mine[8 * kk] : 0u;
    op.b1[kk] = g < 2 ? mine[8 * kk + 4] : 0u;
  }
  return op;
}

// delta[pos] of a tile: `value` where position pos holds a key of the segment (fewer than
// `valid` from the tile's first), else -inf (the mask).
__device__ __forceinline__ float masked_delta(float value, int pos, int valid) {
  return tile_key_at(pos) < valid ? value : -INFINITY;
}

// The shared-memory address of 16-byte chunk `chunk` (channels 8 chunk .. + 7) of K tile row
// `row`: two 64-channel atoms of 128-byte rows, chunk c of a row at c ^ (row % 8) (the swizzle).
__device__ __forceinline__ uint32_t k_chunk_addr(uint32_t k_base, int row, int chunk) {
  return k_base + (chunk >> 3) * kFp16AtomBytes + row * 128 + 16 * ((chunk & 7) ^ (row & 7));
}

constexpr int kDeltaMaxBlocks = (kTileKeys / 16 + kDeltaWarps - 1) / kDeltaWarps;  // m16 blocks a warp

// delta of the m16 blocks first, first + 3, ... of the K tile at `k_tile` (two 64-channel atoms
// of 128 rows x 128 bytes in the 128-byte swizzle) into delta[position]; positions whose key is
// at or past `valid` (the segment's keys left from this tile's first key) get -inf.
__device__ __forceinline__ void tile_delta(const QbarOperand& qb, const uint8_t* k_tile, float* delta, int valid,
                                           int first, int lane) {
  const uint32_t k_base = ptx::smem_addr(k_tile);
  // ldmatrix.x4 of an m16k16 A fragment: lane l gives row (l % 8) + 8 ((l / 8) % 2) of the block
  // and 16-byte chunk 2 kk + l / 16 of that row (matrices: rows 0-7 / 8-15, channels 0-7 / 8-15).
  const int row_in_block = (lane & 7) + 8 * ((lane >> 3) & 1), half = lane >> 4;
  float acc[kDeltaMaxBlocks][4];
#pragma unroll
  for (int i = 0; i < kDeltaMaxBlocks; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int chunk = 2 * kk + half;  // of the 256-byte row: atom chunk / 8, swizzled chunk % 8
#pragma unroll
    for (int i = 0; i < kDeltaMaxBlocks; ++i) {
      const int m = first + kDeltaWarps * i;
      if (m < kTileKeys / 16) {  // warp-uniform
        const int row = 16 * m + row_in_block;
        uint32_t a[4];
        ptx::ldmatrix_x4(a, k_chunk_addr(k_base, row, chunk));
        ptx::mma_m16n8k16_f16(acc[i], a, qb.b0[kk], qb.b1[kk]);
      }
    }
  }
  // Lane 4g (t = 0) holds columns 0 (hi) and 1 (lo) of rows g and g + 8.
  if ((lane & 3) == 0) {
    const int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < kDeltaMaxBlocks; ++i) {
      const int m = first + kDeltaWarps * i;
      if (m < kTileKeys / 16) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pos = 16 * m + g + 8 * r;
          delta[pos] = masked_delta((acc[i][2 * r] + acc[i][2 * r + 1]) * qb.unscale, pos, valid);
        }
      }
    }
  }
}

// ---- the delta products as wgmma (production: kDeltaOnWgmma | kDeltaWgmmaSmemA) ---------------
// The delta warpgroup: per K tile, two m64 blocks of eight k16 steps of `wgmma m64n8k16`: A = the
// block's K' rows, the tile itself through a descriptor (SS, production), or each warp's 16 rows
// by ldmatrix.x4 as in tile_delta (RS, the delta_wgmma_regs benchmark build); B = qbar's hi and
// lo parts, rows 0 and 1 of eight in shared memory (DeltaQbarRows). The same 128 x 8 x 128
// products as tile_delta's, on zeros in six of eight columns.

// Descriptor units (>> 4) of k16 step kk in K-major rows of two 64-channel atoms `atom_bytes`
// apart (128-byte swizzle): atom kk / 4, 32 bytes a step. The qbar rows: 1 KB atoms; a K tile:
// kFp16AtomBytes.
__host__ __device__ constexpr uint64_t fp16_k16_offset(int kk, int atom_bytes) {
  return static_cast<uint64_t>((kk >> 2) * atom_bytes + 32 * (kk & 3)) >> 4;
}
__host__ __device__ constexpr uint64_t qbar_k16_offset(int kk) { return fp16_k16_offset(kk, 1024); }

// Rows 2-7 of both atoms to zero (B's unused columns), once; the writes are fenced for the async
// proxy, and the first item's barrier (write_qbar_rows) orders them before any wgmma.
__device__ __forceinline__ void zero_qbar_rows(uint8_t* rows, int tid) {
  if (tid < 96) {  // 2 atoms x 6 rows x 8 chunks of 16 bytes
    const int atom = tid / 48, row = 2 + (tid % 48) / 8, chunk = tid % 8;
    *reinterpret_cast<uint4*>(rows + atom * 1024 + row * 128 + 16 * chunk) = make_uint4(0u, 0u, 0u, 0u);
    ptx::fence_proxy_async_shared();
  }
}

// The item's qbar into rows 0 (hi) and 1 (lo): the warpgroup meets first (every warp's wgmmas of
// the last item are done reading the rows; the wgmma completion orders that too, but racecheck
// cannot see it), warp 0 writes (lane l: channels 4l .. 4l + 3, in atom l / 16, 16-byte chunk
// (l % 16) / 2 of the row swizzled by the row index, half l % 2), then the warpgroup meets again,
// so no wgmma reads the rows before they are written. Every warp computes the same scale
// (qbar_lane_values), so every thread has the unscale.
__device__ __forceinline__ float write_qbar_rows(const float* __restrict__ qbar, uint8_t* rows, int warp, int lane) {
  const QbarLaneValues v = qbar_lane_values(qbar, lane);
  ptx::named_barrier_sync(kDeltaWarpgroup, kWarpgroupThreads);
  if (warp == 0) {
    uint32_t hi[2], lo[2];
    qbar_fp16_parts(v.x[0], v.x[1], hi[0], lo[0]);
    qbar_fp16_parts(v.x[2], v.x[3], hi[1], lo[1]);
    const int atom = lane >> 4, chunk = (lane & 15) >> 1;
    uint8_t* at = rows + atom * 1024 + 8 * (lane & 1);
    *reinterpret_cast<uint2*>(at + 16 * chunk) = make_uint2(hi[0], hi[1]);          // row 0: chunk ^ 0
    *reinterpret_cast<uint2*>(at + 128 + 16 * (chunk ^ 1)) = make_uint2(lo[0], lo[1]);  // row 1
    ptx::fence_proxy_async_shared();
  }
  ptx::named_barrier_sync(kDeltaWarpgroup, kWarpgroupThreads);
  return qbar_unscale(v.k);
}

// Block b's delta from its accumulator (d[2r + e]: column e, 0 hi and 1 lo, of row
// 64 b + 16 warp + lane / 4 + 8 r, held by lanes 4g).
__device__ __forceinline__ void store_block_delta(const float (&d)[4], int b, float unscale, float* delta, int valid,
                                                  int warp, int lane) {
  if ((lane & 3) == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pos = 64 * b + 16 * warp + (lane >> 2) + 8 * r;
      delta[pos] = masked_delta((d[2 * r] + d[2 * r + 1]) * unscale, pos, valid);
    }
  }
}

// delta of the K tile at `k_tile` (two 64-channel atoms of 128 rows) into delta[position],
// -inf at or past `valid`. Called by all 128 threads of the delta warpgroup; returns once its
// wgmmas completed (the tile may then be released). kSmemA: A through a descriptor of block b's
// 64 rows of the tile (SS, both blocks in one commit group); otherwise each warp's 16 rows by
// ldmatrix.x4, one block at a time (RS: one block's 32 A registers fit the warpgroup's 72).
template <bool kSmemA>
__device__ __forceinline__ void tile_delta_wgmma(uint64_t b_desc, float unscale, const uint8_t* k_tile, float* delta,
                                                 int valid, int warp, int lane) {
  if constexpr (kSmemA) {
    // The K tile is K-major in the 128-byte swizzle, as the consumers' Q' operand: block b's
    // descriptor starts 64 rows on, k16 step kk at fp16_k16_offset(kk, kFp16AtomBytes).
    const uint64_t a_desc = ptx::wgmma_desc_sw128(k_tile);
    constexpr uint64_t kBlockOffset = (64 * 128) >> 4;  // 64 rows of 128 bytes, in descriptor units
    float d[2][4] = {};
    ptx::wgmma_fence();
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        ptx::wgmma_m64n8k16_f16_ss(d[b], a_desc + b * kBlockOffset + fp16_k16_offset(kk, kFp16AtomBytes),
                                   b_desc + qbar_k16_offset(kk), kk > 0);
      }
    }
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      ptx::fence_operands(d[b]);
      store_block_delta(d[b], b, unscale, delta, valid, warp, lane);
    }
  } else {
    const uint32_t k_base = ptx::smem_addr(k_tile);
    const int row_in_block = (lane & 7) + 8 * ((lane >> 3) & 1), half = lane >> 4;
#pragma unroll 1
    for (int b = 0; b < 2; ++b) {
      const int row = 64 * b + 16 * warp + row_in_block;
      uint32_t a[8][4];
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const int chunk = 2 * kk + half;
        ptx::ldmatrix_x4(a[kk], k_chunk_addr(k_base, row, chunk));
      }
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) ptx::wgmma_m64n8k16_f16_rs(d, a[kk], b_desc + qbar_k16_offset(kk), kk > 0);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_operands(d);
      store_block_delta(d, b, unscale, delta, valid, warp, lane);
    }
  }
}

// The benchmark builds without delta products (Nvfp4Variant kComputeDelta off): the same
// positions of the tile get what a zero qbar gives, 0 inside the segment and -inf past it, so the
// consumers' scores, softmax and P are those of real attention without the delta term (an
// unwritten buffer would feed them whatever shared memory held).
__device__ __forceinline__ void tile_delta_mask(float* delta, int valid, int first, int lane) {
  for (int m = first; m < kTileKeys / 16; m += kDeltaWarps) {
    if (lane < 16) {
      const int pos = 16 * m + lane;
      delta[pos] = masked_delta(0.0f, pos, valid);
    }
  }
}

// The same for the delta warpgroup (128 threads): thread tid writes position tid.
__device__ __forceinline__ void tile_delta_mask_wg(float* delta, int valid, int tid) {
  delta[tid] = masked_delta(0.0f, tid, valid);
}

}  // namespace sm90
}  // namespace flashinfer_h3
