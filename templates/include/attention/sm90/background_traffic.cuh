// Benchmark builds only (Fp8Options::kBackgroundTraffic; the NVFP4 kernel's kBackgroundTraffic
// variants): warps 1-3 of the kernel's producer warpgroup, idle in production, stream the DRAM
// traffic and the per-element arithmetic of the pre-pass while the consumers run. What it
// measures: the cost to the attention of a pre-pass fused into the kernel's idle warps, which
// would hide the separate pre-pass launch (~1.5-2 ms of a ~44 ms h3-mix call, DRAM-bound, most of
// the gap of issue 11's h3-mix bar). Measured: +1.5-2 % at h3-mix, mostly clock at the power cap
// (benchmarks/RESULTS.md, thirty-seventh session).
//
// The traffic is the pre-pass's at the call's shape, in units of B = T H 128 bytes: the pre-pass
// reads BF16 q once and k and v twice (statistics, then codes: 10 B) and writes the FP8 codes of
// all three (3 B), or the NVFP4 kernel's FP16 operands (6 B). Here: passes of 16-byte loads over
// the workspace's Q operand (FP8 codes, B bytes: ten passes; FP16, 2 B: five), each pass reading
// every byte once, in order, so that it finds nothing of the previous one in L2; the FP8
// pre-pass's arithmetic on them as if they were BF16 values (each chunk's absolute maximum; E4M3
// codes on the first kCodePasses passes; a proxy of the NVFP4 pre-pass's heavier group
// quantisation); and, on the first kWritePasses passes, each chunk stored back unchanged (volatile
// stores the compiler keeps). The consumers' TMA reads of the operand see the same bytes before
// and after, so the output is production's bit for bit. A real fused pre-pass would also wait on
// per-(segment, head) flags; this build has no such waits.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "../../numerics/group_quantize.cuh"  // e4m3x2_word, Fp8Scale
#include "../../ptx/global_memory.cuh"

namespace flashinfer_h3 {
namespace sm90 {

constexpr int kTrafficWarps = 3;  // warps 1..3 of the producer warpgroup
constexpr int kTrafficThreads = kTrafficWarps * 32;

// The pre-pass's arithmetic on eight BF16 values (their absolute maximum, here on BF16 pairs;
// with `code`, their E4M3 codes at scale reciprocal sc.recip), folded into `acc`. Word by word,
// so that few unpacked values are live at once (the warpgroup's 24 registers).
__device__ __forceinline__ uint32_t fold_word(uint32_t w, uint32_t m, const quantize::Fp8Scale& sc, bool code,
                                              uint32_t& acc) {
  if (code) {
    // The BF16 pair as floats (a bf16 is the upper half of its float).
    acc ^= quantize::e4m3x2_word(__fmul_rn(__uint_as_float(w << 16), sc.recip),
                                 __fmul_rn(__uint_as_float(w & 0xFFFF0000u), sc.recip));
  }
  __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&w), b = *reinterpret_cast<const __nv_bfloat162*>(&m);
  a = __hmax2(__habs2(a), b);
  return *reinterpret_cast<const uint32_t*>(&a);
}
__device__ __forceinline__ uint32_t fold_chunk(const uint4& x, const quantize::Fp8Scale& sc, bool code, uint32_t acc) {
  uint32_t m = 0;
  m = fold_word(x.x, m, sc, code, acc);
  m = fold_word(x.y, m, sc, code, acc);
  m = fold_word(x.z, m, sc, code, acc);
  m = fold_word(x.w, m, sc, code, acc);
  return acc ^ m;
}

// One pass over the chunks: each thread's chunks c, c + stride, ... two at a time (two loads in
// flight a thread: the warpgroup's 24 registers hold no more), 32-bit chunk indices from the
// (constant-bank) base (64-bit indices or pointers spilled 144-164 bytes).
template <bool kCode, bool kWrite>
__device__ __forceinline__ uint32_t stream_pass(uint4* base, uint32_t chunks, float recip, int thread, uint32_t acc) {
  const uint32_t stride = gridDim.x * kTrafficThreads;
  const quantize::Fp8Scale sc{recip, ~0u};
#pragma unroll 1
  for (uint32_t c = blockIdx.x * kTrafficThreads + thread; c < chunks; c += 2 * stride) {
    // Without a second chunk the first is loaded twice (its second copy is folded, not stored).
    const bool second = c + stride < chunks;
    uint4 x, y;
    ptx::ld_global_stream_2x_v4_b32(base + c, base + (second ? c + stride : c), x, y);
    if constexpr (kWrite) {
      ptx::st_global_stream_v4_b32(base + c, x);
      if (second) ptx::st_global_stream_v4_b32(base + c + stride, y);
    }
    acc = fold_chunk(x, sc, kCode, acc);
    acc = fold_chunk(y, sc, kCode, acc);
  }
  return acc;
}

// kReadPasses passes over the region, the first kCodePasses with the codes' arithmetic, the first
// kWritePasses storing each chunk back. thread: 0..95 within the CTA. operand: the region (bytes, a
// multiple of 16). recip: any finite scale reciprocal (the arithmetic's result is discarded).
// never_true: a run-time condition that does not hold (tokens < 0), under which the discarded
// result is stored to `sink`, so the compiler keeps the arithmetic. Shapes past 2^32 chunks
// (64 GB) are not streamed.
template <int kReadPasses, int kCodePasses, int kWritePasses>
__device__ __forceinline__ void stream_background_traffic(void* operand, int64_t bytes, float recip,
                                                          bool never_true, uint32_t* sink, int thread) {
  static_assert(kWritePasses <= kCodePasses && kCodePasses <= kReadPasses, "the passes that write also code");
  if (bytes / 16 >= (int64_t{1} << 32)) return;
  uint4* const base = reinterpret_cast<uint4*>(operand);
  const uint32_t chunks = static_cast<uint32_t>(bytes / 16);
  uint32_t acc = 0;
#pragma unroll 1
  for (int pass = 0; pass < kWritePasses; ++pass) acc = stream_pass<true, true>(base, chunks, recip, thread, acc);
#pragma unroll 1
  for (int pass = kWritePasses; pass < kCodePasses; ++pass)
    acc = stream_pass<true, false>(base, chunks, recip, thread, acc);
#pragma unroll 1
  for (int pass = kCodePasses; pass < kReadPasses; ++pass)
    acc = stream_pass<false, false>(base, chunks, recip, thread, acc);
  if (never_true) sink[thread] = acc;
}

}  // namespace sm90
}  // namespace flashinfer_h3
