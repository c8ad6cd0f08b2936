// The NVFP4 attention kernel (SPEC 3), mma.sync family: native on SM120 (backend mma_sync_fp4),
// and on Hopper with the emulated MMA layer (backend mma_sync_fp4_emulated: same source, same
// register contract; see mma_fp4.cuh).
//
// Work split: one CTA per (128-row query block, head), 8 warps x 16 query rows. The CTA walks its
// segment's keys in tiles of 128 (the reference's tile, so the running max moves at the same keys),
// streaming K and V^T tiles through a 3-stage cp.async ring. Per tile and warp:
//   mainloop   S = Q' K'^T (block-scaled MMAs) + delta, tail keys masked to -inf
//   softmax    online max/sum, Ptil = 2688 * 2^((S - m) c), P groups quantized in registers
//   PV         O = alpha O + P V (block-scaled MMAs)
// and at the end the epilogue writes bf16(O / l) for the block's real rows.
//
// Inputs are the workspace regions of flashinfer_h3/layout.py written by the quantize pre-pass and
// the plan tables of flashinfer_h3/plan.py. Nothing outside a segment's rows and padded V columns
// is ever read: out-of-range K rows and V columns are zero-filled by the copy itself.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "attention/epilogue.cuh"
#include "attention/mma_sync/mma_fp4.cuh"
#include "attention/softmax.cuh"
#include "attention/tile_schedule.cuh"
#include "common.cuh"
#include "numerics/formats.cuh"
#include "ptx/cp_async.cuh"
#include "ptx/ldmatrix.cuh"

namespace flashinfer_h3 {
namespace attn_nvfp4 {

constexpr int kHeadDim = 128;
constexpr int kCodeBytes = kHeadDim / 2;    // E2M1 codes of one row (two per byte)
constexpr int kScaleBytes = kHeadDim / 16;  // UE4M3 scales of one row
constexpr int kBlockRows = 128;             // query rows per CTA: the Q-smoothing block
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = kBlockRows / kWarps;  // 16: one m16 MMA row block per warp
constexpr int kTileKeys = softmax::kTileKeys;   // 128
constexpr int kNTiles = softmax::kNTiles;       // 16 n8 accumulators (S: keys, O: channels)
static_assert(kNTiles == attention::kEpilogueChunks, "the epilogue writes 16 n8 accumulators a row");
constexpr int kStages = 3;
static_assert(kWarpRows == 16, "each warp owns one m16 row block");
static_assert(kThreads == 2 * kTileKeys && kThreads == 2 * kHeadDim,
              "the copy and delta code give every key (and every V channel) two threads");

// Dynamic shared memory, bytes. K and V^T rows are 64 code bytes = 4 chunks of 16, stored with
// chunk q at position q ^ swizzle(row) (see smem_chunk): the fragment loads then hit 8 distinct
// 16-byte bank groups per 8 rows for both the permuted K rows and the consecutive V rows.
struct Smem {
  static constexpr int kKCodes = 0;
  static constexpr int kKScales = kKCodes + kTileKeys * kCodeBytes;
  static constexpr int kVCodes = kKScales + kTileKeys * kScaleBytes;
  static constexpr int kVScales = kVCodes + kHeadDim * kCodeBytes;
  static constexpr int kStageBytes = kVScales + kHeadDim * kScaleBytes;
  // qbar as f32 with 4 floats of padding between the channel halves, so that the two threads of
  // a key (one half each) read different banks.
  static constexpr int kQbarHalfStride = kHeadDim / 2 + 4;
  static constexpr int kQbar = kStages * kStageBytes;
  static constexpr int kDelta = kQbar + 2 * kQbarHalfStride * 4;  // f32 [2][kTileKeys]
  static constexpr int kBytes = kDelta + 2 * kTileKeys * 4;
};
static_assert(Smem::kStageBytes % 128 == 0 && Smem::kQbar % 16 == 0 && Smem::kDelta % 16 == 0,
              "cp.async and vector loads need aligned regions");
static_assert(Smem::kBytes <= 99 * 1024, "one CTA per SM on an RTX 5090 (99 KB per block)");

struct Params {
  __nv_bfloat16* out;         // [T, H, 128]
  const float* qbar;          // [q_blocks_cap, H, 128], canonical block order
  const uint8_t* q_codes;     // [H, T, 64]
  const uint8_t* q_scales;    // [H, T, 8]
  const uint8_t* k_codes;     // [H, T, 64]
  const uint8_t* k_scales;    // [H, T, 8]
  const uint8_t* v_codes;     // [H, 128, v_cols / 2]
  const uint8_t* v_scales;    // [H, 128, v_cols / 16]
  const int32_t* seg_bounds;  // [S + 1]
  const int32_t* vkey_start;  // [S + 1]
  const int32_t* qblocks;     // [NQB, 4] (segment, row_begin, row_end, canonical), schedule order
  int64_t tokens;
  int64_t v_cols;             // padded V key columns of the layout (vkeys_cap)
  int heads;
  int num_qblocks;
  float scale_log2;           // c = softmax_scale * log2(e)
};

// ---------------------------------------------------------------------------------------------
// Small primitives (the PTX wrappers live in ptx/; static_for in common.cuh)
// ---------------------------------------------------------------------------------------------

using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x2;
using ptx::smem_addr;

// PTX ISA 9.0 §9.7.9.25.3 (ptx/cp_async.cuh): 16 bytes, L2 only; a src-size of 0 writes 16 zero
// bytes and reads nothing, which is how rows outside the segment become zeros.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  ptx::cp_async_cg_16(dst, src, valid ? 16 : 0);
}

// The same for 4 bytes (cp.async.cg only moves 16; .ca allows 4, 8, 16).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  ptx::cp_async_ca_4(dst, src, valid ? 4 : 0);
}

