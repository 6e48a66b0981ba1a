// Exact attention of one row, pair by pair: one warp per query row (forward,
// dQ) or key (dK, dV), lanes splitting the head dimension. These are the SIMT
// kernels' bodies, and the tensor-core forwards' fallback for the rows their
// matrix products got wrong: a tile product computes 0 * v for the (row, key)
// pairs the mask hides, which is NaN when v is NaN or inf, so a non-finite
// value can reach rows that do not see it (docs/api.md, "Non-finite values").
// Such a row always comes out non-finite; the tensor-core forwards probe every
// row they write (one FMA per value: probe_nonfinite) and recompute the
// non-finite ones with exact_forward_row, which sums visible pairs only. The
// main loops stay as they are; only rows that are NaN or inf anyway pay.
// The score terms (bias, mask, ALiBi) and dropout are PairTerms': read at run
// time by default (every call), compiled out where a kernel knows there are none.
#pragma once

#include <cstdint>
#include <type_traits>

#include "device.cuh"
#include "flashjax/dropout.h"
#include "flashjax/params.h"
#include "flashjax/score_terms.h"
#include "flashjax/seqlen.h"
#include "score_mod.cuh"

namespace flashjax::cuda {

constexpr int kSlots = kMaxHeadDim / 32;  // head-dim elements per lane

// A row of a tensor (head_dim elements) as seen by one lane.
template <class T>
struct LaneRow {
  const T* base;
  int64_t dim;
  __device__ float get(int slot, int lane) const {
    const int64_t c = slot * 32 + lane;
    return c < dim ? to_float(base[c]) : 0.0f;
  }
};

template <class T>
__device__ void load_lane(float (&x)[kSlots], const T* row, int64_t dim, int lane) {
#pragma unroll
  for (int t = 0; t < kSlots; ++t) x[t] = LaneRow<T>{row, dim}.get(t, lane);
}

template <class T>
__device__ float lane_dot(const float (&x)[kSlots], const T* row, int64_t dim, int lane) {
  float sum = 0.0f;
#pragma unroll
  for (int t = 0; t < kSlots; ++t) sum += x[t] * LaneRow<T>{row, dim}.get(t, lane);
  return warp_sum(sum);
}

template <class T>
__device__ void store_lane(T* row, const float (&x)[kSlots], int64_t dim, int lane, float scale) {
#pragma unroll
  for (int t = 0; t < kSlots; ++t) {
    const int64_t c = t * 32 + lane;
    if (c < dim) row[c] = from_float<T>(x[t] * scale);
  }
}

// The score terms and dropout of one (sequence, query head), pair by pair (the
// CPU path's semantics: flashjax/score_terms.h, dropout.h), built once per row or
// head. kTerms true reads them at run time (any call: the rows the tensor-core
// kernels recompute); false compiles them out, so that the SIMT kernels of calls
// without them keep the plain rows and their registers (the terms take ~40 more).
template <bool kTerms>
class PairTerms {
 public:
  __device__ PairTerms(const AttentionParams& p, const SeqlenInfo& seq, int64_t b, int64_t h)
      : scores_(p.has_score_terms()), drops_(static_cast<bool>(p.dropout)),
        keep_scale_(drops_ ? p.dropout.scale : 1.0f) {
    if (scores_) terms_ = ScoreTerms(p, seq, b, h);
    if (drops_) dropout_ = p.dropout.head(b, h, p.heads_q);
  }
  // Whether the mask lets (i, j) through (windows and segment ids are the caller's).
  __device__ bool allows(int64_t i, int64_t j) const { return !scores_ || terms_.allows(i, j); }
  // s + bias + ALiBi of (i, j), natural units: only for pairs the masks let through.
  __device__ float add_term(float s, int64_t i, int64_t j) const {
    return scores_ ? s + terms_.term(i, j) : s;
  }
  // Whether dropout keeps (i, j): a whole Philox call, all lanes alike (a scalar path).
  __device__ bool kept(int64_t i, int64_t j) const {
    return !drops_ || dropout_.generator.keep(dropout_.b, dropout_.h, static_cast<uint32_t>(i),
                                              static_cast<uint32_t>(j));
  }
  // What dropout multiplies P_ij by: 1 without it, else 1 / (1 - rate) or 0.
  __device__ float factor(int64_t i, int64_t j) const { return kept(i, j) ? keep_scale_ : 0.0f; }
  // The factor of a kept pair (1 without dropout).
  __device__ float keep_scale() const { return keep_scale_; }

