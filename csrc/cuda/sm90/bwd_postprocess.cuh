// The Hopper backward's elementwise post-kernel of the fused (default) mode:
// the float32 dQ buffer (bwd_tile_config.h's block layout) to dq.
#pragma once

#include <cstdint>

#include "../common.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_bwd {

// dq = scale * the float32 accumulation (rows of kHeadDim columns).
template <class T, int kHeadDim>
__global__ void convert_dq_kernel(const AttentionParams p, const float* dq_accum,
                                  int64_t rows_padded) {
  const int64_t n = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  for (int64_t at = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; at < n;
       at += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = at % p.head_dim, rest = at / p.head_dim;
    const int64_t h = rest % p.heads_q, bi = rest / p.heads_q;
    const int64_t b = bi / p.seqlen_q, i = bi % p.seqlen_q;
    constexpr int kCols = kDqCols<kHeadDim>;
    const float x = dq_accum[dq_block_start<kHeadDim, kCols>(b * p.heads_q + h, i, c / kCols,
                                                             rows_padded) +
                             dq_block_offset<kCols>(i, c)];
    static_cast<T*>(p.dq.data)[at] = from_float<T>(x * p.softmax_scale);  // (dense dq)
  }
}

}  // namespace flashjax::cuda::hopper_bwd
