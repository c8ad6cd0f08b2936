// The quantization pre-pass of both recipes (SPEC 3 steps 1-3, SPEC 4 step 1): segment means of
// k, 128-row block means of q, smoothing, and the NVFP4 / FP8 codes and scales of Q, K and V (or,
// for the Hopper NVFP4 kernel, the NVFP4 values as FP16), written into the workspace regions of
// flashinfer_h3/layout.py.
//
// Output policies (the Outputs type every kernel and launcher below is written for):
//   Outputs<Op::kNvfp4>      NVFP4 codes + UE4M3 scales (layout `nvfp4`: the mma.sync kernel,
//                            native on SM120, emulated on sm_90a)
//   Outputs<Op::kFp8>        FP8 codes + FP32 scales (layouts `fp8`, `fp8_sm90`)
//   Fp16Outputs<Op::kNvfp4>  the NVFP4 operands' values s * code as FP16, in the shapes the
//                            Hopper wgmma kernel reads by TMA (layout `nvfp4_fp16`, backend
//                            wgmma_fp16_nvfp4; only the nvfp4_wgmma module instantiates it)
// The FP16 policy runs the same items, groups, scales and element rounding as the NVFP4 codes
// (numerics/group_quantize.cuh, nvfp4_group_fp16), so its values are bit for bit the decoded
// codes; it stores no codes. (The Hopper backend used to store codes and then expand them in a
// pass of its own, which read 0.56 B and wrote 2 B an element: ~1 ms at 61,440 x 56 on an
// H200.) Its kernels have names of their own (quantize_fp16_kernel, segment_reduce_fp16_kernel),
// so the codes kernels keep their names and their code.
//
// Three launches per call, all on the caller's stream; 1 and 3 are the same persistent tile
// kernel (quantize_kernel, or quantize_fp16_kernel) with different item kinds:
//
//   1. quantize_kernel<Pass::kQAndStats>  per (128-row block, head): the Q tile (codes and scales,
//                                         or FP16 values; for NVFP4 also the block mean qbar) and
//                                         the block's column statistics: sums of k (and, for FP8,
//                                         amax of |v|, a separate item) -> scratch
//   2. segment_reduce_kernel              per (segment, head, channel part): kbar = sum / L (FP64
//                                         sum of the block sums, fixed order), FP8 V scales
//   3. quantize_kernel<Pass::kKAndV>      per (128-row block, head): the K' = k - kbar tile and
//                                         the V tile
// (FP8 for a kernel that quantises Q itself: launch 1 is quantize_kernel<Pass::kStats>, without
// its Q items.)
//
// Why this split: the statistics need the whole segment before any K' (or FP8 V) code, so k (and
// v) is read twice for a long segment. Reading it again in launch 1, next to the Q tiles, whose
// quantization is issue-bound and leaves DRAM bandwidth unused, hides that second read; a
// separate statistics launch cost about 15 % of the pre-pass on an H200. Launch 1 walks the
// schedule-order block table backwards and launch 3 forwards, so launch 3's first k (and v) rows
// are the ones launch 1 read last, still in L2. (Q quantised inside the Hopper FP8 kernel
// instead, launch 1 without Q items: the pre-pass 0.33 ms faster at 61,440 x 56, the kernel
// 1.1-4.7 % slower; benchmarks/RESULTS.md, ninth session.)
//
// A 61k-token segment is never summed by one CTA: launch 1's block statistics are fully parallel
// and launch 2 adds the ~500 block partials of a channel in 32 parallel slices. Every sum has a
// fixed order (no atomics), so the means are deterministic for a given shape.
//
// Scratch without extra regions: launch 1 parks the statistics of canonical block cb, channel c,
// head h in row (h, c / 8) of the V region (v_codes; v_f16 for the FP16 policy), which only
// launch 3 writes:
//   NVFP4: the k column sum, a float at byte 32 cb + 4 (c % 8);
//   FP8:   (k column sum, v column amax), two floats at byte 64 cb + 8 (c % 8).
// A block's 128 channels are thus 16 runs of 32 (64) bytes, whole sectors for launch 2. They lie
// in the used columns [0, vkey_start[S]) (vkey_start[S] >= 64 NQB keys, i.e. 32 NQB NVFP4 bytes,
// 64 NQB FP8 bytes, 128 NQB FP16 bytes), and launch 3's V tiles write every one of those columns
// (FP16: every used position, the padding's zeros included). So the binding keeps the design.md
// signatures, and nothing outside the layout's used bytes is ever written: rows of qbar past NQB,
// V columns (K rows) past vkey_start[S] and the gaps between regions stay as they were.
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
//   FP16   q_f16 [H, T, 128]     row (h, t): Q' of token t, s * code as FP16 (256 bytes)
//          k_f16 [H, nvk, 128]   row (h, vkey_start[s] + p): K' of key a_s + window_key_at(p) of
//                                segment s (64-key windows from the segment start), zeros where
//                                that is past the segment's last key
//          v_f16 [H, 128, nvk]   row (h, c), column vkey_start[s] + p: V of the same key
//          kbar, qbar as for NVFP4
// Stores are coalesced for the attention kernels' row-major reads: a warp writes whole 64-byte
// (128-byte) Q/K code rows, consecutive rows adjacent, and whole 32-byte sectors of V code rows
// (see VThread); FP16: whole 256-byte Q/K rows, 8 lanes a row, and whole 128-byte V^T row
// segments (nvfp4_v_fp16).
//
// Numerics: the element path is bit-exact to SPEC 3/4 (formats.cuh conversions, explicit
// __f*_rn steps, never --use_fast_math): the smoothing is __fsub_rn, FP8 uses __fdiv_rn,
// __frcp_rn and __fmul_rn, and the NVFP4 group quantizer is nvfp4_group (or nvfp4_group_fp16,
// its decoded values) of numerics/group_quantize.cuh, whose shortcuts
// tests/kernels/test_quantize_build.py checks for every float (and the whole group against
// formats.py, the FP16 group against the decoded codes).
//
// Files: this one holds the device code; the group quantizers are numerics/group_quantize.cuh,
// the host launcher quantize/launch.cuh.
//
// Host builds. The kernels only use CUDA builtins, numerics/ and the device/host seam of
// quantize/host_hooks.cuh (cp.async, dynamic shared memory, the E4M3 cvt, the f16x2 pack and
// product, __syncwarp), so the CPU test
// (tests/ quantize build tests) compiles this header with a host C++ compiler, one std::thread
// per CUDA thread, and checks the launches against flashinfer_h3.reference on machines without
// a GPU; the emulated_* functions of host_hooks.cuh are what such a build provides.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "attention/sm90/nvfp4_key_order.cuh"
#include "common.cuh"
#include "numerics/formats.cuh"
#include "numerics/group_quantize.cuh"
#include "quantize/host_hooks.cuh"