// Byte offset of 16-byte chunk q of row r inside a [rows][64 B] tile.
__device__ __forceinline__ int smem_chunk(int row, int chunk) {
  return row * kCodeBytes + 16 * (chunk ^ (((row >> 1) ^ (row >> 3)) & 3));
}

// ---------------------------------------------------------------------------------------------
// Per-CTA coordinates
// ---------------------------------------------------------------------------------------------
// (attention/tile_schedule.cuh: the block, head, segment keys and padded V columns of a CTA)
using Cta = attention::QBlockTile;

// ---------------------------------------------------------------------------------------------
// Producer: one KV tile into a stage (every thread issues its share; two threads per key/channel)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void issue_kv_tile(uint8_t* stage, const Params& p, const Cta& cta,
                                              int tile) {
  const int tid = threadIdx.x, row = tid >> 1, half = tid & 1;
  const int key0 = tile * kTileKeys;
  const uint32_t base = smem_addr(stage);

  // K: key `row` of the tile, code chunks 2*half, 2*half+1 (channels 64*half..) and scale bytes
  // 4*half..4*half+3. Keys past the segment end read nothing and land as zeros.
  const bool key_ok = key0 + row < cta.seg_len;
  const int64_t token = cta.seg_begin + (key_ok ? key0 + row : 0);
  const int64_t krow = static_cast<int64_t>(cta.head) * p.tokens + token;
  const uint8_t* k_src = p.k_codes + krow * kCodeBytes;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int chunk = 2 * half + c;
    cp_async_16(base + Smem::kKCodes + smem_chunk(row, chunk), k_src + 16 * chunk, key_ok);
  }
  cp_async_4(base + Smem::kKScales + row * kScaleBytes + 4 * half,
             p.k_scales + krow * kScaleBytes + 4 * half, key_ok);

  // V^T: channel `row`, keys 64*half..64*half+63 of the tile (code chunks 2*half, 2*half+1 and one
  // 4-byte scale word). Padded columns are whole 64-key chunks, so a chunk pair is in or out.
  const bool v_ok = key0 + 64 * half < cta.v_padded_len;
  const int64_t vcol = cta.v_col_begin + (v_ok ? key0 + 64 * half : 0);
  const int64_t vrow = static_cast<int64_t>(cta.head) * kHeadDim + row;
  const uint8_t* v_src = p.v_codes + vrow * (p.v_cols / 2) + vcol / 2;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    cp_async_16(base + Smem::kVCodes + smem_chunk(row, 2 * half + c), v_src + 16 * c, v_ok);
  }
  cp_async_4(base + Smem::kVScales + row * kScaleBytes + 4 * half,
             p.v_scales + vrow * (p.v_cols / 16) + vcol / 16, v_ok);
}

