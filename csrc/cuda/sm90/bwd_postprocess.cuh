// The Hopper backward's elementwise post-kernel of the fused (default) mode:
// the float32 dQ buffer (bwd_tile_config.h's block layout) to dq.
#pragma once

#include <cstdint>

#include "../common/backward_workspace.h"
#include "../common/device.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_bwd {

// dq = scale * the float32 accumulation (padded rows of kHeadDim columns).
// Dense and seqused layouts: one thread per element of dq. Packed: one warp
// per row of dq, which finds its sequence (rows no slot covers are
// fill_uncovered_rows'). A NaN or inf value sets *nonfinite
// (recompute_nonfinite_gradients redoes such rows: exact_rows.cuh).
template <class T, int kHeadDim>
__global__ void convert_dq_kernel(const AttentionParams p, const float* dq_accum,
                                  const PaddedRows padded, int* nonfinite) {
  constexpr int kCols = kDqCols<kHeadDim>;
  const auto accumulated = [&](int64_t padded_start, int64_t i, int64_t c) {
    return dq_accum[dq_block_start<kHeadDim, kCols>(padded_start + i, c / kCols) +
                    dq_block_offset<kCols>(i, c)] *
           p.softmax_scale;
  };
  const int64_t thread = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
  if (!p.packed()) {
    const int64_t n = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
    for (int64_t at = thread; at < n; at += threads) {
      const int64_t c = at % p.head_dim, rest = at / p.head_dim;
      const int64_t h = rest % p.heads_q, bi = rest / p.heads_q;
      const int64_t b = bi / p.seqlen_q, i = bi % p.seqlen_q;
      // (dense dq; rows past seqused accumulated nothing: 0)
      const float value = accumulated(padded.start(SeqlenInfo::uniform(p, b), b, h), i, c);
      if (fmaf(value, 0.0f, 0.0f) != 0.0f) *nonfinite = 1;  // (NaN or inf)
      static_cast<T*>(p.dq.data)[at] = from_float<T>(value);
    }
    return;
  }
  const int lane = threadIdx.x % 32;
  for (int64_t row = thread / 32; row < p.total_q; row += threads / 32) {
    const int64_t b = last_sequence_starting_by(p.batch, row,
                                                [&](int64_t s) { return SeqlenInfo(p, s).q_start; });
    const SeqlenInfo seq(p, b);
    const int64_t i = row - seq.q_start;
    if (i < 0 || i >= seq.q_slot) continue;
    for (int64_t e = lane; e < p.heads_q * p.head_dim; e += 32) {
      const int64_t h = e / p.head_dim, c = e % p.head_dim;
      const float value = accumulated(padded.start(seq, b, h), i, c);
      if (fmaf(value, 0.0f, 0.0f) != 0.0f) *nonfinite = 1;  // (NaN or inf)
      seq.q_at<T>(p.dq, i, h)[c] = from_float<T>(value);
    }
  }
}

}  // namespace flashjax::cuda::hopper_bwd
