// The quantization pre-pass of both recipes (SPEC 3 steps 1-3, SPEC 4 step 1): segment means of
// k, 128-row block means of q, smoothing, and the NVFP4 / FP8 codes and scales of Q, K and V,
// written into the workspace regions of flashinfer_h3/layout.py.
//
// Three launches per call, all on the caller's stream:
//
//   1. block_stats_kernel     grid NQB x H   per (128-row block, head): the block's column sums of
//                                            k (and, for FP8, the column amax of v) -> scratch
//   2. segment_reduce_kernel  grid S x H     per (segment, head): kbar = sum / L (FP64 sum of the
//                                            block sums, fixed order), FP8 V scales amax / 448
//   3. quantize_kernel        persistent     per (128-row block, head, tensor) item: one 128 x 128
//                                            tile of q, k or v -> codes and scales (qbar for
//                                            NVFP4 Q); the next tile is copied in meanwhile
//
// A 61k-token segment is thus never summed by one CTA: launch 1 is fully parallel and launch 2
// adds at most a few hundred FP32 partials per thread. Every sum has a fixed order (no atomics),
// so the means are deterministic for a given shape.
//
// Scratch without extra regions. Launch 1's partials live in bytes that launch 3 overwrites
// completely, so no workspace region is added and the binding keeps the design.md signatures:
//   NVFP4: the k column sums of canonical block cb go to qbar[cb, h, :] (the Q tiles of launch 3
//          then write the real q means there; NQB <= q_blocks_cap rows).
//   FP8:   (k column sum, v column amax) of block cb, channel c go to the 8 bytes at
//          v_codes[h, c, 8 cb : 8 cb + 8] (FP32 pair). These lie in the used columns
//          [0, vkey_start[S]) since vkey_start[S] >= 64 * NQB, and launch 3's V tiles write
//          every one of those columns.
// Nothing outside the layout's used bytes is ever written: rows of qbar past NQB, V columns past
// vkey_start[S] and the gaps between regions stay as they were.
//
// Workspace layout written (see layout.py for shapes; T tokens, H heads, c channel):
//   NVFP4  q_codes/k_codes [H, T, 64]   row (h, t): 64 bytes, channel 2i in the low nibble of byte i
//          q_scales/k_scales [H, T, 8]   UE4M3 of channels 16j..16j+15
//          v_codes [H, 128, nvk/2]       row (h, c), column = padded key: keys of segment s at
//                                        vkey_start[s] + (j - a_s), 16-key groups from the segment
//                                        start; columns to the segment's next multiple of 64 get 0
//          v_scales [H, 128, nvk/16]     UE4M3 of padded keys 16t..16t+15 of that row
//          kbar [S, H, 128], qbar [cap, H, 128] in canonical block order (FP32)
//   FP8    q_codes/k_codes [H, T, 128] E4M3; q_scales [H, T] and k_scales [H, cap] FP32
//          v_codes [H, 128, nvk] E4M3, v_scales [S, H, 128] FP32, kbar as above
// Every store of a tile is coalesced for the attention kernels' row-major reads: a Q/K row is
// 64 (128) contiguous bytes, consecutive rows adjacent; a V row chunk is 32 (64) bytes per
// thread, whole 32-byte sectors.
//
// Numerics: the element path uses formats.cuh only (nvfp4_scale_from_amax, nvfp4_scaled,
// e2m1x8_from_float, cvt_e4m3x2_rn_satfinite); the smoothing is __fsub_rn, FP8 uses __fdiv_rn,
// __frcp_rn and __fmul_rn. Never compile with --use_fast_math.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "common.cuh"
#include "formats.cuh"

