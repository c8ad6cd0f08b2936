// The block-scaled FP4 MMA layer, emulated on Hopper (sm_90a) with the same register contract as
// the native SM120 instruction (mma_fp4_sm120.cuh states the contract and the interface).
//
// Why this is exact: a dequantized operand, E2M1 code times UE4M3 scale, has at most 6
// significant bits and lies in [2^-10, 2688] (or is 0), so it is exact in FP16; an FP16 tensor-core
// product with FP32 accumulation then computes the same dot products (SPEC 3, last paragraph).
//
// Why it is a faithful test of the kernel: the scales are fetched with shuffles from exactly the
// lanes the PTX layout names for the given thread-id selectors, and the byte of each scale word
// is chosen by the K range it covers, so a kernel that puts a scale in the wrong lane or byte gets
// a wrong answer here too. Only the instruction itself is not exercised.
//
// How the K dimension is mapped: a dot product does not care about the order of its terms, and in
// the m16n8k64 layout lane t holds the same logical k (8t..8t+7 and 32+8t..32+8t+7) for A and
// B. So four HMMA m16n8k16 steps each take four of those k per lane, placed in the f16 fragment
// slots 2t, 2t+1, 2t+8, 2t+9 (PTX ISA 9.0 §9.7.14.5.8, m16n8k16 f16 fragments): codes never move
// between lanes, only scales do.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "numerics/formats.cuh"
#include "ptx/cvt.cuh"
#include "ptx/mma_sync.cuh"
#include "ptx/prmt.cuh"