// ---------------------------------------------------------------------------------------------
// delta_j = sum_c qbar_c Khat_jc for the keys of one tile (SPEC 3.4), from the K codes this thread
// copied itself (so a wait on its own copies suffices; the next barrier publishes the result).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void compute_tile_delta(const uint8_t* stage, const float* qbar_s,
                                                   float* delta_s) {
  const int tid = threadIdx.x, key = tid >> 1, half = tid & 1;
  const uint32_t scale_bytes =
      *reinterpret_cast<const uint32_t*>(stage + Smem::kKScales + key * kScaleBytes + 4 * half);
  const float* qbar_half = qbar_s + half * Smem::kQbarHalfStride;
  float acc = 0.0f;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint4 codes =
        *reinterpret_cast<const uint4*>(stage + Smem::kKCodes + smem_chunk(key, 2 * half + c));
    const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      // Word w holds channels 32c + 8w .. +7 of this half: group 2c + w/2 of its four.
      const float scale = e4m3_to_float(static_cast<uint8_t>(scale_bytes >> (8 * (2 * c + w / 2))));
      const float4 q_lo = *reinterpret_cast<const float4*>(qbar_half + 32 * c + 8 * w);
      const float4 q_hi = *reinterpret_cast<const float4*>(qbar_half + 32 * c + 8 * w + 4);
      const float q[8] = {q_lo.x, q_lo.y, q_lo.z, q_lo.w, q_hi.x, q_hi.y, q_hi.z, q_hi.w};
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float2 code = __half22float2(e2m1x2_to_half2(words[w] >> (8 * b)));
        // code * scale is exact in FP32, so this is qbar_c * Khat_jc as the recipe states.
        acc = fmaf(q[2 * b], code.x * scale, acc);
        acc = fmaf(q[2 * b + 1], code.y * scale, acc);
      }
    }
  }
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);  // the key's other half (lane tid ^ 1)
  if (half == 0) delta_s[key] = acc;
}

// ---------------------------------------------------------------------------------------------
// Mainloop pieces (one warp: 16 query rows x one 128-key tile)
// ---------------------------------------------------------------------------------------------

// Q' of this warp's rows as the A operand of both k64 steps (channels 0..63, 64..127), raw codes
// held for the whole CTA life. One scale register serves both steps: step s uses thread-id-a = s,
// so lane 4g + 2s + r supplies row g + 8r's scale word of step s. The MMA-layer fragments are
// made per tile: free on SM120, and on Hopper the decoded form would cost 22 more live registers.
struct QOperand {
  uint32_t codes[2][4];
  uint32_t sf;
};

__device__ __forceinline__ QOperand load_q_operand(const Params& p, const Cta& cta, int warp) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int row0 = cta.row_begin + warp * kWarpRows;
  const int64_t head_rows = static_cast<int64_t>(cta.head) * p.tokens;
  uint32_t a[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    const bool ok = row < cta.row_end;
    const uint8_t* src = p.q_codes + (head_rows + (ok ? row : cta.row_begin)) * kCodeBytes;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      // Fragment register r (run 0) and 2 + r (run 1) of step s: bytes 32s + 4t and 32s + 16 + 4t.
      a[s][r] = ok ? __ldg(reinterpret_cast<const uint32_t*>(src + 32 * s + 4 * t)) : 0u;
      a[s][2 + r] = ok ? __ldg(reinterpret_cast<const uint32_t*>(src + 32 * s + 16 + 4 * t)) : 0u;
    }
  }
  const int sf_row = row0 + g + 8 * (t & 1), sf_step = t >> 1;
  const bool sf_ok = sf_row < cta.row_end;
  const uint32_t sf =
      sf_ok ? __ldg(reinterpret_cast<const uint32_t*>(p.q_scales + (head_rows + sf_row) * kScaleBytes +
                                                      4 * sf_step))
            : 0u;
  QOperand q;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) q.codes[s][i] = a[s][i];
  }
  q.sf = sf;
  return q;
}

