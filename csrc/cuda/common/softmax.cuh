// Online softmax on accumulator fragments (fragment.cuh's layout), shared by
// the mma.sync (sm_80), wgmma (sm_90a) and KV-cache kernels: a thread's query
// rows and running statistics (RowSoftmax), and the backward's probabilities
// and score gradients. Scores are in log2 units (exp2 is ex2.approx).
#pragma once

#include <cstdint>

#include "device.cuh"
#include "flashjax/params.h"
#include "flashjax/seqlen.h"
#include "mask.cuh"
#include "score_mod.cuh"

namespace flashjax::cuda {

// The query rows of one thread and the running softmax statistics (log2 units).
struct RowSoftmax {
  int64_t row;  // first of the thread's two rows (the other is row + 8)
  // GQA packing (0: off): tile row r is query r % packed_rows of head
  // h + r / packed_rows, for the group's heads.
  int packed_rows = 0;  // (tile rows are then < 256: 32-bit arithmetic)
  float m[2] = {kNegInf, kNegInf};
  float l[2] = {0.0f, 0.0f};  // this thread's partial sums; the quad reduces at the end

  // Does every used row of the tile [q0, q_last] see every key of [k0, k0 + n)?
  // (q_last: the tile's last used row; rows past it are written as empty rows.)
  __device__ static bool tile_needs_mask(const SeqlenInfo& seq, int64_t q0, int64_t q_last,
                                         int64_t k0, int n, int64_t key_begin, int64_t key_end) {
    return k0 < key_begin || k0 + n > key_end || k0 < seq.first_key(q_last) ||
           k0 + n - 1 > seq.last_key(q0);
  }
  // The same test as a range, for a caller that asks it of many tiles k0 >= 0 (the
  // Hopper forward's producer, which publishes it): tile_needs_mask is false exactly
  // for lo <= k0 <= hi (int32: clamped, keys are < 2^31; hi < lo: every tile needs it).
  __device__ static void unmasked_tiles(const SeqlenInfo& seq, int64_t q0, int64_t q_last,
                                        int n, int64_t key_begin, int64_t key_end,
                                        int32_t& lo, int32_t& hi) {
    lo = static_cast<int32_t>(clamp_to(max(key_begin, seq.first_key(q_last)), 0, INT32_MAX));
    hi = static_cast<int32_t>(
        clamp_to(min(key_end, seq.last_key(q0) + 1) - n, -1, INT32_MAX));
  }

  // Raw q.k products -> scores in log2 units, -inf where masked. kFoldScale: for
  // exponentiate(s, alpha, exponent_scale(p)), the products stay raw (the scale rides
  // in the exponent's FFMA) unless scores_prescaled(p); m is then in the same units
  // until log2_units.
  // dot_factor: scores_log2's (float8: the products' descale).
  template <int kKeyTiles, bool kFoldScale = false>
  __device__ void scores(float (&s)[kKeyTiles * 4], const AttentionParams& p,
                         const SeqlenInfo& seq, int64_t k0, bool needs_mask,
                         float dot_factor = 1.0f) const {
    if (!kFoldScale || scores_prescaled(p)) scores_log2(s, p, dot_factor);
    if (needs_mask) mask<kKeyTiles>(s, seq, k0);
  }

  // -inf where the thread's rows do not see key k0 + column (positions, windows, seqused).
  template <int kKeyTiles>
  __device__ void mask(float (&s)[kKeyTiles * 4], const SeqlenInfo& seq, int64_t k0) const {
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
      visible_columns(seq.first_key(query(row + 8 * r)), seq.last_key(query(row + 8 * r)), k0,
                      kKeyTiles * 8, lo[r], hi[r]);
    mask_columns<kKeyTiles>(s, lo, hi);
  }

  __device__ int64_t query(int64_t tile_row) const {
    return packed_rows ? static_cast<int>(tile_row) % packed_rows : tile_row;
  }

