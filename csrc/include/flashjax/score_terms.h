// The bias, mask and ALiBi terms of one (sequence, query head), on host and device
// alike: score (i, j) (slot rows and keys) gets bias[i][j] - slope * |i + diagonal - j|
// and is hidden where mask[i][j] is false (bias and mask: dense layout only). The CPU
// tiles, the CUDA kernels' exact rows and their fragments (cuda/common/score_terms.cuh)
// all read the terms here.
#pragma once

#include <cstdint>

#include "flashjax/params.h"
#include "flashjax/seqlen.h"

namespace flashjax {

struct ScoreTerms {
  const float* bias = nullptr;
  const bool* mask = nullptr;
  int64_t bias_ld = 0, mask_ld = 0;
  float slope = 0.0f;
  bool alibi = false;
  int64_t diagonal = 0;

  ScoreTerms() = default;
  FJ_HOST_DEVICE ScoreTerms(const AttentionParams& p, const SeqlenInfo& seq, int64_t b, int64_t h)
      : diagonal(seq.diagonal_offset()) {
    if (p.bias) bias = p.bias.at<const float>(b, h), bias_ld = p.bias.row_stride;
    if (p.mask) mask = p.mask.at<const bool>(b, h), mask_ld = p.mask.row_stride;
    if (p.alibi_slopes) alibi = true, slope = p.alibi_slopes[b * p.heads_q + h];
  }
  FJ_HOST_DEVICE bool active() const { return bias || mask || alibi; }
  // ALiBi's term of query i, key j.
  FJ_HOST_DEVICE float alibi_term(int64_t i, int64_t j) const {
    const int64_t d = i + diagonal - j;
    return -slope * static_cast<float>(d < 0 ? -d : d);
  }
  // bias + ALiBi of (i, j) (natural units).
  FJ_HOST_DEVICE float term(int64_t i, int64_t j) const {
    float t = bias ? bias[i * bias_ld + j] : 0.0f;
    return alibi ? t + alibi_term(i, j) : t;
  }
  // Adds the bias and ALiBi terms to s[lo, hi): row i, keys k0 + lo .. k0 + hi - 1.
  FJ_HOST_DEVICE void add(float* s, int64_t i, int64_t k0, int64_t lo, int64_t hi) const {
    if (bias) {
      const float* row = bias + i * bias_ld + k0;
      for (int64_t j = lo; j < hi; ++j) s[j] += row[j];
    }
    if (alibi) {
      const int64_t d = i + diagonal - k0;  // |d - j| is the distance of key k0 + j
      for (int64_t j = lo; j < hi; ++j) s[j] -= slope * static_cast<float>(d > j ? d - j : j - d);
    }
  }
  FJ_HOST_DEVICE bool allows(int64_t i, int64_t j) const { return !mask || mask[i * mask_ld + j]; }
};

}  // namespace flashjax
