// Device helpers shared by the flashjax CUDA kernels (every target).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <limits>

#include "flashjax/params.h"

namespace flashjax::cuda {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (Hopper; launch_early in dispatch.h launches the
// dependent kernel): once every CTA of a kernel has called
// allow_dependent_grid_launch (or exited), the next kernel's CTAs may start, its
// launch latency hidden behind this kernel's last ones; they call
// wait_for_prerequisite_grid before touching anything the kernels before them
// wrote (it returns once those have finished and their writes are visible; at
// once in a kernel launched the plain way).
__device__ __forceinline__ void allow_dependent_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Both, at the start of a kernel in a chain of early launches (the Hopper backward's).
__device__ __forceinline__ void start_after_prerequisite_grid() {
  allow_dependent_grid_launch();
  wait_for_prerequisite_grid();
}

// A hint: the 128-byte line holding *p into L2 (no register taken; callers keep p
// inside their arrays).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return static_cast<float>(x); }

template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// A row's normaliser from its running max m and sum l (of exp_(s - m)) and
// its sink logit (-inf: none), in the units of exp_ / log_ (e or 2): out =
// acc * factor. No key and no sink: factor 0, lse -inf. A NaN score leaves m
// alone (fmaxf) but makes l NaN: such a row has seen keys and ends NaN (out and
// lse), even when every score was NaN.
struct RowNormaliser {
  float factor = 0.0f, lse = kNegInf;
  template <class Exp, class Log>
  __device__ __forceinline__ RowNormaliser(float m, float l, float sink, bool used, Exp&& exp_,
                                           Log&& log_) {
    const float m_final = fmaxf(m, sink);
    if (m_final != kNegInf || (used && l != 0.0f)) {
      const float keys_scale = exp_(m - m_final);
      const float total = l * keys_scale + exp_(sink - m_final);
      factor = keys_scale / total;
      lse = m_final + log_(total);
    }
  }
};

// Quotient and remainder of work-item indices that the host keeps below 2^31
// (hopper_layouts_supported: kMaxWorkSlots): one 32-bit division, where a 64-bit one
// calls a ~70-instruction routine (the forward's item set-up ran seven of them).
__device__ __forceinline__ int64_t div_index(int64_t a, int64_t b) {
  return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
}
__device__ __forceinline__ int64_t mod_index(int64_t a, int64_t b) {
  return static_cast<uint32_t>(a) % static_cast<uint32_t>(b);
}

// This CTA's query tile and flat (batch, head) index. One head's tiles are
// consecutive block indices, so that the CTAs resident together read the
// same K and V from L2 rather than each streaming its own head's from DRAM;
// within a head the heaviest (latest, for causal) tiles go first.
struct QueryTile {
  int64_t tile, bh;
};
__device__ __forceinline__ QueryTile query_tile(int64_t q_tiles) {
  const int64_t block = blockIdx.x;
  return {q_tiles - 1 - block % q_tiles, block / q_tiles};
}

}  // namespace flashjax::cuda
