// The second step of the Hopper NVFP4 pre-pass: the NVFP4 operands the quantizer wrote (codes and
// UE4M3 scales, flashinfer_h3/layout.py) expanded into the FP16 tiles the wgmma kernel reads
// (attention/sm90/nvfp4_kernel.cuh). Each value is s * code, exact in FP16 (SPEC 3, last
// paragraph), so the FP16 tensor cores compute the recipe's products exactly.
//
// Why a separate step and not FP16 from the quantizer: the quantizer and its bit-exactness tests
// stay one for both NVFP4 backends, and this pass is pure bandwidth (read 0.56 B, write 2 B per
// element: about 1 % of the attention time at the model's lengths; benchmarks/RESULTS.md).
//
// Outputs (regions of layout.nvfp4_fp16_layout; rows of 128 f16, i.e. 256 bytes):
//   q_f16  [H, T, 128]          Q' rows in token order
//   k_f16  [H, vkeys_cap, 128]  K' rows at padded key positions, in the window key order of
//                               attention/sm90/nvfp4_key_order.cuh; positions past a segment's
//                               last key hold zeros
//   v_f16  [H, 128, vkeys_cap]  V^T columns at the same positions
// Positions at or past vkeys_used (the plan's vkey_start[S]) are never written: the kernel's
// tensor maps end there.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "attention/sm90/nvfp4_key_order.cuh"
#include "numerics/formats.cuh"

namespace flashinfer_h3 {
namespace quantize {

constexpr int kExpandThreads = 256;

// Two E2M1 codes (one byte) times a scale (as f16x2), exact: both factors are FP16 values and the
// product has at most 6 significant bits, in [2^-10, 2688].
__device__ __forceinline__ uint32_t dequant_e2m1x2(uint32_t byte, __half2 scale) {
  const __half2 h = __hmul2(e2m1x2_to_half2(byte), scale);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ __half2 scale_half2(uint32_t ue4m3) {
  const uint32_t bits = ptx::cvt_f16x2_e4m3x2(static_cast<uint16_t>(ue4m3 * 0x0101u));
  return *reinterpret_cast<const __half2*>(&bits);
}

// 16 channels (one scale group) of one row: 8 code bytes + 1 scale byte -> 32 bytes of f16.
__device__ __forceinline__ void expand_group(const uint8_t* codes, uint8_t scale, __half* dst) {
  const uint2 c = *reinterpret_cast<const uint2*>(codes);
  const __half2 s = scale_half2(scale);
  const uint32_t words[2] = {c.x, c.y};
  uint32_t out[8];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int b = 0; b < 4; ++b) out[4 * w + b] = dequant_e2m1x2((words[w] >> (8 * b)) & 0xFF, s);
  }
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(out[0], out[1], out[2], out[3]);
  d[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

// Q: one thread per (head, token, 16-channel group); rows = H * T.
__global__ void __launch_bounds__(kExpandThreads)
    expand_q_fp16_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                         __half* __restrict__ out, int64_t rows) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  if (i >= rows * 8) return;
  const int64_t row = i >> 3;
  const int g = static_cast<int>(i & 7);
  expand_group(codes + row * 64 + 8 * g, __ldg(scales + row * 8 + g), out + row * 128 + 16 * g);
}

// The segment owning padded key position `pos`: the last s with vkey_start[s] <= pos (empty
// segments own no position, so ties resolve to the non-empty one after them).
__device__ __forceinline__ int segment_of_position(const int32_t* vkey_start, int segments, int pos) {
  int lo = 0, hi = segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(vkey_start + mid) <= pos) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// K: one thread per (head, padded position, 16-channel group), positions < vkeys_used.
__global__ void __launch_bounds__(kExpandThreads)
    expand_k_fp16_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                         const int32_t* __restrict__ seg_bounds, const int32_t* __restrict__ vkey_start,
                         int segments, __half* __restrict__ out, int64_t tokens, int64_t vkeys_cap,
                         int vkeys_used, int heads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  const int64_t per_head = static_cast<int64_t>(vkeys_used) * 8;
  if (i >= per_head * heads) return;
  const int head = static_cast<int>(i / per_head);
  const int pos = static_cast<int>((i - head * per_head) >> 3);
  const int g = static_cast<int>(i & 7);
  const int s = segment_of_position(vkey_start, segments, pos);
  const int p = pos - __ldg(vkey_start + s);
  const int key = (p & ~(sm90::kKeyWindow - 1)) + sm90::window_key_at(p & (sm90::kKeyWindow - 1));
  const int seg_begin = __ldg(seg_bounds + s);
  __half* dst = out + (head * vkeys_cap + pos) * 128 + 16 * g;
  if (key < __ldg(seg_bounds + s + 1) - seg_begin) {
    const int64_t row = head * tokens + seg_begin + key;
    expand_group(codes + row * 64 + 8 * g, __ldg(scales + row * 8 + g), dst);
  } else {
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = d[1] = make_uint4(0, 0, 0, 0);
  }
}

// V^T: one thread per (head, channel, 8 consecutive positions), positions < vkeys_used. The 8
// positions 8i + 2t + e (t < 4, e < 2) of a window hold keys 16t + 2i + e: four code bytes (one
// per t) and the window's four scale bytes (one per 16-key group t).
__global__ void __launch_bounds__(kExpandThreads)
    expand_v_fp16_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                         __half* __restrict__ out, int64_t vkeys_cap, int vkeys_used, int heads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kExpandThreads + threadIdx.x;
  const int64_t per_row = vkeys_used / 8;
  if (i >= per_row * 128 * heads) return;
  const int64_t row = i / per_row;  // head * 128 + channel
  const int pos0 = static_cast<int>(i - row * per_row) * 8;
  const int window = pos0 & ~(sm90::kKeyWindow - 1), i8 = (pos0 & (sm90::kKeyWindow - 1)) >> 3;
  const uint8_t* code_row = codes + row * (vkeys_cap / 2);
  const uint32_t scale_word = __ldg(reinterpret_cast<const uint32_t*>(scales + row * (vkeys_cap / 16) + window / 16));
  uint32_t out4[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    // keys window + 16t + 2 i8 + {0, 1}: one byte, the even key in the low nibble
    const uint32_t byte = __ldg(code_row + (window + 16 * t + 2 * i8) / 2);
    out4[t] = dequant_e2m1x2(byte, scale_half2((scale_word >> (8 * t)) & 0xFF));
  }
  *reinterpret_cast<uint4*>(out + row * vkeys_cap + pos0) = make_uint4(out4[0], out4[1], out4[2], out4[3]);
}

}  // namespace quantize
}  // namespace flashinfer_h3