namespace flashinfer_h3 {
namespace quantize {

enum class Op { kNvfp4, kFp8 };

constexpr int kHeadDim = 128;
constexpr int kBlockRows = 128;       // rows per Q block == keys per FP8 K-scale block (layout.Q_BLOCK)
constexpr int kVKeyPad = 64;          // padded V columns per segment come in these (layout.V_KEY_PAD)
constexpr int kThreads = 256;         // launches 1 and 3
constexpr int kWarps = kThreads / kWarpSize;            // 8
constexpr int kChanGroups = kHeadDim / kGroup;          // 8 groups of 16 channels per row
constexpr int kRowSlices = kThreads / kChanGroups;      // 32 row slices of a row tile
constexpr int kRowsPerThread = kBlockRows / kRowSlices; // 4 rows per thread
constexpr int kReduceMaxSlices = 32;                    // launch 2: threads adding one channel
constexpr int kReduceMaxThreads = 1024;                 // launch 2: a CTA's threads

static_assert(kThreads % kChanGroups == 0 && kBlockRows % kRowSlices == 0, "row tile split");
static_assert(kBlockRows == 2 * kVKeyPad, "a block covers one or two 64-key V chunks");

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

// Every output policy says which recipe it writes (kOp), whether as FP16 operands (kFp16), and
// where launch 1 parks its statistics (stats_rows: the V region's rows, see the file comment).
template <>
struct Outputs<Op::kNvfp4> {
  static constexpr Op kOp = Op::kNvfp4;
  static constexpr bool kFp16 = false;
  float* kbar;        // [S, H, 128]
  float* qbar;        // [cap, H, 128]
  uint8_t* q_codes;   // [H, T, 64]
  uint8_t* q_scales;  // [H, T, 8]
  uint8_t* k_codes;
  uint8_t* k_scales;
  uint8_t* v_codes;   // [H, 128, v_code_row]; launch 1 parks the k block sums here
  uint8_t* v_scales;  // [H, 128, v_code_row / 8]
  int64_t v_code_row; // bytes per v_codes row (nvk / 2)

  __device__ __forceinline__ uint8_t* stats_rows() const { return v_codes; }
  __device__ __forceinline__ int64_t stats_row_bytes() const { return v_code_row; }
};

template <>
struct Outputs<Op::kFp8> {
  static constexpr Op kOp = Op::kFp8;
  static constexpr bool kFp16 = false;
  float* kbar;        // [S, H, 128]
  uint8_t* q_codes;   // [H, T, 128]
  float* q_scales;    // [H, T]
  uint8_t* k_codes;   // [H, T, 128]
  float* k_scales;    // [H, k_scale_row]
  uint8_t* v_codes;   // [H, 128, v_code_row]; launch 1 parks (k sum, v amax) pairs here
  float* v_scales;    // [S, H, 128]
  int64_t v_code_row; // bytes per v_codes row (nvk)
  int64_t k_scale_row;

  __device__ __forceinline__ uint8_t* stats_rows() const { return v_codes; }
  __device__ __forceinline__ int64_t stats_row_bytes() const { return v_code_row; }
};

// The FP16 policy (the Hopper wgmma backend, layout nvfp4_fp16): the NVFP4 recipe's values
// s * code as FP16 bits. No codes or scales are stored: the kernel reads only these and qbar.
// Defined for NVFP4 only (the FP8 kernels read codes).
template <Op op>
struct Fp16Outputs;

template <>
struct Fp16Outputs<Op::kNvfp4> {
  static constexpr Op kOp = Op::kNvfp4;
  static constexpr bool kFp16 = true;
  float* kbar;        // [S, H, 128]
  float* qbar;        // [cap, H, 128]
  uint16_t* q_f16;    // [H, T, 128]
  uint16_t* k_f16;    // [H, vkeys_cap, 128]
  uint16_t* v_f16;    // [H, 128, vkeys_cap]; launch 1 parks the k block sums here
  int64_t vkeys_cap;  // k_f16 rows and v_f16 columns per head (a multiple of 64)

