// See introspection.h.
#include "introspection.h"

#include <cstdio>
#include <string>
#include <type_traits>

#include "flashjax/operands.h"
#include "flashjax/params.h"

#ifdef FLASHJAX_WITH_CUDA
#include <cuda_runtime.h>

#include "cuda/launch.h"
#endif

#ifndef FLASHJAX_BUILD_CUDA_ARCHS
#define FLASHJAX_BUILD_CUDA_ARCHS ""
#endif
#ifndef FLASHJAX_BUILD_HEAD_DIMS
#define FLASHJAX_BUILD_HEAD_DIMS ""
#endif

namespace {

#ifdef FLASHJAX_WITH_CUDA
// AttentionParams of a description: shapes and options, placeholder metadata pointers
// (the kernels' support checks look at which are set, never at their values).
flashjax::AttentionParams params_of(const FlashjaxCallDescription& d) {
  using flashjax::TensorRef;
  static const int32_t placeholder[2] = {0, 0};
  static const float slope_placeholder[1] = {0.0f};
  flashjax::AttentionParams p;
  p.dtype = static_cast<flashjax::DType>(d.dtype);
  p.batch = d.batch;
  p.seqlen_q = d.seqlen_q;
  p.seqlen_k = d.seqlen_k;
  p.heads_q = d.heads_q;
  p.heads_kv = d.heads_kv;
  p.head_dim = d.head_dim;
  p.head_dim_v = d.head_dim_v;
  p.window_left = d.window_left;
  p.window_right = d.window_right;
  p.deterministic = d.deterministic != 0;
  p.kernel_cap = static_cast<flashjax::KernelCap>(d.kernel_cap);
  if (d.packed) {
    p.cu_seqlens_q = p.cu_seqlens_k = placeholder;
    p.total_q = d.batch * d.seqlen_q;
    p.total_k = d.batch * d.seqlen_k;
  }
  if (d.seqused) p.seqused_q = p.seqused_k = placeholder;
  if (d.segment_ids) p.q_segment_ids = p.kv_segment_ids = placeholder;
  if (d.positions) p.diagonal_offset = placeholder;
  if (d.score_terms) p.alibi_slopes = slope_placeholder;  // (any term picks the same kernels)
  if (d.float8) {
    static int8_t vt_placeholder[1];
    p.float8.element = static_cast<flashjax::CacheElement>(d.float8);
    p.float8.score_descale = p.float8.v_descale = slope_placeholder;
    p.float8.vt_keys = (d.seqlen_k + flashjax::kFloat8KeyBlock - 1) / flashjax::kFloat8KeyBlock *
                       flashjax::kFloat8KeyBlock;
    p.float8.vt = TensorRef{vt_placeholder, 0, p.float8.vt_keys, d.head_dim_v * p.float8.vt_keys};
  }
  const int64_t rows_q = d.packed ? p.total_q : d.seqlen_q;
  const int64_t rows_k = d.packed ? p.total_k : d.seqlen_k;
  p.q = TensorRef::rows_heads_dim(nullptr, rows_q, d.heads_q, d.head_dim);
  p.k = TensorRef::rows_heads_dim(nullptr, rows_k, d.heads_kv, d.head_dim);
  p.v = TensorRef::rows_heads_dim(nullptr, rows_k, d.heads_kv, d.head_dim_v);
  if (d.kv_cache) {
    p.cache.seqlens = placeholder;
    p.cache.slots = d.batch;
    p.cache.slot_rows = d.seqlen_k;
  }
  return p;
}
#endif

}  // namespace

extern "C" const char* FlashjaxBuildInfo() {
#ifdef FLASHJAX_WITH_CUDA
  static const std::string info = std::string("cuda_targets=") + FLASHJAX_BUILD_CUDA_ARCHS +
                                  ";head_dims=" + FLASHJAX_BUILD_HEAD_DIMS +
                                  ";cuda_runtime=" + std::to_string(CUDART_VERSION);
#else
  static const std::string info = "cuda_targets=;head_dims=;cuda_runtime=";
#endif
  return info.c_str();
}

namespace {

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "f32";
  if constexpr (std::is_same_v<T, int64_t>) return "i64";
  if constexpr (std::is_same_v<T, double>) return "f64";
  return "bool";
}

}  // namespace

extern "C" const char* FlashjaxOperands() {
#define FLASHJAX_NAME_OPTION(type, name) + #name ":" + type_name<type>() + ","
#define FLASHJAX_NAME_INPUT(name, flag, kind, field) + #name ":" #flag ","
  static const std::string table =
      std::string("attention.options=") FLASHJAX_ATTENTION_OPTIONS(FLASHJAX_NAME_OPTION) +
      ";attention.inputs=" FLASHJAX_ATTENTION_INPUTS(FLASHJAX_NAME_INPUT) +
      ";kvcache.options=" FLASHJAX_KVCACHE_OPTIONS(FLASHJAX_NAME_OPTION) +
      ";kvcache.inputs=" FLASHJAX_KVCACHE_INPUTS(FLASHJAX_NAME_INPUT);
#undef FLASHJAX_NAME_OPTION
#undef FLASHJAX_NAME_INPUT
  return table.c_str();
}

extern "C" int FlashjaxKernelChoice(int device, const FlashjaxCallDescription* call,
                                    char* forward, char* backward, int capacity) {
#ifdef FLASHJAX_WITH_CUDA
  int previous = 0;
  if (cudaError_t e = cudaGetDevice(&previous); e != cudaSuccess) return e;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  const flashjax::AttentionParams p = params_of(*call);
  using namespace flashjax::cuda;
  // (float8: the Hopper kernel or none; flash_attention dequantises for the others)
  const Kernel kernel = forward_kernel(p);
  std::snprintf(forward, capacity, "%s",
                call->float8 && kernel != Kernel::kHopper ? "none" : kernel_name(kernel));
  std::snprintf(backward, capacity, "%s",
                call->kv_cache || call->float8 ? "none" : kernel_name(backward_kernel(p)));
  cudaSetDevice(previous);
  return 0;
#else
  (void)device, (void)call, (void)forward, (void)backward, (void)capacity;
  return -1;
#endif
}
