// The SIMT path: one warp per query row (forward, dQ) or key (dK/dV), lanes
// split the head dimension. Slow but exact for every dtype, head dim and
// GPU; the tensor-core kernels take over where they apply.
#include "common.cuh"
#include "backward_workspace.h"
#include "launch.h"
#include "simt_attention.h"

namespace flashjax::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kSlots = kMaxHeadDim / 32;  // head-dim elements per lane

// Rows of a (batch, seqlen, heads, dim) tensor as seen by one lane.
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
__device__ const T* row_ptr(const void* data, int64_t b, int64_t seqlen, int64_t i, int64_t heads,
                            int64_t h, int64_t dim) {
  return static_cast<const T*>(data) + ((b * seqlen + i) * heads + h) * dim;
}

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
__device__ void store_lane(void* data, int64_t offset, const float (&x)[kSlots], int64_t dim,
                           int lane, float scale) {
  T* row = static_cast<T*>(data) + offset;
#pragma unroll
  for (int t = 0; t < kSlots; ++t) {
    const int64_t c = t * 32 + lane;
    if (c < dim) row[c] = from_float<T>(x[t] * scale);
  }
}

// Decodes a flat (batch, head, row) index.
struct RowIndex {
  int64_t b, h, i;
  __device__ RowIndex(int64_t flat, int64_t heads, int64_t seqlen)
      : b(flat / (heads * seqlen)), h((flat / seqlen) % heads), i(flat % seqlen) {}
};

__device__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}

template <class T>
__global__ void forward_kernel(AttentionParams p) {
  const int64_t row = global_warp();
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(row, p.heads_q, p.seqlen_q);
  const int64_t hk = r.h / p.group_size();
  float q[kSlots], acc[kSlots] = {};
  load_lane(q, row_ptr<T>(p.q, r.b, p.seqlen_q, r.i, p.heads_q, r.h, p.head_dim), p.head_dim,
            lane);
  float m = kNegInf, l = 0.0f;
  for (int64_t j = p.first_key(r.i); j <= p.last_key(r.i); ++j) {
    const float s = score(p, lane_dot(q, row_ptr<T>(p.k, r.b, p.seqlen_k, j, p.heads_kv, hk,
                                                    p.head_dim), p.head_dim, lane));
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new), pj = expf(s - m_new);
    l = l * alpha + pj;
    const LaneRow<T> v{row_ptr<T>(p.v, r.b, p.seqlen_k, j, p.heads_kv, hk, p.head_dim_v),
                       p.head_dim_v};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) acc[t] = acc[t] * alpha + pj * v.get(t, lane);
    m = m_new;
  }
  const float sink = p.sinks ? p.sinks[r.b * p.heads_q + r.h] : kNegInf;
  const float m_final = fmaxf(m, sink);
  float factor = 0.0f, lse = kNegInf;
  if (m_final != kNegInf) {  // else: no key, no sink -> out 0, lse -inf
    const float keys_scale = expf(m - m_final);
    const float total = l * keys_scale + expf(sink - m_final);
    factor = keys_scale / total;
    lse = m_final + logf(total);
  }
  store_lane<T>(p.out, ((r.b * p.seqlen_q + r.i) * p.heads_q + r.h) * p.head_dim_v, acc,
                p.head_dim_v, lane, factor);
  if (lane == 0) p.lse[row] = lse;
}

// D = rowsum(dO * O) - dlse, one warp per row.
template <class T>
__global__ void preprocess_kernel(AttentionParams p, float* D) {
  const int64_t row = global_warp();
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(row, p.heads_q, p.seqlen_q);
  float o[kSlots];
  load_lane(o, row_ptr<T>(p.out, r.b, p.seqlen_q, r.i, p.heads_q, r.h, p.head_dim_v),
            p.head_dim_v, lane);
  const float dot = lane_dot(o, row_ptr<T>(p.dout, r.b, p.seqlen_q, r.i, p.heads_q, r.h,
                                           p.head_dim_v), p.head_dim_v, lane);
  if (lane == 0) D[row] = dot - (p.dlse ? p.dlse[row] : 0.0f);
}

// dS of one (row, key) pair, given q.k, dO.v and the row's lse and D.
__device__ float score_grad(const AttentionParams& p, float dot, float dp, float lse, float D,
                            float* prob) {
  const float s = score(p, dot);
  const float pr = expf(s - lse);
  *prob = pr;
  float ds = pr * (dp - D);
  if (p.softcap > 0.0f) {
    const float t = s / p.softcap;
    ds *= 1.0f - t * t;
  }
  return ds;
}

