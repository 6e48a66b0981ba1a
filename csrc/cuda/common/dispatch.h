// Host-side choices shared by the launchers: which instantiation of a kernel
// runs a call (its head-dim bucket and element type), and the GPU.
//
// Every launcher dispatches the same way:
//   with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
//     return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
//       return launch<decltype(tag), decltype(dim)::value>(p, stream);
//     });
//   });
// A kernel declares the buckets it has code for (a HeadDims list) and the
// element types it takes (an ElementTypes list); the build compiles the buckets
// of FLASHJAX_HEAD_DIMS only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <mutex>
#include <type_traits>
#include <utility>

#include "flashjax/params.h"

namespace flashjax::cuda {

// The head-dim buckets this build compiles (FLASHJAX_HEAD_DIMS, which cmake
// passes as FLASHJAX_TC_HEAD_DIM_<d>); 0 ends the list.
inline constexpr int kCompiledHeadDims[] = {
#ifdef FLASHJAX_TC_HEAD_DIM_64
    64,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_96
    96,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
    128,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_192
    192,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
    256,
#endif
    0};

constexpr bool head_dim_compiled(int bucket) {
  for (int compiled : kCompiledHeadDims)
    if (compiled != 0 && compiled == bucket) return true;
  return false;
}

// The head-dim buckets a kernel has code for, smallest first. A call runs in
// the smallest compiled one that holds both its head dims (zero-padded).
template <int... kBuckets>
struct HeadDims {};

// The buckets of the tensor-core kernels; the Hopper forward declares its own
// list (it also has 96 and 192, which these kernels pad to 128 and 256).
inline constexpr HeadDims<64, 128, 256> kTensorCoreBuckets{};

// The bucket of `buckets` that runs p, 0 if none does.
template <int... kBuckets>
int head_dim_bucket(HeadDims<kBuckets...>, const AttentionParams& p) {
  const int64_t d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  int bucket = 0;
  (void)((head_dim_compiled(kBuckets) && d <= kBuckets && (bucket = kBuckets, true)) || ...);
  return bucket;
}

// Calls fn(std::integral_constant<int, head_dim_bucket(buckets, p)>{});
// cudaErrorInvalidValue when no bucket runs p. Only compiled buckets are
// instantiated.
template <int... kBuckets, class Fn>
cudaError_t with_bucket(HeadDims<kBuckets...> buckets, const AttentionParams& p, Fn&& fn) {
  const int bucket = head_dim_bucket(buckets, p);
  cudaError_t status = cudaErrorInvalidValue;
  const auto call = [&](auto dim) {
    if constexpr (head_dim_compiled(decltype(dim)::value)) status = fn(dim);
    return true;
  };
  (void)((bucket == kBuckets && call(std::integral_constant<int, kBuckets>{})) || ...);
  return status;
}

// The element types a kernel takes.
template <class... Ts>
struct ElementTypes {};

inline constexpr ElementTypes<__half, __nv_bfloat16, float> kAllTypes{};
inline constexpr ElementTypes<__half, __nv_bfloat16> kHalfTypes{};  // tensor-core kernels

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() { return DType::kFloat32; }
template <>
constexpr DType dtype_of<__half>() { return DType::kFloat16; }
template <>
constexpr DType dtype_of<__nv_bfloat16>() { return DType::kBFloat16; }

// Calls fn(T{}) with the type of `types` that stores `dtype`;
// cudaErrorInvalidValue when none does.
template <class... Ts, class Fn>
cudaError_t with_dtype(ElementTypes<Ts...>, DType dtype, Fn&& fn) {
  cudaError_t status = cudaErrorInvalidValue;
  (void)((dtype == dtype_of<Ts>() && (status = fn(Ts{}), true)) || ...);
  return status;
}

// An attribute of the current GPU, or `fallback` if it cannot be read.
inline int current_device_attribute(cudaDeviceAttr attribute, int fallback) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess)
    return fallback;
  return value;
}

// Multiprocessors of the current GPU (1 if it cannot be read); persistent
// kernels launch one CTA per multiprocessor.
inline int multiprocessor_count() {
  const int count = current_device_attribute(cudaDevAttrMultiProcessorCount, 1);
  return count < 1 ? 1 : count;
}

// The blocks of kThreads threads of kKernel (no dynamic shared memory) that every
// multiprocessor holds at once: a grid-stride kernel's grid, which a larger grid would
// run in a second, partial wave (the dQ conversion: 1,056 blocks of which 660 resident,
// 75% of an H200's DRAM bandwidth; 79% with 660). The per-multiprocessor count is the
// binary's, read once.
template <auto kKernel, int kThreads>
unsigned resident_grid() {
  static const int per_multiprocessor = [] {
    int blocks = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kThreads, 0) ==
                       cudaSuccess && blocks > 0
               ? blocks
               : 1;
  }();
  return static_cast<unsigned>(per_multiprocessor * multiprocessor_count());
}

// Kernel attributes (the shared-memory opt-in) belong to the device that is
// current when they are set, and one process may drive several GPUs: a
// launcher's configuration runs once per device, not once per process.
//   static DeviceOnce configured;
//   if (cudaError_t e = configured([] { return cudaFuncSetAttribute(...); }); e != cudaSuccess)
//     return e;
class DeviceOnce {
 public:
  template <class Configure>
  cudaError_t operator()(Configure&& configure) {
    int device = 0;
    if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
    if (device < 0 || device >= kMaxDevices) return configure();  // (untracked: every call)
    std::lock_guard<std::mutex> lock(mutex_);
    State& state = states_[device];
    if (!state.done) {
      state.status = configure();
      state.done = true;
    }
    return state.status;
  }

 private:
  static constexpr int kMaxDevices = 64;
  struct State {
    bool done = false;
    cudaError_t status = cudaSuccess;
  };
  std::mutex mutex_;
  State states_[kMaxDevices];
};

// 10 * major + minor of the current GPU, 0 if it cannot be read.
inline int compute_capability() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
    return 0;
  return 10 * major + minor;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a programmatic dependent launch
// on Hopper (device.cuh's allow_dependent_grid_launch / wait_for_prerequisite_grid
// say what the kernels then do; the kernel must wait before reading what the
// kernels before it wrote); a plain launch elsewhere.
template <class... Params, class... Args>
cudaError_t launch_early(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute early = {};
  early.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early.val.programmaticStreamSerializationAllowed = 1;
  if (compute_capability() >= 90) {
    config.attrs = &early;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Tensor-core paths need fp16/bf16 and 16-byte rows (head dims % 8 == 0).
inline bool tensor_core_shapes(const AttentionParams& p) {
  return p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 &&
         head_dim_bucket(kTensorCoreBuckets, p) != 0;
}

}  // namespace flashjax::cuda