namespace flashinfer_h3 {
namespace quantize {

enum class Op { kNvfp4, kFp8 };

constexpr int kHeadDim = 128;
constexpr int kBlockRows = 128;       // rows per Q block == keys per FP8 K-scale block (layout.Q_BLOCK)
constexpr int kGroup = 16;            // NVFP4 group (layout.GROUP)
constexpr int kVKeyPad = 64;          // padded V columns per segment come in these (layout.V_KEY_PAD)
constexpr int kThreads = 256;         // every tile kernel
constexpr int kChanGroups = kHeadDim / kGroup;          // 8 groups of 16 channels per row
constexpr int kRowSlices = kThreads / kChanGroups;      // 32 row slices of a row tile
constexpr int kRowsPerThread = kBlockRows / kRowSlices; // 4 rows per thread
constexpr int kReduceMaxSlices = 8;                     // launch 2: at most 8 x 128 threads
constexpr int kTileBytes = kBlockRows * kHeadDim * 2;   // one bf16 tile in shared memory (32 KB)
constexpr float kFp8Max = kE4M3Max;
// Launch 3 CTAs resident per SM: shared memory (65 KB each) allows 3 on H100/H200; the bound
// keeps registers from being the tighter limit (<= 85 a thread).
constexpr int kQuantizeMinBlocks = 3;

static_assert(kThreads % kChanGroups == 0 && kBlockRows % kRowSlices == 0, "row tile split");
static_assert(kThreads == 2 * kHeadDim, "V tiles: one thread per (channel, half of the keys)");
static_assert(kBlockRows == 2 * kVKeyPad, "a block covers one or two 64-key V chunks");
static_assert(kRowSlices == 32, "the slice reductions below are a 5-level tree");

// ---------------------------------------------------------------------------------------------
// Arguments (plain pointers; the binding checks shapes, dtypes and devices)
// ---------------------------------------------------------------------------------------------

struct Tables {
  const int* seg_bounds;    // [S + 1]
  const int* vkey_start;    // [S + 1]
  const int* qblock_start;  // [S + 1]
  const int* qblocks;       // [NQB, 4] (segment, row_begin, row_end, canonical), schedule order
  int segments;
  int num_qblocks;
};

struct Inputs {
  const uint16_t* q;  // bf16 bits, [T, H, 128]
  const uint16_t* k;
  const uint16_t* v;
  int64_t tokens;
  int heads;
};

template <Op op>
struct Outputs;

template <>
struct Outputs<Op::kNvfp4> {
  float* kbar;        // [S, H, 128]
  float* qbar;        // [cap, H, 128]; launch 1 parks the k block sums here
  uint8_t* q_codes;   // [H, T, 64]
  uint8_t* q_scales;  // [H, T, 8]
  uint8_t* k_codes;
  uint8_t* k_scales;
  uint8_t* v_codes;   // [H, 128, v_code_row]
  uint8_t* v_scales;  // [H, 128, v_code_row / 8]
  int64_t v_code_row; // bytes per v_codes row (nvk / 2)
};

template <>
struct Outputs<Op::kFp8> {
  float* kbar;        // [S, H, 128]
  uint8_t* q_codes;   // [H, T, 128]
  float* q_scales;    // [H, T]
  uint8_t* k_codes;   // [H, T, 128]
  float* k_scales;    // [H, k_scale_row]
  uint8_t* v_codes;   // [H, 128, v_code_row]; launch 1 parks (k sum, v amax) pairs here
  float* v_scales;    // [S, H, 128]
  int64_t v_code_row; // bytes per v_codes row (nvk)
  int64_t k_scale_row;
};

// ---------------------------------------------------------------------------------------------
// Small device helpers
// ---------------------------------------------------------------------------------------------

struct QBlock {
  int segment, row_begin, row_end, canonical;
};

// Four scalar loads: the tables are views into one int32 buffer (plan.py), so a row is only
// 4-byte aligned.
__device__ __forceinline__ QBlock load_qblock(const int* qblocks, int i) {
  const int* b = qblocks + 4 * static_cast<int64_t>(i);
  return {b[0], b[1], b[2], b[3]};
}

// bf16 -> f32 is exact: the bf16 bits are the upper half of the f32.
__device__ __forceinline__ float bf16_lo(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

__device__ __forceinline__ void unpack_bf16x16(const uint4 (&raw)[2], float (&x)[16]) {
  const uint32_t w[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w, raw[1].x, raw[1].y, raw[1].z, raw[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[2 * i] = bf16_lo(w[i]);
    x[2 * i + 1] = bf16_hi(w[i]);
  }
}

// Read-only, read-once input: the non-coherent path keeps it out of L1.
__device__ __forceinline__ uint4 load_input16(const uint16_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// A thread's share of a 128-row x 128-channel bf16 tile: channel group j = tid % 8 (16 channels,
// 32 bytes), rows rs + 32 i for rs = tid / 8. A warp reads 4 whole 256-byte rows per load step.
struct RowTile {
  uint4 raw[kRowsPerThread][2];
  int j, rs;

  __device__ __forceinline__ int row(int i) const { return rs + kRowSlices * i; }

  // Rows >= n are not loaded (their registers are zeroed so no garbage is ever used).
  __device__ __forceinline__ void load(const uint16_t* base, int64_t row_begin, int n, int heads, int h) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (row(i) < n) {
        const uint16_t* p = base + ((row_begin + row(i)) * heads + h) * kHeadDim + j * kGroup;
        raw[i][0] = load_input16(p);
        raw[i][1] = load_input16(p + 8);
      } else {
        raw[i][0] = raw[i][1] = make_uint4(0, 0, 0, 0);
      }
    }
  }
};

__device__ __forceinline__ RowTile make_row_tile() {
  RowTile t;
  t.j = threadIdx.x % kChanGroups;
  t.rs = threadIdx.x / kChanGroups;
  return t;
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Combines the per-thread channel partials of a RowTile over its 32 row slices. Every thread
// passes part[16] (its channels j*16..j*16+15); afterwards thread c < 128 returns channel c's
// total, combined by a fixed 5-level tree (deterministic; for sums its error is about 5 roundings
// instead of 31). `red` is 32 x 128 floats of shared memory; the call ends with a barrier so the
// caller may reuse it.
template <class Combine>
__device__ __forceinline__ float combine_row_slices(const float (&part)[kGroup], float* red, Combine op) {
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
  float4* dst = reinterpret_cast<float4*>(red + rs * kHeadDim + j * kGroup);
#pragma unroll
  for (int e = 0; e < kGroup / 4; ++e)
    dst[e] = make_float4(part[4 * e], part[4 * e + 1], part[4 * e + 2], part[4 * e + 3]);
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x < kHeadDim) {
    float v[kRowSlices];
#pragma unroll
    for (int s = 0; s < kRowSlices; ++s) v[s] = red[s * kHeadDim + threadIdx.x];
    // One loop per level: a loop over the levels is not unrolled by nvcc and v[] then goes to
    // local memory.
#pragma unroll
    for (int s = 0; s < 16; ++s) v[s] = op(v[s], v[s + 16]);
#pragma unroll
    for (int s = 0; s < 8; ++s) v[s] = op(v[s], v[s + 8]);
#pragma unroll
    for (int s = 0; s < 4; ++s) v[s] = op(v[s], v[s + 4]);
    v[0] = op(v[0], v[2]);
    v[1] = op(v[1], v[3]);
    v[0] = op(v[0], v[1]);
    total = v[0];
  }
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------------------------
// Group quantizers (formats.cuh does the rounding)
// ---------------------------------------------------------------------------------------------

struct Nvfp4Group {
  uint2 codes;    // 16 E2M1 codes, element 0 in bits [3:0] of .x
  uint32_t scale; // UE4M3 byte
};

// SPEC 3 "quantize a group": s = rn_e4m3(amax / 6); s == 0 -> all codes 0; else rn_e2m1(x * 1/s).
__device__ __forceinline__ Nvfp4Group nvfp4_quantize_group(const float (&x)[kGroup]) {
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < kGroup; ++e) amax = fmaxf(amax, fabsf(x[e]));
  const Nvfp4Scale s = nvfp4_scale_from_amax(amax);
  float lo[8], hi[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    lo[e] = nvfp4_scaled(x[e], s);
    hi[e] = nvfp4_scaled(x[8 + e], s);
  }
  return {make_uint2(e2m1x8_from_float(lo), e2m1x8_from_float(hi)), s.code};
}

// SPEC 4: codes rn_e4m3(x * (1/s)), all 0 when s == 0 (then 1/s would be inf and 0*inf NaN).
// Four elements -> one little-endian word, element 0 in the low byte.
__device__ __forceinline__ uint32_t fp8_codes4(float x0, float x1, float x2, float x3, float s, float r) {
  if (s == 0.0f) return 0u;
  const uint32_t lo = cvt_e4m3x2_rn_satfinite(__fmul_rn(x0, r), __fmul_rn(x1, r));
  const uint32_t hi = cvt_e4m3x2_rn_satfinite(__fmul_rn(x2, r), __fmul_rn(x3, r));
  return lo | hi << 16;
}

__device__ __forceinline__ uint4 fp8_codes16(const float (&x)[kGroup], float s) {
  const float r = s == 0.0f ? 0.0f : __frcp_rn(s);
  return make_uint4(fp8_codes4(x[0], x[1], x[2], x[3], s, r), fp8_codes4(x[4], x[5], x[6], x[7], s, r),
                    fp8_codes4(x[8], x[9], x[10], x[11], s, r),
                    fp8_codes4(x[12], x[13], x[14], x[15], s, r));
}

// ---------------------------------------------------------------------------------------------
// Where launch 1 parks its per-block partials (see the file comment)
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float* nvfp4_k_sum_slot(const Outputs<Op::kNvfp4>& o, int cb, int heads, int h,
                                                   int c) {
  return o.qbar + (static_cast<int64_t>(cb) * heads + h) * kHeadDim + c;
}

__device__ __forceinline__ float2* fp8_stats_slot(const Outputs<Op::kFp8>& o, int cb, int h, int c) {
  return reinterpret_cast<float2*>(o.v_codes + (static_cast<int64_t>(h) * kHeadDim + c) * o.v_code_row +
                                   static_cast<int64_t>(cb) * sizeof(float2));
}

// ---------------------------------------------------------------------------------------------
// Launch 1: per-(block, head) column sums of k (FP8: also the column amax of v)
// ---------------------------------------------------------------------------------------------

template <Op op>
__global__ void __launch_bounds__(kThreads) block_stats_kernel(Inputs in, Tables tb, Outputs<op> out) {
  __shared__ alignas(16) float red[kRowSlices * kHeadDim];
  const int h = static_cast<int>(blockIdx.x % in.heads);
  const QBlock blk = load_qblock(tb.qblocks, static_cast<int>(blockIdx.x / in.heads));
  const int n = blk.row_end - blk.row_begin;

  RowTile kt = make_row_tile();
  kt.load(in.k, blk.row_begin, n, in.heads, h);
  RowTile vt = make_row_tile();
  if constexpr (op == Op::kFp8) vt.load(in.v, blk.row_begin, n, in.heads, h);

  // Rows past n hold zeros, which add nothing (and cannot raise an amax of |v|).
  float part[kGroup];
#pragma unroll
  for (int e = 0; e < kGroup; ++e) part[e] = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    float x[kGroup];
    unpack_bf16x16(kt.raw[i], x);
#pragma unroll
    for (int e = 0; e < kGroup; ++e) part[e] = __fadd_rn(part[e], x[e]);
  }
  const float ksum = combine_row_slices(part, red, SumOp{});

  if constexpr (op == Op::kNvfp4) {
    if (threadIdx.x < kHeadDim) *nvfp4_k_sum_slot(out, blk.canonical, in.heads, h, threadIdx.x) = ksum;
  } else {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) part[e] = 0.0f;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      float x[kGroup];
      unpack_bf16x16(vt.raw[i], x);
#pragma unroll
      for (int e = 0; e < kGroup; ++e) part[e] = fmaxf(part[e], fabsf(x[e]));
    }
    const float vmax = combine_row_slices(part, red, MaxOp{});
    if (threadIdx.x < kHeadDim) *fp8_stats_slot(out, blk.canonical, h, threadIdx.x) = make_float2(ksum, vmax);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch 2: per-(segment, head) kbar (and FP8 V scales); blockDim = 128 * slices
// ---------------------------------------------------------------------------------------------

template <Op op>
__global__ void __launch_bounds__(kHeadDim * kReduceMaxSlices) segment_reduce_kernel(Inputs in, Tables tb,
                                                                                      Outputs<op> out) {
  __shared__ double sums[kReduceMaxSlices][kHeadDim];
  __shared__ float maxes[kReduceMaxSlices][kHeadDim];
  const int h = static_cast<int>(blockIdx.x % in.heads);
  const int s = static_cast<int>(blockIdx.x / in.heads);
  const int c = threadIdx.x % kHeadDim, slice = threadIdx.x / kHeadDim;
  const int slices = blockDim.x / kHeadDim;
  const int b0 = tb.qblock_start[s], b1 = tb.qblock_start[s + 1];

  // The FP32 block sums are added in FP64 (exact unless they span > 29 binades), block order
  // fixed by the slice split. Each slice takes a contiguous run of blocks, so the FP8 pairs
  // (8 bytes at a 8-byte step along one V row) are read a whole 32-byte sector at a time.
  const int chunk = ceil_div(b1 - b0, slices);
  const int begin = b0 + slice * chunk, end = min(b1, begin + chunk);
  double sum = 0.0;
  float vmax = 0.0f;
#pragma unroll 4
  for (int cb = begin; cb < end; ++cb) {
    if constexpr (op == Op::kNvfp4) {
      sum += static_cast<double>(*nvfp4_k_sum_slot(out, cb, in.heads, h, c));
    } else {
      const float2 p = *fp8_stats_slot(out, cb, h, c);
      sum += static_cast<double>(p.x);
      vmax = fmaxf(vmax, p.y);
    }
  }
  sums[slice][c] = sum;
  maxes[slice][c] = vmax;
  __syncthreads();
  if (slice != 0) return;
  for (int p = 1; p < slices; ++p) {
    sum += sums[p][c];
    vmax = fmaxf(vmax, maxes[p][c]);
  }
  const int length = tb.seg_bounds[s + 1] - tb.seg_bounds[s];
  const int64_t at = (static_cast<int64_t>(s) * in.heads + h) * kHeadDim + c;
  out.kbar[at] = length > 0 ? static_cast<float>(sum / static_cast<double>(length)) : 0.0f;
  if constexpr (op == Op::kFp8) out.v_scales[at] = __fdiv_rn(vmax, kFp8Max);
}

// ---------------------------------------------------------------------------------------------
// Launch 3: 128 x 128 tiles of q, k and v, staged through shared memory
// ---------------------------------------------------------------------------------------------

// Launch 3 is persistent and double-buffered: each CTA walks the (tensor, block, head) tiles
// with a stride of gridDim.x and copies tile i+1 into shared memory (cp.async) while it
// quantizes tile i, so every resident CTA always has 32 KB of loads in flight. (A CTA per tile
// that loads, waits, then computes left the memory system idle during its compute phase: 3.0
// of 4.3 TB/s for FP8 on an H200.)
//
// Shared memory: two bf16 tiles ([row][channel], 256 bytes a row) and two rows of per-channel
// statistics (the column-sum halves; the mean being subtracted). 65 KB: 3 CTAs an SM on
// H100/H200, 1 on SM120 (99 KB a CTA at most).
constexpr int kTileWords = kTileBytes / 16;  // uint4 per tile
struct PipeSmem {
  uint4 tile[2][kTileWords];
  float stat[2][kHeadDim];
};
constexpr size_t kPipeSmemBytes = sizeof(PipeSmem);
static_assert(kPipeSmemBytes <= 99 * 1024, "must fit one CTA on SM120 (99 KB a CTA)");

// What the tile functions work on: the tile of the current pipeline stage and the statistics.
struct TileSmem {
  uint4* tile;
  float (*stat)[kHeadDim];
};

// PTX ISA 9.0 §9.7.9.25.3 (non-bulk cp.async): copy 16 bytes global -> shared through L2 only
// (.cg); the cp-size - src-size trailing bytes are zero-filled, so src_bytes = 0 writes 16 zero
// bytes. Completion is tracked per thread by commit/wait groups below.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, uint32_t src_bytes) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}

// cp.async.commit_group: closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// cp.async.wait_group N: waits until at most N of this thread's committed groups are pending.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Issues the copies of rows [0, n) of a tile and the zero fill of rows [n, round_up(n, 64)):
// the padded keys of a V chunk quantize as +0, and column loops may run to a multiple of 64
// rows. Rows past that are left as they are and never read. Thread t copies 16-byte chunk
// t % 16 of rows t / 16 + 16 i: a warp covers two whole 256-byte rows per step.
__device__ __forceinline__ void issue_tile_load(const uint16_t* base, int64_t row_begin, int n, int heads, int h,
                                                uint4* tile) {
  constexpr int kChunksPerRow = kHeadDim * 2 / 16;  // 16 uint4 per row
  constexpr int kRowsPerStep = kThreads / kChunksPerRow;
  constexpr int kSteps = kBlockRows / kRowsPerStep;
  const int chunk = threadIdx.x % kChunksPerRow;
  const int padded = round_up(n, kVKeyPad);
  // The zero fill reads nothing, but its source operand still names a row of this tile.
  const uint16_t* row0 = base + (row_begin * heads + h) * kHeadDim + chunk * 8;
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int r = threadIdx.x / kChunksPerRow + kRowsPerStep * i;
    if (r < padded) {
      const bool real = r < n;
      cp_async_16(tile + r * kChunksPerRow + chunk, real ? row0 + static_cast<int64_t>(r) * heads * kHeadDim : row0,
                  real ? 16u : 0u);
    }
  }
}

// Channels 16 j .. 16 j + 15 of row r.
__device__ __forceinline__ void tile_row16(const uint4* tile, int r, int j, float (&x)[kGroup]) {
  const uint4 raw[2] = {tile[r * (kHeadDim / 8) + 2 * j], tile[r * (kHeadDim / 8) + 2 * j + 1]};
  unpack_bf16x16(raw, x);
}

// Keys key0 .. key0 + 15 of channel c (a warp reads 64 contiguous bytes: no bank conflict).
__device__ __forceinline__ void tile_column16(const uint4* tile, int key0, int c, float (&x)[kGroup]) {
  const uint16_t* t = reinterpret_cast<const uint16_t*>(tile);
#pragma unroll
  for (int e = 0; e < kGroup; ++e) x[e] = __uint_as_float(static_cast<uint32_t>(t[(key0 + e) * kHeadDim + c]) << 16);
}

// Column sums of the tile's rows [0, n) (FP32, fixed order): thread (c, half) adds rows
// half*64 .. half*64+63 into 8 interleaved accumulators (the zero rows past n add nothing), a
// 3-level tree joins them, then half 0 + half 1. About 10 roundings deep, not 127. Thread c < 128
// returns channel c's sum. Uses sm.stat[0]; ends with a barrier.
__device__ __forceinline__ float tile_column_sum(const TileSmem& sm, int n) {
  const int c = threadIdx.x % kHeadDim, half = threadIdx.x / kHeadDim;
  const uint16_t* t = reinterpret_cast<const uint16_t*>(sm.tile);
  const int r0 = half * kVKeyPad, r1 = min(round_up(n, kVKeyPad), r0 + kVKeyPad);
  float acc[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
  for (int r = r0; r < r1; r += 8) {
#pragma unroll
    for (int u = 0; u < 8; ++u)
      acc[u] = __fadd_rn(acc[u], __uint_as_float(static_cast<uint32_t>(t[(r + u) * kHeadDim + c]) << 16));
  }
#pragma unroll
  for (int u = 0; u < 4; ++u) acc[u] = __fadd_rn(acc[u], acc[u + 4]);
  acc[0] = __fadd_rn(acc[0], acc[2]);
  acc[1] = __fadd_rn(acc[1], acc[3]);
  const float mine = __fadd_rn(acc[0], acc[1]);
  if (half == 1) sm.stat[0][c] = mine;
  __syncthreads();
  return half == 0 ? __fadd_rn(mine, sm.stat[0][c]) : 0.0f;
}

__device__ __forceinline__ void load_mean16(const float* mean, int j, float (&m)[kGroup]) {
#pragma unroll
  for (int e = 0; e < kGroup; e += 4) {
    const float4 v = *reinterpret_cast<const float4*>(mean + j * kGroup + e);
    m[e] = v.x, m[e + 1] = v.y, m[e + 2] = v.z, m[e + 3] = v.w;
  }
}

// NVFP4 Q or K tile: Q' = q - qbar (this block's mean, computed here) or K' = k - kbar, then
// 16-channel groups. Thread (row slice rs, group j) owns rows rs + 32 i; a warp stores 4 whole
// 64-byte code rows (256 contiguous bytes) and 32 contiguous scale bytes.
__device__ __forceinline__ void nvfp4_qk_tile(const TileSmem& sm, const Outputs<Op::kNvfp4>& out, const QBlock& blk,
                                              int n, int h, int heads, int64_t tokens, bool is_q) {
  float* mean = sm.stat[1];
  if (is_q) {
    const float total = tile_column_sum(sm, n);
    if (threadIdx.x < kHeadDim) {
      const float qbar = __fdiv_rn(total, static_cast<float>(n));
      mean[threadIdx.x] = qbar;
      out.qbar[(static_cast<int64_t>(blk.canonical) * heads + h) * kHeadDim + threadIdx.x] = qbar;
    }
  } else if (threadIdx.x < kHeadDim) {
    mean[threadIdx.x] = out.kbar[(static_cast<int64_t>(blk.segment) * heads + h) * kHeadDim + threadIdx.x];
  }
  __syncthreads();
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
  float m[kGroup];
  load_mean16(mean, j, m);
  uint8_t* codes = is_q ? out.q_codes : out.k_codes;
  uint8_t* scales = is_q ? out.q_scales : out.k_scales;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = rs + kRowSlices * i;
    if (r >= n) break;
    float x[kGroup];
    tile_row16(sm.tile, r, j, x);
#pragma unroll
    for (int e = 0; e < kGroup; ++e) x[e] = __fsub_rn(x[e], m[e]);
    const Nvfp4Group g = nvfp4_quantize_group(x);
    const int64_t row = static_cast<int64_t>(h) * tokens + blk.row_begin + r;
    *reinterpret_cast<uint2*>(codes + row * (kHeadDim / 2) + j * (kGroup / 2)) = g.codes;
    scales[row * kChanGroups + j] = static_cast<uint8_t>(g.scale);
  }
}

// FP8 Q tile (per-token scale, no smoothing) or K tile (K' = k - kbar, one scale for the block).
// The 8 lanes sharing a row are consecutive lanes, so xor-shuffles 1, 2, 4 reduce a row.
__device__ __forceinline__ void fp8_qk_tile(const TileSmem& sm, const Outputs<Op::kFp8>& out, const QBlock& blk, int n,
                                            int h, int heads, int64_t tokens, bool is_q) {
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
  float m[kGroup];
  if (is_q) {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) m[e] = 0.0f;
  } else {
    if (threadIdx.x < kHeadDim)
      sm.stat[1][threadIdx.x] = out.kbar[(static_cast<int64_t>(blk.segment) * heads + h) * kHeadDim + threadIdx.x];
    __syncthreads();
    load_mean16(sm.stat[1], j, m);
  }
  float row_amax[kRowsPerThread];
  float tile_amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = rs + kRowSlices * i;
    float a = 0.0f;
    if (r < n) {
      float x[kGroup];
      tile_row16(sm.tile, r, j, x);
#pragma unroll
      for (int e = 0; e < kGroup; ++e) a = fmaxf(a, fabsf(is_q ? x[e] : __fsub_rn(x[e], m[e])));
    }
#pragma unroll
    for (int w = 1; w < kChanGroups; w *= 2) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, w));
    row_amax[i] = a;
    tile_amax = fmaxf(tile_amax, a);
  }
  float k_scale = 0.0f;
  if (!is_q) {
#pragma unroll
    for (int w = kChanGroups; w < kWarpSize; w *= 2) tile_amax = fmaxf(tile_amax, __shfl_xor_sync(0xFFFFFFFFu, tile_amax, w));
    if (threadIdx.x % kWarpSize == 0) sm.stat[0][threadIdx.x / kWarpSize] = tile_amax;
    __syncthreads();
    float a = 0.0f;
#pragma unroll
    for (int w = 0; w < kThreads / kWarpSize; ++w) a = fmaxf(a, sm.stat[0][w]);
    k_scale = __fdiv_rn(a, kFp8Max);
    if (threadIdx.x == 0) out.k_scales[static_cast<int64_t>(h) * out.k_scale_row + blk.canonical] = k_scale;
  }
  uint8_t* codes = is_q ? out.q_codes : out.k_codes;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = rs + kRowSlices * i;
    if (r >= n) break;
    float x[kGroup];
    tile_row16(sm.tile, r, j, x);
    if (!is_q) {
#pragma unroll
      for (int e = 0; e < kGroup; ++e) x[e] = __fsub_rn(x[e], m[e]);
    }
    const float s = is_q ? __fdiv_rn(row_amax[i], kFp8Max) : k_scale;
    const int64_t row = static_cast<int64_t>(h) * tokens + blk.row_begin + r;
    *reinterpret_cast<uint4*>(codes + row * kHeadDim + j * kGroup) = fp8_codes16(x, s);
    if (is_q && j == 0) out.q_scales[row] = s;
  }
}

