// Online softmax (shared by the mma.sync NVFP4 and FP8 kernels; the P scale is a parameter) and
// the two-level quantization of P for the NVFP4 attention kernel (SPEC 3.6-3.8, 4.3).
//
// Works on one warp's slice of a KV tile: S is 16 query rows x 128 keys held as 16 m16n8 FP32
// accumulators (lane g = lane/4, t = lane%4 holds rows g and g+8, columns 2t and 2t+1 of each).
// Which logical key each accumulator column holds is chosen by the kernel's K fragment loads (the
// key permutation below); it is chosen so that, after QK^T, every lane already holds the keys it
// must supply as the PV A operand, and P becomes E2M1 fragments without moving between lanes.
#pragma once

#include <math.h>
#include <stdint.h>

#include "numerics/formats.cuh"
#include "ptx/prmt.cuh"

namespace flashinfer_h3 {
namespace softmax {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr float kPtilMax = 2688.0f;  // 448 * 6: the row max of P lands on the largest E4M3 scale
constexpr int kTileKeys = 128;
constexpr int kNTiles = kTileKeys / 8;  // m16n8 accumulators per warp and tile

// ---------------------------------------------------------------------------------------------
// The key permutation
// ---------------------------------------------------------------------------------------------
// The PV A operand of k64 chunk c (keys 64c..64c+63 of the tile) wants, in lane t, keys 8t..8t+7
// (fragment registers 0 and 1: rows g, g+8) and 32+8t..32+8t+7 (registers 2 and 3), element e in
// nibble e. An accumulator gives lane t the columns 2t, 2t+1 of each n8 tile, so n8 tile
// J = 8c + 4h + x (h < 2, x < 4) is made to hold, in column 2t + p, key 64c + 32h + 8t + 2x + p:
// the lane's 8 keys of run h are then elements 2x + p of S[8c+4h+x][p] (row g) and [2+p] (row g+8).
__host__ __device__ constexpr int qk_column_key(int ntile, int column) {
  return 64 * (ntile >> 3) + 32 * ((ntile >> 2) & 1) + 8 * (column >> 1) + 2 * (ntile & 3) +
         (column & 1);
}

// ---------------------------------------------------------------------------------------------
// Quad reductions: the four lanes g*4 .. g*4+3 share the rows g and g+8
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, 1));
  return fmaxf(x, __shfl_xor_sync(kFullWarp, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(kFullWarp, x, 1);
  return x + __shfl_xor_sync(kFullWarp, x, 2);
}

// ---------------------------------------------------------------------------------------------
// Online softmax state of the rows g and g+8
// ---------------------------------------------------------------------------------------------
struct OnlineSoftmax {
  float row_max[2];  // m_t in raw score units (-inf before the first tile)
  float row_sum[2];  // this lane's share of l_t (the quad's shares are added at the end)

  __device__ __forceinline__ void init() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
  }

  // One tile: S (masked keys at -inf) -> Ptil = p_scale * 2^((S - m_t) c) in place (p_scale: 2688
  // for NVFP4, SPEC 3.6; 256 for FP8, SPEC 4.3). Returns, per row, alpha = 2^((m_{t-1} - m_t) c),
  // the factor the caller applies to O.
  // kN: the n8 accumulators of the tile (16 for 128 keys; the FP8 kernel's tiles have 8).
  template <int kN>
  __device__ __forceinline__ void update(float (&s)[kN][4], float c, float (&alpha)[2],
                                         float p_scale = kPtilMax) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[j][e]);
    }
    float m_ref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(row_max[r], quad_max(tile_max[r]));
      // A row whose keys are all masked keeps m = -inf; subtracting 0 instead keeps -inf - -inf
      // (NaN) out of both exponents: Ptil and alpha are then 0.
      m_ref[r] = m_new == -INFINITY ? 0.0f : m_new;
      alpha[r] = exp2f((row_max[r] - m_ref[r]) * c);
      row_max[r] = m_new;
    }
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = p_scale * exp2f((s[j][e] - m_ref[e >> 1]) * c);
        s[j][e] = p;
        tile_sum[e >> 1] += p;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] = alpha[r] * row_sum[r] + tile_sum[r];
  }

  // l of rows g and g+8, complete (the same value in the four lanes of the quad).
  __device__ __forceinline__ float total(int r) const { return quad_sum(row_sum[r]); }
};

// ---------------------------------------------------------------------------------------------
// Two-level quantization of P into PV A fragments
// ---------------------------------------------------------------------------------------------
// A P group is 16 consecutive keys from the segment start; tiles start at multiples of 128 keys
// from the segment start, so groups are keys 16j..16j+15 of a tile. Lane t holds 8 keys of group
// (chunk c, j = 2h + t/2), and lane t^1 the other 8.
struct PChunk {
  uint32_t codes[4];  // the A fragment registers of the chunk's m16n8k64 product
  uint32_t scales;    // byte 2r + h: this lane's UE4M3 scale of (row g + 8r, run h)
};

template <int kChunk>
__device__ __forceinline__ PChunk quantize_p_chunk(const float (&p)[kNTiles][4]) {
  PChunk out;
  out.scales = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v[8];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        v[2 * x] = p[8 * kChunk + 4 * h + x][2 * r];
        v[2 * x + 1] = p[8 * kChunk + 4 * h + x][2 * r + 1];
      }
      float group_max = 0.0f;  // Ptil >= 0
#pragma unroll
      for (int e = 0; e < 8; ++e) group_max = fmaxf(group_max, v[e]);
      group_max = fmaxf(group_max, __shfl_xor_sync(kFullWarp, group_max, 1));
      // SPEC 3.7: the group function of every operand, s = rn_e4m3(max / 6), codes rn_e2m1(P / s).
      const Nvfp4Scale scale = nvfp4_scale_from_amax(group_max);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = nvfp4_scaled(v[e], scale);
      out.codes[2 * h + r] = e2m1x8_from_float(v);
      out.scales |= static_cast<uint32_t>(scale.code) << (8 * (2 * r + h));
    }
  }
  return out;
}

// The SF_A word of the PV products: chunk c uses thread-id-a = c, so row m's four scales (groups
// j = 0..3 of the chunk) must sit in lane 4(m%8) + 2c + m/8, byte j. In a quad, lanes t = 0, 1
// computed groups j = 0, 2 of both rows and lanes 2, 3 groups j = 1, 3 (pairs agree after the
// max exchange), so each lane t reads the chunk t/2 word of one lane of each pair and keeps the
// bytes of row t%2. Lane t offers its chunk t%2 word, which makes both reads plain shuffles.
__device__ __forceinline__ uint32_t gather_pv_scale_a(uint32_t chunk0_scales,
                                                      uint32_t chunk1_scales) {
  const int lane = threadIdx.x & 31, quad_base = lane & ~3, t = lane & 3;
  const uint32_t offer = (t & 1) ? chunk1_scales : chunk0_scales;
  const int chunk = t >> 1;
  const uint32_t even_groups = __shfl_sync(kFullWarp, offer, quad_base + chunk);      // j = 0, 2
  const uint32_t odd_groups = __shfl_sync(kFullWarp, offer, quad_base + 2 + chunk);   // j = 1, 3
  // Row g (t even): bytes 0 (h=0) and 1 (h=1) of each; row g+8: bytes 2 and 3.
  // prmt (ptx/prmt.cuh): result byte k takes source byte sel[k] of {odd:even}.
  return ptx::prmt(even_groups, odd_groups, (t & 1) ? 0x7362u : 0x5140u);
}

}  // namespace softmax
}  // namespace flashinfer_h3
