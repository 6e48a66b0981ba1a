// One description of an attention call, shared by the CPU path and the CUDA
// kernels. The FFI layer fills it from XLA buffers and attributes; kernels
// only read it. Layout is (batch, seqlen, heads, head_dim), contiguous, so
// strides are derived rather than stored.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FJ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FJ_HOST_DEVICE inline
#endif

namespace flashjax {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline constexpr int64_t kMaxHeadDim = 256;

struct AttentionParams {
  // Shapes. `batch` folds every leading dimension (vmap adds them).
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  DType dtype = DType::kFloat32;

  // Semantics. Causal is folded into window_right = 0 by the caller.
  float softmax_scale = 1.0f;
  float softcap = 0.0f;          // 0 = off
  int64_t window_left = -1;      // -1 = unbounded
  int64_t window_right = -1;     // -1 = unbounded

  // Forward tensors.
  const void* q = nullptr;       // [batch, seqlen_q, heads_q, head_dim]
  const void* k = nullptr;       // [batch, seqlen_k, heads_kv, head_dim]
  const void* v = nullptr;       // [batch, seqlen_k, heads_kv, head_dim_v]
  const float* sinks = nullptr;  // [batch, heads_q], nullptr = no sinks
  void* out = nullptr;           // [batch, seqlen_q, heads_q, head_dim_v]
  float* lse = nullptr;          // [batch, heads_q, seqlen_q]

  // Backward tensors (unused by the forward).
  const void* dout = nullptr;    // like out
  const float* dlse = nullptr;   // like lse: cotangent of the returned lse
  void* dq = nullptr;            // like q
  void* dk = nullptr;            // like k
  void* dv = nullptr;            // like v
  float* dsinks = nullptr;       // [batch, heads_q]
  bool deterministic = false;    // GPU: bitwise-repeatable dq accumulation

  FJ_HOST_DEVICE int64_t group_size() const { return heads_q / heads_kv; }
  // Key offset of bottom-right alignment: row i's diagonal is key i + offset.
  FJ_HOST_DEVICE int64_t diagonal_offset() const { return seqlen_k - seqlen_q; }

  // Visible key range [first, last] of query row i (may be empty: first > last).
  FJ_HOST_DEVICE int64_t first_key(int64_t i) const {
    int64_t lo = window_left < 0 ? 0 : i + diagonal_offset() - window_left;
    return lo < 0 ? 0 : lo;
  }
  FJ_HOST_DEVICE int64_t last_key(int64_t i) const {
    int64_t hi = window_right < 0 ? seqlen_k - 1 : i + diagonal_offset() + window_right;
    return hi > seqlen_k - 1 ? seqlen_k - 1 : hi;
  }
  // Query rows that see key j: [first_query(j), last_query(j)] (may be empty).
  FJ_HOST_DEVICE int64_t first_query(int64_t j) const {
    int64_t lo = window_right < 0 ? 0 : j - diagonal_offset() - window_right;
    return lo < 0 ? 0 : lo;
  }
  FJ_HOST_DEVICE int64_t last_query(int64_t j) const {
    int64_t hi = window_left < 0 ? seqlen_q - 1 : j - diagonal_offset() + window_left;
    return hi > seqlen_q - 1 ? seqlen_q - 1 : hi;
  }
};

}  // namespace flashjax
