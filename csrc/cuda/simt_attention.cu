// The SIMT path: one warp per query row (forward, dQ) or key (dK/dV), lanes
// split the head dimension. Slow but exact for every dtype, head dim and
// GPU; the tensor-core kernels take over where they apply.
#include "backward_workspace.h"
#include "common.cuh"
#include "dispatch.h"
#include "flashjax/seqlen.h"
#include "launch.h"
#include "sequence_layout.h"
#include "simt_attention.h"

namespace flashjax::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kSlots = kMaxHeadDim / 32;  // head-dim elements per lane
// Elements of a row each lane sums in the backward's preprocess (H100: 16
// keeps more rows per warp in flight; d64 took half the time of a warp per row).
constexpr int kPreprocessElementsPerLane = 16;

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

// Decodes a flat (sequence, head, slot row) index; slots of `rows` rows (the
// longest slot: rows past a sequence's own slot have no work).
struct RowIndex {
  int64_t b, h, i;
  __device__ RowIndex(int64_t flat, int64_t heads, int64_t rows)
      : b(flat / (heads * rows)), h((flat / rows) % heads), i(flat % rows) {}
};

__device__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}

template <class T>
__global__ void forward_kernel(AttentionParams p) {
  const int64_t warp = global_warp();
  const int lane = threadIdx.x % 32;
  if (warp >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(warp, p.heads_q, p.seqlen_q);
  const SeqlenInfo seq(p, r.b);
  if (r.i >= seq.q_slot) return;
  const SegmentIds ids(p, r.b);
  const int64_t hk = r.h / p.group_size();
  float q[kSlots], acc[kSlots] = {};
  load_lane(q, seq.q_at<const T>(p.q, r.i, r.h), p.head_dim, lane);
  float m = kNegInf, l = 0.0f;
  for (int64_t j = seq.first_key(r.i); j <= seq.last_key(r.i); ++j) {  // none past used rows
    if (!ids.visible(r.i, j)) continue;
    const float s = score(p, lane_dot(q, seq.k_at<const T>(p.k, j, hk), p.head_dim, lane));
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new), pj = expf(s - m_new);
    l = l * alpha + pj;
    const LaneRow<T> v{seq.k_at<const T>(p.v, j, hk), p.head_dim_v};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) acc[t] = acc[t] * alpha + pj * v.get(t, lane);
    m = m_new;
  }
  // Rows past the used ones get lse -inf, sinks or not.
  const bool used = r.i < seq.seqlen_q;
  const float sink = p.sinks && used ? p.sinks[r.b * p.heads_q + r.h] : kNegInf;
  const float m_final = fmaxf(m, sink);
  float factor = 0.0f, lse = kNegInf;
  if (m_final != kNegInf) {  // else: no key, no sink -> out 0, lse -inf
    const float keys_scale = expf(m - m_final);
    const float total = l * keys_scale + expf(sink - m_final);
    factor = keys_scale / total;
    lse = m_final + logf(total);
  }
  store_lane(seq.q_at<T>(p.out, r.i, r.h), acc, p.head_dim_v, lane, factor);
  if (lane == 0) *seq.q_at<float>(p.lse, r.i, r.h) = lse;
}