  __device__ __forceinline__ uint8_t* stats_rows() const { return reinterpret_cast<uint8_t*>(v_f16); }
  __device__ __forceinline__ int64_t stats_row_bytes() const { return 2 * vkeys_cap; }
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

// ---------------------------------------------------------------------------------------------
// Where launch 1 parks the block statistics (see the file comment)
// ---------------------------------------------------------------------------------------------

// The k column sum of canonical block cb, channel c; for FP8 the v column amax follows it.
template <class Out>
__device__ __forceinline__ float* stats_slot(const Out& o, int cb, int h, int c) {
  constexpr int kFloats = Out::kOp == Op::kNvfp4 ? 1 : 2;
  return reinterpret_cast<float*>(o.stats_rows() + (static_cast<int64_t>(h) * kHeadDim + c / 8) * o.stats_row_bytes()) +
         (static_cast<int64_t>(cb) * 8 + c % 8) * kFloats;
}

// ---------------------------------------------------------------------------------------------
// Launch 2: per-(segment, head) kbar (and FP8 V scales)
// ---------------------------------------------------------------------------------------------

// Launch 2's shape: `slices` threads add the block sums of one channel (slice i takes blocks
// b0 + i, b0 + i + slices, ...), and a (segment, head) is split over `split` CTAs of 128 / split
// channels so that no CTA has more than 1024 threads. Enough slices that a long segment's ~500
// block sums are read in two rounds of 8 loads per thread; few enough that 10k short segments do
// not launch 1024-thread CTAs.
struct ReduceShape {
  int slices, split;
};

inline ReduceShape reduce_shape(int num_qblocks, int segments) {
  const int per_segment = segments > 0 ? ceil_div(num_qblocks, segments) : 0;
  int slices = 1;
  while (slices < kReduceMaxSlices && slices * 4 <= per_segment) slices *= 2;
  const int split = slices * kHeadDim > kReduceMaxThreads ? slices * kHeadDim / kReduceMaxThreads : 1;
  return {slices, split};
}

// grid S * H * split, blockDim (128 / split) * slices.
template <class Out>
__device__ __forceinline__ void segment_reduce(const Inputs& in, const Tables& tb, const Out& out, int split) {
  constexpr Op op = Out::kOp;
  __shared__ double sums[kReduceMaxThreads];
  __shared__ float maxes[kReduceMaxThreads];
  const int channels = kHeadDim / split;  // of this CTA
  const int sh = static_cast<int>(blockIdx.x) / split;
  const int h = sh % in.heads, s = sh / in.heads;
  const int lc = static_cast<int>(threadIdx.x) % channels, slice = static_cast<int>(threadIdx.x) / channels;
  const int c = (static_cast<int>(blockIdx.x) % split) * channels + lc;
  const int slices = static_cast<int>(blockDim.x) / channels;
  const int b0 = tb.qblock_start[s], b1 = tb.qblock_start[s + 1];

  // The FP32 block sums are added in FP64 (exact unless they span > 29 binades) in a fixed order:
  // each slice in block order, then the slices in order. A warp reads 32 adjacent channels of one
  // block (four whole 32-byte runs for NVFP4, four 64-byte runs for FP8), and a thread issues
  // its loads 8 at a time before adding (a long segment: 2 rounds of memory latency, not 15).
  constexpr int kBatch = 8;
  double sum = 0.0;
  float vmax = 0.0f;
  for (int first = b0 + slice; first < b1; first += kBatch * slices) {
    float2 part[kBatch];  // (k sum, v amax); past the segment: (0, 0), which changes nothing
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int cb = first + u * slices;
      part[u] = make_float2(0.0f, 0.0f);
      if (cb < b1) {
        if constexpr (op == Op::kNvfp4) {
          part[u].x = *stats_slot(out, cb, h, c);
        } else {
          part[u] = *reinterpret_cast<const float2*>(stats_slot(out, cb, h, c));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      sum += static_cast<double>(part[u].x);
      vmax = fmaxf(vmax, part[u].y);
    }
  }
  sums[threadIdx.x] = sum;
  maxes[threadIdx.x] = vmax;
  __syncthreads();
  if (slice != 0) return;
  for (int p = 1; p < slices; ++p) {
    sum += sums[p * channels + lc];
    vmax = fmaxf(vmax, maxes[p * channels + lc]);
  }
  const int length = tb.seg_bounds[s + 1] - tb.seg_bounds[s];
  const int64_t at = (static_cast<int64_t>(s) * in.heads + h) * kHeadDim + c;
  out.kbar[at] = length > 0 ? static_cast<float>(sum / static_cast<double>(length)) : 0.0f;
  if constexpr (op == Op::kFp8) out.v_scales[at] = fp8_group_scale(vmax);
}

template <Op op>
__global__ void __launch_bounds__(kReduceMaxThreads) segment_reduce_kernel(Inputs in, Tables tb, Outputs<op> out,
                                                                            int split) {
  segment_reduce(in, tb, out, split);
}

template <Op op>
__global__ void __launch_bounds__(kReduceMaxThreads) segment_reduce_fp16_kernel(Inputs in, Tables tb,
                                                                                 Fp16Outputs<op> out, int split) {
  segment_reduce(in, tb, out, split);
}

// Launch 2's kernel of an output policy.
template <class Out>
constexpr auto reduce_kernel() {
  if constexpr (Out::kFp16) {
    return &segment_reduce_fp16_kernel<Out::kOp>;
  } else {
    return &segment_reduce_kernel<Out::kOp>;
  }
}

// ---------------------------------------------------------------------------------------------
// Launches 1 and 3: 128 x 128 tiles of q, k and v, streamed through a shared-memory ring
// ---------------------------------------------------------------------------------------------
//
// The tile kernel is persistent: CTA b takes items b, b + G, b + 2G, ... (G = gridDim.x), item =
// (block step * kinds + kind) * H + head, where the block step walks the schedule-order block
// table (backwards in launch 1, forwards in launch 3: item_qblock) and the kinds of a pass are
// those of pass_kind. Neighbouring CTAs thus read neighbouring 256-byte pieces of the same token
// rows, and every SM works on a mix of kinds at any time.
//
// Each CTA keeps kStages - 1 tiles in flight. Its shared memory is a ring of kStages stages (a
// 32 KB bf16 tile, the 512-byte row of means or scales the item needs, and the item's
// descriptor), filled by cp.async. Item i is handled as
//     wait for its stage -> barrier -> refill the stage item i - 1 used with item i - 1 + kStages
//     -> copy the thread's 128 bytes into registers -> quantize from registers and store,
// so one barrier an item suffices (Q tiles, the statistics and FP8 K add one for their
// cross-thread sums): the barrier that opens item i also proves that every thread is done with
// item i - 1's stage. With 3 stages, two tiles per CTA (128 KB an SM) are being loaded during
// the whole compute, about 5x the ~25 KB an H200 SM needs in flight to cover the DRAM latency at
// 4.3 TB/s, and two CTAs an SM overlap each other's barriers. (A second barrier per item, to free
// the stage right after the copy, cost ~13 % of the samples in barrier stalls in an ncu profile.)
//
// The element work is written for few instructions, most on the FP32 pipe (see e2m1_top_nibble):
// a 128 x 128 NVFP4 tile is 16k encodes, and with formats.cuh's integer encoder (~20
// instructions an element, mostly on the half-rate ALU pipe) issuing a tile took longer than
// streaming it. Now a K tile is ~1000 instructions a thread (~13 an element), a Q tile ~1200,
// a V tile ~1000: about 80 % of the time an SM needs to stream the tile at 4.3 TB/s.
//
// Shared-memory tile layout: row r (a token), 16-byte chunk c (channels 8c..8c+7) at chunk
// r * 16 + swizzle_chunk(c, r), c ^ ((c >> 3) & 1) ^ (((r >> 4) & 1) << 2). The swizzle makes
// both register copies conflict-free: a row tile thread reads chunks 2j and 2j + 1 of its row (8
// lanes a phase cover all 32 banks); a column thread (VThread) reads 8 bytes of a key row, and a
// half-warp covers 64 bytes of each of two key rows 16 apart, which the second term puts in
// opposite halves of the banks.

constexpr int kRowChunks = kHeadDim * 2 / 16;            // 16-byte chunks per bf16 row
constexpr int kTileChunks = kBlockRows * kRowChunks;     // 2048 (32 KB)
constexpr int kLoadsPerThread = kTileChunks / kThreads;  // 8 cp.async a thread a tile
constexpr int kRawWords = 32;                            // bf16 pairs a row tile thread holds (128 bytes)
constexpr int kKeyChunks = kBlockRows / kGroup;          // 8 chunks of 16 keys (column threads)
constexpr int kChanQuads = kHeadDim / 4;                 // 32 quads of 4 channels (column threads)
static_assert(kRawWords * 4 * kThreads == kBlockRows * kHeadDim * 2, "every tile byte in one register");
static_assert(kKeyChunks * kChanQuads == kThreads, "a column thread: 16 keys x 4 channels");

__host__ __device__ constexpr int swizzle_chunk(int c, int r) { return c ^ ((c >> 3) & 1) ^ (((r >> 4) & 1) << 2); }

// Division by a runtime divisor d >= 1 for 0 <= n < 2^31 with a multiply-high (the item index
// is decoded every iteration; IMAD.HI + IADD + SHF instead of a ~20-instruction division):
// shift = ceil(log2 d), mul = 2^32 (2^shift - d) / d + 1, n / d = (umulhi(n, mul) + n) >> shift.
struct FastDiv {
  uint32_t mul, shift;

  static FastDiv make(uint32_t d) {
    uint32_t shift = 0;
    while ((uint64_t{1} << shift) < d) ++shift;
    return {static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d)) / d + 1), shift};
  }
  __device__ __forceinline__ int div(int n) const {
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), mul) + static_cast<uint32_t>(n)) >> shift);
  }
};

// What a tile item does. Launch 1 (Pass::kQAndStats) needs nothing from earlier launches; launch
// 3 (Pass::kKAndV) needs kbar and, for FP8, the V scales of launch 2. Pass::kStats (FP8 only) is
// launch 1 without its Q items, for a kernel that quantises Q itself (the Hopper FP8 kernel's
// q_in_kernel builds, sm90/fp8_q_quantizer.cuh): the Q regions are then left as they are.
enum class Kind : int {
  kQ,       // Q codes and scales (NVFP4: of Q' = q - qbar, and qbar itself)
  kK,       // K' = k - kbar codes and scales
  kV,       // V codes and scales
  kKStats,  // column sums of the k tile -> stats_slot
  kVStats,  // FP8: column amax of |v| -> stats_slot + 1
};
enum class Pass { kQAndStats, kKAndV, kStats };

template <Op op, Pass pass>
constexpr int pass_kinds() {
  static_assert(pass != Pass::kStats || op == Op::kFp8, "launch 1 without Q: the FP8 pre-pass only");
  return pass == Pass::kQAndStats && op == Op::kFp8 ? 3 : 2;
}

