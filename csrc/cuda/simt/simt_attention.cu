// The SIMT path: one warp per query row (forward, dQ), key (dK/dV) or dbias
// row, lanes split the head dimension. Slow but exact for every dtype, head
// dim and GPU; the tensor-core kernels take over where they apply. Kernels come
// with and without the score terms and dropout (kTerms: exact_rows.cuh).
#include <algorithm>
#include <type_traits>

#include "../common/backward_workspace.h"
#include "../common/device.cuh"
#include "../common/dispatch.h"
#include "../common/exact_rows.cuh"
#include "../common/sequence_layout.h"
#include "flashjax/seqlen.h"
#include "simt_attention.h"

namespace flashjax::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
// Elements of a row each lane sums in the backward's preprocess (H100: 16
// keeps more rows per warp in flight; d64 took half the time of a warp per row).
constexpr int kPreprocessElementsPerLane = 16;
constexpr int kVectorBytes = 16;  // of one vector load

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

// kTerms: whether the call has score terms or dropout (PairTerms, exact_rows.cuh).
template <class T, bool kTerms>
__global__ void forward_kernel(AttentionParams p) {
  const int64_t warp = global_warp();
  if (warp >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(warp, p.heads_q, p.seqlen_q);
  const SeqlenInfo seq(p, r.b);
  if (r.i >= seq.q_slot) return;
  exact_forward_row<T, T, kTerms>(p, r.b, r.h, r.i, threadIdx.x % 32);
}

// D = rowsum(dO * O) - dlse for every used row (no other row's D is read).
// Every backward path runs it, so it is tuned: a row takes lanes_per_row
// lanes (a power of two), so that short rows do not leave most of a warp
// idle, and it is compiled per Layouts, so that uniform calls keep the dense
// index arithmetic. Where out and dout allow (`vectorized`), a lane reads
// 16 bytes at a time (2-byte loads kept it at 2.2 TB/s on an H200, d128 2k).
// It also zeroes the `zero_count` float4s at `zero` (the fused Hopper
// backward's float32 dQ buffer) instead of a memset node of their own: the
// same time in all (H200, d128 2k causal, b8 h16: 91.6 us against 60 + 30),
// one node less; and, without sinks, dsinks (backward_dsinks then launches nothing).
template <class T, Layouts kLayouts>
__global__ void preprocess_kernel(AttentionParams p, const __grid_constant__ TensorRef D,
                                  int* nonfinite, int lanes_per_row, bool vectorized,
                                  float4* zero, int64_t zero_count) {
  allow_dependent_grid_launch();
  const int lane = threadIdx.x % 32, lane_in_row = lane % lanes_per_row;
  if (blockIdx.x == 0 && threadIdx.x == 0) *nonfinite = 0;  // (BackwardWorkspace::nonfinite)
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  const int64_t thread = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t at = thread; at < zero_count; at += threads)
    zero[at] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (!p.sinks && p.dsinks)
    for (int64_t at = thread; at < p.batch * p.heads_q; at += threads) p.dsinks[at] = 0.0f;
  const int64_t rows = p.batch * p.heads_q * p.seqlen_q;
  const int64_t warp_row = global_warp() * (32 / lanes_per_row);
  if (warp_row >= rows) return;  // (whole warps only: they shuffle below)
  const int64_t row = warp_row + lane / lanes_per_row;
  // (heads outer: with a warp's rows one token's heads instead, adjacent in out and
  // dout, d128 2k took 74.4 us against 71.6, 70% of an H200's DRAM bandwidth against 73%)
  const RowIndex r(row < rows ? row : 0, p.heads_q, p.seqlen_q);
  const SeqlenInfo seq = sequence_info<kLayouts>(p, r.b);
  const bool used = row < rows && r.i < seq.seqlen_q;
  float dot = 0.0f;
  if (used) {
    const T* o = seq.q_at<const T>(p.out, r.i, r.h);
    const T* dout = seq.q_at<const T>(p.dout, r.i, r.h);
    if (vectorized) {  // 16-byte loads: a row's lanes read consecutive chunks
      constexpr int kVec = kVectorBytes / sizeof(T);
      for (int64_t c = lane_in_row * kVec; c < p.head_dim_v; c += lanes_per_row * kVec) {
        const uint4 a = *reinterpret_cast<const uint4*>(o + c);
        const uint4 b = *reinterpret_cast<const uint4*>(dout + c);
        const T* x = reinterpret_cast<const T*>(&a);
        const T* y = reinterpret_cast<const T*>(&b);
#pragma unroll
        for (int j = 0; j < kVec; ++j) dot += to_float(x[j]) * to_float(y[j]);
      }
    } else {
#pragma unroll 4
      for (int64_t c = lane_in_row; c < p.head_dim_v; c += lanes_per_row)
        dot += to_float(o[c]) * to_float(dout[c]);
    }
  }
  for (int offset = lanes_per_row / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (used && lane_in_row == 0) {
    const float dlse = p.dlse ? *seq.q_at<const float>(p.dlse, r.i, r.h) : 0.0f;
    *seq.q_at<float>(D, r.i, r.h) = dot - dlse;
  }
}

// dK, dV of one key, summed over the query heads of its group (0 for keys
// past the used ones: no query sees them).
template <class T, bool kTerms>
__global__ void dkdv_kernel(AttentionParams p, const __grid_constant__ TensorRef D) {
  const int64_t warp = global_warp();
  if (warp >= p.batch * p.heads_kv * p.seqlen_k) return;
  const RowIndex r(warp, p.heads_kv, p.seqlen_k);  // r.i is the key index j
  const SeqlenInfo seq(p, r.b);
  if (r.i >= seq.k_slot) return;
  exact_key_gradients<T, kTerms>(p, D, r.b, r.h, r.i, threadIdx.x % 32);
}

// dQ of one row (0 past the used rows), and a used row's share of dsinks.
template <class T, bool kTerms>
__global__ void dq_kernel(AttentionParams p, const __grid_constant__ TensorRef D,
                          const __grid_constant__ TensorRef dsink_rows) {
  const int64_t warp = global_warp();
  const int lane = threadIdx.x % 32;
  if (warp >= p.batch * p.heads_q * p.seqlen_q) return;
  const RowIndex r(warp, p.heads_q, p.seqlen_q);
  const SeqlenInfo seq(p, r.b);
  if (r.i >= seq.q_slot) return;
  exact_query_gradient<T, kTerms>(p, D, r.b, r.h, r.i, lane);
  if (lane == 0 && p.sinks && r.i < seq.seqlen_q) {  // d lse / d sink = p_sink; dL/d lse = -D
    const float lse = *seq.q_at<const float>(p.lse, r.i, r.h);
    const float D_row = *seq.q_at<const float>(D, r.i, r.h);
    const float sink = p.sinks[r.b * p.heads_q + r.h];
    *seq.q_at<float>(dsink_rows, r.i, r.h) = lse == kNegInf ? 0.0f : -expf(sink - lse) * D_row;
  }
}

// One row of one dbias entry: warp (entry b, entry h, row i) of `rows` warps.
template <class T>
__global__ void dbias_kernel(AttentionParams p, const __grid_constant__ TensorRef D,
                             int64_t head_entries, int64_t rows) {
  const int64_t warp = global_warp();
  if (warp >= rows) return;
  const RowIndex r(warp, head_entries, p.seqlen_q);  // r.b, r.h: the entry's indices
  exact_bias_gradient_row<T>(p, D, r.b, r.h, r.i, threadIdx.x % 32);
}

// dsinks[b, h] = sum over sequence b's used rows, in a fixed order (deterministic).
__global__ void dsinks_kernel(AttentionParams p, const __grid_constant__ TensorRef dsink_rows) {
  wait_for_prerequisite_grid();  // (launch_early)
  const int64_t bh = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (bh >= p.batch * p.heads_q) return;
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
  const SeqlenInfo seq(p, b);
  float total = 0.0f;
  if (p.sinks)
    for (int64_t i = 0; i < seq.seqlen_q; ++i) total += *seq.q_at<const float>(dsink_rows, i, h);
  p.dsinks[bh] = total;
}

// The rows of dk, dv and dq that hold NaN or inf, recomputed pair by pair,
// once a tensor-core backward flagged one (BackwardWorkspace::nonfinite: a
// tile product may have got them wrong, exact_rows.cuh). Otherwise the
// kernel ends at once. Warps stride over the key rows, then the query rows.
template <class T, bool kTerms>
__global__ void recompute_gradients_kernel(const __grid_constant__ AttentionParams p,
                                           const __grid_constant__ TensorRef D,
                                           const int* nonfinite) {
  wait_for_prerequisite_grid();  // (launch_early: the flag is the kernels' before)
  if (*nonfinite == 0) return;
  const int lane = threadIdx.x % 32;
  const int64_t keys = p.batch * p.heads_kv * p.seqlen_k;
  const int64_t rows = keys + p.batch * p.heads_q * p.seqlen_q;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t w = global_warp(); w < rows; w += stride) {
    if (w < keys) {
      const RowIndex r(w, p.heads_kv, p.seqlen_k);
      const SeqlenInfo seq(p, r.b);
      if (r.i < seq.k_slot) recompute_key_if_nonfinite<T, kTerms>(p, D, seq, r.b, r.h, r.i, lane);
    } else {
      const RowIndex r(w - keys, p.heads_q, p.seqlen_q);
      const SeqlenInfo seq(p, r.b);
      if (r.i < seq.q_slot) recompute_query_if_nonfinite<T, kTerms>(p, D, seq, r.b, r.h, r.i, lane);
    }
  }
}