// V tile, transposed: thread (channel c, keys half*64 .. half*64+63 of the block). Its padded
// columns are [col, col + 64): one whole 32-byte (NVFP4) or 64-byte (FP8) run of its V row.
template <Op op>
__device__ __forceinline__ void v_tile(const TileSmem& sm, const Outputs<op>& out, const Tables& tb,
                                       const QBlock& blk, int n, int h, int heads) {
  const int c = threadIdx.x % kHeadDim, half = threadIdx.x / kHeadDim;
  const int key0 = half * kVKeyPad;
  if (key0 >= n) return;  // the block's padded columns end at round_up(n, 64)
  const int64_t col = tb.vkey_start[blk.segment] + (blk.row_begin - tb.seg_bounds[blk.segment]) + key0;
  const int64_t vrow = static_cast<int64_t>(h) * kHeadDim + c;
  if constexpr (op == Op::kNvfp4) {
    uint32_t words[8];
    uint32_t scales = 0;
#pragma unroll
    for (int g = 0; g < kVKeyPad / kGroup; ++g) {
      float x[kGroup];
      tile_column16(sm.tile, key0 + g * kGroup, c, x);
      const Nvfp4Group q = nvfp4_quantize_group(x);
      words[2 * g] = q.codes.x;
      words[2 * g + 1] = q.codes.y;
      scales |= q.scale << (8 * g);
    }
    uint4* dst = reinterpret_cast<uint4*>(out.v_codes + vrow * out.v_code_row + col / 2);
    dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
    dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
    *reinterpret_cast<uint32_t*>(out.v_scales + vrow * (out.v_code_row / 8) + col / kGroup) = scales;
  } else {
    const float sv = out.v_scales[(static_cast<int64_t>(blk.segment) * heads + h) * kHeadDim + c];
    uint4* dst = reinterpret_cast<uint4*>(out.v_codes + vrow * out.v_code_row + col);
#pragma unroll
    for (int g = 0; g < kVKeyPad / kGroup; ++g) {
      float x[kGroup];
      tile_column16(sm.tile, key0 + g * kGroup, c, x);
      dst[g] = fp8_codes16(x, sv);
    }
  }
}

