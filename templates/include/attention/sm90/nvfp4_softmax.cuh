// Online softmax and the in-register P quantisation of the NVFP4 recipe (SPEC 3.6-3.8) on one
// consumer thread's fragment of a 64 x 128 wgmma accumulator: two rows (g and g + 8 of its
// warp's 16), 32 key positions of each, in the window key order of nvfp4_key_order.cuh. The same
// functions take the fragment of a 64 x 64 accumulator (one 64-key window: 16 positions a row,
// one P group), which benchmarks/sm90_pipes.cu times for a schedule of 64-key tiles.
//
// Per KV tile (128 keys from a multiple of 128 after the segment start, the reference's tile):
//   S    = dot + delta  (delta, or -inf past the segment, is the accumulator's initial value)
//   m_t  = max(m_{t-1}, max_j S)
//   Ptil = 2688 * 2^((S - m_t) c) = 2^(S c - (m_t c - log2 2688))      one FFMA + one MUFU.EX2
//   l    = 2^((m_{t-1} - m_t) c) l + sum Ptil        (unquantized Ptil)
// then per row and 16-key group (the thread's 16 positions of a window, so no shuffle):
//   s = rn_e4m3(max / 6), r = 1 / s (a table), P = s * rn_e2m1(Ptil * r)
// written as f16x2 straight into the A registers of the PV wgmma: register 2i + r holds the
// accumulator pair (4i + 2r, 4i + 2r + 1), the A layout of k16 step i / 2 (ptx/wgmma.cuh).
//
// Production folds r into the exponent (kFoldPScale): the group scales come first (from the
// group maxima, below), so each group's exponential yields y = Ptil / s = 2^(S c - (bias +
// log2 s)) directly and the 64 FMULs Ptil * r of a tile are gone; the row sum is then
// sum over groups of s * sum y (for s = 0 the group's offset is 0 and its weight 1: y is Ptil,
// and P = s * code = 0). y equals the correctly rounded Ptil * r to within the exponential's own
// approximation (ex2.approx, ~2 ulp); rn_e2m1 of it is the same exact rounding as before.
#pragma once

#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "../../numerics/e2m1_round.cuh"
#include "../../numerics/formats.cuh"  // e4m3_to_float
#include "../../numerics/group_quantize.cuh"
#include "../../ptx/cvt.cuh"
#include "../../ptx/math.cuh"
#include "fp8_softmax.cuh"  // quad_max, quad_sum, exp2_fma
#include "nvfp4_shared_storage.cuh"  // PScaleFold

namespace flashinfer_h3 {
namespace sm90 {

constexpr float kLog2Nvfp4PScale = 11.392317422778761f;  // log2(2688): SPEC 3.6, Ptil <= 448 * 6

struct Nvfp4RowState {
  float m[2];      // running max of S (raw units) of rows g, g + 8
  float l[2];      // this thread's share of the running sum (reduced over the quad at the end)
  float alpha[2];  // rescale of O produced by the last softmax step