 private:
  ScoreTerms terms_;
  Dropout::Head dropout_;
  bool scores_, drops_;
  float keep_scale_;
};

template <>
class PairTerms<false> {
 public:
  __device__ PairTerms(const AttentionParams&, const SeqlenInfo&, int64_t, int64_t) {}
  __device__ bool allows(int64_t, int64_t) const { return true; }
  __device__ float add_term(float s, int64_t, int64_t) const { return s; }
  __device__ bool kept(int64_t, int64_t) const { return true; }
  __device__ float factor(int64_t, int64_t) const { return 1.0f; }
  __device__ float keep_scale() const { return 1.0f; }
};

// The form of the exact rows a kernel that recomputes rows compiles: kNone or kRead
// (PairTerms<false> / <true>) when it knows its calls' terms at compile time, else
// kPerCall: both, picked per call.
enum class RowTerms { kNone, kRead, kPerCall };

// row(std::bool_constant<kTerms>{}): PairTerms' kTerms of form kForm for call p.
template <RowTerms kForm, class Row>
__device__ __forceinline__ void with_row_terms(const AttentionParams& p, Row&& row) {
  if constexpr (kForm == RowTerms::kPerCall) {
    if (p.has_pair_terms()) row(std::true_type{});
    else row(std::false_type{});
  } else {
    row(std::bool_constant<kForm == RowTerms::kRead>{});
  }
}

// The gradients of one visible (row, key) pair.
struct PairGradient {
  float prob = 0.0f;  // P times dropout's factor: dV's weight of dO
  float g = 0.0f;     // dL / d(score after softcap): dbias's share
  float ds = 0.0f;    // dL / d(scale * q.k): g times softcap's slope
  bool adds = false;  // false for a -inf score: the pair adds nothing (the CPU path's masked pair)
};

// From q.k (dot), dO.v (dp) and the row's lse and D. Dropout: out = sum_j P_ij z_ij v_j
// (z: 0 or 1 / (1 - rate)), so dV takes P z and dP is z dO.v; D = rowsum(dO * O) is
// still sum_j P_ij dP_ij, so g = P (dP - D) as without.
template <bool kTerms>
__device__ __forceinline__ PairGradient score_grad(const AttentionParams& p,
                                                   const PairTerms<kTerms>& terms, int64_t i,
                                                   int64_t j, float dot, float dp, float lse,
                                                   float D) {
  const float capped = score(p, dot);
  const float s = terms.add_term(capped, i, j);
  PairGradient r;
  if (s == kNegInf) return r;  // (a -inf bias; exp would give 0, but 0 * NaN is not 0)
  const float z = terms.factor(i, j);
  const float pr = expf(s - lse);
  r.prob = pr * z;
  r.g = pr * (dp * z - D);
  r.ds = p.softcap > 0.0f ? r.g * softcap_slope(capped / p.softcap) : r.g;
  r.adds = true;
  return r;
}

// out and lse of slot row i of sequence b, query head h. Rows past the used
// ones get out 0 and lse -inf, sinks or not. T: the inputs' element type, TOut: out's;
// kTerms: PairTerms' (the default serves every call).
template <class T, class TOut = T, bool kTerms = true>
__device__ __forceinline__ void exact_forward_row(const AttentionParams& p, int64_t b, int64_t h,
                                               int64_t i, int lane) {
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  const PairTerms<kTerms> terms(p, seq, b, h);
  const int64_t hk = h / p.group_size();
  // (float8 inputs: q.k and V times their descales)
  constexpr bool kFloat8 = sizeof(T) == 1;
  const float score_descale = kFloat8 ? p.float8.score_factor(b, hk, p.heads_kv) : 1.0f;
  float q[kSlots], acc[kSlots] = {};
  load_lane(q, seq.q_at<const T>(p.q, i, h), p.head_dim, lane);
  float m = kNegInf, l = 0.0f;
  for (int64_t j = seq.first_key(i); j <= seq.last_key(i); ++j) {  // none past used rows
    if (!ids.visible(i, j) || !terms.allows(i, j)) continue;
    const float dot = lane_dot(q, seq.k_at<const T>(p.k, j, hk), p.head_dim, lane);
    const float s = terms.add_term(score(p, dot * score_descale), i, j);
    const float m_new = fmaxf(m, s);
    // Exponents from 0 while every score so far is -inf (a -inf bias, an inf input):
    // such a key adds exp(-inf) = 0, as in the reference, not exp(-inf - -inf) = NaN.
    // l holds 1 meanwhile (the next finite score's alpha = 0 clears it), so that a row
    // whose scores all are -inf ends as on the CPU path: NaN without a sink
    // (RowNormaliser's exp(-inf - -inf)), out 0 and lse = sink with one.
    const float base = m_new == kNegInf ? 0.0f : m_new;
    const float alpha = expf(m - base), pj = expf(s - base);
    l = l * alpha + (s == kNegInf && m == kNegInf ? 1.0f : pj);
    // Dropout after the row sum (the lse is the undropped one); its scale at the end.
    const float weight = terms.kept(i, j) ? pj : 0.0f;
    const LaneRow<T> v{seq.k_at<const T>(p.v, j, hk), p.head_dim_v};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) acc[t] = acc[t] * alpha + weight * v.get(t, lane);
    m = m_new;
  }
  const bool used = i < seq.seqlen_q;
  const float sink = p.sinks && used ? p.sinks[b * p.heads_q + h] : kNegInf;
  const RowNormaliser row(m, l, sink, used, [](float x) { return expf(x); },
                          [](float x) { return logf(x); });
  store_lane(seq.q_at<TOut>(p.out, i, h), acc, p.head_dim_v, lane,
             row.factor * terms.keep_scale() *
                 (kFloat8 ? p.float8.value_factor(b, hk, p.heads_kv) : 1.0f));
  if (lane == 0) *seq.q_at<float>(p.lse, i, h) = row.lse;
}

