// The block-scaled FP4 MMA layer of the mma.sync kernels: the native SM120 instruction
// (mma_fp4_sm120.cuh) where the target has FP4 tensor cores, else the exact emulation of the same
// register contract on Hopper (mma_fp4_sm90_emulated.cuh). Both define, in namespace
// flashinfer_h3::mma, FragA<kThreadIdA>, make_frag_a<kThreadIdA>(a, sfa) and
// mma_nvfp4<kThreadIdB>(d, frag_a, b0, b1, sfb); a kernel written against them is the same source
// on both targets.
#pragma once

#include "numerics/formats.cuh"  // FLASHINFER_H3_NATIVE_FP4
#if FLASHINFER_H3_NATIVE_FP4
#include "attention/mma_sync/mma_fp4_sm120.cuh"
#else
#include "attention/mma_sync/mma_fp4_sm90_emulated.cuh"
#endif
