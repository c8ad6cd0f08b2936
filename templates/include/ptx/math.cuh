// Transcendental approximations on the MUFU pipe (PTX ISA 9.7.4, "Floating Point Instructions").
#pragma once

namespace flashinfer_h3 {
namespace ptx {

// ex2.approx.ftz.f32 (9.7.4.11): 2^x with max relative error 2^-22.5 or so; -inf -> +0, the
// value the online softmax needs for masked keys. One MUFU.EX2 instruction.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// rcp.approx.ftz.f32 (9.7.4.9, "rcp.approx"): 1 / x within 1 ulp (subnormal inputs and results
// flushed). One MUFU.RCP instruction: the starting point of a correctly rounded division.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// rcp.approx.ftz.f64 (9.7.4.9, "rcp.approx.ftz.f64"): a fast approximation of 1 / x in FP64
// (MUFU.RCP64H and a few integer ops; subnormal inputs flushed), a starting point for Newton steps.
__device__ __forceinline__ double rcp_approx_f64(double x) {
  double y;
  asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(y) : "d"(x));
  return y;
}

}  // namespace ptx
}  // namespace flashinfer_h3