namespace flashinfer_h3 {
namespace mma {

constexpr unsigned kFullWarp = 0xffffffffu;

namespace emu {

// Byte p (p = 0..3) of an E2M1 word, i.e. elements 2p and 2p+1, as an f16x2 pair times 2^-14
// (numerics/formats.cuh, e2m1x2_f16_bits: the one E2M1 decode).
template <int kByte>
__device__ __forceinline__ uint32_t e2m1x2_bits_scaled_down(uint32_t even_nibbles,
                                                            uint32_t odd_nibbles) {
  // Bytes 0 and 2 of w get the even and odd element; bytes 1 and 3 are don't-care (masked off).
  constexpr uint32_t kSel = kByte | kByte << 4 | (4 + kByte) << 8 | (4 + kByte) << 12;
  return e2m1x2_f16_bits(ptx::prmt(even_nibbles, odd_nibbles, kSel));
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ __half2 as_half2(uint32_t bits) {
  return *reinterpret_cast<const __half2*>(&bits);
}

// Eight E2M1 codes (one fragment register) times one scale -> four exact f16x2 words, word p
// holding elements 2p, 2p+1.
__device__ __forceinline__ void dequant_e2m1x8(uint32_t codes, __half2 scale, uint32_t (&out)[4]) {
  const uint32_t even = codes & 0x0F0F0F0Fu, odd = (codes >> 4) & 0x0F0F0F0Fu;
  const __half2 two_pow_14 = __half2half2(__ushort_as_half(0x7400));
  const uint32_t bits[4] = {e2m1x2_bits_scaled_down<0>(even, odd),
                            e2m1x2_bits_scaled_down<1>(even, odd),
                            e2m1x2_bits_scaled_down<2>(even, odd),
                            e2m1x2_bits_scaled_down<3>(even, odd)};
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    // Two exact steps: x 2^14 restores the code value, x scale gives the operand (<= 6 bits).
    out[p] = half2_bits(__hmul2(__hmul2(as_half2(bits[p]), two_pow_14), scale));
  }
}

// The two scale bytes this lane's k runs need, as f16: .x scales k 8t..8t+7 (byte t/2), .y scales
// k 32+8t..32+8t+7 (byte 2 + t/2). cvt.rn.f16x2.e4m3x2 (ptx/cvt.cuh) converts the low byte into
// the low half; UE4M3 is E4M3 with the sign bit 0, and every E4M3 value is exact in f16.
__device__ __forceinline__ __half2 scales_for_lane(uint32_t sf_word, int t) {
  const uint32_t sel = static_cast<uint32_t>(t >> 1) | static_cast<uint32_t>(2 + (t >> 1)) << 4 |
                       0x4400u;
  const uint16_t pair = static_cast<uint16_t>(ptx::prmt(sf_word, 0u, sel));
  return as_half2(ptx::cvt_f16x2_e4m3x2(pair));
}

// One HMMA m16n8k16, f16 inputs, f32 accumulate (ptx/mma_sync.cuh).
__device__ __forceinline__ void hmma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1) {
  ptx::mma_m16n8k16_f16(d, a, b0, b1);
}

}  // namespace emu

// The A operand dequantized into four HMMA A fragments: steps[q] covers, for every lane, the
// elements 4(q%2)..4(q%2)+3 of its k run q/2 (run 0: k 8t.., run 1: k 32+8t..).
template <int kThreadIdA>
struct FragA {
  static_assert(kThreadIdA == 0 || kThreadIdA == 1, "thread-id-a selects a thread pair: 0 or 1");
  uint32_t steps[4][4];
};

template <int kThreadIdA>
__device__ __forceinline__ FragA<kThreadIdA> make_frag_a(const uint32_t (&a)[4], uint32_t sfa) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // SF_A of row m lives in lane 4 (m % 8) + 2 kThreadIdA + m / 8: rows g and g + 8 here.
  const uint32_t sf_row_lo = __shfl_sync(kFullWarp, sfa, 4 * g + 2 * kThreadIdA);
  const uint32_t sf_row_hi = __shfl_sync(kFullWarp, sfa, 4 * g + 2 * kThreadIdA + 1);
  const __half2 s_lo = emu::scales_for_lane(sf_row_lo, t);  // row g:   (run 0, run 1)
  const __half2 s_hi = emu::scales_for_lane(sf_row_hi, t);  // row g+8: (run 0, run 1)
  uint32_t r0[4], r1[4], r2[4], r3[4];
  emu::dequant_e2m1x8(a[0], __low2half2(s_lo), r0);   // row g,   run 0
  emu::dequant_e2m1x8(a[1], __low2half2(s_hi), r1);   // row g+8, run 0
  emu::dequant_e2m1x8(a[2], __high2half2(s_lo), r2);  // row g,   run 1
  emu::dequant_e2m1x8(a[3], __high2half2(s_hi), r3);  // row g+8, run 1
  // HMMA A registers: {row g slots 2t,2t+1; row g+8 slots 2t,2t+1; row g slots 2t+8,2t+9;
  // row g+8 slots 2t+8,2t+9}. Step q takes elements 4(q%2).. of run q/2: f16 words 2(q%2) and
  // 2(q%2)+1 of that run.
  FragA<kThreadIdA> f;
  const uint32_t* runs_lo[2] = {r0, r2};
  const uint32_t* runs_hi[2] = {r1, r3};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int run = q >> 1, w = 2 * (q & 1);
    f.steps[q][0] = runs_lo[run][w];
    f.steps[q][1] = runs_hi[run][w];
    f.steps[q][2] = runs_lo[run][w + 1];
    f.steps[q][3] = runs_hi[run][w + 1];
  }
  return f;
}

template <int kThreadIdB, int kThreadIdA>
__device__ __forceinline__ void mma_nvfp4(float (&d)[4], const FragA<kThreadIdA>& a, uint32_t b0,
                                          uint32_t b1, uint32_t sfb) {
  static_assert(kThreadIdB >= 0 && kThreadIdB <= 3, "thread-id-b selects one lane of a quad");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // SF_B of column n lives in lane 4 n + kThreadIdB: column g here.
  const __half2 s = emu::scales_for_lane(__shfl_sync(kFullWarp, sfb, 4 * g + kThreadIdB), t);
  uint32_t run0[4], run1[4];
  emu::dequant_e2m1x8(b0, __low2half2(s), run0);
  emu::dequant_e2m1x8(b1, __high2half2(s), run1);
  // HMMA B registers: {slots 2t,2t+1; slots 2t+8,2t+9}, matching the A placement above.
  emu::hmma_m16n8k16(d, a.steps[0], run0[0], run0[1]);
  emu::hmma_m16n8k16(d, a.steps[1], run0[2], run0[3]);
  emu::hmma_m16n8k16(d, a.steps[2], run1[0], run1[1]);
  emu::hmma_m16n8k16(d, a.steps[3], run1[2], run1[3]);
}

}  // namespace mma
}  // namespace flashinfer_h3
