// The FP8 attention kernel (SPEC 4), mma.sync family: native on SM120 (QMMA.16832 E4M3), and the
// same source on Hopper, where ptxas lowers the FP8 mma.sync to exact F16 unpacks + HMMA.
//
// Work split (as the NVFP4 kernel, attention_nvfp4.cuh): one CTA per (128-row query block, head),
// 8 warps x 16 query rows; the CTA walks its segment's keys in tiles of 64 counted from the
// segment start, streaming K and V^T tiles through a 4-stage cp.async ring. Per tile and warp:
//   QK^T   S = fp32(sq sk) * (qcode . kcode)     8 n8 key tiles x 4 k32 steps, E4M3 MMAs
//   mask   keys at or past the segment end -> -inf
//   softmax  online max/sum (softmax.cuh), Ptil = 256 * 2^((S - m) c), l from unquantized Ptil
//   P      Ptil -> E4M3 A fragments in registers (cvt.rn.satfinite.e4m3x2.f32), no shuffles
//   PV     per n8 channel tile: a fresh FP32 accumulator over the tile's 64 keys, then
//          O = alpha O + acc (two-level accumulation, SPEC 4.4; kept on SM120 too)
// and the epilogue writes bf16(O * sv / l) for the block's real rows.
//
// Why 64-key tiles (the reference uses 128; SPEC 5 allows another tile size, results then differ
// only where the running max moves): S and P of a 128-key tile plus O and the Q fragments leave
// ptxas no room on sm_90a, where each FP8 MMA becomes unpacks and two HMMAs (spills were
// measured with 128). Two 64-key tiles make up one 128-key K-scale block, so the K scale of tile
// t is k_scales[t / 2], exactly the reference's; V's padded columns (multiples of 64) cover
// whole tiles.
//
// Why P needs no data movement: the QK^T accumulator of n8 key tile i gives lane (g, t) keys
// 8i + 2t, 8i + 2t + 1 of rows g and g + 8, while the PV A operand wants per register the four
// consecutive k indices 4t..4t+3 (mma_fp8.cuh). The pre-pass stores V with the keys of every
// 16-key group (from the segment start) permuted, key 8h + 2q + e at column 4q + 2h + e
// (reference.fp8_v_column), so PV's k index 4t + u of 16-key group G is key 16G + 8(u/2) + 2t +
// u%2: the accumulator elements (tile 2G + u/2, element u%2) this lane already holds.
//
// Inputs are the workspace regions of flashinfer_h3/layout.py (fp8_layout) written by the
// quantize pre-pass and the plan tables of flashinfer_h3/plan.py. Nothing outside a segment's
// rows and padded V columns is read: out-of-range K rows are zero-filled by the copy.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "attention/epilogue.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_schedule.cuh"
#include "attention/mma_sync/mma_fp8.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/cvt.cuh"
#include "ptx/ldmatrix.cuh"

