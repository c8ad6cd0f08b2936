// The one binding helper of every templates/*.cu.jinja: tensor checks, typed data pointers,
// torch's current stream and CUDA error reporting for tvm-ffi exports.
//
// Host code only (no kernels here), used by bindings only: the kernel headers under include/
// stay framework-free. Every check raises a Python ValueError through TVM_FFI_CHECK with a
// message that starts with the argument's name, e.g. "k_codes must start on a 16-byte boundary".
//
// API (namespace flashinfer_h3::binding; keep it small and stable, other bindings include it):
//   kU8, kI32, kI64, kF32, kBF16                     DLDataType constants
//   check_tensor(t, name, dtype, ndim, device)  CUDA, on `device` (when not null), dtype, rank,
//                                               contiguous
//   check_shape(t, name, {dims})                the exact shape (rank included)
//   check_cuda_contiguous(t, name)              CUDA and contiguous, any dtype and rank
//   check_aligned(t, name, bytes)               the data pointer is a multiple of `bytes`
//   data<T>(t)                                  the typed data pointer (byte_offset applied)
//   stream_of(t)                                torch's current stream on t's device
//   check_cuda(status, what)                    a RuntimeError naming `what` unless cudaSuccess
//   shape_str(t), dtype_name(d)                 for messages
#pragma once

#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace flashinfer_h3 {
namespace binding {

using tvm::ffi::TensorView;

inline constexpr DLDataType kU8{kDLUInt, 8, 1};
inline constexpr DLDataType kI32{kDLInt, 32, 1};
inline constexpr DLDataType kI64{kDLInt, 64, 1};
inline constexpr DLDataType kF32{kDLFloat, 32, 1};
inline constexpr DLDataType kF16{kDLFloat, 16, 1};
inline constexpr DLDataType kBF16{kDLBfloat, 16, 1};

inline bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

inline const char* dtype_name(DLDataType d) {
  if (same_dtype(d, kU8)) return "uint8";
  if (same_dtype(d, kI32)) return "int32";
  if (same_dtype(d, kI64)) return "int64";
  if (same_dtype(d, kF32)) return "float32";
  if (same_dtype(d, kF16)) return "float16";
  if (same_dtype(d, kBF16)) return "bfloat16";
  return "another dtype";
}

inline std::string dims_str(const int64_t* dims, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

inline std::string shape_str(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

inline std::string device_str(DLDevice d) {
  return d.device_type == kDLCUDA ? "cuda:" + std::to_string(d.device_id)
                                  : "device type " + std::to_string(static_cast<int>(d.device_type));
}

// A CUDA tensor of the given dtype and rank, contiguous, on `device` when it is not null (the
// device of the call: every tensor of one call lives on one GPU).
inline void check_tensor(const TensorView& t, const char* name, DLDataType dtype, int ndim,
                         const DLDevice* device) {
  const DLDevice d = t.device();
  if (device != nullptr) {
    TVM_FFI_CHECK(d.device_type == kDLCUDA && d.device_id == device->device_id, ValueError)
        << name << " must be on cuda:" << device->device_id
        << " (a CUDA tensor on the device of the call), got " << device_str(d);
  } else {
    TVM_FFI_CHECK(d.device_type == kDLCUDA, ValueError)
        << name << " must be a CUDA tensor, got " << device_str(d);
  }
  TVM_FFI_CHECK(same_dtype(t.dtype(), dtype), ValueError)
      << name << " must be " << dtype_name(dtype) << ", got " << dtype_name(t.dtype());
  TVM_FFI_CHECK(t.ndim() == ndim, ValueError)
      << name << " must have " << ndim << " dimensions, got shape " << shape_str(t);
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}

// A contiguous CUDA tensor of any dtype and rank (byte-level helpers such as fill_u8).
inline void check_cuda_contiguous(const TensorView& t, const char* name) {
  TVM_FFI_CHECK(t.device().device_type == kDLCUDA, ValueError)
      << name << " must be a CUDA tensor, got " << device_str(t.device());
  TVM_FFI_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}

// The exact shape, rank included.
inline void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  bool same = t.ndim() == static_cast<int>(shape.size());
  int i = 0;
  for (int64_t want : shape) {
    same = same && t.size(i) == want;
    ++i;
  }
  TVM_FFI_CHECK(same, ValueError) << name << " must have shape "
                                  << dims_str(shape.begin(), static_cast<int>(shape.size()))
                                  << ", got " << shape_str(t);
}

template <class T>
inline T* data(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

// Vector loads and cp.async need aligned regions; an empty tensor is never read.
inline void check_aligned(const TensorView& t, const char* name, uintptr_t bytes) {
  TVM_FFI_CHECK(t.numel() == 0 || reinterpret_cast<uintptr_t>(data<const char>(t)) % bytes == 0,
                ValueError)
      << name << " must start on a " << bytes << "-byte boundary";
}

// torch's current stream on t's device (tvm-ffi's environment stream, set by the torch bridge).
inline cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(t.device().device_type, t.device().device_id));
}

// A RuntimeError naming `what` (e.g. "attention_nvfp4 launch") for any status but cudaSuccess.
inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << what << ": CUDA error " << cudaGetErrorName(status) << " ("
                                << static_cast<int>(status) << "): " << cudaGetErrorString(status);
  }
}

}  // namespace binding
}  // namespace flashinfer_h3
