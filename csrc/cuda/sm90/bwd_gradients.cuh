// The per-tile math every Hopper backward consumer shares: P and dS from the
// scores S and dP in registers, and their 16-bit wgmma fragments, packed and,
// transposed, stored to shared memory.
#pragma once

#include <cstdint>

#include "../common/device.cuh"
#include "../common/fragment.cuh"
#include "../common/score_mod.cuh"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// P (in s) and dS (in dp), in place: P = exp2(s * scale - lse2), with s the
// raw scores and scale = softmax_scale * log2(e), or s the log2 scores
// (scores_log2: softcap) and scale = 1; lse2/D per element.
template <int kN, class LseOf, class DOf>
__device__ __forceinline__ void probabilities_and_grad(float (&s)[kN], float (&dp)[kN],
                                                       const AttentionParams& p, float scale,
                                                       LseOf&& lse2, DOf&& d_of) {
  const float inv_cap_log2 = p.softcap > 0.0f ? 1.0f / (p.softcap * kLog2e) : 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const float prob = fast_exp2(fmaf(s[i], scale, -lse2(i)));
    float ds = prob * (dp[i] - d_of(i));
    if (p.softcap > 0.0f) {
      const float t = prob > 0.0f ? s[i] * inv_cap_log2 : 0.0f;
      ds *= softcap_slope(t);
    }
    s[i] = prob;
    dp[i] = ds;
  }
}

// The same with dP's product still running when it is called (S's done):
// without softcap, P's exponentials run first and overlap that product;
// wait_dp() then waits for it. With softcap, dS needs the capped scores that P
// overwrites, so it waits first.
template <int kN, class LseOf, class DOf, class WaitDp>
__device__ __forceinline__ void probabilities_then_grad(float (&s)[kN], float (&dp)[kN],
                                                        const AttentionParams& p, float scale,
                                                        LseOf&& lse2, DOf&& d_of,
                                                        WaitDp&& wait_dp) {
  if (p.softcap > 0.0f) {
    wait_dp();
    probabilities_and_grad(s, dp, p, scale, lse2, d_of);
    return;
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = fast_exp2(fmaf(s[i], scale, -lse2(i)));
  fence_operands(s);  // (the exponentials are issued before the wait)
  wait_dp();
#pragma unroll
  for (int i = 0; i < kN; ++i) dp[i] = s[i] * (dp[i] - d_of(i));
}

// kTerms kernels: P and dS in place from log2 scores with the score terms added
// (s) and dP (dp), with dropout (dP and P dropped: dV's P is the dropped one) and,
// kBiasGradient, dbias += P * (dP' - D) (before softcap's slope). terms: a
// FragmentTerms of the tile from column c0.
template <bool kBiasGradient, int kTiles, class Terms, class LseOf, class DOf>
__device__ __forceinline__ void terms_probabilities_and_grad(float (&s)[kTiles * 4],
                                                             float (&dp)[kTiles * 4],
                                                             const AttentionParams& p,
                                                             const Terms& terms, int64_t c0,
                                                             LseOf&& lse2, DOf&& d_of) {
  const float inv_cap_log2 = p.softcap > 0.0f ? 1.0f / (p.softcap * kLog2e) : 0.0f;
  const auto keep = terms.template keep_words<kTiles>(c0);
  terms.template drop<kTiles>(dp, keep);
#pragma unroll
  for (int i = 0; i < kTiles * 4; ++i) {
    const float prob = fast_exp2(s[i] - lse2(i));
    float ds = prob * (dp[i] - d_of(i));
    if constexpr (kBiasGradient) terms.add_bias_gradient_at(i, c0, ds);
    if (p.softcap > 0.0f)  // (the slope is the capped score's: the terms come off again)
      ds *= softcap_slope(prob > 0.0f ? (s[i] - terms.term_log2_at(i, c0)) * inv_cap_log2 : 0.0f);
    s[i] = prob;
    dp[i] = ds;
  }
  terms.template drop<kTiles>(s, keep);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