namespace flashinfer_h3 {
namespace attn_fp8 {

constexpr int kHeadDim = 128;
constexpr int kBlockRows = 128;  // query rows per CTA (a plan block)
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = kBlockRows / kWarps;  // 16: one m16 row block per warp
constexpr int kTileKeys = 64;                   // keys per KV tile
constexpr int kKScaleKeys = 128;                // keys per K-scale block (layout.Q_BLOCK)
constexpr int kSTiles = kTileKeys / 8;          // 8 n8 accumulators of S per tile
constexpr int kOTiles = kHeadDim / 8;           // 16 n8 accumulators of O
static_assert(kOTiles == attention::kEpilogueChunks, "the epilogue writes 16 n8 accumulators a row");
constexpr int kQKSteps = kHeadDim / 32;         // 4 k32 steps of QK^T (channels)
constexpr int kPVSteps = kTileKeys / 32;        // 2 k32 steps of PV (keys)
constexpr int kStages = 4;
constexpr int kKRowBytes = kHeadDim;            // one K row of a tile: 128 channels
constexpr int kVRowBytes = kTileKeys;           // one V^T row of a tile: 64 keys
constexpr float kPScale = 256.0f;               // SPEC 4.3: Ptil = 256 * 2^((S - m) c)
static_assert(kWarpRows == 16, "each warp owns one m16 row block");
static_assert(kKScaleKeys % kTileKeys == 0, "a tile lies in one K-scale block");
static_assert(kThreads == 4 * kTileKeys && kThreads == 2 * kHeadDim,
              "the copy gives every K row four threads and every V^T row two");

// Dynamic shared memory, bytes: per stage a K tile [64 keys][128 B] and a V^T tile
// [128 channels][64 B], both in 16-byte chunks placed so that the 8 row addresses of every
// ldmatrix matrix (8 consecutive rows, one chunk column) hit 8 distinct 16-byte bank groups:
// K chunk c of row r at c ^ (r % 8), V^T chunk c of row r at c ^ ((r / 2) % 4) (two rows share a
// 128-byte bank period).
struct Smem {
  static constexpr int kKCodes = 0;
  static constexpr int kVCodes = kKCodes + kTileKeys * kKRowBytes;
  static constexpr int kStageBytes = kVCodes + kHeadDim * kVRowBytes;
  static constexpr int kBytes = kStages * kStageBytes;
};
static_assert(Smem::kStageBytes % 128 == 0, "stages on 128-byte boundaries");
static_assert(Smem::kBytes <= 99 * 1024, "one CTA per SM on an RTX 5090 (99 KB per block)");

struct Params {
  __nv_bfloat16* out;           // [T, H, 128]
  const uint8_t* q_codes;       // [H, T, 128] E4M3
  const float* q_scales;        // [H, T]
  const uint8_t* k_codes;       // [H, T, 128] E4M3 of K' = k - kbar
  const float* k_scales;        // [H, k_scale_cols], canonical 128-key block order
  const uint8_t* v_codes;       // [H, 128, v_cols] V^T, keys permuted in 16s
  const float* v_scales;        // [S, H, 128]
  const int32_t* seg_bounds;    // [S + 1]
  const int32_t* vkey_start;    // [S + 1]
  const int32_t* qblock_start;  // [S + 1]
  const int32_t* qblocks;       // [NQB, 4] (segment, row_begin, row_end, canonical), schedule order
  int64_t tokens;
  int64_t v_cols;               // padded V key columns of the layout (vkeys_cap)
  int64_t k_scale_cols;         // k_scales.shape[1] (q_blocks_cap of the layout)
  int heads;
  float scale_log2;             // c = softmax_scale * log2(e)
  uint32_t zero;                // always 0, unknown to the compilers: see schedule_after
};

// ---------------------------------------------------------------------------------------------
// Shared-memory placement
// ---------------------------------------------------------------------------------------------

// Byte offsets of 16-byte chunk c of row r in the K tile [64][128 B] and the V^T tile [128][64 B].
__device__ __forceinline__ int k_smem_offset(int row, int chunk) {
  return row * kKRowBytes + 16 * (chunk ^ (row & 7));
}

__device__ __forceinline__ int v_smem_offset(int row, int chunk) {
  return row * kVRowBytes + 16 * (chunk ^ ((row >> 1) & 3));
}

// ---------------------------------------------------------------------------------------------
// Per-CTA coordinates
// ---------------------------------------------------------------------------------------------
// The work item of attention/tile_schedule.cuh (query block, head, the segment's keys and V
// columns) plus the canonical index of the segment's first 128-key block (its K scales).
struct Cta : attention::QBlockTile {
  int kblock_begin;
};

__device__ __forceinline__ Cta load_cta(const Params& p) {
  Cta cta;
  static_cast<attention::QBlockTile&>(cta) = attention::qblock_tile(
      static_cast<int>(blockIdx.x), p.heads, p.qblocks, p.seg_bounds, p.vkey_start);
  cta.kblock_begin = p.qblock_start[cta.segment];
  return cta;
}

// ---------------------------------------------------------------------------------------------
// Producer: one KV tile into a stage, 2 x 512 chunks of 16 bytes. K: thread 4r + x copies chunks
// 2x, 2x + 1 of key r (32 contiguous bytes); V^T: thread 2r + h copies chunks 2h, 2h + 1 of
// channel r. A segment's padded V columns are a multiple of 64, so every tile's 64 columns are
// inside them; K rows past the segment end read nothing and land as zeros.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void issue_kv_tile(uint8_t* stage, const Params& p, const Cta& cta,
                                              int tile) {
  const int tid = threadIdx.x;
  const int key0 = tile * kTileKeys;
  const uint32_t base = ptx::smem_addr(stage);
  {
    const int row = tid >> 2, x = tid & 3;
    const bool key_ok = key0 + row < cta.seg_len;
    const int64_t token = cta.seg_begin + (key_ok ? key0 + row : 0);
    const uint8_t* src =
        p.k_codes + (static_cast<int64_t>(cta.head) * p.tokens + token) * kKRowBytes + 32 * x;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      ptx::cp_async_cg_16(base + Smem::kKCodes + k_smem_offset(row, 2 * x + c), src + 16 * c,
                          key_ok ? 16 : 0);
    }
  }
  {
    const int row = tid >> 1, h = tid & 1;
    const uint8_t* src = p.v_codes + (static_cast<int64_t>(cta.head) * kHeadDim + row) * p.v_cols +
                         cta.v_col_begin + key0 + 32 * h;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      ptx::cp_async_cg_16(base + Smem::kVCodes + v_smem_offset(row, 2 * h + c), src + 16 * c, 16);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Q operand: this warp's 16 rows. The A fragments of each k32 step are read from global memory
// (L1) when the step needs them, every tile: 2 KB per warp and tile next to its 24 KB of shared
// memory fragment reads, and 16 registers that are free for the rest of the tile (on sm_90a ptxas
// needs them: its FP8 MMA lowering keeps a product temporary per MMA in flight).
// ---------------------------------------------------------------------------------------------
struct QOperand {
  const uint32_t* src[2];  // rows g, g + 8: code bytes 4t.. (padding rows: the block's row 0)
  float scale[2];          // sq of rows g and g + 8 (0 for padding rows)
};

__device__ __forceinline__ QOperand load_q_operand(const Params& p, const Cta& cta, int warp) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = cta.row_begin + warp * kWarpRows;
  const int64_t head_rows = static_cast<int64_t>(cta.head) * p.tokens;
  QOperand q;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    const bool ok = row < cta.row_end;
    q.src[r] = reinterpret_cast<const uint32_t*>(
        p.q_codes + (head_rows + (ok ? row : cta.row_begin)) * kHeadDim + 4 * t);
    q.scale[r] = ok ? __ldg(p.q_scales + head_rows + row) : 0.0f;
  }
  return q;
}