// One tile of launch 3: item = tensor * (NQB * H) + q block (schedule order) * H + head, tensor
// 0 q, 1 k, 2 v. Consecutive items are the heads of one block: neighbouring CTAs read
// neighbouring 256-byte pieces of the same token rows.
struct TileItem {
  QBlock blk;
  int h, tensor, n;
};

__device__ __forceinline__ TileItem decode_item(int item, int tiles, int heads, const int* qblocks) {
  TileItem it;
  it.tensor = item / tiles;
  const int tile = item - it.tensor * tiles;
  it.h = tile % heads;
  it.blk = load_qblock(qblocks, tile / heads);
  it.n = it.blk.row_end - it.blk.row_begin;
  return it;
}

__device__ __forceinline__ const uint16_t* tile_source(const Inputs& in, int tensor) {
  return tensor == 0 ? in.q : tensor == 1 ? in.k : in.v;
}

template <Op op>
__device__ __forceinline__ void quantize_tile(const TileItem& it, const TileSmem& sm, const Inputs& in,
                                              const Tables& tb, const Outputs<op>& out) {
  if (it.tensor == 2) {
    v_tile<op>(sm, out, tb, it.blk, it.n, it.h, in.heads);
  } else if constexpr (op == Op::kNvfp4) {
    nvfp4_qk_tile(sm, out, it.blk, it.n, it.h, in.heads, in.tokens, it.tensor == 0);
  } else {
    fp8_qk_tile(sm, out, it.blk, it.n, it.h, in.heads, in.tokens, it.tensor == 0);
  }
}

