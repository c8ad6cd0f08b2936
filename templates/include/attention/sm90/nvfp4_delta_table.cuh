// The delta table of the NVFP4 Hopper kernel's delta_table build: delta_j = qbar_b . Khat_j (SPEC
// 3.4) for every (query block b, key position j) pair of each segment, computed once per call by
// a kernel of its own after the pre-pass; the attention kernel's TMA thread then copies each
// tile's 128 values with the K tile (ptx::bulk_load), so no warpgroup of the attention kernel
// computes them.
//
// Why it was tried: inside the attention kernel the delta of a K tile is recomputed for every
// query block that reads the tile, as wgmma m64n8k16 whose 2 KB A operand (the K rows) holds the
// tensor pipe ~16 cycles an instruction for 2 useful columns of 8 (nvfp4_delta.cuh); the
// delta=False build had measured that at 4-6 % of the kernel. Here the same products are a GEMM
// with the K tile as A and the qbar parts of four blocks as the eight B columns (every column
// used), and the table costs one write of 4 bytes a (block, position) pair: 128 n_s^2 floats a
// segment and head (6.2 GiB at 61,440 tokens x 56 heads).
//
// Measured on an H100 (benchmarks/RESULTS.md, thirtieth session; bench_delta_table.py), not
// kept: the attention kernel on the table -1.5 to -2.3 % at h3-mix and -0.6 to +0.3 % at h3-10s
// against production (delta=False, no products at all: -2.0 and -1.9 %), the table kernels 2.2
// and 5.7 ms: whole calls 1.7-1.9 % slower, for 2-6 GiB more memory. Outputs bit for bit
// production's.
//
// Table layout (flashinfer_h3 delta_table_offsets): per head, the blocks of every segment in the
// canonical block order, each a row of its segment's n_s * 128 positions (n_s = the segment's
// 128-key tiles = its query blocks; positions in the window key order of the K' rows). Block b of
// segment s starts at delta_start[s] + (b - qblock_start[s]) * n_s * 128, head h at
// h * delta_start[S]; delta_start[s] = 128 * sum over s' < s of n_s'^2. Positions past the
// segment's keys hold -inf (the mask), as the delta warpgroup writes them.
//
// Exactness: the same products and order as the delta warpgroup's (nvfp4_delta.cuh): qbar of a
// block times 2^k (its largest |qbar| into [2^14, 2^15)) as FP16 hi and lo parts, the eight k16
// steps accumulated in FP32 from zero in order, delta = (hi column + lo column) * 2^-k. Its
// values are those of the mma.sync form (tile_delta), which the attention kernel's builds match
// bit for bit.
#pragma once

#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "../../ptx/mma_sync.cuh"
#include "nvfp4_delta.cuh"
#include "nvfp4_key_order.cuh"
#include "shared_storage.cuh"  // kHeadDim, kTileKeys