// The A fragment of k32 step k: registers r (k 4t..) and 2 + r (k 16 + 4t..) of row g + 8r are
// channels 32k + 4t.. and 32k + 16 + 4t.. of that row (mma_fp8.cuh).
__device__ __forceinline__ void q_fragment(uint32_t (&a)[4], const QOperand& q, int k) {
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = __ldg(q.src[r & 1] + 8 * k + 4 * (r >> 1));
}

// A scheduling fence: `addr` made to depend on `value` through Params::zero, which is 0 at run
// time but a kernel argument to nvcc and ptxas, so neither can fold the dependency away. An
// instruction using the result cannot be issued before `value` exists (one LOP3 + one IADD).
// PV uses it to keep ptxas from hoisting all 16 ldmatrix of a tile (and, on sm_90a, their F16
// unpacks and the MMAs' product temporaries) above the first products: with it the kernel fits
// 255 registers without spills on sm_90a (it spilled 8-92 bytes in every variant without).
__device__ __forceinline__ uint32_t schedule_after(uint32_t addr, float value, uint32_t zero) {
  return addr + (__float_as_uint(value) & zero);
}

// ---------------------------------------------------------------------------------------------
// Mainloop pieces (one warp: 16 query rows x one 64-key tile)
// ---------------------------------------------------------------------------------------------

