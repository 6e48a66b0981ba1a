// flashjax.info()'s view into the library: how it was built, and which CUDA kernel a
// call of a given description would run on a given GPU (the dispatch's own choice,
// csrc/cuda/launch.cu, not a copy of its rules). Plain C, read through ctypes.
#pragma once

#include <cstdint>

// A call, by its shapes and options only (no data).
struct FlashjaxCallDescription {
  int32_t dtype;  // flashjax::DType
  int64_t batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v;
  int64_t window_left, window_right;  // causal: window_right = 0
  int32_t packed, seqused, segment_ids, positions, kv_cache, deterministic, kernel_cap;
  int32_t score_terms;  // bias, mask, ALiBi or dropout (the kernels' kTerms variants)
  int32_t float8;       // float8 q, k, v: their flashjax::CacheElement (dtype: out's); 0: none
};

extern "C" {
// "cuda_targets=..;head_dims=..;cuda_runtime=.." (cuda_targets empty: a CPU-only build).
__attribute__((visibility("default"))) const char* FlashjaxBuildInfo();
// The operand table of the FFI targets (flashjax/operands.h), for tests that check
// the Python side agrees: "target.options=name:type,..;target.inputs=name:flag,..;.."
// for targets "attention" and "kvcache" (types f32, i64, bool; inputs in order).
__attribute__((visibility("default"))) const char* FlashjaxOperands();
// The forward and backward kernel names ("hopper", "mma", "split-kv", "simt") of the
// call on CUDA device `device`, NUL-terminated in buffers of `capacity` bytes.
// Returns 0, or a CUDA error code (-1: a CPU-only build).
__attribute__((visibility("default"))) int FlashjaxKernelChoice(
    int device, const FlashjaxCallDescription* call, char* forward, char* backward,
    int capacity);
}
