// mma.sync: warp-level matrix multiply-accumulate, D = A B + C, FP32 accumulators.
// PTX ISA 9.0 §9.7.14.5.14 ("mma"); fragment layouts in §9.7.14.5.8 (m16n8k16 .f16) and
// §9.7.14.5.11 (m16n8k64 .e2m1), the scale-lane rules of block scaling in §9.7.14.3.
#pragma once

#include <stdint.h>

namespace flashinfer_h3 {
namespace ptx {

// mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32
// .ue4m3 (sm_120a / sm_121a: OMMA.SF.16864). With scale_vec::4X every byte of a scale word is
// used, so both byte-ids are 0; the thread-ids are immediates because a register selector turns
// into a waterfall loop in SASS.
template <int kThreadIdA, int kThreadIdB>
__device__ __forceinline__ void mma_m16n8k64_e2m1_block_scale(float (&d)[4], const uint32_t (&a)[4],
                                                              uint32_t b0, uint32_t b1,
                                                              uint32_t sfa, uint32_t sfb) {
  asm volatile(
      "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1"
      ".f32.ue4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, {%10}, "
      "{%11, %12}, {%13}, {%14, %15};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(sfa), "n"(0),
        "n"(kThreadIdA), "r"(sfb), "n"(0), "n"(kThreadIdB));
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (HMMA.16816.F32).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 (sm_89 and later; fragments in
// §9.7.14.5.10, summarised in attention/mma_sync/mma_fp8.cuh). SASS: QMMA.16832.F32.E4M3.E4M3 on
// sm_120a; on sm_90a ptxas lowers it to F2FP.F16.E4M3.UNPACK_B + two HMMA.16816.F32.
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace ptx
}  // namespace flashinfer_h3