// Persistent: CTA b takes items b, b + gridDim.x, ...; `items` = 3 * NQB * H.
template <Op op>
__global__ void __launch_bounds__(kThreads, kQuantizeMinBlocks) quantize_kernel(Inputs in, Tables tb, Outputs<op> out,
                                                                                 int items) {
  extern __shared__ uint4 dynamic_smem[];
  PipeSmem& pipe = *reinterpret_cast<PipeSmem*>(dynamic_smem);
  const int tiles = items / 3;
  int item = blockIdx.x;
  if (item >= items) return;
  TileItem cur = decode_item(item, tiles, in.heads, tb.qblocks);
  issue_tile_load(tile_source(in, cur.tensor), cur.blk.row_begin, cur.n, in.heads, cur.h, pipe.tile[0]);
  cp_async_commit();
  for (int stage = 0; item < items; stage ^= 1) {
    const int next_item = item + static_cast<int>(gridDim.x);
    TileItem next = cur;
    if (next_item < items) {
      next = decode_item(next_item, tiles, in.heads, tb.qblocks);
      issue_tile_load(tile_source(in, next.tensor), next.blk.row_begin, next.n, in.heads, next.h,
                      pipe.tile[stage ^ 1]);
    }
    cp_async_commit();  // possibly empty: keeps "all but the newest group" = the current tile
    cp_async_wait<1>();
    __syncthreads();    // every thread's copies of the current tile have landed
    quantize_tile<op>(cur, TileSmem{pipe.tile[stage], pipe.stat}, in, tb, out);
    __syncthreads();    // the tile and stat are free for the copies issued next iteration
    item = next_item;
    cur = next;
  }
}