// dK, dV of one key, summed over the query heads of its group.
template <class T>
__global__ void dkdv_kernel(AttentionParams p, const float* D) {
  const int64_t key = global_warp();
  const int lane = threadIdx.x % 32;
  if (key >= p.batch * p.heads_kv * p.seqlen_k) return;
  const RowIndex r(key, p.heads_kv, p.seqlen_k);  // r.i is the key index j
  float k[kSlots], v[kSlots], dk[kSlots] = {}, dv[kSlots] = {};
  load_lane(k, row_ptr<T>(p.k, r.b, p.seqlen_k, r.i, p.heads_kv, r.h, p.head_dim), p.head_dim,
            lane);
  load_lane(v, row_ptr<T>(p.v, r.b, p.seqlen_k, r.i, p.heads_kv, r.h, p.head_dim_v),
            p.head_dim_v, lane);
  for (int64_t h = r.h * p.group_size(); h < (r.h + 1) * p.group_size(); ++h) {
    for (int64_t i = p.first_query(r.i); i <= p.last_query(r.i); ++i) {
      const int64_t row = (r.b * p.heads_q + h) * p.seqlen_q + i;
      const float lse = p.lse[row];
      if (lse == kNegInf) continue;
      const T* q = row_ptr<T>(p.q, r.b, p.seqlen_q, i, p.heads_q, h, p.head_dim);
      const T* dout = row_ptr<T>(p.dout, r.b, p.seqlen_q, i, p.heads_q, h, p.head_dim_v);
      float prob;
      const float ds = score_grad(p, lane_dot(k, q, p.head_dim, lane),
                                  lane_dot(v, dout, p.head_dim_v, lane), lse, D[row], &prob);
      const LaneRow<T> qr{q, p.head_dim}, dor{dout, p.head_dim_v};
#pragma unroll
      for (int t = 0; t < kSlots; ++t) {
        dv[t] += prob * dor.get(t, lane);
        dk[t] += ds * qr.get(t, lane);
      }
    }
  }
  const int64_t at = (r.b * p.seqlen_k + r.i) * p.heads_kv + r.h;
  store_lane<T>(p.dk, at * p.head_dim, dk, p.head_dim, lane, p.softmax_scale);
  store_lane<T>(p.dv, at * p.head_dim_v, dv, p.head_dim_v, lane, 1.0f);
}

// dQ of one row, and the row's share of dsinks.
template <class T>
__global__ void dq_kernel(AttentionParams p, const float* D, float* dsink_rows) {
  const int64_t row = global_warp();
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(row, p.heads_q, p.seqlen_q);
  const int64_t hk = r.h / p.group_size();
  const float lse = p.lse[row];
  float q[kSlots], dout[kSlots], dq[kSlots] = {};
  load_lane(q, row_ptr<T>(p.q, r.b, p.seqlen_q, r.i, p.heads_q, r.h, p.head_dim), p.head_dim,
            lane);
  load_lane(dout, row_ptr<T>(p.dout, r.b, p.seqlen_q, r.i, p.heads_q, r.h, p.head_dim_v),
            p.head_dim_v, lane);
  const int64_t last = lse == kNegInf ? -1 : p.last_key(r.i);
  for (int64_t j = p.first_key(r.i); j <= last; ++j) {
    const T* k = row_ptr<T>(p.k, r.b, p.seqlen_k, j, p.heads_kv, hk, p.head_dim);
    const T* v = row_ptr<T>(p.v, r.b, p.seqlen_k, j, p.heads_kv, hk, p.head_dim_v);
    float prob;
    const float ds = score_grad(p, lane_dot(q, k, p.head_dim, lane),
                                lane_dot(dout, v, p.head_dim_v, lane), lse, D[row], &prob);
    const LaneRow<T> kr{k, p.head_dim};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) dq[t] += ds * kr.get(t, lane);
  }
  store_lane<T>(p.dq, ((r.b * p.seqlen_q + r.i) * p.heads_q + r.h) * p.head_dim, dq, p.head_dim,
                lane, p.softmax_scale);
  if (lane == 0 && p.sinks) {  // d lse / d sink = p_sink; dL/d lse = -D
    const float sink = p.sinks[r.b * p.heads_q + r.h];
    dsink_rows[row] = lse == kNegInf ? 0.0f : -expf(sink - lse) * D[row];
  }
}

// dsinks[b, h] = sum over rows, in a fixed order (deterministic).
__global__ void dsinks_kernel(AttentionParams p, const float* dsink_rows) {
  const int64_t bh = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bh >= p.batch * p.heads_q) return;
  float total = 0.0f;
  if (p.sinks)
    for (int64_t i = 0; i < p.seqlen_q; ++i) total += dsink_rows[bh * p.seqlen_q + i];
  p.dsinks[bh] = total;
}

unsigned warp_blocks(int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
    forward_kernel<T><<<warp_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t backward_preprocess(const AttentionParams& p, float* D, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
    preprocess_kernel<decltype(tag)><<<warp_blocks(rows), kWarpsPerBlock * 32, 0, stream>>>(p, D);
    return cudaGetLastError();
  });
}

cudaError_t backward_dsinks(const AttentionParams& p, const float* dsink_rows,
                            cudaStream_t stream) {
  const int64_t bh = p.batch * p.heads_q;
  dsinks_kernel<<<static_cast<unsigned>((bh + 127) / 128), 128, 0, stream>>>(p, dsink_rows);
  return cudaGetLastError();
}

cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const BackwardWorkspace ws(p, workspace, false, 0);
  float* D = ws.D;
  if (cudaError_t e = backward_preprocess(p, D, stream); e != cudaSuccess) return e;
  cudaError_t status = dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int threads = kWarpsPerBlock * 32;
    dkdv_kernel<T><<<warp_blocks(p.batch * p.heads_kv * p.seqlen_k), threads, 0, stream>>>(p, D);
    dq_kernel<T><<<warp_blocks(p.batch * p.heads_q * p.seqlen_q), threads, 0, stream>>>(
        p, D, ws.dsink_rows);
    return cudaGetLastError();
  });
  if (status != cudaSuccess) return status;
  return backward_dsinks(p, ws.dsink_rows, stream);
}

}  // namespace flashjax::cuda