// D = rowsum(dO * O) - dlse for every used row (no other row's D is read).
// Every backward path runs it, so it is tuned: a row takes lanes_per_row
// lanes (a power of two), so that short rows do not leave most of a warp
// idle, and it is compiled per Layouts, so that uniform calls keep the dense
// index arithmetic.
template <class T, Layouts kLayouts>
__global__ void preprocess_kernel(AttentionParams p, const __grid_constant__ TensorRef D,
                                  int lanes_per_row) {
  const int lane = threadIdx.x % 32, lane_in_row = lane % lanes_per_row;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int64_t warp_row = global_warp() * (32 / lanes_per_row);
  if (warp_row >= rows) return;  // (whole warps only: they shuffle below)
  const int64_t row = warp_row + lane / lanes_per_row;
  const RowIndex r(row < rows ? row : 0, p.heads_q, p.seqlen_q);
  const SeqlenInfo seq = sequence_info<kLayouts>(p, r.b);
  const bool used = row < rows && r.i < seq.seqlen_q;
  float dot = 0.0f;
  if (used) {
    const T* o = seq.q_at<const T>(p.out, r.i, r.h);
    const T* dout = seq.q_at<const T>(p.dout, r.i, r.h);
#pragma unroll 4
    for (int64_t c = lane_in_row; c < p.head_dim_v; c += lanes_per_row)
      dot += to_float(o[c]) * to_float(dout[c]);
  }
  for (int offset = lanes_per_row / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (used && lane_in_row == 0) {
    const float dlse = p.dlse ? *seq.q_at<const float>(p.dlse, r.i, r.h) : 0.0f;
    *seq.q_at<float>(D, r.i, r.h) = dot - dlse;
  }
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

// dK, dV of one key, summed over the query heads of its group (0 for keys
// past the used ones: no query sees them).
template <class T>
__global__ void dkdv_kernel(AttentionParams p, const __grid_constant__ TensorRef D) {
  const int64_t warp = global_warp();
  const int lane = threadIdx.x % 32;
  if (warp >= p.batch * p.heads_kv * p.seqlen_k) return;
  const RowIndex r(warp, p.heads_kv, p.seqlen_k);  // r.i is the key index j
  const SeqlenInfo seq(p, r.b);
  if (r.i >= seq.k_slot) return;
  const SegmentIds ids(p, r.b);
  float k[kSlots], v[kSlots], dk[kSlots] = {}, dv[kSlots] = {};
  load_lane(k, seq.k_at<const T>(p.k, r.i, r.h), p.head_dim, lane);
  load_lane(v, seq.k_at<const T>(p.v, r.i, r.h), p.head_dim_v, lane);
  for (int64_t h = r.h * p.group_size(); h < (r.h + 1) * p.group_size(); ++h) {
    for (int64_t i = seq.first_query(r.i); i <= seq.last_query(r.i); ++i) {
      if (!ids.visible(i, r.i)) continue;
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
  store_lane(seq.k_at<T>(p.dk, r.i, r.h), dk, p.head_dim, lane, p.softmax_scale);
  store_lane(seq.k_at<T>(p.dv, r.i, r.h), dv, p.head_dim_v, lane, 1.0f);
}

// dQ of one row (0 past the used rows), and a used row's share of dsinks.
template <class T>
__global__ void dq_kernel(AttentionParams p, const __grid_constant__ TensorRef D,
                          const __grid_constant__ TensorRef dsink_rows) {
  const int64_t warp = global_warp();
  const int lane = threadIdx.x % 32;
  if (warp >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(warp, p.heads_q, p.seqlen_q);
  const SeqlenInfo seq(p, r.b);
  if (r.i >= seq.q_slot) return;
  const SegmentIds ids(p, r.b);
  const int64_t hk = r.h / p.group_size();
  const bool used = r.i < seq.seqlen_q;
  const float lse = used ? *seq.q_at<const float>(p.lse, r.i, r.h) : kNegInf;
  const float D_row = used ? *seq.q_at<const float>(D, r.i, r.h) : 0.0f;
  float q[kSlots], dout[kSlots], dq[kSlots] = {};
  load_lane(q, seq.q_at<const T>(p.q, r.i, r.h), p.head_dim, lane);
  load_lane(dout, seq.q_at<const T>(p.dout, r.i, r.h), p.head_dim_v, lane);
  const int64_t last = lse == kNegInf ? -1 : seq.last_key(r.i);
  for (int64_t j = seq.first_key(r.i); j <= last; ++j) {
    if (!ids.visible(r.i, j)) continue;
    const T* k = seq.k_at<const T>(p.k, j, hk);
    const T* v = seq.k_at<const T>(p.v, j, hk);
    float prob;
    const float ds = score_grad(p, lane_dot(q, k, p.head_dim, lane),
                                lane_dot(dout, v, p.head_dim_v, lane), lse, D_row, &prob);
    const LaneRow<T> kr{k, p.head_dim};
#pragma unroll
    for (int t = 0; t < kSlots; ++t) dq[t] += ds * kr.get(t, lane);
  }
  store_lane(seq.q_at<T>(p.dq, r.i, r.h), dq, p.head_dim, lane, p.softmax_scale);
  if (lane == 0 && p.sinks && used) {  // d lse / d sink = p_sink; dL/d lse = -D
    const float sink = p.sinks[r.b * p.heads_q + r.h];
    *seq.q_at<float>(dsink_rows, r.i, r.h) = lse == kNegInf ? 0.0f : -expf(sink - lse) * D_row;
  }
}

// dsinks[b, h] = sum over sequence b's used rows, in a fixed order (deterministic).
__global__ void dsinks_kernel(AttentionParams p, const __grid_constant__ TensorRef dsink_rows) {
  const int64_t bh = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bh >= p.batch * p.heads_q) return;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const SeqlenInfo seq(p, b);
  float total = 0.0f;
  if (p.sinks)
    for (int64_t i = 0; i < seq.seqlen_q; ++i) total += *seq.q_at<const float>(dsink_rows, i, h);
  p.dsinks[bh] = total;
}

// Launches kernel over `warps` warps (none if there are none).
template <class Kernel, class... Args>
cudaError_t launch_warps(Kernel kernel, int64_t warps, cudaStream_t stream, const Args&... args) {
  if (warps <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream) {
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    return launch_warps(forward_kernel<decltype(tag)>, p.batch * p.heads_q * p.seqlen_q, stream,
                        p);
  });
}

cudaError_t backward_preprocess(const AttentionParams& p, const TensorRef& D,
                                cudaStream_t stream) {
  int lanes_per_row = 1;  // about kPreprocessElementsPerLane elements each
  while (lanes_per_row < 32 && lanes_per_row * kPreprocessElementsPerLane < p.head_dim_v)
    lanes_per_row *= 2;
  const int64_t rows_per_warp = 32 / lanes_per_row;
  const int64_t warps = (p.batch * p.heads_q * p.seqlen_q + rows_per_warp - 1) / rows_per_warp;
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    return with_layouts(p, [&](auto layouts) {
      return launch_warps(preprocess_kernel<decltype(tag), decltype(layouts)::value>, warps,
                          stream, p, D, lanes_per_row);
    });
  });
}

cudaError_t backward_dsinks(const AttentionParams& p, const TensorRef& dsink_rows,
                            cudaStream_t stream) {
  const int64_t bh = p.batch * p.heads_q;
  if (bh <= 0) return cudaSuccess;
  dsinks_kernel<<<static_cast<unsigned>((bh + 127) / 128), 128, 0, stream>>>(p, dsink_rows);
  return cudaGetLastError();
}

cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const BackwardWorkspace ws(p, workspace, false, 0);
  if (cudaError_t e = backward_preprocess(p, ws.D, stream); e != cudaSuccess) return e;
  cudaError_t status = with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (cudaError_t e = launch_warps(dkdv_kernel<T>, p.batch * p.heads_kv * p.seqlen_k, stream,
                                     p, ws.D);
        e != cudaSuccess)
      return e;
    return launch_warps(dq_kernel<T>, p.batch * p.heads_q * p.seqlen_q, stream, p, ws.D,
                        ws.dsink_rows);
  });
  if (status != cudaSuccess) return status;
  return backward_dsinks(p, ws.dsink_rows, stream);
}

}  // namespace flashjax::cuda
