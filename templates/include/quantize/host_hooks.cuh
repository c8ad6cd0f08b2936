// The device/host seam of the quantization pre-pass: the few operations that are instructions
// in a CUDA build and functions of the CPU test in a host build (tests/ builds prepass.cuh as
// host C++, one std::thread per CUDA thread, and supplies the emulated_* functions declared
// here). A CUDA build never declares or calls them: everything below dispatches on
// __CUDA_ARCH__, the device side to the wrappers of ptx/.
//
// Nothing else in the pre-pass knows about host builds; keep this seam the only one.
#pragma once

#include <stdint.h>

#include "numerics/formats.cuh"
#ifdef __CUDACC__  // a host C++ build (no nvcc) has no cvta: it never sees the device wrappers
#include "ptx/cp_async.cuh"
#endif

namespace flashinfer_h3 {
namespace quantize {

#ifndef __CUDA_ARCH__
// Supplied by host builds (the CPU emulation test); never defined or called in a CUDA build,
// whose device code uses the instructions instead.
void emulated_cp_async_16(void* smem_dst, const void* gmem_src, uint32_t src_bytes);
void emulated_cp_async_4(void* smem_dst, const void* gmem_src);
void emulated_cp_async_commit();
void emulated_cp_async_wait(int pending);
void* emulated_dynamic_smem();
uint32_t emulated_e4m3(float x);  // cvt.rn.satfinite.e4m3 of one float
uint32_t emulated_f16x2(float lo, float hi);     // cvt.rn.f16x2.f32 (lo in the low half)
uint32_t emulated_f16x2_mul(uint32_t a, uint32_t b);  // mul.rn.f16x2
void emulated_syncwarp();                        // bar.warp.sync of the whole warp
#endif


// cvt.rn.satfinite.e4m3x2.f32 as a 32-bit word: `lo` in bits [7:0], `hi` in bits [15:8].
__device__ __forceinline__ uint32_t e4m3x2_word(float lo, float hi) {
#ifdef __CUDA_ARCH__
  return ptx::cvt_e4m3x2_rn_satfinite(lo, hi);
#else
  return emulated_e4m3(lo) | emulated_e4m3(hi) << 8;
#endif
}

// cvt.rn.f16x2.f32: two floats -> f16x2 bits, `lo` in the low half (the FP16 output mode of the
// NVFP4 pre-pass; its values are exact in FP16, so the rounding never acts there).
__device__ __forceinline__ uint32_t f16x2_bits(float lo, float hi) {
#ifdef __CUDA_ARCH__
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
#else
  return emulated_f16x2(lo, hi);
#endif
}

// mul.rn.f16x2 on f16x2 bits (HMUL2).
__device__ __forceinline__ uint32_t f16x2_mul(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  const __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&h);
#else
  return emulated_f16x2_mul(a, b);
#endif
}

// A UE4M3 byte's value in both halves of an f16x2 word (cvt.rn.f16x2.e4m3x2, exact: every E4M3
// value is an FP16 value).
__device__ __forceinline__ uint32_t ue4m3_f16x2(uint32_t code) {
#ifdef __CUDA_ARCH__
  return ptx::cvt_f16x2_e4m3x2(static_cast<uint16_t>(code * 0x0101u));
#else
  const float s = e4m3_to_float(static_cast<uint8_t>(code));
  return emulated_f16x2(s, s);
#endif
}

// __syncwarp(): the warp's lanes meet, and their shared-memory accesses before it are ordered
// before those after it.
__device__ __forceinline__ void sync_warp() {
#ifdef __CUDA_ARCH__
  __syncwarp();
#else
  emulated_syncwarp();
#endif
}

// ptx/cp_async.cuh (PTX ISA 9.0 §9.7.9.25.3, non-bulk cp.async): copy 16 bytes global -> shared through L2 only
// (.cg); the cp-size - src-size trailing bytes are zero-filled, so src_bytes = 0 writes 16 zero
// bytes. Completion is tracked per thread by commit/wait groups below.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, uint32_t src_bytes) {
#ifdef __CUDA_ARCH__
  ptx::cp_async_cg_16(ptx::smem_addr(smem_dst), gmem_src, src_bytes);
#else
  emulated_cp_async_16(smem_dst, gmem_src, src_bytes);
#endif
}

// The 4-byte form (through L1, .ca; the only sizes .cg takes are 16).
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* gmem_src) {
#ifdef __CUDA_ARCH__
  ptx::cp_async_ca_4(ptx::smem_addr(smem_dst), gmem_src);
#else
  emulated_cp_async_4(smem_dst, gmem_src);
#endif
}

// cp.async.commit_group: closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#ifdef __CUDA_ARCH__
  ptx::cp_async_commit();
#else
  emulated_cp_async_commit();
#endif
}

// cp.async.wait_group N: waits until at most N of this thread's committed groups are pending.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#ifdef __CUDA_ARCH__
  ptx::cp_async_wait<kPending>();
#else
  emulated_cp_async_wait(kPending);
#endif
}

__device__ __forceinline__ void* dynamic_smem() {
#ifdef __CUDA_ARCH__
  extern __shared__ __align__(128) uint4 dynamic_smem_words[];
  return dynamic_smem_words;
#else
  return emulated_dynamic_smem();
#endif
}

}  // namespace quantize
}  // namespace flashinfer_h3