// dK and dV of slot key j of sequence b, kv head hk, summed over the query
// heads of its group (0 for keys past the used ones: no query sees them).
// D: rowsum(dO * O) - dlse, laid out like lse.
template <class T, bool kTerms = true>
__device__ __forceinline__ void exact_key_gradients(const AttentionParams& p, const TensorRef& D,
                                                 int64_t b, int64_t hk, int64_t j, int lane) {
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  float k[kSlots], v[kSlots], dk[kSlots] = {}, dv[kSlots] = {};
  load_lane(k, seq.k_at<const T>(p.k, j, hk), p.head_dim, lane);
  load_lane(v, seq.k_at<const T>(p.v, j, hk), p.head_dim_v, lane);
  for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    const PairTerms<kTerms> terms(p, seq, b, h);
    for (int64_t i = seq.first_query(j); i <= seq.last_query(j); ++i) {
      if (!ids.visible(i, j) || !terms.allows(i, j)) continue;
      const float lse = *seq.q_at<const float>(p.lse, i, h);
      if (lse == kNegInf) continue;
      const T* q = seq.q_at<const T>(p.q, i, h);
      const T* dout = seq.q_at<const T>(p.dout, i, h);
      const PairGradient g =
          score_grad(p, terms, i, j, lane_dot(k, q, p.head_dim, lane),
                     lane_dot(v, dout, p.head_dim_v, lane), lse, *seq.q_at<const float>(D, i, h));
      if (!g.adds) continue;
      const LaneRow<T> qr{q, p.head_dim}, dor{dout, p.head_dim_v};
#pragma unroll
      for (int t = 0; t < kSlots; ++t) {
        dv[t] += g.prob * dor.get(t, lane);
        dk[t] += g.ds * qr.get(t, lane);
      }
    }
  }
  store_lane(seq.k_at<T>(p.dk, j, hk), dk, p.head_dim, lane, p.softmax_scale);
  store_lane(seq.k_at<T>(p.dv, j, hk), dv, p.head_dim_v, lane, 1.0f);
}