  // s becomes exp2((s - m_new) * scale + kOffset); alpha = exp2((m_old - m_new) *
  // scale) is what the output accumulated so far must be scaled by. scale (> 0): 1 for
  // scores in log2 units, exponent_scale(p) for scores<.., true>' (one FFMA a score).
  // kOffset: P in (0, 2^kOffset], l and O 2^kOffset times theirs (log2_units takes it
  // off m), so that a float8 P keeps its precision for small probabilities (FA3's
  // Max_offset).
  template <int kKeyTiles, int kOffset = 0>
  __device__ void exponentiate(float (&s)[kKeyTiles * 4], float (&alpha)[2],
                               float scale = 1.0f) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == kNegInf ? 0.0f : mx * scale;  // nothing visible yet: keep zeros
      alpha[r] = fast_exp2(fmaf(m[r], scale, -base));
      const float shifted = base - kOffset;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        s[4 * n + 2 * r] = fast_exp2(fmaf(s[4 * n + 2 * r], scale, -shifted));
        s[4 * n + 2 * r + 1] = fast_exp2(fmaf(s[4 * n + 2 * r + 1], scale, -shifted));
        sum += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
      }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = mx;
    }
  }

  // After exponentiate with a scale other than 1 (or an offset): m to log2 units, as
  // the epilogue reads it, less the offset that l and O carry (-inf stays -inf).
  template <int kOffset = 0>
  __device__ void log2_units(float scale) {
    m[0] = m[0] * scale - kOffset;
    m[1] = m[1] * scale - kOffset;
  }

  template <int kDimTiles>
  __device__ static void rescale(float (&o)[kDimTiles * 4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      o[4 * n] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
  }

  template <int kKeyTiles, int kDimTiles>
  __device__ void update(float (&s)[kKeyTiles * 4], float (&o)[kDimTiles * 4]) {
    float alpha[2];
    exponentiate<kKeyTiles>(s, alpha);
    rescale<kDimTiles>(o, alpha);
  }

  // The query head of tile row tile_row (h0: the tile's, or its group's first when packed).
  __device__ int64_t head(int64_t h0, int64_t tile_row) const {
    return h0 + (packed_rows ? static_cast<int>(tile_row) / packed_rows : 0);
  }
  // Whether tile row tile_row is a row of the output (of sequence b's slot).
  __device__ bool writes(const AttentionParams& p, const SeqlenInfo& seq, int64_t tile_row) const {
    return !(packed_rows && tile_row >= packed_rows * p.group_size()) &&
           query(tile_row) < seq.q_slot;
  }
};

// P = exp2(S - lse) from log2-unit scores; `lse_log2(e)` gives the lse of
// element e's query (+inf for a row that saw nothing, so that P = 0).
template <int kN, class LseOf>
__device__ __forceinline__ void probabilities(float (&s)[kN], LseOf&& lse_log2) {
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = fast_exp2(s[i] - lse_log2(i));
}

// dP becomes dS = P * (dP - D) * softcap'(S); `d_of(e)` gives element e's D.
template <int kN, class DOf>
__device__ __forceinline__ void score_gradient(float (&dp)[kN], const float (&prob)[kN],
                                               const float (&s_log2)[kN],
                                               const AttentionParams& p, DOf&& d_of) {
  const float inv_cap_log2 = p.softcap > 0.0f ? 1.0f / (p.softcap * kLog2e) : 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float ds = prob[i] * (dp[i] - d_of(i));
    if (p.softcap > 0.0f) {
      const float t = prob[i] > 0.0f ? s_log2[i] * inv_cap_log2 : 0.0f;
      ds *= softcap_slope(t);
    }
    dp[i] = ds;
  }
}

__device__ __forceinline__ float lse_to_log2(float lse) {
  return lse == kNegInf ? -kNegInf : lse * kLog2e;
}

}  // namespace flashjax::cuda