// Launches kernel over `warps` warps (none if there are none).
template <class Kernel, class... Args>
cudaError_t launch_warps(Kernel kernel, int64_t warps, cudaStream_t stream, const Args&... args) {
  if (warps <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(args...);
  return cudaGetLastError();
}

// Calls fn(std::bool_constant<kTerms>{}): whether p has score terms or dropout.
template <class Fn>
cudaError_t with_pair_terms(const AttentionParams& p, Fn&& fn) {
  return p.has_pair_terms() ? fn(std::true_type{}) : fn(std::false_type{});
}

}  // namespace

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream) {
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    return with_pair_terms(p, [&](auto terms) {
      return launch_warps(forward_kernel<decltype(tag), decltype(terms)::value>,
                          p.batch * p.heads_q * p.seqlen_q, stream, p);
    });
  });
}

cudaError_t backward_preprocess(const AttentionParams& p, const BackwardWorkspace& ws,
                                cudaStream_t stream) {
  int lanes_per_row = 1;  // about kPreprocessElementsPerLane elements each
  while (lanes_per_row < 32 && lanes_per_row * kPreprocessElementsPerLane < p.head_dim_v)
    lanes_per_row *= 2;
  const int64_t rows_per_warp = 32 / lanes_per_row;
  const int64_t row_warps = (p.batch * p.heads_q * p.seqlen_q + rows_per_warp - 1) / rows_per_warp;
  // (enough threads to zero dsinks without sinks, whatever the rows)
  const int64_t warps = std::max(row_warps, p.sinks ? 0 : (p.batch * p.heads_q + 31) / 32);
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    const int64_t vec = kVectorBytes / sizeof(tag);
    const auto aligned = [&](const TensorRef& t) {
      return reinterpret_cast<uintptr_t>(t.data) % kVectorBytes == 0 && t.row_stride % vec == 0 &&
             t.head_stride % vec == 0 && t.batch_stride % vec == 0;
    };
    const bool vectorized = p.head_dim_v % vec == 0 && aligned(p.out) && aligned(p.dout);
    return with_layouts(p, [&](auto layouts) {
      return launch_warps(preprocess_kernel<decltype(tag), decltype(layouts)::value>, warps,
                          stream, p, ws.D, ws.nonfinite, lanes_per_row, vectorized,
                          reinterpret_cast<float4*>(ws.zeroed), ws.zeroed_float4s);
    });
  });
}