// Kind number i (< pass_kinds) of a pass: launch 1 {Q, k stats (, v stats)} or, without Q,
// {k stats, v stats}; launch 3 {K, V}.
template <Pass pass>
__device__ __forceinline__ Kind pass_kind(int i) {
  if constexpr (pass == Pass::kKAndV) return i == 0 ? Kind::kK : Kind::kV;
  if constexpr (pass == Pass::kStats) return i == 0 ? Kind::kKStats : Kind::kVStats;
  return i == 0 ? Kind::kQ : i == 1 ? Kind::kKStats : Kind::kVStats;
}

struct ItemMap {
  int items;  // pass_kinds * NQB * H
  int num_qblocks;
  FastDiv by_heads;
};

// The items of a tile launch: pass_kinds per (block, head) pair.
template <Op op, Pass pass>
inline ItemMap make_item_map(const Tables& tb, int heads) {
  ItemMap map;
  map.items = pass_kinds<op, pass>() * tb.num_qblocks * heads;
  map.num_qblocks = tb.num_qblocks;
  map.by_heads = FastDiv::make(static_cast<uint32_t>(heads));
  return map;
}

struct alignas(16) ItemDesc {
  Kind kind;
  int h, segment, row_begin, n, canonical, pad0, pad1;
};

// A V item's two table entries (and an FP16 K item's, whose rows go to padded positions too)
// come into its stage by cp.async with the tile: loaded by thread 0 with plain loads, they made
// its warp, and so everyone's next barrier, wait an L2 round trip per item (long-scoreboard
// stalls were ~30 % of the warp samples in an ncu profile). Stages start on 128-byte boundaries:
// with 16-byte ones the pre-pass measured ~5 % slower on an H200.
struct alignas(128) Stage {
  uint4 tile[kTileChunks];    // bf16 rows, chunk-swizzled (see above)
  float aux[kHeadDim];        // K: kbar[segment, h, :]; FP8 V: v_scales[segment, h, :]
  int vkey_start, seg_start;  // V (and FP16 K): vkey_start[segment], seg_bounds[segment]
  ItemDesc desc;              // written by thread 0 when the stage is filled
};

template <int kStages>
struct PipeSmem {
  Stage stage[kStages];
  float red[kKeyChunks][kHeadDim];  // column statistics of each key chunk; FP8 K: amax of each warp
  float mean[kHeadDim];             // NVFP4 Q: the block mean
  float recip[128];                 // NVFP4: nvfp4_recip_scaled of each UE4M3 code
};

template <int kStages>
constexpr size_t pipe_smem_bytes() {
  return sizeof(PipeSmem<kStages>);
}
static_assert(sizeof(Stage) == 33408, "a 32 KB tile, its aux row and descriptor, rounded to 128 bytes");

// The q block (row of the schedule-order table) of an item: launch 1 walks the table backwards
// and launch 3 forwards, so that launch 3's first tiles are the k (and v) rows launch 1 read
// last, which are still in L2.
template <Op op, Pass pass>
__device__ __forceinline__ int item_qblock(const ItemMap& map, int item) {
  const int step = map.by_heads.div(item) / pass_kinds<op, pass>();
  return pass == Pass::kKAndV ? step : map.num_qblocks - 1 - step;
}

template <Op op, Pass pass>
__device__ __forceinline__ ItemDesc decode_item(const ItemMap& map, int item, int heads, const QBlock& blk) {
  ItemDesc d;
  const int tile = map.by_heads.div(item);  // block step * kinds + kind
  d.h = item - tile * heads;
  d.kind = pass_kind<pass>(tile % pass_kinds<op, pass>());
  d.segment = blk.segment;
  d.row_begin = blk.row_begin;
  d.n = blk.row_end - blk.row_begin;
  d.canonical = blk.canonical;
  d.pad0 = d.pad1 = 0;
  return d;
}

// The row of means (K) or scales (FP8 V) an item needs next to its tile, or null.
template <class Out>
__device__ __forceinline__ const float* aux_source(const Out& out, const ItemDesc& d, int heads) {
  const int64_t at = (static_cast<int64_t>(d.segment) * heads + d.h) * kHeadDim;
  if (d.kind == Kind::kK) return out.kbar + at;
  if constexpr (Out::kOp == Op::kFp8) {
    if (d.kind == Kind::kV) return out.v_scales + at;
  }
  return nullptr;
}

// Starts the copies of an item into a stage: rows [0, n) of its tile, zeros for rows [n, 128)
// (padded V keys quantize as +0, and every register copy reads whole tiles), its aux row and a V
// (or FP16 K) item's two table entries. Thread t copies chunk t % 16 of rows t / 16 + 16 i: a warp
// covers two whole 256-byte rows per step. A full tile (every block but a segment's last) needs no
// per-row test; in a partial one the zero fill reads nothing, but its source operand still names
// a row of this tile.
template <class Out>
__device__ __forceinline__ void issue_item(const Inputs& in, const Tables& tb, const Out& out, const ItemDesc& d,
                                           Stage& st) {
  constexpr int kRowsPerStep = kThreads / kRowChunks;  // 16
  const int c = threadIdx.x % kRowChunks, r0 = threadIdx.x / kRowChunks;
  const uint16_t* base = d.kind == Kind::kQ ? in.q : d.kind == Kind::kK || d.kind == Kind::kKStats ? in.k : in.v;
  const int64_t step = static_cast<int64_t>(in.heads) * kHeadDim * kRowsPerStep;  // 16 token rows
  const uint16_t* first = base + (static_cast<int64_t>(d.row_begin) * in.heads + d.h) * kHeadDim + c * 8;
  const uint16_t* src = first + r0 * (step / kRowsPerStep);
  // Row r0 + 16 i: bit 4 of the row is i's lowest bit.
  uint4* dst[2] = {st.tile + r0 * kRowChunks + swizzle_chunk(c, 0), st.tile + r0 * kRowChunks + swizzle_chunk(c, 16)};
  if (d.n == kBlockRows) {
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i)
      cp_async_16(dst[i % 2] + i * kRowsPerStep * kRowChunks, src + i * step, 16u);
  } else {
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const bool real = r0 + kRowsPerStep * i < d.n;
      cp_async_16(dst[i % 2] + i * kRowsPerStep * kRowChunks, real ? src + i * step : first, real ? 16u : 0u);
    }
  }
  const float* aux = aux_source(out, d, in.heads);
  if (aux != nullptr && threadIdx.x < kHeadDim / 4) cp_async_16(&st.aux[4 * threadIdx.x], aux + 4 * threadIdx.x, 16u);
  // The table entries: 4-byte copies by two lanes of warp 1 (warp 0 copies the aux row).
  const int t = static_cast<int>(threadIdx.x) - kWarpSize;
  const bool positions = d.kind == Kind::kV || (Out::kFp16 && d.kind == Kind::kK);  // padded positions
  if (positions && (t == 0 || t == 1)) {
    cp_async_4(t == 0 ? &st.vkey_start : &st.seg_start, (t == 0 ? tb.vkey_start : tb.seg_bounds) + d.segment);
  }
}

