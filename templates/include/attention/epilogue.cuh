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

namespace flashinfer_h3 {
namespace attention {

constexpr int kEpilogueChunks = 16;  // 128 channels = 16 chunks of 8 columns

// kChannelScale: multiply by sv[8j], sv[8j + 1] (read through the read-only cache) first.
template <bool kChannelScale, typename Pair>
__device__ __forceinline__ void store_row_bf16(__nv_bfloat16* dst, const float* sv, float l, Pair pair) {
#pragma unroll
  for (int j = 0; j < kEpilogueChunks; ++j) {
    float2 x = pair(j);
    if constexpr (kChannelScale) {
      const float2 s = __ldg(reinterpret_cast<const float2*>(sv + 8 * j));
      x.x = __fmul_rn(x.x, s.x);
      x.y = __fmul_rn(x.y, s.y);
    }
    *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j) = __floats2bfloat162_rn(__fdiv_rn(x.x, l), __fdiv_rn(x.y, l));
  }
}

}  // namespace attention
}  // namespace flashinfer_h3