cudaError_t recompute_nonfinite_gradients(const AttentionParams& p, const BackwardWorkspace& ws,
                                          cudaStream_t stream) {
  // A few waves: the kernel ends at once unless a row was flagged.
  constexpr int kBlocksPerMultiprocessor = 2;
  const int64_t warps = p.batch * (p.heads_kv * p.seqlen_k + p.heads_q * p.seqlen_q);
  const int64_t blocks = std::min<int64_t>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock,
                                           kBlocksPerMultiprocessor * multiprocessor_count());
  if (blocks <= 0) return cudaSuccess;
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    return with_pair_terms(p, [&](auto terms) {
      return launch_early(recompute_gradients_kernel<decltype(tag), decltype(terms)::value>,
                          static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream, p, ws.D,
                          ws.nonfinite);
    });
  });
}

cudaError_t backward_dsinks(const AttentionParams& p, const TensorRef& dsink_rows,
                            cudaStream_t stream) {
  const int64_t bh = p.batch * p.heads_q;
  if (bh <= 0 || !p.sinks) return cudaSuccess;  // (no sinks: backward_preprocess zeroed dsinks)
  constexpr int kThreads = 128;
  return launch_early(dsinks_kernel, static_cast<unsigned>((bh + kThreads - 1) / kThreads),
                      kThreads, 0, stream, p, dsink_rows);
}

cudaError_t simt_bias_gradient(const AttentionParams& p, const TensorRef& D,
                               cudaStream_t stream) {
  const ScoreArray& dbias = p.dbias;
  if (!dbias || dbias.batch_div <= 0 || dbias.head_div <= 0) return cudaSuccess;
  const int64_t head_entries = p.heads_q / dbias.head_div;
  const int64_t rows = p.batch / dbias.batch_div * head_entries * p.seqlen_q;
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    return launch_warps(dbias_kernel<decltype(tag)>, rows, stream, p, D, head_entries, rows);
  });
}

cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const BackwardWorkspace ws(p, workspace);
  if (cudaError_t e = backward_preprocess(p, ws, stream); e != cudaSuccess) return e;
  cudaError_t status = with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    return with_pair_terms(p, [&](auto terms) {
      using T = decltype(tag);
      constexpr bool kTerms = decltype(terms)::value;
      if (cudaError_t e = launch_warps(dkdv_kernel<T, kTerms>, p.batch * p.heads_kv * p.seqlen_k,
                                       stream, p, ws.D);
          e != cudaSuccess)
        return e;
      return launch_warps(dq_kernel<T, kTerms>, p.batch * p.heads_q * p.seqlen_q, stream, p, ws.D,
                          ws.dsink_rows);
    });
  });
  if (status != cudaSuccess) return status;
  if (cudaError_t e = simt_bias_gradient(p, ws.D, stream); e != cudaSuccess) return e;
  return backward_dsinks(p, ws.dsink_rows, stream);
}

}  // namespace flashjax::cuda