// S = Q' K'^T for one tile. n8 tile J's column n holds key qk_column_key(J, n) (softmax.cuh): the
// ldmatrix row addresses pick those K rows, and the SF_B words follow the same keys. Four n8 tiles
// share one SF_B register: tile J reads lane 4n + J%4, so lane 4n + tb holds the scales of column n
// of tiles 4i + tb (i = 0..3). The k64 steps are the outer loop so that only one A operand is live
// at a time (the Hopper emulation's A fragments are 16 registers each).
template <int kStep>
__device__ __forceinline__ void qk_step(float (&s)[kNTiles][4], const mma::FragA<kStep>& a,
                                        const uint8_t* stage) {
  const int lane = threadIdx.x & 31, n = lane >> 2, tb = lane & 3;
  // ldmatrix.x2: lanes 0-7 address run 0 (chunk 2 kStep), lanes 8-15 run 1 of column `lane % 8`.
  const int ld_row = lane & 7, ld_chunk = 2 * kStep + ((lane >> 3) & 1);
  const uint32_t k_codes = smem_addr(stage + Smem::kKCodes);
  const uint8_t* k_scales = stage + Smem::kKScales + 4 * kStep;
  uint32_t sfb = 0;
  static_for<kNTiles>([&](auto jc) {
    constexpr int J = decltype(jc)::value;
    if constexpr (J % 4 == 0) {
      sfb = *reinterpret_cast<const uint32_t*>(k_scales +
                                               softmax::qk_column_key(J + tb, n) * kScaleBytes);
    }
    uint32_t b[2];
    ldmatrix_x2(b, k_codes + smem_chunk(softmax::qk_column_key(J, ld_row), ld_chunk));
    mma::mma_nvfp4<J % 4>(s[J], a, b[0], b[1], sfb);
  });
}

// Hides a value's origin from the optimizer (an empty asm that claims to modify it). Used on the
// Q codes in the tile loop: otherwise the Hopper emulation's decode of the loop-invariant Q is
// hoisted out of the loop and its 32 registers stay live across it, which spills.
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ void qk_scores(float (&s)[kNTiles][4], const QOperand& q,
                                          const uint8_t* stage) {
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  const uint32_t step0[4] = {opaque(q.codes[0][0]), opaque(q.codes[0][1]), opaque(q.codes[0][2]),
                             opaque(q.codes[0][3])};
  qk_step<0>(s, mma::make_frag_a<0>(step0, q.sf), stage);
  const uint32_t step1[4] = {opaque(q.codes[1][0]), opaque(q.codes[1][1]), opaque(q.codes[1][2]),
                             opaque(q.codes[1][3])};
  qk_step<1>(s, mma::make_frag_a<1>(step1, q.sf), stage);
}

// S += delta (per key, the same for every row of the block); keys at or past the segment end get
// -inf. Masking uses the logical key of each column, not its position.
__device__ __forceinline__ void add_delta_and_mask(float (&s)[kNTiles][4], const float* delta_s,
                                                   int valid_keys) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
    const int key = softmax::qk_column_key(j, 2 * t);  // and key + 1 for the odd column
    const float2 d = *reinterpret_cast<const float2*>(delta_s + key);
    const bool ok0 = key < valid_keys, ok1 = key + 1 < valid_keys;
    s[j][0] = ok0 ? s[j][0] + d.x : -INFINITY;
    s[j][1] = ok1 ? s[j][1] + d.y : -INFINITY;
    s[j][2] = ok0 ? s[j][2] + d.x : -INFINITY;
    s[j][3] = ok1 ? s[j][3] + d.y : -INFINITY;
  }
}

// O += P V for the keys of chunk kChunk (64 keys) of one tile. n8 tile j of O is channels
// 8j..8j+7; its B fragment is channel 8j + g, keys of the chunk, straight from the V^T rows. SF_B as
// in qk_step: lane 4n + tb holds channel 8(4i + tb) + n's scale word of the chunk.
template <int kChunk>
__device__ __forceinline__ void pv_chunk(float (&o)[kNTiles][4], const mma::FragA<kChunk>& a,
                                         const uint8_t* stage) {
  const int lane = threadIdx.x & 31, n = lane >> 2, tb = lane & 3;
  const int ld_row = lane & 7, ld_chunk = 2 * kChunk + ((lane >> 3) & 1);
  const uint32_t v_codes = smem_addr(stage + Smem::kVCodes);
  const uint8_t* v_scales = stage + Smem::kVScales + 4 * kChunk;
  uint32_t sfb = 0;
  static_for<kNTiles>([&](auto jc) {
    constexpr int J = decltype(jc)::value;
    if constexpr (J % 4 == 0) {
      sfb = *reinterpret_cast<const uint32_t*>(v_scales + (8 * (J + tb) + n) * kScaleBytes);
    }
    uint32_t b[2];
    ldmatrix_x2(b, v_codes + smem_chunk(8 * J + ld_row, ld_chunk));
    mma::mma_nvfp4<J % 4>(o[J], a, b[0], b[1], sfb);
  });
}

