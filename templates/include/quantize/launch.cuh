// Host launcher of the quantization pre-pass (quantize/prepass.cuh): the three launches of a
// call on the caller's stream, their grid sizes and the once-per-device shared-memory opt-in, for
// any output policy (Outputs<op>, Fp16Outputs<Op::kNvfp4>). CUDA builds only; the bindings
// (templates/quantize.cu.jinja) call launch_quantize.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "common.cuh"
#include "quantize/prepass.cuh"

namespace flashinfer_h3 {
namespace quantize {

// ---------------------------------------------------------------------------------------------
// Host launcher
// ---------------------------------------------------------------------------------------------

#ifdef __CUDACC__
// CTAs of a persistent tile launch on the current device: all that fit at once. The dynamic
// shared memory opt-in and the occupancy query run once per device, output policy, pass and stage
// count.
template <class Out, Pass pass, int kStages>
cudaError_t quantize_kernel_ctas(int* ctas) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const int known = device < kMaxDevices ? cached[device].load(std::memory_order_relaxed) : 0;
  if (known > 0) {
    *ctas = known;
    return cudaSuccess;
  }
  constexpr auto kernel = tile_kernel<Out, pass, kStages>();
  constexpr size_t kSmem = pipe_smem_bytes<kStages>();
  if (const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmem));
      e != cudaSuccess)
    return e;
  int per_sm = 0, sms = 0;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmem);
      e != cudaSuccess)
    return e;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // the ring does not fit this GPU's SMs
  if (const cudaError_t e = sm_count(device, &sms); e != cudaSuccess) return e;
  *ctas = per_sm * sms;
  if (device < kMaxDevices) cached[device].store(*ctas, std::memory_order_relaxed);
  return cudaSuccess;
}

// kMaxCtas > 0 (benchmark builds, KernelConfig flag prepass_ctas): at most that many CTAs, to
// measure what the pre-pass costs on a few SMs (benchmarks/bench_prepass_sms.py).
template <class Out, Pass pass, int kStages, int kMaxCtas = 0>
cudaError_t launch_tiles(const Inputs& in, const Tables& tb, const Out& out, cudaStream_t stream) {
  int ctas = 0;
  if (const cudaError_t e = quantize_kernel_ctas<Out, pass, kStages>(&ctas); e != cudaSuccess) return e;
  if (kMaxCtas > 0 && ctas > kMaxCtas) ctas = kMaxCtas;
  const ItemMap map = make_item_map<Out::kOp, pass>(tb, in.heads);
  const unsigned grid = static_cast<unsigned>(map.items < ctas ? map.items : ctas);
  constexpr auto kernel = tile_kernel<Out, pass, kStages>();
  kernel<<<grid, kThreads, pipe_smem_bytes<kStages>(), stream>>>(in, tb, out, map);
  return last_launch_status();
}

// Runs the three launches on `stream`. Zero-size grids are skipped (tokens == 0 launches only
// launch 2, which writes kbar = 0 for every segment). Returns the first launch error.
// kStages: the ring depth of the tile launches (the binding picks it per architecture: its
// shared memory, pipe_smem_bytes<kStages>(), must fit the SM twice on SM90 and once on SM120).
// The binding keeps 3 * NQB * H <= INT_MAX / 2, so every item index (and the divisions of
// FastDiv) stays below 2^31. kMaxCtas: see launch_tiles (0 in production: every CTA that fits).
// kWithQ = false (FP8, for a kernel that quantises Q itself): launch 1 takes only the K and V
// statistics (Pass::kStats) and the Q regions are not written.
template <int kStages, int kMaxCtas = 0, bool kWithQ = true, class Out>
cudaError_t launch_quantize(const Inputs& in, const Tables& tb, const Out& out, cudaStream_t stream) {
  const bool tiles = static_cast<int64_t>(tb.num_qblocks) * in.heads > 0;
  if (tiles) {
    constexpr Pass kFirst = kWithQ ? Pass::kQAndStats : Pass::kStats;
    if (const cudaError_t e = launch_tiles<Out, kFirst, kStages, kMaxCtas>(in, tb, out, stream); e != cudaSuccess)
      return e;
  }
  const int64_t seg_heads = static_cast<int64_t>(tb.segments) * in.heads;
  if (seg_heads > 0) {
    const ReduceShape shape = reduce_shape(tb.num_qblocks, tb.segments);
    constexpr auto reduce = reduce_kernel<Out>();
    reduce<<<static_cast<unsigned>(seg_heads * shape.split), kHeadDim / shape.split * shape.slices, 0, stream>>>(
        in, tb, out, shape.split);
    if (const cudaError_t e = last_launch_status(); e != cudaSuccess) return e;
  }
  if (tiles) return launch_tiles<Out, Pass::kKAndV, kStages, kMaxCtas>(in, tb, out, stream);
  return cudaSuccess;
}
#endif  // __CUDACC__

}  // namespace quantize
}  // namespace flashinfer_h3