// The thread's 128 bytes of a row tile (Q, K): channel group j = t % 8, rows rs + 32 i for
// rs = t / 8. Word 8 i + e holds channels 16 j + 2 e (low half) and 16 j + 2 e + 1 of row i.
__device__ __forceinline__ void copy_rows(const Stage& st, uint32_t (&w)[kRawWords]) {
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = rs + kRowSlices * i;
    const uint4 a = st.tile[r * kRowChunks + swizzle_chunk(2 * j, r)];
    const uint4 b = st.tile[r * kRowChunks + swizzle_chunk(2 * j + 1, r)];
    w[8 * i + 0] = a.x, w[8 * i + 1] = a.y, w[8 * i + 2] = a.z, w[8 * i + 3] = a.w;
    w[8 * i + 4] = b.x, w[8 * i + 5] = b.y, w[8 * i + 6] = b.z, w[8 * i + 7] = b.w;
  }
}

// Column thread of a tile (V tiles and the column statistics): channel quad u (channels
// 4u..4u+3) and key chunk kc (keys 16kc..16kc+15, one NVFP4 group of each channel). Lane =
// u % 8 + 8 (kc % 4), warp = 2 (u / 8) + kc / 4: a warp holds 64 channels of 64 keys, so each of
// its V stores writes whole 32-byte sectors (four key chunks of NVFP4 codes, two of FP8 codes).
struct VThread {
  int u, kc;
};

__device__ __forceinline__ VThread v_thread() {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), warp = static_cast<int>(threadIdx.x / kWarpSize);
  return {lane % 8 + 8 * (warp / 2), lane / 8 + 4 * (warp % 2)};
}

// w[e] = channels 4u..4u+3 of key 16 kc + e (bf16 pairs: .x channels 4u, 4u + 1).
__device__ __forceinline__ void copy_columns(const Stage& st, const VThread& vt, uint2 (&w)[kGroup]) {
  const uint2* halves = reinterpret_cast<const uint2*>(st.tile);
  const int col = swizzle_chunk(vt.u / 2, kGroup * vt.kc) * 2 + vt.u % 2;  // 8-byte half-chunk in a row
#pragma unroll
  for (int e = 0; e < kGroup; ++e) w[e] = halves[(kGroup * vt.kc + e) * (kRowChunks * 2) + col];
}

// Channel 4u + k of key 16 kc + e.
__device__ __forceinline__ float column_value(const uint2 (&w)[kGroup], int e, int k) {
  const uint32_t pair = k < 2 ? w[e].x : w[e].y;
  return k % 2 == 0 ? bf16_lo(pair) : bf16_hi(pair);
}

__device__ __forceinline__ void load16(const float* src, float (&m)[kGroup]) {
#pragma unroll
  for (int e = 0; e < kGroup; e += 4) {
    const float4 v = *reinterpret_cast<const float4*>(src + e);
    m[e] = v.x, m[e + 1] = v.y, m[e + 2] = v.z, m[e + 3] = v.w;
  }
}

// Row i of a row tile as floats minus the thread's 16 means (m = 0: no smoothing).
__device__ __forceinline__ void row_minus(const uint32_t (&w)[kRawWords], int i, const float (&m)[kGroup],
                                          float (&x)[kGroup]) {
#pragma unroll
  for (int e = 0; e < kGroup / 2; ++e) {
    x[2 * e] = __fsub_rn(bf16_lo(w[8 * i + e]), m[2 * e]);
    x[2 * e + 1] = __fsub_rn(bf16_hi(w[8 * i + e]), m[2 * e + 1]);
  }
}

// Column statistics: sums (of q, k) or maxima of |v|.
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
  __device__ __forceinline__ float lift(float x) const { return x; }
};
struct AbsMaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  __device__ __forceinline__ float lift(float x) const { return fabsf(x); }
};

// Part 1 of a tile's column statistics, while the stage still holds the tile: the column
// thread's 16 keys of each of its 4 channels as a 4-level tree, into red[kc][4u + k]. Rows past n
// are zeros, which add nothing and cannot raise an amax of |v|.
template <class Combine>
__device__ __forceinline__ void column_partials(const Stage& st, float (*red)[kHeadDim], Combine op) {
  const VThread vt = v_thread();
  uint2 w[kGroup];
  copy_columns(st, vt, w);
  float part[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float x[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) x[e] = op.lift(column_value(w, e, k));
    // One loop per level: a loop over the halving widths is not unrolled by nvcc.
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = op(x[e], x[e + 8]);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = op(x[e], x[e + 4]);
    part[k] = op(op(x[0], x[2]), op(x[1], x[3]));
  }
  *reinterpret_cast<float4*>(&red[vt.kc][4 * vt.u]) = make_float4(part[0], part[1], part[2], part[3]);
}

// Part 2 (after a barrier; threads c < 128): channel c's total, the 8 key chunks as a 3-level
// tree (7 levels in all).
template <class Combine>
__device__ __forceinline__ float column_total(const float (*red)[kHeadDim], int c, Combine op) {
  return op(op(op(red[0][c], red[1][c]), op(red[2][c], red[3][c])),
            op(op(red[4][c], red[5][c]), op(red[6][c], red[7][c])));
}

// A statistics item: k column sums or (FP8) v column amax of the block -> stats_slot. One
// barrier.
template <class Out, class Combine>
__device__ __forceinline__ void block_stats(const Stage& st, const ItemDesc& d, const Out& out,
                                            float (*red)[kHeadDim], Combine combine, int slot_offset) {
  column_partials(st, red, combine);
  __syncthreads();
  if (threadIdx.x < kHeadDim)
    stats_slot(out, d.canonical, d.h, threadIdx.x)[slot_offset] = column_total(red, threadIdx.x, combine);
}

// NVFP4 Q, part 2 (after a barrier): the block mean of each channel over rows [0, n), stored to
// qbar; m gets the thread's 16 means. One barrier.
__device__ __forceinline__ void nvfp4_q_mean(int n, const float (*red)[kHeadDim], float* mean_smem, float* qbar_row,
                                             float (&m)[kGroup]) {
  if (threadIdx.x < kHeadDim) {
    const int c = threadIdx.x;
    const float qbar = __fdiv_rn(column_total(red, c, SumOp{}), static_cast<float>(n));
    mean_smem[c] = qbar;
    qbar_row[c] = qbar;
  }
  __syncthreads();
  load16(mean_smem + (threadIdx.x % kChanGroups) * kGroup, m);
}

// NVFP4 Q or K tile from registers: Q' = q - qbar or K' = k - kbar, 16-channel groups. A warp
// stores 4 whole 64-byte code rows (256 contiguous bytes) and 32 contiguous scale bytes.
__device__ __forceinline__ void nvfp4_rows(const uint32_t (&w)[kRawWords], const float (&m)[kGroup],
                                           const ItemDesc& d, const Outputs<Op::kNvfp4>& out, int64_t tokens,
                                           const float* recip) {
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
  const int64_t row0 = static_cast<int64_t>(d.h) * tokens + d.row_begin + rs;  // the thread's row i = 0
  const bool is_q = d.kind == Kind::kQ;
  uint8_t* codes = (is_q ? out.q_codes : out.k_codes) + row0 * (kHeadDim / 2) + j * (kGroup / 2);
  uint8_t* scales = (is_q ? out.q_scales : out.k_scales) + row0 * kChanGroups + j;
  // Rows past n (a segment's last block) are quantized too and not stored: no branch between
  // the rows, so the compiler may interleave their groups.
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    float x[kGroup];
    row_minus(w, i, m, x);
    const Nvfp4Group g = nvfp4_group(x, recip);
    if (rs + kRowSlices * i < d.n) {
      *reinterpret_cast<uint2*>(codes + i * kRowSlices * (kHeadDim / 2)) = g.codes;
      scales[i * kRowSlices * kChanGroups] = static_cast<uint8_t>(g.scale);
    }
  }
}