namespace flashinfer_h3 {
namespace sm90 {

constexpr int kDeltaTableWarps = 4;  // a CTA: 4 warps, 32 positions (two m16 blocks) each
constexpr int kDeltaTableThreads = 32 * kDeltaTableWarps;
constexpr uint32_t kDeltaRowBytes = kTileKeys * sizeof(float);  // one tile's delta row
static_assert(kDeltaTableWarps * 32 == kTileKeys, "the CTA's warps cover the tile's positions");

// Each (block, head)'s B fragments, prepared once by nvfp4_qbar_parts_kernel as 132 words: [0, 64) the hi parts and [64, 128) the lo parts, lane
// quarter t's 16 words (b0, b1 of k16 steps 0..7 in turn) at 16 t; word 128 its 2^-k.
constexpr int kQbarPartsWords = 132;

// The attention kernel's view of the table (its kDeltaTable builds; a kernel parameter of its own,
// after Nvfp4Params, so that production's parameters keep their offsets): the table, its
// segments' offsets and a head's floats (delta_start[S]).
struct DeltaTableRef {
  const float* table;
  const int64_t* start;
  int64_t head_floats;
};

struct DeltaTableParams {
  const __half* k_f16;          // [H, V, 128]: K' rows in the window key order (the pre-pass's)
  const float* qbar;            // [q_blocks_cap, H, 128], canonical block order
  uint32_t* parts;              // [the plan's blocks, H, kQbarPartsWords]: nvfp4_qbar_parts_kernel's
  float* table;                 // [H, delta_start[S]]
  const int32_t* seg_bounds;    // [S + 1]
  const int32_t* vkey_start;    // [S + 1]
  const int32_t* qblock_start;  // [S + 1]
  const int64_t* delta_start;   // [S + 1]
  int segments;
  int heads;
  int64_t vkeys_cap;  // V: k_f16's rows a head
};

// The segment whose canonical blocks (= tiles) contain `b`: the last s with qblock_start[s] <= b
// (a binary search; empty segments own no block and are skipped by the <=).
__device__ __forceinline__ int segment_of_block(const int32_t* qblock_start, int segments, int b) {
  int lo = 0, hi = segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(qblock_start + mid) <= b) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The B fragments of four blocks (one group; the eight columns) for lane (g, t): column g is block
// base + g / 2, its hi (even g) or lo part (odd g), from nvfp4_qbar_parts_kernel's words (zero past
// the segment's blocks); and the 2^-k of block base + t, the block whose deltas this lane stores.
struct GroupOperand {
  uint32_t b0[8], b1[8];
  float unscale;
};

__device__ __forceinline__ GroupOperand load_group(const DeltaTableParams& p, int block0, int blocks, int head,
                                                   int base, int g, int t) {
  GroupOperand op;
  const int col_block = base + (g >> 1);
  if (col_block < blocks) {
    const uint4* src = reinterpret_cast<const uint4*>(
        p.parts + (static_cast<int64_t>(block0 + col_block) * p.heads + head) * kQbarPartsWords + 64 * (g & 1) + 16 * t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint4 w = __ldg(src + j);
      op.b0[2 * j] = w.x;
      op.b1[2 * j] = w.y;
      op.b0[2 * j + 1] = w.z;
      op.b1[2 * j + 1] = w.w;
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) op.b0[kk] = op.b1[kk] = 0u;
  }
  op.unscale = base + t < blocks ? __uint_as_float(__ldg(p.parts + (static_cast<int64_t>(block0 + base + t) * p.heads +
                                                                    head) * kQbarPartsWords + 128))
                                 : 1.0f;
  return op;
}

// One K tile (canonical tile index blockIdx.x) of one head (blockIdx.y) against every query block
// of its segment, four blocks (a group) at a time. Warp w: positions 32w .. 32w + 31 of the tile,
// m16 blocks 2w and 2w + 1, whose A fragments (8 k16 steps) it loads once; lane 4g + t stores the
// deltas of block t of the group (accumulator columns 2t, 2t + 1) at positions g and g + 8 of its
// m16 blocks. The warp runs two groups at once (four accumulation chains; each chain's eight k16
// steps stay in order, so the values are the delta warpgroup's) and loads the next two groups'
// operands before their products (the loads' L2 latency hidden behind them).
// (Templates, so that only the modules that launch them compile them.)
template <bool kUnused = true>
__global__ void __launch_bounds__(kDeltaTableThreads) nvfp4_delta_table_kernel(const DeltaTableParams p) {
  const int tile = blockIdx.x, head = blockIdx.y;
  if (tile >= __ldg(p.qblock_start + p.segments)) return;  // the grid covers qbar's capacity
  const int seg = segment_of_block(p.qblock_start, p.segments, tile);
  const int block0 = __ldg(p.qblock_start + seg), blocks = __ldg(p.qblock_start + seg + 1) - block0;
  const int t_local = tile - block0;
  const int valid = __ldg(p.seg_bounds + seg + 1) - __ldg(p.seg_bounds + seg) - kTileKeys * t_local;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;

  // A fragments (row.col m16k16, PTX ISA 9.7.14.5.8): a0 row g, channels 2t, 2t + 1 of the step;
  // a1 row g + 8; a2, a3 the same rows, channels + 8. Rows past k_f16's end (a segment's last
  // tile of the last head) read as zero; rows past the segment's keys are masked whatever they hold.
  const int64_t pos0 = __ldg(p.vkey_start + seg) + static_cast<int64_t>(kTileKeys) * t_local + 32 * warp;
  const __half* rows = p.k_f16 + (static_cast<int64_t>(head) * p.vkeys_cap + pos0) * kHeadDim;
  uint32_t a[2][8][4];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = 16 * m + g + 8 * (j & 1), ch = 16 * kk + 2 * t + 8 * (j >> 1);
        a[m][kk][j] = pos0 + row < p.vkeys_cap
                          ? __ldg(reinterpret_cast<const uint32_t*>(rows + row * kHeadDim + ch))
                          : 0u;
      }
    }
  }

  const int64_t row_len = static_cast<int64_t>(blocks) * kTileKeys;
  float* table = p.table + static_cast<int64_t>(head) * __ldg(p.delta_start + p.segments) +
                 __ldg(p.delta_start + seg) + static_cast<int64_t>(kTileKeys) * t_local + 32 * warp;
  GroupOperand next[2] = {load_group(p, block0, blocks, head, 0, g, t), load_group(p, block0, blocks, head, 4, g, t)};
  for (int base = 0; base < blocks; base += 8) {
    const GroupOperand cur[2] = {next[0], next[1]};
    if (base + 8 < blocks) {
      next[0] = load_group(p, block0, blocks, head, base + 8, g, t);
      next[1] = load_group(p, block0, blocks, head, base + 12, g, t);
    }
    float acc[2][2][4] = {};  // [group][m16 block]
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
#pragma unroll
        for (int m = 0; m < 2; ++m) ptx::mma_m16n8k16_f16(acc[q][m], a[m][kk], cur[q].b0[kk], cur[q].b1[kk]);
      }
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int block = base + 4 * q + t;
      if (block < blocks) {
        float* out = table + block * row_len;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int pos = 16 * m + g + 8 * r;
            out[pos] = masked_delta((acc[q][m][2 * r] + acc[q][m][2 * r + 1]) * cur[q].unscale, 32 * warp + pos, valid);
          }
        }
      }
    }
  }
}

