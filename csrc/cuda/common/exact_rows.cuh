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
#pragma once

#include <cstdint>

#include "device.cuh"
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

// dS of one (row, key) pair, given q.k, dO.v and the row's lse and D.
__device__ __forceinline__ float score_grad(const AttentionParams& p, float dot, float dp,
                                            float lse, float D, float* prob) {
  const float s = score(p, dot);
  const float pr = expf(s - lse);
  *prob = pr;
  float ds = pr * (dp - D);
  if (p.softcap > 0.0f) {
    ds *= softcap_slope(s / p.softcap);
  }
  return ds;
}

// out and lse of slot row i of sequence b, query head h. Rows past the used
// ones get out 0 and lse -inf, sinks or not. T: the inputs' element type, TOut: out's.
template <class T, class TOut = T>
__device__ __forceinline__ void exact_forward_row(const AttentionParams& p, int64_t b, int64_t h,
                                               int64_t i, int lane) {
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  const int64_t hk = h / p.group_size();
  float q[kSlots], acc[kSlots] = {};
  load_lane(q, seq.q_at<const T>(p.q, i, h), p.head_dim, lane);
  float m = kNegInf, l = 0.0f;
  for (int64_t j = seq.first_key(i); j <= seq.last_key(i); ++j) {  // none past used rows
    if (!ids.visible(i, j)) continue;
    const float s = score(p, lane_dot(q, seq.k_at<const T>(p.k, j, hk), p.head_dim, lane));
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new), pj = expf(s - m_new);
    l = l * alpha + pj;
    const LaneRow<T> v{seq.k_at<const T>(p.v, j, hk), p.head_dim_v};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) acc[t] = acc[t] * alpha + pj * v.get(t, lane);
    m = m_new;
  }
  const bool used = i < seq.seqlen_q;
  const float sink = p.sinks && used ? p.sinks[b * p.heads_q + h] : kNegInf;
  const RowNormaliser row(m, l, sink, used, [](float x) { return expf(x); },
                          [](float x) { return logf(x); });
  store_lane(seq.q_at<TOut>(p.out, i, h), acc, p.head_dim_v, lane, row.factor);
  if (lane == 0) *seq.q_at<float>(p.lse, i, h) = row.lse;
}

// dK and dV of slot key j of sequence b, kv head hk, summed over the query
// heads of its group (0 for keys past the used ones: no query sees them).
// D: rowsum(dO * O) - dlse, laid out like lse.
template <class T>
__device__ __forceinline__ void exact_key_gradients(const AttentionParams& p, const TensorRef& D,
                                                 int64_t b, int64_t hk, int64_t j, int lane) {
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  float k[kSlots], v[kSlots], dk[kSlots] = {}, dv[kSlots] = {};
  load_lane(k, seq.k_at<const T>(p.k, j, hk), p.head_dim, lane);
  load_lane(v, seq.k_at<const T>(p.v, j, hk), p.head_dim_v, lane);
  for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    for (int64_t i = seq.first_query(j); i <= seq.last_query(j); ++i) {
      if (!ids.visible(i, j)) continue;
      const float lse = *seq.q_at<const float>(p.lse, i, h);
      if (lse == kNegInf) continue;
      const T* q = seq.q_at<const T>(p.q, i, h);
      const T* dout = seq.q_at<const T>(p.dout, i, h);
      float prob;
      const float ds = score_grad(p, lane_dot(k, q, p.head_dim, lane),
                                  lane_dot(v, dout, p.head_dim_v, lane), lse,
                                  *seq.q_at<const float>(D, i, h), &prob);
      const LaneRow<T> qr{q, p.head_dim}, dor{dout, p.head_dim_v};
#pragma unroll
      for (int t = 0; t < kSlots; ++t) {
        dv[t] += prob * dor.get(t, lane);
        dk[t] += ds * qr.get(t, lane);
      }
    }
  }
  store_lane(seq.k_at<T>(p.dk, j, hk), dk, p.head_dim, lane, p.softmax_scale);
  store_lane(seq.k_at<T>(p.dv, j, hk), dv, p.head_dim_v, lane, 1.0f);
}

// dQ of slot row i of sequence b, query head h (0 past the used rows).
template <class T>
__device__ __forceinline__ void exact_query_gradient(const AttentionParams& p, const TensorRef& D,
                                                  int64_t b, int64_t h, int64_t i, int lane) {
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  const int64_t hk = h / p.group_size();
  const bool used = i < seq.seqlen_q;
  const float lse = used ? *seq.q_at<const float>(p.lse, i, h) : kNegInf;
  const float D_row = used ? *seq.q_at<const float>(D, i, h) : 0.0f;
  float q[kSlots], dout[kSlots], dq[kSlots] = {};
  load_lane(q, seq.q_at<const T>(p.q, i, h), p.head_dim, lane);
  load_lane(dout, seq.q_at<const T>(p.dout, i, h), p.head_dim_v, lane);
  const int64_t last = lse == kNegInf ? -1 : seq.last_key(i);
  for (int64_t j = seq.first_key(i); j <= last; ++j) {
    if (!ids.visible(i, j)) continue;
    const T* k = seq.k_at<const T>(p.k, j, hk);
    const T* v = seq.k_at<const T>(p.v, j, hk);
    float prob;
    const float ds = score_grad(p, lane_dot(q, k, p.head_dim, lane),
                                lane_dot(dout, v, p.head_dim_v, lane), lse, D_row, &prob);
    const LaneRow<T> kr{k, p.head_dim};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) dq[t] += ds * kr.get(t, lane);
  }
  store_lane(seq.q_at<T>(p.dq, i, h), dq, p.head_dim, lane, p.softmax_scale);
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
template <class T>
__device__ __forceinline__ void recompute_key_if_nonfinite(const AttentionParams& p,
                                                           const TensorRef& D_rows,
                                                           const SeqlenInfo& seq, int64_t b,
                                                           int64_t hk, int64_t j, int lane) {
  if (row_nonfinite(seq.k_at<const T>(p.dk, j, hk), p.head_dim, lane) ||
      row_nonfinite(seq.k_at<const T>(p.dv, j, hk), p.head_dim_v, lane))
    exact_key_gradients<T>(p, D_rows, b, hk, j, lane);
}

// Query row i of sequence b (seq), head h: dQ again if the stored row holds NaN or inf.
template <class T>
__device__ __forceinline__ void recompute_query_if_nonfinite(const AttentionParams& p,
                                                             const TensorRef& D_rows,
                                                             const SeqlenInfo& seq, int64_t b,
                                                             int64_t h, int64_t i, int lane) {
  if (row_nonfinite(seq.q_at<const T>(p.dq, i, h), p.head_dim, lane))
    exact_query_gradient<T>(p, D_rows, b, h, i, lane);
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