// ---------------------------------------------------------------------------------------------
// Epilogue: out = bf16(O / l), real rows only
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void store_output(const Params& p, const Cta& cta, int warp,
                                             const float (&o)[kNTiles][4],
                                             const softmax::OnlineSoftmax& sm) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = sm.total(r);  // warp-collective: every lane takes part
    const int row = cta.row_begin + warp * kWarpRows + g + 8 * r;
    if (row >= cta.row_end) continue;
    __nv_bfloat16* dst = p.out + (static_cast<int64_t>(row) * p.heads + cta.head) * kHeadDim + 2 * t;
    // SPEC 3.8: bf16_rn(O / l), one rounding.
    attention::store_row_bf16<false>(dst, nullptr, l,
                                     [&](int j) { return make_float2(o[j][2 * r], o[j][2 * r + 1]); });
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------
// Grid: NQB * H CTAs, x = qblock * H + head, so that the hardware's in-order dispatch starts every
// head of the longest segments first (the plan lists blocks longest segment first).
__global__ void __launch_bounds__(kThreads, 1) attention_nvfp4_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5;

  const Cta cta = attention::qblock_tile(blockIdx.x, p.heads, p.qblocks, p.seg_bounds, p.vkey_start);
  const int num_tiles = (cta.seg_len + kTileKeys - 1) / kTileKeys;
  auto stage_ptr = [&](int tile) { return smem + (tile % kStages) * Smem::kStageBytes; };
  float* qbar_s = reinterpret_cast<float*>(smem + Smem::kQbar);
  float* delta_s = reinterpret_cast<float*>(smem + Smem::kDelta);

  // Prologue: start the first tiles, then stage qbar and the Q fragments while they fly.
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < num_tiles) issue_kv_tile(stage_ptr(i), p, cta, i);
    cp_async_commit();  // one group per tile slot, empty or not, keeps wait_group's count exact
  }
  if (threadIdx.x < kHeadDim) {
    const int c = threadIdx.x;
    qbar_s[(c / 64) * Smem::kQbarHalfStride + c % 64] =
        p.qbar[(static_cast<int64_t>(cta.canonical) * p.heads + cta.head) * kHeadDim + c];
  }
  const bool warp_has_rows = cta.row_begin + warp * kWarpRows < cta.row_end;
  const QOperand q = load_q_operand(p, cta, warp);
  __syncthreads();  // qbar_s
  cp_async_wait<kStages - 2>();
  compute_tile_delta(stage_ptr(0), qbar_s, delta_s);

  float o[kNTiles][4];
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  softmax::OnlineSoftmax sm;
  sm.init();

  for (int tile = 0; tile < num_tiles; ++tile) {
    // Tile `tile` and its delta are now visible to all; every warp is done with tile - 1, so its
    // stage (and the other delta buffer) may be refilled.
    __syncthreads();
    if (tile + kStages - 1 < num_tiles) {
      issue_kv_tile(stage_ptr(tile + kStages - 1), p, cta, tile + kStages - 1);
    }
    cp_async_commit();

    const uint8_t* stage = stage_ptr(tile);
    if (warp_has_rows) {  // warps holding only padding rows copy and compute delta, nothing else
      float s[kNTiles][4];
      qk_scores(s, q, stage);
      add_delta_and_mask(s, delta_s + (tile & 1) * kTileKeys, cta.seg_len - tile * kTileKeys);
      float alpha[2];
      sm.update(s, p.scale_log2, alpha);
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
      }
      const softmax::PChunk p0 = softmax::quantize_p_chunk<0>(s);
      const softmax::PChunk p1 = softmax::quantize_p_chunk<1>(s);
      const uint32_t p_sf = softmax::gather_pv_scale_a(p0.scales, p1.scales);
      pv_chunk<0>(o, mma::make_frag_a<0>(p0.codes, p_sf), stage);
      pv_chunk<1>(o, mma::make_frag_a<1>(p1.codes, p_sf), stage);
    }

    if (tile + 1 < num_tiles) {
      cp_async_wait<kStages - 2>();  // this thread's copies of tile + 1 have landed
      compute_tile_delta(stage_ptr(tile + 1), qbar_s, delta_s + ((tile + 1) & 1) * kTileKeys);
    }
  }

  if (warp_has_rows) store_output(p, cta, warp, o, sm);
}

}  // namespace attn_nvfp4
}  // namespace flashinfer_h3
