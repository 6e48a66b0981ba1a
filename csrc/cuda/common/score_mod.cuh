// Score modifiers: what turns a raw q.k product into a score, and its
// derivative. The one home of softcap on the GPU (s = cap * tanh(scale * dot /
// cap)); a bias or ALiBi would go here too.
#pragma once

#include <cstdint>

#include "device.cuh"
#include "flashjax/params.h"

namespace flashjax::cuda {

// Scale, softcap: the score of a raw q.k product (natural units).
__device__ __forceinline__ float score(const AttentionParams& p, float dot) {
  const float s = dot * p.softmax_scale;
  return p.softcap > 0.0f ? p.softcap * tanhf(s / p.softcap) : s;
}

// scale and softcap: raw q.k products become scores in log2 units. dot_factor: what
// the products are to be multiplied by first (float8: their descale).
template <int kN>
__device__ __forceinline__ void scores_log2(float (&s)[kN], const AttentionParams& p,
                                            float dot_factor = 1.0f) {
  if (p.softcap > 0.0f) {
    const float inv_cap = dot_factor * p.softmax_scale / p.softcap,
                cap_log2 = p.softcap * kLog2e;
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] = cap_log2 * tanhf(s[i] * inv_cap);
  } else {
    const float scale_log2 = dot_factor * p.softmax_scale * kLog2e;
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] *= scale_log2;
  }
}

// Whether raw q.k products must become scores (scores_log2) before they are
// masked: with softcap, or with a scale that is not positive (a masked -inf
// times it would not stay -inf). Otherwise the kernels mask the raw products
// and fold the scale into the exponent's FFMA, exp2(s * scale - m * scale),
// one instruction per score instead of a multiply and a subtraction.
__device__ __forceinline__ bool scores_prescaled(const AttentionParams& p) {
  return p.softcap > 0.0f || !(p.softmax_scale > 0.0f);
}
// The factor that brings such masked scores to log2 units in the exponent.
__device__ __forceinline__ float exponent_scale(const AttentionParams& p) {
  return scores_prescaled(p) ? 1.0f : p.softmax_scale * kLog2e;
}

// The softcap's derivative d score / d (scale * dot) at a capped score s,
// given t = s / cap (tanh's derivative, 1 - tanh^2).
__device__ __forceinline__ float softcap_slope(float t) { return 1.0f - t * t; }

}  // namespace flashjax::cuda
