// Online softmax of the FP8 recipe (docs/spec.md section 4) on one consumer thread's fragment of a
// 64 x 128 wgmma accumulator: two rows (g and g + 8 of its warp's 16), 32 keys of each.
//
// Per KV tile t of 128 keys (one K-scale block):
//   S    = fp32(sq * sk) * dot                     sk of the tile's block, sq of the row
//   m_t  = max(m_{t-1}, max_j S)                   the max of S is fp32(sq sk) * max(dot): sq sk >= 0
//   Ptil = 256 * 2^((S - m_t) c) = 2^(dot * (sq sk c) - (m_t c - 8))      one FFMA + one MUFU.EX2
//   l    = 2^((m_{t-1} - m_t) c) l + sum Ptil      (unquantized Ptil)
// and P is packed as E4M3 codes straight into the A registers of the PV wgmma: with V's keys
// stored in the FP8 key order (reference.fp8_v_column), A register 2h + r of k-step k holds the
// accumulator pairs of chunks 4k + 2h and 4k + 2h + 1 of row g + 8r, in that order.
#pragma once

#include <math.h>
#include <stdint.h>

#include "../../ptx/fp8_pack.cuh"
#include "../../ptx/math.cuh"

namespace flashinfer_h3 {
namespace sm90 {

constexpr float kFp8PScale = 256.0f;  // spec 4.3: Ptil = 256 * 2^((S - m) c)
constexpr float kLog2FP8PScale = 8.0f;

struct Fp8RowState {
  float m[2];      // running max of S (raw units) of rows g, g + 8
  float l[2];      // this thread's share of the running sum (reduced over the quad at the end)
  float alpha[2];  // rescale of the previous O, produced by the last softmax step
  float sq[2];     // Q scales of the rows

  __device__ __forceinline__ void reset(float sq0, float sq1) {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    alpha[0] = alpha[1] = 0.0f;
    sq[0] = sq0;
    sq[1] = sq1;
  }
};

// 2^x on the FMA pipe, for the share of the exponentials taken off the MUFU unit (FP8 attention
// at head dim 128 needs one exp per 512 tensor FLOPs, which makes MUFU.EX2 as busy as the tensor
// cores; see docs/design.md). x = j + f with j = round(x), f in [-0.5, 0.5]; 2^f by a degree-3
// polynomial fitted for relative error (max 7.6e-5 over the interval), 2^j added to its exponent
// field. x is clamped at -125 so the exponent never underflows: 2^-125 instead of 0, which E4M3
// rounds to 0 and which is below any row sum's rounding.
__device__ __forceinline__ float exp2_fma(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: x + kRound holds round(x) in its low mantissa bits
  x = fmaxf(x, -125.0f);
  const float t = x + kRound;
  const float f = x - (t - kRound);
  const float p = fmaf(fmaf(fmaf(0.055170975625514984f, f, 0.24260970950126648f), f, 0.6932609677314758f), f,
                       0.9999281764030457f);
  // bits(t) << 23 = round(x) << 23: the high bits of kRound's pattern shift out.
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The maxima of the thread's two rows (32 keys each) of the raw dot products, reduced over the
// quad: the max of every key of the row in this tile. Masked keys (kMasked: columns >= valid)
// are set to -inf first. One row after the other, in two chains each (halves the dependent
// FMNMX chain; four measured no faster and cost registers): row g's quad shuffles then run
// while row g + 8's chains do; with the rows interleaved the kernel measured 1-2 % slower
// (benchmarks/RESULTS.md).
template <bool kMasked>
__device__ __forceinline__ void fp8_row_maxima(float (&s)[64], float (&row_max)[2], int valid, int quad_col) {
  if constexpr (kMasked) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (8 * i + quad_col + e >= valid) s[4 * i + e] = s[4 * i + 2 + e] = -INFINITY;
      }
    }
  }
  // Key k (0..31) of row r is s[4 (k / 2) + 2 r + k % 2].
  auto key = [&](int r, int k) { return s[4 * (k >> 1) + 2 * r + (k & 1)]; };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m0 = key(r, 0), m1 = key(r, 1);
#pragma unroll
    for (int k = 2; k < 32; k += 2) {
      m0 = fmaxf(m0, key(r, k));
      m1 = fmaxf(m1, key(r, k + 1));
    }
    row_max[r] = quad_max(fmaxf(m0, m1));
  }
}

