// Host helpers of the Hopper bindings (templates/attention_*_wgmma.cu.jinja): the tensor maps of
// the bulk tensor copies (TMA) and the per-device launch facts of a persistent kernel.
//
// Host code only, used by bindings only (the kernel headers stay framework-free). Errors are
// tvm-ffi RuntimeErrors that name the binding (`who`) and what failed.
//
// API (namespace flashinfer_h3::binding):
//   tile_map_3d(dtype, base, dim0, dim1, dim2, stride1, stride2, box0, box1, who, name)
//       a 3-D tensor map [dim2][dim1][dim0] (dim0 contiguous, strides of dims 1 and 2 in
//       bytes) read in boxes of box0 x box1 elements of one dim2 slice, with the 128-byte
//       swizzle that wgmma's K-major shared-memory descriptors expect; elements outside the
//       tensor read as zeros
//   sm_count_once(device_id, who, prepare)
//       the device's SM count, and prepare(device_id) (a kernel's shared-memory opt-in), both
//       once per device and call site
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>
#include <tvm/ffi/error.h>

#include <cstdint>
#include <mutex>

#include "tvm_ffi_utils.h"

namespace flashinfer_h3 {
namespace binding {

// cuTensorMapEncodeTiled from the driver, found once through the runtime (no -lcuda link).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled(const char* who) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
    if (e == cudaSuccess && found == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }
  });
  TVM_FFI_CHECK(fn != nullptr, RuntimeError)
      << who << ": the CUDA driver has no cuTensorMapEncodeTiled (needs a CUDA 12+ driver)";
  return fn;
}

inline CUtensorMap tile_map_3d(CUtensorMapDataType dtype, const void* base, uint64_t dim0, uint64_t dim1,
                               uint64_t dim2, uint64_t stride1, uint64_t stride2, uint32_t box0, uint32_t box1,
                               const char* who, const char* name) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {dim0, dim1, dim2};
  const cuuint64_t strides[2] = {stride1, stride2};
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled(who)(&map, dtype, 3, const_cast<void*>(base), dims, strides, box, elem_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TVM_FFI_CHECK(r == CUDA_SUCCESS, RuntimeError)
      << who << ": cuTensorMapEncodeTiled failed for " << name << " (CUresult " << static_cast<int>(r) << ")";
  return map;
}

// A template, so each call site (each lambda type) has its own once-per-device state.
template <typename Prepare>
int sm_count_once(int device_id, const char* who, Prepare prepare) {
  constexpr int kMaxDevices = 64;
  static int sms[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  TVM_FFI_CHECK(device_id >= 0 && device_id < kMaxDevices, ValueError)
      << who << ": unsupported CUDA device index " << device_id;
  std::call_once(once[device_id], [&] {
    check_cuda(cudaDeviceGetAttribute(&sms[device_id], cudaDevAttrMultiProcessorCount, device_id), who);
    prepare(device_id);
  });
  return sms[device_id];
}

}  // namespace binding
}  // namespace flashinfer_h3
