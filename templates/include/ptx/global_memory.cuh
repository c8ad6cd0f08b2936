// Global-memory loads and stores the compiler must neither drop nor merge (PTX ISA 9.0 9.7.9.8
// "ld", 9.7.9.11 "st", .global state space, .v4 vectors, the .cs cache operator of 9.7.9.1
// "Cache Operators": streaming, allocated with evict-first priority in L1 and L2). Used by the
// benchmark builds that stream DRAM traffic of their own beside the attention
// (attention/sm90/background_traffic.cuh): a plain store of a value just loaded from the same
// address is a no-op the compiler may delete.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

// Two 16-byte loads (16-byte aligned, streamed once: first out of L1 and L2) in one statement,
// so that both are in flight before either value is used (as two statements, the compiler put
// the first value's arithmetic between them).
__device__ __forceinline__ void ld_global_stream_2x_v4_b32(const void* a, const void* b, uint4& x, uint4& y) {
  asm volatile(
      "ld.global.cs.v4.b32 {%0, %1, %2, %3}, [%8];\n\t"
      "ld.global.cs.v4.b32 {%4, %5, %6, %7}, [%9];"
      : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w), "=r"(y.x), "=r"(y.y), "=r"(y.z), "=r"(y.w)
      : "l"(a), "l"(b)
      : "memory");
}

// A 16-byte store (16-byte aligned), first out of L1 and L2.
__device__ __forceinline__ void st_global_stream_v4_b32(void* p, const uint4& v) {
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

}  // namespace ptx
}  // namespace flashinfer_h3