// A registers 2m and 2m + 1 of the PV wgmma's E4M3 operand (k-step m / 2; the header's layout)
// from chunks 2m and 2m + 1 of Ptil in the accumulator layout.
__device__ __forceinline__ void pack_p_chunks(const float (&p)[64], uint32_t* pa, int m) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int c0 = 8 * m + 2 * r;  // chunk 2m, row g + 8r; chunk 2m + 1 is 4 values on
    pa[2 * m + r] = ptx::pack_e4m3x4(p[c0], p[c0 + 1], p[c0 + 4], p[c0 + 5]);
  }
}

// Ptil of 128 keys in place (a 128-key tile, or one half of a 256-key tile with `valid` counted
// from its first key) and their row sums, in two partials a row (halves the dependent FADD
// chain). `first`: the partials start from the first exponentials (0 + x is x for the x >= 0
// here: no FADD of zero, which the compiler keeps for the sign of a zero); else they are added to.
// A masked key has s = -inf; with a zero Q scale (an all-zero row) -inf * 0 would be NaN, so its
// x is set to -inf. Every kPolyExp2Every-th exponential (0: none) runs on the FMA pipe.
// pa (kPack): also the E4M3 A operand of the PV wgmma (pack_p's words), each pair of words as soon
// as the 8 values it holds are exponentiated, so that the packing fills the issue slots the
// MUFU-bound tail of the exponentials leaves free instead of following it.
template <bool kMasked, int kPolyExp2Every, bool kPack = false>
__device__ __forceinline__ void fp8_exp_half(float (&s)[64], const float (&scale)[2], const float (&bias)[2],
                                             float (&lsum)[2][2], int valid, int quad_col, bool first,
                                             uint32_t* pa = nullptr) {
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int r = (i >> 1) & 1;
    float x = fmaf(s[i], scale[r], -bias[r]);
    if (kMasked && 8 * (i >> 2) + quad_col + (i & 1) >= valid) x = -INFINITY;
    if (kPolyExp2Every > 0 && i % kPolyExp2Every == kPolyExp2Every - 1) {
      s[i] = exp2_fma(x);
    } else {
      s[i] = ptx::ex2_approx(x);
    }
    lsum[r][i & 1] = (first && i < 4) ? s[i] : lsum[r][i & 1] + s[i];
    if constexpr (kPack) {
      if ((i & 7) == 7) pack_p_chunks(s, pa, i >> 3);
    }
  }
}

// One tile, first half: s = raw dot products (accumulator layout) in, Ptil out (in place);
// `valid` = keys of the tile inside the segment (< 128 only on a segment's last tile: columns
// >= valid are masked), sk = the tile's K scale, c = softmax_scale * log2(e); updates `st`
// (st.alpha is now this tile's rescale). Every kPolyExp2Every-th exponential (0: none) runs on
// the FMA pipe (exp2_fma).
template <bool kMasked, int kPolyExp2Every>
__device__ __forceinline__ void fp8_softmax_exp(float (&s)[64], Fp8RowState& st, int valid, float sk, float c,
                                                int quad_col) {
  float row_max[2];
  fp8_row_maxima<kMasked>(s, row_max, valid, quad_col);
  float scale[2], bias[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float qk = st.sq[r] * sk;                       // fp32(sq * sk), as the reference
    const float m_new = fmaxf(st.m[r], qk * row_max[r]);  // max S = fp32(sq sk) * max(dot): sq sk >= 0
    st.alpha[r] = ptx::ex2_approx((st.m[r] - m_new) * c);  // 0 on the first tile (m = -inf)
    st.m[r] = m_new;
    scale[r] = qk * c;
    bias[r] = m_new * c - kLog2FP8PScale;
  }
  float lsum[2][2];
  fp8_exp_half<kMasked, kPolyExp2Every>(s, scale, bias, lsum, valid, quad_col, true);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] = fmaf(st.l[r], st.alpha[r], lsum[r][0] + lsum[r][1]);
  }
}

// Second half: Ptil (in the accumulator layout) -> the E4M3 A operand of the PV wgmma.
__device__ __forceinline__ void pack_p(const float (&p)[64], uint32_t (&pa)[16]) {
#pragma unroll
  for (int m = 0; m < 8; ++m) pack_p_chunks(p, pa, m);
}

template <bool kMasked, int kPolyExp2Every>
__device__ __forceinline__ void fp8_softmax_tile(float (&s)[64], uint32_t (&pa)[16], Fp8RowState& st, int valid,
                                                 float sk, float c, int quad_col) {
  fp8_softmax_exp<kMasked, kPolyExp2Every>(s, st, valid, sk, c, quad_col);
  pack_p(s, pa);
}

