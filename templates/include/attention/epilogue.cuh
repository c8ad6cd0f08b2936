// The epilogue every attention kernel shares: one output row of a thread's accumulator fragment,
// out[row, head, :] = bf16_rn(fp32(O * sv) / l) (SPEC 4.4, FP8: sv = the per-(segment, head,
// channel) V scale) or bf16_rn(O / l) (SPEC 3.8, NVFP4: no channel scale), one rounding to bf16.
//
// The fragment layouts of mma.sync m16n8 accumulators (16 n8 tiles) and of wgmma m64nN ones are
// the same within a row: lane t of a quad holds columns 8j + 2t and 8j + 2t + 1 of chunk j, so a
// row is 16 pairs `pair(j)` and the thread writes them as bf16x2 at dst + 8 j, where dst (and sv)
// already point at the thread's first column 2t.
#pragma once

#include <cuda_bf16.h>
#include <float.h>

#include "../ptx/math.cuh"

namespace flashinfer_h3 {
namespace attention {

constexpr int kEpilogueChunks = 16;  // 128 channels = 16 chunks of 8 columns

// x / d rounded to nearest even for one row's quotients, d's reciprocal computed once:
//   r = r0 + r0 (1 - d r0), r0 = rcp.approx(d);  q0 = x r;  q = q0 + r (x - d q0)
// (each step one FFMA), the sequence of div.rn.f32's fast path, for a divisor d that is finite
// and >= 256: every row sum l of P (the row's maximum contributes 256: SPEC 3.6, 4.3). The
// quotient is then div.rn's bit for bit wherever it is a normal number and |x| >= 2^-100, and
// within one unit of the last place below (subnormal quotients, invisible in a bf16 output near
// 2^-108); tests/kernels/test_epilogue_gpu.py holds both against IEEE division. Two fixes keep
// div.rn's special values: x = +-inf makes the remainder NaN (inf - inf), which fmaxf turns into
// a finite value so that q = q0 = +-inf; and x = -0 would give +0, so the quotient takes x's sign
// (d > 0: every other quotient has it already). Compiled per element, div.rn recomputes r for
// every quotient and wraps each in a range check (FCHK) and a branch to its slow path: ~10
// instructions and a divergence region per output element, 64 a thread at every item's end.
struct RowDivisor {
  float d, r;
  __device__ __forceinline__ explicit RowDivisor(float divisor) : d(divisor) {
    const float r0 = ptx::rcp_approx(divisor);
    r = fmaf(r0, fmaf(-divisor, r0, 1.0f), r0);
  }
  __device__ __forceinline__ float operator()(float x) const {
    const float q0 = fmaf(x, r, 0.0f);  // x r rounded, as div.rn's fast path computes it
    const float remainder = fmaxf(fmaf(-d, q0, x), -FLT_MAX);  // NaN (x infinite) -> finite
    const float q = fmaf(r, remainder, q0);
    return __int_as_float(__float_as_int(q) | (__float_as_int(x) & static_cast<int>(0x80000000u)));
  }
};

// kChannelScale: multiply by sv[8j], sv[8j + 1] (read through the read-only cache) first.
// kRowDivisor: divide through RowDivisor (one reciprocal for the row, the scales read before the
// loop, so that their 16 loads wait for L2 once) instead of a div.rn per element. The Hopper FP8
// kernel's epilogue: 1 % of its h3-mix time and a third of it on 184-token segments, the same
// output bits (benchmarks/RESULTS.md, twenty-third session). The other kernels keep div.rn: in the
// Hopper NVFP4 kernel the cheaper epilogue measured 0.7 % slower at h3-10s and 3-7 % on short
// segments (ptxas scheduled its tile loop anew), and the SM120 kernels were not measured.
template <bool kChannelScale, bool kRowDivisor = false, typename Pair>
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16* dst, const float* sv, float l, Pair pair) {
  float2 s[kEpilogueChunks];
  if constexpr (kChannelScale && kRowDivisor) {
#pragma unroll
    for (int j = 0; j < kEpilogueChunks; ++j) s[j] = __ldg(reinterpret_cast<const float2*>(sv + 8 * j));
  }
  const RowDivisor row(l);  // dead code (and compiled away) in the div.rn builds
  auto divide = [&](float x) { return kRowDivisor ? row(x) : __fdiv_rn(x, l); };
#pragma unroll
  for (int j = 0; j < kEpilogueChunks; ++j) {
    float2 x = pair(j);
    if constexpr (kChannelScale) {
      const float2 sj = kRowDivisor ? s[j] : __ldg(reinterpret_cast<const float2*>(sv + 8 * j));
      x.x = __fmul_rn(x.x, sj.x);
      x.y = __fmul_rn(x.y, sj.y);
    }
    *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = __floats2bfloat162_rn(divide(x.x), divide(x.y));
  }
}

}  // namespace attention
}  // namespace flashinfer_h3
