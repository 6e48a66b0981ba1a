// Host-side choices shared by the tensor-core kernels: the compiled head-dim
// buckets (FLASHJAX_HEAD_DIMS), the 16-bit element type and the GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "flashjax/params.h"

namespace flashjax::cuda {

// Smallest compiled bucket holding both head dims, or 0 if none does.
inline int head_dim_bucket(const AttentionParams& p) {
  const int64_t d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
#ifdef FLASHJAX_TC_HEAD_DIM_64
  if (d <= 64) return 64;
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
  if (d <= 128) return 128;
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
  if (d <= 256) return 256;
#endif
  return 0;
}

// Calls fn(std::integral_constant<int, bucket>{}).
template <class Fn>
cudaError_t with_bucket(int bucket, Fn&& fn) {
  switch (bucket) {
#ifdef FLASHJAX_TC_HEAD_DIM_64
    case 64: return fn(std::integral_constant<int, 64>{});
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
    case 128: return fn(std::integral_constant<int, 128>{});
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
    case 256: return fn(std::integral_constant<int, 256>{});
#endif
    default: return cudaErrorInvalidValue;
  }
}

// Calls fn(T{}) with the 16-bit storage type of p.dtype.
template <class Fn>
cudaError_t with_half_type(DType dtype, Fn&& fn) {
  if (dtype == DType::kFloat16) return fn(__half{});
  return fn(__nv_bfloat16{});
}

// Multiprocessors of the current GPU (1 if it cannot be read); persistent
// kernels launch one CTA per multiprocessor.
inline int multiprocessor_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      count < 1)
    return 1;
  return count;
}

// 10 * major + minor of the current GPU, 0 if it cannot be read.
inline int compute_capability() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return 0;
  return 10 * major + minor;
}

// Tensor-core paths need fp16/bf16 and 16-byte rows (head dims % 8 == 0).
inline bool tensor_core_shapes(const AttentionParams& p) {
  return p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 &&
         head_dim_bucket(p) != 0;
}

}  // namespace flashjax::cuda