// The B fragments of every (block, head) for the table kernel: one warp a pair, lane l
// with channels 4l .. 4l + 3 (qbar_lane_values: the same 2^k as the delta warpgroup's), each
// channel pair's hi and lo word written where its lane quarter t and k16 step read it.
template <bool kUnused = true>
__global__ void __launch_bounds__(kDeltaTableThreads) nvfp4_qbar_parts_kernel(const float* __restrict__ qbar,
                                                                              uint32_t* __restrict__ parts,
                                                                              int64_t pairs) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * kDeltaTableWarps + threadIdx.x / 32;
  if (pair >= pairs) return;  // warp-uniform
  const int lane = threadIdx.x % 32;
  const QbarLaneValues v = qbar_lane_values(qbar + pair * kHeadDim, lane);
  uint32_t* out = parts + pair * kQbarPartsWords;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int c = 4 * lane + 2 * q;  // channels c, c + 1 = 16 kk + 8 hh + 2 t
    const int kk = c >> 4, hh = (c >> 3) & 1, t = (c >> 1) & 3;
    uint32_t hi, lo;
    qbar_fp16_parts(v.x[2 * q], v.x[2 * q + 1], hi, lo);
    out[16 * t + 2 * kk + hh] = hi;
    out[64 + 16 * t + 2 * kk + hh] = lo;
  }
  if (lane == 0) out[128] = __float_as_uint(qbar_unscale(v.k));
}

}  // namespace sm90
}  // namespace flashinfer_h3