  __device__ __forceinline__ void reset() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    alpha[0] = alpha[1] = 0.0f;
  }
};

// The scale of one 16-key group of P: s = rn_e4m3(fl(max / 6)) (SPEC 3 "quantize a group"), its
// correctly rounded reciprocal (0 for s = 0: every P of the group is then 0) from the table, and
// s as f16x2 for the dequantisation. With kFold, instead of the reciprocal: the group's exponent
// offset bias + log2 s and its row-sum weight (both from the fold table, see the header).
struct PGroupScale {
  float recip;     // 1 / s (not kFold)
  float bias;      // kFold: y = 2^(S c - bias) = Ptil / s
  float weight;    // kFold: Ptil = weight * y (s; 1 for s = 0)
  uint32_t s2;     // f16x2 bits of (s, s)
  bool saturates;  // some Ptil r of the group may reach 7 (then rn_e2m1 needs its saturation)
};

// Entry `code` (a UE4M3 byte) of the P scales' table that p_group_scale<kFold> reads: kFold, the
// fold table's (log2 s rounded once from double, exact for powers of two; s), (0, 1) for s = 0
// and the NaN code; else the reciprocal r = 1 / s correctly rounded (SPEC 3), 0 for s = 0.
template <bool kFold>
__device__ __forceinline__ void fill_p_scale_table(uint32_t code, float* recip_table, PScaleFold* fold_table) {
  const bool no_scale = code == 0 || code == 0x7F;
  const float value = e4m3_to_float(static_cast<uint8_t>(code));
  if constexpr (kFold) {
    fold_table[code] =
        no_scale ? PScaleFold{0.0f, 1.0f} : PScaleFold{static_cast<float>(log2(static_cast<double>(value))), value};
  } else {
    recip_table[code] = no_scale ? 0.0f : __frcp_rn(value);
  }
}

template <bool kFold>
__device__ __forceinline__ PGroupScale p_group_scale(float pmax, float row_bias, const float* recip_table,
                                                     const PScaleFold* fold_table) {
  const uint32_t code = quantize::e4m3x2_word(quantize::div6_rn(pmax), 0.0f) & 0xFFu;
  PGroupScale g;
  if constexpr (kFold) {
    const PScaleFold f = fold_table[code];
    g.bias = row_bias + f.log2s;
    g.weight = f.weight;
  } else {
    g.recip = recip_table[code];
  }
  g.s2 = ptx::cvt_f16x2_e4m3x2(static_cast<uint16_t>(code * 0x0101u));
  // A normal s is within 1/16 of max / 6, so max r < 6.4; a subnormal one (codes 1..7) is not,
  // nor a saturated 448 if max exceeds 2688 by more than that (huge scores: the exponent's
  // rounding). kPMaxFast / 448 < 6.4.
  constexpr float kPMaxFast = 2800.0f;
  g.saturates = code - 1u < 7u || !(pmax <= kPMaxFast);
  return g;
}

// One 16-key group of one row: the 16 Ptil values (kFold: y = Ptil / s) at accumulator indices
// 4i + 2r + e of the window's i = 8w .. 8w + 7 -> 8 f16x2 A registers 2i + r. kQuantizeP = false
// (benchmark builds only) packs Ptil itself, to measure what the quantisation costs.
//
// kF16: each pair of y is rounded to FP16 first (the conversion the FP16 A operand needs anyway)
// and rn_e2m1 runs on the f16x2 pair (numerics/e2m1_round.cuh): 5 ops a pair instead of 9. The
// E2M1 rounding is exact for its FP16 input; the FP16 step is one more approximation of y, next
// to ex2.approx's: the code differs from that of the FP32 y only where y lies within half an FP16
// ulp (2^-11 relative) of a rounding tie, and then by one grid step (benchmarks/RESULTS.md,
// sixteenth session, gives the outputs' distance; the row sums stay FP32 on the FP32 y).
template <bool kQuantizeP, bool kSaturate, bool kFold, bool kF16, int kN>
__device__ __forceinline__ void quantize_p_group(const float (&p)[kN], uint32_t (&pa)[kN / 2], int w, int r,
                                                 const PGroupScale& g) {
  const __half2 s2 = *reinterpret_cast<const __half2*>(&g.s2);
#pragma unroll
  for (int i = 8 * w; i < 8 * w + 8; ++i) {
    __half2 h;
    if constexpr (kQuantizeP) {
      const float y0 = kFold ? p[4 * i + 2 * r] : __fmul_rn(p[4 * i + 2 * r], g.recip);
      const float y1 = kFold ? p[4 * i + 2 * r + 1] : __fmul_rn(p[4 * i + 2 * r + 1], g.recip);
      if constexpr (kF16) {
        const uint32_t y = h2_bits(__floats2half2_rn(y0, y1));
        h = __hmul2(h2_value(kSaturate ? e2m1_round_nonneg_h2(y) : e2m1_round_below7_h2(y)), s2);
      } else {
        // rn_e2m1 values are exact in FP16, and so is their product with s (<= 6 significant bits).
        const float v0 = kSaturate ? e2m1_round_nonneg(y0) : e2m1_round_below7(y0);
        const float v1 = kSaturate ? e2m1_round_nonneg(y1) : e2m1_round_below7(y1);
        h = __hmul2(__floats2half2_rn(v0, v1), s2);
      }
    } else {
      h = __floats2half2_rn(p[4 * i + 2 * r], p[4 * i + 2 * r + 1]);
    }
    pa[2 * i + r] = *reinterpret_cast<const uint32_t*>(&h);
  }
}

// 2^x for exponential i of a tile: MUFU.EX2, or for every kEvery-th (kEvery > 0, benchmark
// builds) the FMA-pipe polynomial, whose clamp at -125 gives a masked key 2^-125 instead of 0
// (rn_e2m1 makes it a zero code; in the row sum it is below every rounding).
template <int kEvery>
__device__ __forceinline__ float tile_exp2(float x, int i) {
  if constexpr (kEvery > 0) {  // (constexpr: no "% 0" for the compiler to warn about)
    if (i % kEvery == kEvery - 1) return exp2_fma(x);
  }
  return ptx::ex2_approx(x);
}

// The maximum of one group's 16 scores (a tree: the scale waits on it).
template <int kN>
__device__ __forceinline__ float group_max(const float (&s)[kN], int w, int r) {
  float m[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) m[j] = fmaxf(s[4 * (8 * w + j) + 2 * r], s[4 * (8 * w + j) + 2 * r + 1]);
#pragma unroll
  for (int j = 0; j < 4; ++j) m[j] = fmaxf(m[j], m[j + 4]);
  return fmaxf(fmaxf(m[0], m[2]), fmaxf(m[1], m[3]));
}

// What the exponential part of a tile hands the P quantisation: each group's scale and whether
// some group of this thread needs the saturating rounding.
template <int kWindows>
struct Nvfp4TileScales {
  PGroupScale group[kWindows][2];  // [window][row]
  bool saturates;
};

// The first part of a tile's softmax: s = the scores (delta and mask included) in, the
// exponentials out (kFold: y = Ptil / s of each group; else Ptil), in place; updates `st`
// (st.alpha is now this tile's rescale of O) and returns the group scales for
// nvfp4_quantize_p_tile. It reads and writes s and st only, so it may run while a wgmma still
// reads P's registers and accumulates into O (the pv_under_softmax benchmark build did that:
// measured slower, removed after 2ecf91a; nvfp4_kernel.cuh Nvfp4Variant).
// c = softmax_scale * log2(e).
//
// The group maxima come first, from the scores: Ptil is a non-decreasing function of S (one
// FFMA and ex2), so the group's largest Ptil is that of its largest score, and the row maximum
// is the maximum of the row's group maxima. That is one max pass instead of two, and (without
// kFold) the scales are under way while the 64 exponentials run.
//
// kN: the fragment's accumulator registers, 64 (a 128-key tile: two 64-key windows) or 32 (a
// 64-key tile: one window, so one group a row and no second group maximum to merge).
// kPolyExp2Every (benchmark builds; 0 in production): every n-th of the kN exponentials runs on
// the FMA pipe (fp8_softmax.cuh exp2_fma, relative error 7.6e-5, below FP16's rounding of y),
// as the FP8 kernel does with 2 in 128. Here MUFU is not the binding unit (XU 31 %): 1 or 2 in
// 64 measured 1.9-5.4 % slower on an H100 (benchmarks/RESULTS.md, twenty-eighth session).
template <bool kQuantizeP, bool kFoldIn, int kN, int kPolyExp2Every = 0>
__device__ __forceinline__ Nvfp4TileScales<kN / 32> nvfp4_softmax_exponentials(float (&s)[kN], Nvfp4RowState& st,
                                                                                float c, const float* recip_table,
                                                                                const PScaleFold* fold_table) {
  static_assert(kN == 64 || kN == 32, "a 64 x 128 or 64 x 64 accumulator fragment");
  constexpr int kWindows = kN / 32;  // 64-key windows of the tile = P groups of a row
  constexpr bool kFold = kFoldIn && kQuantizeP;
  float gmax[kWindows][2];  // [window][row]
#pragma unroll
  for (int w = 0; w < kWindows; ++w) {
#pragma unroll
    for (int r = 0; r < 2; ++r) gmax[w][r] = group_max(s, w, r);
  }
  float bias[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float row_max = gmax[0][r];
#pragma unroll
    for (int w = 1; w < kWindows; ++w) row_max = fmaxf(row_max, gmax[w][r]);
    // Every tile has a key of the segment, so m_new is finite; m = -inf before the first tile
    // gives alpha = 0 (O and l are 0 then).
    const float m_new = fmaxf(st.m[r], quad_max(row_max));
    st.alpha[r] = ptx::ex2_approx((st.m[r] - m_new) * c);
    st.m[r] = m_new;
    bias[r] = m_new * c - kLog2Nvfp4PScale;
  }
  Nvfp4TileScales<kWindows> scales;
  scales.saturates = false;
#pragma unroll
  for (int w = 0; w < kWindows; ++w) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      scales.group[w][r] = p_group_scale<kFold>(ptx::ex2_approx(fmaf(gmax[w][r], c, -bias[r])), bias[r],
                                                recip_table, fold_table);
      scales.saturates |= scales.group[w][r].saturates;
    }
  }
  if constexpr (kFold) {
    float ysum[kWindows][2] = {};  // [window][row]
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int w = i >> 5, r = (i >> 1) & 1;
      // y = Ptil / s; -inf (masked) -> 0 (2^-125 on a polynomial element: tile_exp2)
      s[i] = tile_exp2<kPolyExp2Every>(fmaf(s[i], c, -scales.group[w][r].bias), i);
      ysum[w][r] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // sum over windows of s_w * ysum_w, the last window's product first (two windows:
      // fmaf(s_0, ysum_0, s_1 ysum_1)).
      float tile_sum = scales.group[kWindows - 1][r].weight * ysum[kWindows - 1][r];
#pragma unroll
      for (int w = kWindows - 2; w >= 0; --w) tile_sum = fmaf(scales.group[w][r].weight, ysum[w][r], tile_sum);
      st.l[r] = fmaf(st.l[r], st.alpha[r], tile_sum);
    }
  } else {
    float lsum[2][2] = {};
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const int r = (i >> 1) & 1;
      s[i] = tile_exp2<kPolyExp2Every>(fmaf(s[i], c, -bias[r]), i);  // -inf (masked) -> 0 (or 2^-125)
      lsum[r][i & 1] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) st.l[r] = fmaf(st.l[r], st.alpha[r], lsum[r][0] + lsum[r][1]);
  }
  return scales;
}