// dQ of slot row i of sequence b, query head h (0 past the used rows).
template <class T, bool kTerms = true>
__device__ __forceinline__ void exact_query_gradient(const AttentionParams& p, const TensorRef& D,
                                                  int64_t b, int64_t h, int64_t i, int lane) {
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  const PairTerms<kTerms> terms(p, seq, b, h);
  const int64_t hk = h / p.group_size();
  const bool used = i < seq.seqlen_q;
  const float lse = used ? *seq.q_at<const float>(p.lse, i, h) : kNegInf;
  const float D_row = used ? *seq.q_at<const float>(D, i, h) : 0.0f;
  float q[kSlots], dout[kSlots], dq[kSlots] = {};
  load_lane(q, seq.q_at<const T>(p.q, i, h), p.head_dim, lane);
  load_lane(dout, seq.q_at<const T>(p.dout, i, h), p.head_dim_v, lane);
  const int64_t last = lse == kNegInf ? -1 : seq.last_key(i);
  for (int64_t j = seq.first_key(i); j <= last; ++j) {
    if (!ids.visible(i, j) || !terms.allows(i, j)) continue;
    const T* k = seq.k_at<const T>(p.k, j, hk);
    const PairGradient g =
        score_grad(p, terms, i, j, lane_dot(q, k, p.head_dim, lane),
                   lane_dot(dout, seq.k_at<const T>(p.v, j, hk), p.head_dim_v, lane), lse, D_row);
    if (!g.adds) continue;
    const LaneRow<T> kr{k, p.head_dim};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) dq[t] += g.ds * kr.get(t, lane);
  }
  store_lane(seq.q_at<T>(p.dq, i, h), dq, p.head_dim, lane, p.softmax_scale);
}

// Row i of dbias entry (eb, eh) (the bias's batch and head entries), keys below
// seqlen_k: g of each pair summed over the (sequence, query head)s that read the
// entry, in a fixed order (deterministic, no atomics), 0 where none uses the pair.
// Keys go kBiasKeys at a time, lane l holding key j0 + l's sum, so that the warp
// writes each chunk once (coalesced) and the entry needs no zeroing first.
constexpr int kBiasKeys = 32;  // a warp's lanes

template <class T>
__device__ __forceinline__ void exact_bias_gradient_row(const AttentionParams& p,
                                                     const TensorRef& D, int64_t eb, int64_t eh,
                                                     int64_t i, int lane) {
  const ScoreArray& dbias = p.dbias;
  const int64_t b0 = eb * dbias.batch_div, h0 = eh * dbias.head_div;
  float* out = dbias.at<float>(b0, h0) + i * dbias.row_stride;
  for (int64_t j0 = 0; j0 < p.seqlen_k; j0 += kBiasKeys) {
    float sum = 0.0f;  // key j0 + lane's
    for (int64_t b = b0; b < b0 + dbias.batch_div; ++b) {
      const SeqlenInfo seq(p, b);
      const SegmentIds ids(p, b);
      const int64_t first = j0 > seq.first_key(i) ? j0 : seq.first_key(i);
      const int64_t last = j0 + kBiasKeys - 1 < seq.last_key(i) ? j0 + kBiasKeys - 1
                                                                : seq.last_key(i);
      if (first > last) continue;  // (always past the used rows: no lse, bias or mask read)
      for (int64_t h = h0; h < h0 + dbias.head_div; ++h) {
        const float lse = *seq.q_at<const float>(p.lse, i, h);
        if (lse == kNegInf) continue;
        const float D_row = *seq.q_at<const float>(D, i, h);
        const PairTerms<true> terms(p, seq, b, h);
        const int64_t hk = h / p.group_size();
        float q[kSlots], dout[kSlots];
        load_lane(q, seq.q_at<const T>(p.q, i, h), p.head_dim, lane);
        load_lane(dout, seq.q_at<const T>(p.dout, i, h), p.head_dim_v, lane);
        for (int64_t j = first; j <= last; ++j) {
          if (!ids.visible(i, j) || !terms.allows(i, j)) continue;
          const PairGradient g = score_grad(
              p, terms, i, j, lane_dot(q, seq.k_at<const T>(p.k, j, hk), p.head_dim, lane),
              lane_dot(dout, seq.k_at<const T>(p.v, j, hk), p.head_dim_v, lane), lse, D_row);
          if (lane == j - j0) sum += g.g;
        }
      }
    }
    if (j0 + lane < p.seqlen_k) out[j0 + lane] = sum;
  }
}