// dot = Q K^T for one tile: n8 tile i holds keys 8i..8i+7 in their natural order (column n of
// the MMA = key 8i + n). The k32 steps are the outer loop, so only one step's A operand is in
// use at a time; one ldmatrix.x4 gives the B fragments of two n8 tiles: lane l addresses key
// 8(i + l / 16) + l % 8, chunk 2k + (l / 8) % 2.
__device__ __forceinline__ void qk_dot(float (&s)[kSTiles][4], const QOperand& q,
                                       const uint8_t* stage) {
  const int lane = threadIdx.x & 31;
  const uint32_t k_codes = ptx::smem_addr(stage + Smem::kKCodes);
#pragma unroll
  for (int i = 0; i < kSTiles; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
  for (int k = 0; k < kQKSteps; ++k) {
    uint32_t a[4];
    q_fragment(a, q, k);
#pragma unroll
    for (int i = 0; i < kSTiles; i += 2) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, k_codes + k_smem_offset(8 * (i + (lane >> 4)) + (lane & 7),
                                             2 * k + ((lane >> 3) & 1)));
      mma::mma_e4m3_m16n8k32(s[i], a, b[0], b[1]);
      mma::mma_e4m3_m16n8k32(s[i + 1], a, b[2], b[3]);
    }
  }
}

// S = fp32(fp32(sq sk) * dot) (SPEC 4.2, the reference's rounding); keys at or past the segment
// end get -inf.
__device__ __forceinline__ void scale_and_mask(float (&s)[kSTiles][4], const QOperand& q,
                                               float sk, int valid_keys) {
  const int t = threadIdx.x & 3;
  const float scale[2] = {__fmul_rn(q.scale[0], sk), __fmul_rn(q.scale[1], sk)};
#pragma unroll
  for (int i = 0; i < kSTiles; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = 8 * i + 2 * t + (e & 1);
      s[i][e] = key < valid_keys ? __fmul_rn(scale[e >> 1], s[i][e]) : -INFINITY;
    }
  }
}

// Ptil -> the PV A fragments. k32 step k covers 16-key groups 2k (registers 0, 1) and 2k + 1
// (registers 2, 3); byte u of a register is accumulator (tile 2G + u / 2, element u % 2) of the
// row (see the file comment). PTX ISA 9.0 §9.7.9.21 (cvt): e4m3x2 RN with satfinite (Ptil <= 256
// never saturates); ptx/cvt.cuh's wrapper puts its first argument in the low byte.
__device__ __forceinline__ void pack_p(uint32_t (&pa)[kPVSteps][4], const float (&p)[kSTiles][4]) {
#pragma unroll
  for (int k = 0; k < kPVSteps; ++k) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tile = 4 * k + 2 * h;  // first n8 tile of group G = 2k + h
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t lo = ptx::cvt_e4m3x2_rn_satfinite(p[tile][2 * r], p[tile][2 * r + 1]);
        const uint32_t hi =
            ptx::cvt_e4m3x2_rn_satfinite(p[tile + 1][2 * r], p[tile + 1][2 * r + 1]);
        pa[k][2 * h + r] = lo | hi << 16;
      }
    }
  }
}