// The second part: the exponentials of nvfp4_softmax_exponentials -> P (f16x2 A registers of the
// PV wgmma). The saturating rounding only when some group of the warp needs it (subnormal
// scales: groups far below the row max); warp-uniform, so no divergence. kFastRounding = false:
// always.
template <bool kQuantizeP, bool kFastRounding, bool kFoldIn, bool kF16Rounding, int kN>
__device__ __forceinline__ void nvfp4_quantize_p_tile(const float (&s)[kN], uint32_t (&pa)[kN / 2],
                                                      const Nvfp4TileScales<kN / 32>& scales) {
  constexpr int kWindows = kN / 32;
  constexpr bool kFold = kFoldIn && kQuantizeP;
  if (!kFastRounding || __any_sync(0xffffffffu, scales.saturates)) {
#pragma unroll
    for (int w = 0; w < kWindows; ++w) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        quantize_p_group<kQuantizeP, true, kFold, kF16Rounding>(s, pa, w, r, scales.group[w][r]);
      }
    }
  } else {
#pragma unroll
    for (int w = 0; w < kWindows; ++w) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        quantize_p_group<kQuantizeP, false, kFold, kF16Rounding>(s, pa, w, r, scales.group[w][r]);
      }
    }
  }
}

// One tile: s = the scores in, P out; both parts above, one after the other.
template <bool kQuantizeP, bool kFastRounding, bool kFoldIn, bool kF16Rounding, int kN, int kPolyExp2Every = 0>
__device__ __forceinline__ void nvfp4_softmax_tile(float (&s)[kN], uint32_t (&pa)[kN / 2], Nvfp4RowState& st,
                                                   float c, const float* recip_table, const PScaleFold* fold_table) {
  const Nvfp4TileScales<kN / 32> scales =
      nvfp4_softmax_exponentials<kQuantizeP, kFoldIn, kN, kPolyExp2Every>(s, st, c, recip_table, fold_table);
  nvfp4_quantize_p_tile<kQuantizeP, kFastRounding, kFoldIn, kF16Rounding, kN>(s, pa, scales);
}

}  // namespace sm90
}  // namespace flashinfer_h3