// Whether a stored row of dim values holds NaN or inf (the whole warp answers).
template <class T>
__device__ __forceinline__ bool row_nonfinite(const T* row, int64_t dim, int lane) {
  float probe = 0.0f;
  for (int64_t c = lane; c < dim; c += 32) probe = fmaf(to_float(row[c]), 0.0f, probe);
  return __any_sync(0xffffffffu, probe != 0.0f);
}

// Key row j of sequence b (seq), kv head hk: dK and dV again if either stored
// row holds NaN or inf (D_rows: D laid out like lse). Call with the whole warp.
template <class T, bool kTerms>
__device__ __forceinline__ void recompute_key_if_nonfinite(const AttentionParams& p,
                                                           const TensorRef& D_rows,
                                                           const SeqlenInfo& seq, int64_t b,
                                                           int64_t hk, int64_t j, int lane) {
  if (row_nonfinite(seq.k_at<const T>(p.dk, j, hk), p.head_dim, lane) ||
      row_nonfinite(seq.k_at<const T>(p.dv, j, hk), p.head_dim_v, lane))
    exact_key_gradients<T, kTerms>(p, D_rows, b, hk, j, lane);
}

// Query row i of sequence b (seq), head h: dQ again if the stored row holds NaN or
// inf, and then row i of the dbias entry it adds to: the kernels wrote both from the
// same dS row (dQ_i = dS_i K: a non-finite dS_ij makes dQ_i non-finite), so a dbias
// row a tile product got wrong always comes with a flagged dQ row. (Several heads
// sharing the entry may each write the row: the same values.)
template <class T, bool kTerms>
__device__ __forceinline__ void recompute_query_if_nonfinite(const AttentionParams& p,
                                                             const TensorRef& D_rows,
                                                             const SeqlenInfo& seq, int64_t b,
                                                             int64_t h, int64_t i, int lane) {
  if (!row_nonfinite(seq.q_at<const T>(p.dq, i, h), p.head_dim, lane)) return;
  exact_query_gradient<T, kTerms>(p, D_rows, b, h, i, lane);
  if constexpr (kTerms)
    if (p.dbias)
      exact_bias_gradient_row<T>(p, D_rows, b / p.dbias.batch_div, h / p.dbias.head_div, i,
                                 lane);
}

// A tensor-core fragment (common/fragment.cuh's layout: a thread holds rows
// g = lane / 4 and g + 8 of its warp's 16, as elements 4n + 0, 1 and 4n + 2, 3)
// is probed when it is written: probe[r] becomes NaN when a value of the
// thread's row half r is NaN or inf (x * 0 is 0 for finite x only).
template <int kN>
__device__ __forceinline__ void probe_nonfinite(const float (&acc)[kN], float (&probe)[2]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) probe[(i % 4) / 2] = fmaf(acc[i], 0.0f, probe[(i % 4) / 2]);
}

// The backward kernels' side: after storing its accumulators, a thread sets
// *flag if one of their values is NaN or inf; recompute_nonfinite_gradients
// (simt_attention.h) then recomputes such rows. (One predicated store: code
// that recomputes rows inside the tensor-core kernels made ptxas spill.)
template <class... Accumulators>
__device__ __forceinline__ void flag_nonfinite(int* flag, const Accumulators&... accs) {
  float probe[2] = {0.0f, 0.0f};
  (probe_nonfinite(accs, probe), ...);
  if (probe[0] != probe[0] || probe[1] != probe[1]) *flag = 1;
}

}  // namespace flashjax::cuda