// ---------------------------------------------------------------------------------------------
// Host launcher
// ---------------------------------------------------------------------------------------------

// Threads of launch 2 per (segment, head): enough slices that a long segment's block sums are
// read by several threads, few enough that 10k short segments do not launch 1024-thread CTAs.
inline int reduce_slices(int num_qblocks, int segments) {
  const int per_segment = segments > 0 ? ceil_div(num_qblocks, segments) : 0;
  int slices = 1;
  while (slices < kReduceMaxSlices && slices * 4 <= per_segment) slices *= 2;
  return slices;
}

// Runs the three launches on `stream`. Zero-size grids are skipped (tokens == 0 launches only
// launch 2, which writes kbar = 0 for every segment). Returns the first launch error.
// CTAs of the persistent launch 3 on the current device: all that fit at once. The dynamic
// shared memory opt-in and the occupancy query run once per device and op.
template <Op op>
cudaError_t quantize_kernel_ctas(int* ctas) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const int known = device < kMaxDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (known > 0) {
    *ctas = known;
    return cudaSuccess;
  }
  const auto kernel = quantize_kernel<op>;
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kPipeSmemBytes));
      e != cudaSuccess)
    return e;
  int per_sm = 0, sms = 0;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kPipeSmemBytes);
      e != cudaSuccess)
    return e;
  if (const cudaError_t e = sm_count(device, &sms); e != cudaSuccess) return e;
  *ctas = (per_sm > 0 ? per_sm : 1) * sms;
  if (device < kMaxDevices) cached[device].store(*ctas, std::memory_order_relaxed);
  return cudaSuccess;
}

