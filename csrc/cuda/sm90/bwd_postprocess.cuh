// The Hopper backward's elementwise post-kernel of the fused (default) mode:
// the float32 dQ buffer (bwd_tile_config.h's block layout) to dq.
#pragma once

#include <cstdint>

#include "../common/backward_workspace.h"
#include "../common/device.cuh"
#include "../common/fragment.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_bwd {

// Columns a dense-layout thread converts: the block layout's swizzle moves
// whole aligned groups of 8 columns, so a group is two 16-byte reads.
constexpr int kConvertCols = 8;

// Stores 8 values at dst (16-byte aligned when `aligned`).
template <class T>
__device__ __forceinline__ void store_group(T* dst, const float (&v)[kConvertCols], bool aligned) {
  if (aligned) {
    uint32_t packed[kConvertCols / 2];
#pragma unroll
    for (int j = 0; j < kConvertCols / 2; ++j) packed[j] = pack2<T>(v[2 * j], v[2 * j + 1]);
    *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  } else {
#pragma unroll
    for (int j = 0; j < kConvertCols; ++j) dst[j] = from_float<T>(v[j]);
  }
}

// dq = scale * the float32 accumulation (padded rows of kHeadDim columns).
// Dense and seqused layouts: one thread per 8 columns of a row and head of
// dq, index arithmetic in Index (int32 where the sizes allow: with 64-bit
// divisions per element this kernel took 240 us where FA3's takes 65, d128
// 2k causal). Packed: one warp per row of dq, which finds its sequence (rows
// no slot covers are fill_uncovered_rows'). A NaN or inf value sets
// *nonfinite (recompute_nonfinite_gradients redoes such rows: exact_rows.cuh).
template <class T, int kHeadDim, class Index>
__device__ __forceinline__ void convert_dense_dq(const AttentionParams& p, const float* dq_accum,
                                                 const PaddedRows& padded, int* nonfinite) {
  constexpr int kCols = KeyKernelConfig<kHeadDim>::kDqCols;
  static_assert(kCols % kConvertCols == 0, "a group must not straddle dQ blocks");
  // (the bucket's groups a row: a division by a constant; those past head_dim skipped)
  constexpr int kGroups = kHeadDim / kConvertCols;
  const int groups = p.head_dim / kConvertCols;
  const Index heads = static_cast<Index>(p.heads_q), seqlen = static_cast<Index>(p.seqlen_q);
  const Index n = static_cast<Index>(p.batch) * seqlen * heads * kGroups;
  const TensorRef& dq = p.dq;
  const bool aligned = reinterpret_cast<uintptr_t>(dq.data) % 16 == 0 &&
                       dq.row_stride % kConvertCols == 0 && dq.head_stride % kConvertCols == 0 &&
                       dq.batch_stride % kConvertCols == 0;
  const Index threads = static_cast<Index>(gridDim.x) * blockDim.x;
  // (two groups' loads in flight a thread)
#pragma unroll 2
  for (Index at = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; at < n;
       at += threads) {
    const Index row_head = at / kGroups;
    const int g = static_cast<int>(at - row_head * kGroups), c = g * kConvertCols;
    if (g >= groups) continue;
    const Index row = row_head / heads, h = row_head - row * heads;
    const Index b = row / seqlen, i = row - b * seqlen;
    // (rows past seqused accumulated nothing: 0)
    const int64_t padded_row = padded.start_of<false>(SeqlenInfo{}, b, h) + i;
    const float* src = dq_accum + dq_block_start<kHeadDim, kCols>(padded_row, c / kCols) +
                       dq_block_offset<kCols>(i, c);
    const float4 lo = reinterpret_cast<const float4*>(src)[0];
    const float4 hi = reinterpret_cast<const float4*>(src)[1];
    float v[kConvertCols] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float probe = 0.0f;
#pragma unroll
    for (int j = 0; j < kConvertCols; ++j) {
      v[j] *= p.softmax_scale;
      probe = fmaf(v[j], 0.0f, probe);
    }
    if (probe != 0.0f) *nonfinite = 1;  // (NaN or inf)
    store_group(dq.at<T>(b, i, h) + c, v, aligned);
  }
}

template <class T, int kHeadDim>
__global__ void convert_dq_kernel(const AttentionParams p, const float* dq_accum,
                                  const PaddedRows padded, int* nonfinite) {
  constexpr int kCols = KeyKernelConfig<kHeadDim>::kDqCols;
  start_after_prerequisite_grid();  // (launch_early, after the key kernel)
  if (!p.packed()) {
    const int64_t n = p.batch * p.seqlen_q * p.heads_q * (kHeadDim / kConvertCols);
    if (n < (int64_t(1) << 31))
      convert_dense_dq<T, kHeadDim, int32_t>(p, dq_accum, padded, nonfinite);
    else
      convert_dense_dq<T, kHeadDim, int64_t>(p, dq_accum, padded, nonfinite);
    return;
  }
  const auto accumulated = [&](int64_t padded_start, int64_t i, int64_t c) {
    return dq_accum[dq_block_start<kHeadDim, kCols>(padded_start + i, c / kCols) +
                    dq_block_offset<kCols>(i, c)] *
           p.softmax_scale;
  };
  const int64_t thread = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t threads = int64_t(gridDim.x) * blockDim.x;
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