// NVFP4 V tile from registers: one group (the thread's 16 keys) of each of channels 4u..4u+3:
// 8 code bytes and a scale byte of each of the four V rows. A warp store covers whole 32-byte code
// sectors (4 key chunks) and 4 contiguous scale bytes of 8 rows. Key chunks past the tile's
// padded end (round_up(n, 64)) write nothing.
__device__ __forceinline__ void nvfp4_v(const uint2 (&w)[kGroup], const ItemDesc& d, int64_t col0,
                                        const Outputs<Op::kNvfp4>& out, const float* recip) {
  const VThread vt = v_thread();
  if (kGroup * vt.kc >= round_up(d.n, kVKeyPad)) return;
  const int64_t col = col0 + kGroup * vt.kc;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float x[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) x[e] = column_value(w, e, k);
    const Nvfp4Group g = nvfp4_group(x, recip);
    const int64_t vrow = static_cast<int64_t>(d.h) * kHeadDim + 4 * vt.u + k;
    *reinterpret_cast<uint2*>(out.v_codes + vrow * out.v_code_row + col / 2) = g.codes;
    out.v_scales[vrow * (out.v_code_row / 8) + col / kGroup] = static_cast<uint8_t>(g.scale);
  }
}

// FP8 Q (per-token scale, no smoothing) or K (K' = k - kbar, one scale for the block) tile from
// registers. The 8 lanes sharing a row are consecutive lanes, so xor-shuffles 1, 2, 4 reduce a
// row; the K block amax adds shuffles 8, 16 and one barrier.
__device__ __forceinline__ void fp8_rows(const uint32_t (&w)[kRawWords], const float (&m)[kGroup], const ItemDesc& d,
                                         const Outputs<Op::kFp8>& out, int64_t tokens, float (*red)[kHeadDim]) {
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
  const bool is_q = d.kind == Kind::kQ;
  float row_amax[kRowsPerThread];
  float tile_amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    float a = 0.0f;
    if (rs + kRowSlices * i < d.n) {  // rows past n are zeros, minus the mean for K: left out
      float x[kGroup];
      row_minus(w, i, m, x);
#pragma unroll
      for (int e = 0; e < kGroup; ++e) a = fmaxf(a, fabsf(x[e]));
    }
    if (is_q) {
#pragma unroll
      for (int o = 1; o < kChanGroups; o *= 2) a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
    }
    row_amax[i] = a;
    tile_amax = fmaxf(tile_amax, a);
  }
  Fp8Scale k_scale{0.0f, 0u};
  if (!is_q) {
#pragma unroll
    for (int o = 1; o < kWarpSize; o *= 2) tile_amax = fmaxf(tile_amax, __shfl_xor_sync(0xFFFFFFFFu, tile_amax, o));
    if (threadIdx.x % kWarpSize == 0) red[0][threadIdx.x / kWarpSize] = tile_amax;
    __syncthreads();
    float a = red[0][0];
#pragma unroll
    for (int v = 1; v < kWarps; ++v) a = fmaxf(a, red[0][v]);
    const float s = fp8_group_scale(a);
    if (threadIdx.x == 0) out.k_scales[static_cast<int64_t>(d.h) * out.k_scale_row + d.canonical] = s;
    k_scale = fp8_scale(s);
  }
  const int64_t row0 = static_cast<int64_t>(d.h) * tokens + d.row_begin + rs;  // the thread's row i = 0
  uint8_t* codes = (is_q ? out.q_codes : out.k_codes) + row0 * kHeadDim + j * kGroup;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    if (rs + kRowSlices * i >= d.n) break;
    float x[kGroup];
    row_minus(w, i, m, x);
    const float s = is_q ? fp8_group_scale(row_amax[i]) : 0.0f;
    const Fp8Scale sc = is_q ? fp8_scale(s) : k_scale;
    *reinterpret_cast<uint4*>(codes + i * kRowSlices * kHeadDim) = fp8_codes16(x, sc);
    if (is_q && j == 0) out.q_scales[row0 + i * kRowSlices] = s;
  }
}

// FP8 V tile from registers: channels 4u..4u+3 (scales sv from the stage's aux row), the
// thread's 16 keys (in the FP8 key order, below): 16 contiguous code bytes of each of the four V rows; a warp store covers two
// whole 32-byte sectors of 8 rows.
__device__ __forceinline__ void fp8_v(const uint2 (&w)[kGroup], const float (&sv)[4], const ItemDesc& d,
                                      int64_t col0, const Outputs<Op::kFp8>& out) {
  const VThread vt = v_thread();
  if (kGroup * vt.kc >= round_up(d.n, kVKeyPad)) return;
  const int64_t col = col0 + kGroup * vt.kc;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const Fp8Scale sc = fp8_scale(sv[k]);
    uint32_t word[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      // Column 4q + 2h + e holds key 8h + 2q + e (keys permuted within the 16-key group, so
      // an FP8 MMA's FP32 accumulator packs straight into the P operand; reference.fp8_v_column).
      word[q] = fp8_codes4(column_value(w, 2 * q, k), column_value(w, 2 * q + 1, k), column_value(w, 2 * q + 8, k),
                           column_value(w, 2 * q + 9, k), sc);
    }
    const int64_t vrow = static_cast<int64_t>(d.h) * kHeadDim + 4 * vt.u + k;
    *reinterpret_cast<uint4*>(out.v_codes + vrow * out.v_code_row + col) = make_uint4(word[0], word[1], word[2], word[3]);
  }
}

// ---------------------------------------------------------------------------------------------
// The FP16 policy's tiles (Fp16Outputs<Op::kNvfp4>): the values of the groups nvfp4_rows /
// nvfp4_v would encode, as FP16 at the positions the Hopper kernel's TMA reads
// ---------------------------------------------------------------------------------------------