// ---- 256-key tiles (Fp8Options::kTileKeys = 256) ----------------------------------------------
// A tile of 256 keys is two 128-key halves, each a 64 x 128 accumulator fragment (lo: keys
// 0..127, K-scale block 2t; hi: keys 128..255, block 2t + 1). One max over both halves, one
// rescale per 256 keys; the exponentials and the row sums as above, half by half.
constexpr int kFp8HalfKeys = 128;  // keys of a half (= kTileKeys, shared_storage.cuh)

// The maxima of S over the tile for the thread's two rows, reduced over the quad: per half the
// raw dot maxima (two chains), scaled by the half's fp32(sq sk) (max S = fp32(sq sk) * max(dot):
// sq sk >= 0), the larger of the two, then the quad. Masked keys (columns >= valid) are set to
// -inf first; a half whose keys are all masked gives -inf (or NaN for a zero scale, which fmaxf
// drops: the tile's key 0 is in the segment, so the quad's maximum is finite). (Measured and
// removed: the maxima on the dot products' bit patterns as signed integers, three at a time
// (VIMNMX3; exact wherever m_t >= 0, the float maxima otherwise), 16 instructions a row and
// half instead of 31, bit-identical output, 0.9-2.6 % slower; benchmarks/RESULTS.md, nineteenth
// session.)
template <bool kMasked>
__device__ __forceinline__ void fp8_row_maxima_256(float (&lo)[64], float (&hi)[64], const float (&qk)[2][2],
                                                   float (&row_max)[2], int valid, int quad_col) {
  if constexpr (kMasked) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (8 * i + quad_col + e >= valid) lo[4 * i + e] = lo[4 * i + 2 + e] = -INFINITY;
        if (kFp8HalfKeys + 8 * i + quad_col + e >= valid) hi[4 * i + e] = hi[4 * i + 2 + e] = -INFINITY;
      }
    }
  }
  auto key = [](const float (&s)[64], int r, int k) { return s[4 * (k >> 1) + 2 * r + (k & 1)]; };
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m0 = key(lo, r, 0), m1 = key(lo, r, 1), m2 = key(hi, r, 0), m3 = key(hi, r, 1);
#pragma unroll
    for (int k = 2; k < 32; k += 2) {
      m0 = fmaxf(m0, key(lo, r, k));
      m1 = fmaxf(m1, key(lo, r, k + 1));
      m2 = fmaxf(m2, key(hi, r, k));
      m3 = fmaxf(m3, key(hi, r, k + 1));
    }
    row_max[r] = quad_max(fmaxf(qk[r][0] * fmaxf(m0, m1), qk[r][1] * fmaxf(m2, m3)));
  }
}

// One 256-key tile: lo, hi = raw dot products in, Ptil out; sk0, sk1 = the halves' K scales.
// kPack: P packed into pa_lo / pa_hi as the exponentials complete (fp8_exp_half); else the caller
// packs it after (pack_p).
template <bool kMasked, int kPolyExp2Every, bool kPack = false>
__device__ __forceinline__ void fp8_softmax_exp_256(float (&lo)[64], float (&hi)[64], Fp8RowState& st, int valid,
                                                    float sk0, float sk1, float c, int quad_col,
                                                    uint32_t* pa_lo = nullptr, uint32_t* pa_hi = nullptr) {
  float qk[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    qk[r][0] = st.sq[r] * sk0;  // fp32(sq * sk), as the reference
    qk[r][1] = st.sq[r] * sk1;
  }
  float row_max[2];
  fp8_row_maxima_256<kMasked>(lo, hi, qk, row_max, valid, quad_col);
  float scale_lo[2], scale_hi[2], bias[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(st.m[r], row_max[r]);
    st.alpha[r] = ptx::ex2_approx((st.m[r] - m_new) * c);  // 0 on the first tile (m = -inf)
    st.m[r] = m_new;
    scale_lo[r] = qk[r][0] * c;
    scale_hi[r] = qk[r][1] * c;
    bias[r] = m_new * c - kLog2FP8PScale;
  }
  float lsum[2][2];
  fp8_exp_half<kMasked, kPolyExp2Every, kPack>(lo, scale_lo, bias, lsum, valid, quad_col, true, pa_lo);
  fp8_exp_half<kMasked, kPolyExp2Every, kPack>(hi, scale_hi, bias, lsum, valid - kFp8HalfKeys, quad_col, false,
                                               pa_hi);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    st.l[r] = fmaf(st.l[r], st.alpha[r], lsum[r][0] + lsum[r][1]);
  }
}

}  // namespace sm90
}  // namespace flashinfer_h3