template <Op op>
cudaError_t launch_quantize(const Inputs& in, const Tables& tb, const Outputs<op>& out, cudaStream_t stream) {
  const int64_t tiles = static_cast<int64_t>(tb.num_qblocks) * in.heads;
  if (tiles > 0) {
    block_stats_kernel<op><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(in, tb, out);
    if (const cudaError_t e = last_launch_status(); e != cudaSuccess) return e;
  }
  const int64_t seg_heads = static_cast<int64_t>(tb.segments) * in.heads;
  if (seg_heads > 0) {
    const int slices = reduce_slices(tb.num_qblocks, tb.segments);
    segment_reduce_kernel<op><<<static_cast<unsigned>(seg_heads), kHeadDim * slices, 0, stream>>>(in, tb, out);
    if (const cudaError_t e = last_launch_status(); e != cudaSuccess) return e;
  }
  if (tiles > 0) {
    int ctas = 0;
    if (const cudaError_t e = quantize_kernel_ctas<op>(&ctas); e != cudaSuccess) return e;
    const int items = static_cast<int>(3 * tiles);  // the binding keeps 3 * NQB * H <= INT_MAX
    const unsigned grid = static_cast<unsigned>(items < ctas ? items : ctas);
    quantize_kernel<op><<<grid, kThreads, kPipeSmemBytes, stream>>>(in, tb, out, items);
    if (const cudaError_t e = last_launch_status(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace quantize
}  // namespace flashinfer_h3