// NVFP4 Q or K tile from registers as FP16: the thread's group of each of its 4 rows is 32 bytes
// of a 256-byte row, so the 8 lanes of a row write it whole (two 16-byte stores each) and a warp
// 4 rows. Q rows go to token order; K rows to the padded window order of the segment
// (nvfp4_key_order.cuh): key p of the segment to position vkey_start[s] + (p - p % 64) +
// window_position_of(p % 64). A block starts on a multiple of 128 keys, so key row_begin - a_s +
// r of the block lands on col0 + (r & 64) + window_position_of(r & 63), col0 = vkey_start[s] +
// (row_begin - a_s) as for V (the stage holds both table entries for an FP16 K item). The
// positions of rows [n, round_up(n, 64)) of a segment's last block get zeros (their stage rows
// are zeros, minus kbar: not zero, hence the separate store), those past it nothing.
__device__ __forceinline__ void nvfp4_rows_fp16(const uint32_t (&w)[kRawWords], const float (&m)[kGroup],
                                                const ItemDesc& d, const Stage& st,
                                                const Fp16Outputs<Op::kNvfp4>& out, int64_t tokens,
                                                const float* recip) {
  const int j = threadIdx.x % kChanGroups, rs = threadIdx.x / kChanGroups;
  const bool is_q = d.kind == Kind::kQ;
  int64_t first;  // row (Q) or position (K) of the tile's row 0
  if (is_q) {
    first = static_cast<int64_t>(d.h) * tokens + d.row_begin;
  } else {
    first = static_cast<int64_t>(d.h) * out.vkeys_cap + st.vkey_start + (d.row_begin - st.seg_start);
  }
  uint16_t* rows = (is_q ? out.q_f16 : out.k_f16) + first * kHeadDim + j * kGroup;
  const int written = is_q ? d.n : round_up(d.n, kVKeyPad);
  // Rows past n are computed too (no branch between the rows, as in nvfp4_rows).
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int r = rs + kRowSlices * i;
    float x[kGroup];
    row_minus(w, i, m, x);
    uint32_t v[kGroup / 2];
    nvfp4_group_fp16(x, recip, v);
    const int at = is_q ? r : (r & kVKeyPad) | sm90::window_position_of(r & (kVKeyPad - 1));
    uint4* dst = reinterpret_cast<uint4*>(rows + static_cast<int64_t>(at) * kHeadDim);
    if (r < d.n) {
      dst[0] = make_uint4(v[0], v[1], v[2], v[3]);
      dst[1] = make_uint4(v[4], v[5], v[6], v[7]);
    } else if (r < written) {
      dst[0] = dst[1] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The FP16 V staging area of a warp: its own part of the stage, the 4 KB its lanes' copy_columns
// read (key rows 64 (warp % 2) .. + 63, logical 16-byte chunks 4 (warp / 2) .. + 3), exactly the
// size of its output, 32 V^T rows (channels 32 (warp / 2) + row) x 128 bytes (the 64 positions of
// window warp % 2). Chunk cx (< 8: positions 8 cx .. 8 cx + 7) of output row `row` (< 32) sits at
//   key row  r = 64 (warp % 2) + row % 16 + 16 b + 32 (row / 16),   b = (cx ^ row / 4) % 2,
//   chunk    c = 4 (warp / 2) + p,                                  p = (cx / 2 ^ row / 8) % 4,
// swizzled like every stage access (swizzle_chunk(c, r)). Bit 4 of r (b) picks the bank half of
// the chunk, so (b, p) is its 16-byte bank group, and both accesses are conflict-free: the 32
// lanes of a staging store (lane (u % 8, t): word t of chunk i of row 4 (u % 8) + k) cover 8
// values of row / 4, hence 8 (b, p), x 4 words; the 8 lanes of a row in a copy-out load cover 8
// values of cx, hence 8 (b, p).
// Addresses: in the byte offset r 256 + 16 swizzle_chunk(c, r), b and p are bit fields of their
// own (b: 0x1000, and 0x40 through the swizzle; p: 0x30) which cx and row / 4 enter only by XOR,
// and row % 4 adds 256 (row % 4) without a carry. So offset(row, cx) = (base(row / 4) ^ flip(cx))
// + 256 (row % 4), with base(q) = offset(4 q, 0) = (base(0) ^ flip(q)) + rows(q): a lane's 32
// stores take 8 XORs and immediate offsets, its 8 loads 8 XORs.
constexpr uint32_t v_staging_flip(int cx) { return (cx & 1) * 0x1040u ^ ((cx >> 1) & 3) * 0x10u; }
constexpr uint32_t v_staging_rows(int q) { return 256u * (4 * (q & 3) + 32 * (q >> 2)); }

// base(q) = offset(4 q, 0), computed from the placement above.
__device__ __forceinline__ uint32_t v_staging_base(int warp, int q) {
  const int b = q & 1;
  const int r = kVKeyPad * (warp % 2) + 4 * (q & 3) + 16 * b + 32 * (q >> 2);
  const int c = 4 * (warp / 2) + ((q >> 1) & 3);
  return static_cast<uint32_t>(r * kRowChunks + swizzle_chunk(c, r)) * 16u;
}

// A lane's two base offsets: its staging stores' (word lane / 8 of row 4 (lane % 8), chunk 0) and
// its copy-out loads' (chunk lane % 8 of row lane / 8).
struct VStaging {
  uint32_t store, load;
};

__device__ __forceinline__ VStaging v_staging(int warp, int lane) {
  return {v_staging_base(warp, lane % 8) + 4u * (lane / 8),
          (v_staging_base(warp, 0) + 256u * (lane / 8)) ^ v_staging_flip(lane % 8)};
}

// Staging store (k, i) of a lane: word lane / 8 of chunk i of row 4 (lane % 8) + k.
__device__ __forceinline__ uint32_t v_staging_store_at(const VStaging& s, int k, int i) {
  return (s.store ^ v_staging_flip(i)) + 256u * k;
}

// Copy-out load jj of a lane: chunk lane % 8 of row 4 jj + lane / 8.
__device__ __forceinline__ uint32_t v_staging_load_at(const VStaging& s, int jj) {
  return (s.load ^ v_staging_flip(jj)) + v_staging_rows(jj);
}

// NVFP4 V tile as FP16. The column thread (VThread) holds group t = kc % 4 of its window for
// channels 4u..4u+3; in the window order group t's keys 2i, 2i + 1 sit at positions 8i + 2t,
// 8i + 2t + 1, one f16x2 word (the values of a group are never more than 4 bytes together). A
// warp holds channels 32 (warp / 2) .. + 31 of window warp % 2: 32 whole 128-byte row segments of
// v_f16. Stored straight from the registers, a store instruction would write 16-byte pieces of 8
// rows (4 lanes x 4 bytes each): half sectors. So the warp stages its 4 KB in its own part of the
// stage (free once all its lanes hold their columns: a __syncwarp, no CTA barrier) and copies
// them out whole: each store instruction writes 4 rows x 128 bytes, 16 bytes a lane (32 4-byte
// shared stores, 8 16-byte loads and 8 16-byte global stores a thread, against 32 4-byte global
// stores). A window past the tile's padded end (round_up(n, 64); a whole warp's) is computed and
// staged but not stored: leaving before the __syncwarps made ptxas compile the whole path twice
// (a WARPSYNC.COLLECTIVE copy for a divergent warp), +800 instructions.
__device__ __forceinline__ void nvfp4_v_fp16(const uint2 (&w)[kGroup], const ItemDesc& d, int64_t col0, Stage& st,
                                             const Fp16Outputs<Op::kNvfp4>& out, const float* recip) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize), warp = static_cast<int>(threadIdx.x / kWarpSize);
  char* tile = reinterpret_cast<char*>(st.tile);
  const VStaging at = v_staging(warp, lane);
  sync_warp();  // every lane of the warp holds its columns: the warp's part of the stage is free
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float x[kGroup];
#pragma unroll
    for (int e = 0; e < kGroup; ++e) x[e] = column_value(w, e, k);
    uint32_t v[kGroup / 2];
    nvfp4_group_fp16(x, recip, v);
#pragma unroll
    for (int i = 0; i < kGroup / 2; ++i)
      *reinterpret_cast<uint32_t*>(tile + v_staging_store_at(at, k, i)) = v[i];
  }
  sync_warp();  // the warp's 32 rows are staged
  // Copy-out: 8 lanes a row, each 16 bytes (chunk lane % 8) of row 4 jj + lane / 8.
  const int64_t row0 = static_cast<int64_t>(d.h) * kHeadDim + 32 * (warp / 2) + lane / 8;  // the lane's row jj = 0
  uint16_t* dst = out.v_f16 + row0 * out.vkeys_cap + col0 + kVKeyPad * (warp % 2) + 8 * (lane % 8);
  if (kVKeyPad * (warp % 2) >= round_up(d.n, kVKeyPad)) return;  // the window is past the padded end