// O = fp32(fp32(alpha O) + fp32(P V)) with a fresh FP32 accumulator per n8 channel tile j and
// KV tile (two-level, SPEC 4.4). B of channel tiles j, j + 1 from one ldmatrix.x4: lane l
// addresses channel 8(j + l / 16) + l % 8, chunk 2k + (l / 8) % 2 of the tile's V columns, which
// hold the keys in the P fragments' k order. The loads of pair j / 2 wait for the products of
// pair j / 2 - 2 (schedule_after): two pairs in flight.
__device__ __forceinline__ void pv_accumulate(float (&o)[kOTiles][4],
                                              const uint32_t (&pa)[kPVSteps][4],
                                              const float (&alpha)[2], const uint8_t* stage,
                                              uint32_t zero) {
  const int lane = threadIdx.x & 31;
  const uint32_t v_codes = ptx::smem_addr(stage + Smem::kVCodes);
  float last[2] = {0.0f, 0.0f};  // a product of the pair two before (0: nothing to wait for)
#pragma unroll
  for (int j = 0; j < kOTiles; j += 2) {
    const uint32_t v_base = schedule_after(v_codes, last[(j / 2) & 1], zero);
    float acc[2][4] = {};
#pragma unroll
    for (int k = 0; k < kPVSteps; ++k) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, v_base + v_smem_offset(8 * (j + (lane >> 4)) + (lane & 7),
                                            2 * k + ((lane >> 3) & 1)));
      mma::mma_e4m3_m16n8k32(acc[0], pa[k], b[0], b[1]);
      mma::mma_e4m3_m16n8k32(acc[1], pa[k], b[2], b[3]);
    }
    last[(j / 2) & 1] = acc[1][3];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        o[j + x][e] = __fadd_rn(__fmul_rn(alpha[e >> 1], o[j + x][e]), acc[x][e]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Epilogue: out = bf16(fp32(fp32(O sv) / l)), real rows only (SPEC 4.4)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void store_output(const Params& p, const Cta& cta, int warp,
                                             const float (&o)[kOTiles][4],
                                             const softmax::OnlineSoftmax& sm) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float* sv = p.v_scales +
                    (static_cast<int64_t>(cta.segment) * p.heads + cta.head) * kHeadDim + 2 * t;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = sm.total(r);  // warp-collective: every lane takes part
    const int row = cta.row_begin + warp * kWarpRows + g + 8 * r;
    if (row >= cta.row_end) continue;
    __nv_bfloat16* dst =
        p.out + (static_cast<int64_t>(row) * p.heads + cta.head) * kHeadDim + 2 * t;
    attention::store_row_bf16<true>(dst, sv, l,
                                    [&](int j) { return make_float2(o[j][2 * r], o[j][2 * r + 1]); });
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------
// Grid: NQB * H CTAs, x = schedule_index * H + head (every head of the longest segments first).
__global__ void __launch_bounds__(kThreads, 1) attention_fp8_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5;
  const Cta cta = load_cta(p);
  const int num_tiles = (cta.seg_len + kTileKeys - 1) / kTileKeys;
  auto stage_ptr = [&](int tile) { return smem + (tile % kStages) * Smem::kStageBytes; };
  const float* k_scales =
      p.k_scales + static_cast<int64_t>(cta.head) * p.k_scale_cols + cta.kblock_begin;

  // Prologue: start the first tiles, then the Q pointers and scales while they fly.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < num_tiles) issue_kv_tile(stage_ptr(i), p, cta, i);
    ptx::cp_async_commit();  // one group per tile slot, empty or not: wait_group counts exactly
  }
  const bool warp_has_rows = cta.row_begin + warp * kWarpRows < cta.row_end;
  const QOperand q = load_q_operand(p, cta, warp);

  float o[kOTiles][4];
#pragma unroll
  for (int j = 0; j < kOTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  softmax::OnlineSoftmax sm;
  sm.init();

  for (int tile = 0; tile < num_tiles; ++tile) {
    // This thread's copies of `tile` have landed; after the barrier everyone's have, and every
    // warp is done with tile - 1, whose stage the next issue refills.
    ptx::cp_async_wait<kStages - 2>();
    __syncthreads();
    if (tile + kStages - 1 < num_tiles) {
      issue_kv_tile(stage_ptr(tile + kStages - 1), p, cta, tile + kStages - 1);
    }
    ptx::cp_async_commit();

    if (warp_has_rows) {  // warps holding only padding rows copy, nothing else
      const uint8_t* stage = stage_ptr(tile);
      // The K scale of the 128-key block (from the segment start) holding this tile.
      const float sk = __ldg(k_scales + tile * kTileKeys / kKScaleKeys);
      float s[kSTiles][4];
      qk_dot(s, q, stage);
      scale_and_mask(s, q, sk, cta.seg_len - tile * kTileKeys);
      float alpha[2];
      sm.update(s, p.scale_log2, alpha, kPScale);
      uint32_t pa[kPVSteps][4];
      pack_p(pa, s);
      pv_accumulate(o, pa, alpha, stage, p.zero);
    }
  }
  ptx::cp_async_wait<0>();  // no copy is in flight when the CTA exits

  // The coordinates again (the cp.async memory clobbers make them reloads from L1), rather than
  // registers held across the tile loop.
  if (warp_has_rows) store_output(p, load_cta(p), warp, o, sm);
}

}  // namespace attn_fp8
}  // namespace flashinfer_h3
