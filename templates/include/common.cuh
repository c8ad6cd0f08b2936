// Small helpers shared by every kernel of flashinfer_h3.
//
// Framework-free on purpose (no torch, no tvm-ffi): the .cu.jinja bindings own argument checks
// and turn the cudaError_t values returned here into Python exceptions.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

namespace flashinfer_h3 {

constexpr int kWarpSize = 32;

// Integer ceil(a / b) for a >= 0, b > 0; constexpr so grid sizes of fixed tiles fold at compile time.
template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  static_assert(std::is_integral<T>::value, "ceil_div is for integers");
  return (a + b - 1) / b;
}

// Smallest multiple of b that is >= a (a >= 0, b > 0).
template <typename T>
__host__ __device__ constexpr T round_up(T a, T b) {
  return ceil_div(a, b) * b;
}

// True when p is aligned to `bytes` (a power of two): decides whether vector accesses are legal.
__host__ __device__ inline bool is_aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// Number of SMs of the current device, for grid-stride kernels that size their grid to the GPU.
// Returns the CUDA error instead of throwing so the caller's binding decides how to report it.
inline cudaError_t sm_count(int device, int* out) {
  return cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, device);
}

// The status of the launch just issued on this thread. A bad launch configuration or a missing
// kernel image (a .so built for another arch) is reported here, not at the next synchronisation,
// so every binding calls this right after each launch.
inline cudaError_t last_launch_status() { return cudaGetLastError(); }

// p, as a value the compiler knows nothing about. Where it can prove a buffer's alignment it
// forms each address of an unrolled loop with an OR of the base and the offset, and an OR is not
// folded into a load's immediate offset: every load then costs its own address arithmetic
// (two instructions for a 64-bit generic pointer). An opaque base keeps the offsets additions,
// which the loads take as immediates. (An empty asm: no instruction.)
template <class T>
__device__ __forceinline__ T* opaque_pointer(T* p) {
  asm("" : "+l"(p));
  return p;
}

template <class F, int... Is>
__device__ __forceinline__ void static_for_impl(F&& f, std::integer_sequence<int, Is...>) {
  (f(std::integral_constant<int, Is>{}), ...);
}

// f(integral_constant<int, i>) for i = 0..N-1: MMA selectors must be compile-time immediates.
template <int N, class F>
__device__ __forceinline__ void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

}  // namespace flashinfer_h3