#pragma unroll
  for (int jj = 0; jj < 8; ++jj) {
    *reinterpret_cast<uint4*>(dst + 4 * jj * out.vkeys_cap) =
        *reinterpret_cast<const uint4*>(tile + v_staging_load_at(at, jj));
  }
}

// One item from its stage, after the barrier that opened it. Every read of the stage happens
// before the barrier that opens the next item (an FP16 V item also writes its warps' parts of the
// stage, after their own reads: nvfp4_v_fp16).
template <class Out, int kStages>
__device__ __forceinline__ void process_item(const Inputs& in, const Out& out, const ItemDesc& d, Stage& st,
                                             PipeSmem<kStages>& sm) {
  constexpr Op op = Out::kOp;
  if (d.kind == Kind::kKStats) {
    block_stats(st, d, out, sm.red, SumOp{}, 0);
    return;
  }
  if constexpr (op == Op::kFp8) {
    if (d.kind == Kind::kVStats) {
      block_stats(st, d, out, sm.red, AbsMaxOp{}, 1);
      return;
    }
  }
  if (d.kind == Kind::kV) {
    const VThread vt = v_thread();
    uint2 w[kGroup];
    copy_columns(st, vt, w);
    // The first padded V column of the tile: keys of segment s sit at vkey_start[s] + (key - a_s).
    const int64_t col0 = static_cast<int64_t>(st.vkey_start) + (d.row_begin - st.seg_start);
    if constexpr (Out::kFp16) {
      nvfp4_v_fp16(w, d, col0, st, out, sm.recip);
    } else if constexpr (op == Op::kNvfp4) {
      nvfp4_v(w, d, col0, out, sm.recip);
    } else {
      const float4 s4 = *reinterpret_cast<const float4*>(&st.aux[4 * vt.u]);
      const float sv[4] = {s4.x, s4.y, s4.z, s4.w};
      fp8_v(w, sv, d, col0, out);
    }
    return;
  }
  uint32_t w[kRawWords];
  copy_rows(st, w);
  float m[kGroup];  // the 16 means of the thread's channels (K: kbar; NVFP4 Q: qbar; FP8 Q: none)
  if (d.kind == Kind::kK) {
    load16(st.aux + (threadIdx.x % kChanGroups) * kGroup, m);
  } else {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) m[e] = 0.0f;
  }
  if constexpr (op == Op::kNvfp4) {
    if (d.kind == Kind::kQ) {
      column_partials(st, sm.red, SumOp{});
      __syncthreads();
      nvfp4_q_mean(d.n, sm.red, sm.mean, out.qbar + (static_cast<int64_t>(d.canonical) * in.heads + d.h) * kHeadDim, m);
    }
    if constexpr (Out::kFp16) {
      nvfp4_rows_fp16(w, m, d, st, out, in.tokens, sm.recip);
    } else {
      nvfp4_rows(w, m, d, out, in.tokens, sm.recip);
    }
  } else {
    fp8_rows(w, m, d, out, in.tokens, sm.red);
  }
}

template <class Out, Pass pass, int kStages>
__device__ __forceinline__ void quantize_tiles(const Inputs& in, const Tables& tb, const Out& out, const ItemMap& map) {
  static_assert(kStages >= 2, "a ring of at least two stages");
  constexpr Op op = Out::kOp;
  PipeSmem<kStages>& sm = *static_cast<PipeSmem<kStages>*>(dynamic_smem());
  if constexpr (op == Op::kNvfp4) {
    if (threadIdx.x < 128) sm.recip[threadIdx.x] = nvfp4_recip_scaled(threadIdx.x);
  }
  const int stride = static_cast<int>(gridDim.x);
  const auto block_of = [&](int item) { return load_qblock(tb.qblocks, item_qblock<op, pass>(map, item)); };
  int next = static_cast<int>(blockIdx.x);  // the next item to copy in
  // Prologue: the CTA's first kStages items (one commit group each, empty past the end).
#pragma unroll
  for (int s = 0; s < kStages; ++s, next += stride) {
    if (next < map.items) {
      const ItemDesc d = decode_item<op, pass>(map, next, in.heads, block_of(next));
      issue_item(in, tb, out, d, sm.stage[s]);
      if (threadIdx.x == 0) sm.stage[s].desc = d;
    }
    cp_async_commit();
  }
  // The q block of `next`, fetched one item ahead so its latency hides behind the compute.
  QBlock next_blk{};
  if (next < map.items) next_blk = block_of(next);
  __syncthreads();  // the prologue's descriptors and the recip table are visible

  int s = 0;
  for (int item = static_cast<int>(blockIdx.x); item < map.items; item += stride) {
    Stage& st = sm.stage[s];
    Stage& freed = sm.stage[s == 0 ? kStages - 1 : s - 1];  // the last item's stage
    // Group of item i: i (the prologue's kStages groups, then one per later iteration); at most
    // kStages - 2 younger ones may still be in flight.
    cp_async_wait<kStages - 2>();
    ItemDesc d;
    if constexpr (kStages >= 3) d = st.desc;  // written at least one barrier ago
    __syncthreads();  // everyone's copies of this item landed; everyone is done with the last one
    if constexpr (kStages < 3) d = st.desc;
    if (item != static_cast<int>(blockIdx.x)) {  // refill the stage the last item used
      if (next < map.items) {
        const ItemDesc dn = decode_item<op, pass>(map, next, in.heads, next_blk);
        issue_item(in, tb, out, dn, freed);
        if (threadIdx.x == 0) freed.desc = dn;
      }
      cp_async_commit();
      next += stride;
      if (next < map.items) next_blk = block_of(next);
    }
    process_item(in, out, d, st, sm);
    s = s + 1 == kStages ? 0 : s + 1;
  }
}

template <Op op, Pass pass, int kStages>
__global__ void __launch_bounds__(kThreads, 2) quantize_kernel(Inputs in, Tables tb, Outputs<op> out, ItemMap map) {
  quantize_tiles<Outputs<op>, pass, kStages>(in, tb, out, map);
}

template <Op op, Pass pass, int kStages>
__global__ void __launch_bounds__(kThreads, 2) quantize_fp16_kernel(Inputs in, Tables tb, Fp16Outputs<op> out,
                                                                    ItemMap map) {
  quantize_tiles<Fp16Outputs<op>, pass, kStages>(in, tb, out, map);
}

// The tile kernel (launches 1 and 3) of an output policy.
template <class Out, Pass pass, int kStages>
constexpr auto tile_kernel() {
  if constexpr (Out::kFp16) {
    return &quantize_fp16_kernel<Out::kOp, pass, kStages>;
  } else {
    return &quantize_kernel<Out::kOp, pass, kStages>;
  }
}

}  // namespace quantize
}  // namespace flashinfer_h3
