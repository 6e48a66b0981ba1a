// Row writes from accumulator fragments (fragment.cuh's layout): the
// forward's out and lse (with the sink folded in), gradient rows, and each
// row's share of dsinks.
#pragma once

#include <cstdint>

#include "device.cuh"
#include "exact_rows.cuh"
#include "flashjax/params.h"
#include "flashjax/seqlen.h"
#include "fragment.cuh"
#include "softmax.cuh"

namespace flashjax::cuda {

// Folds in the sink, normalises o by the statistics of `rows` and writes out
// (head_dim_v % 8 == 0) and lse for the rows of sequence b's slot; rows past
// the used ones get out 0 and lse -inf (whatever o holds, as long as it is
// finite: see clear_unused_rows; also with sinks). Returns whether a used row of the
// thread's holds a non-finite value: the caller then has the warp run
// recompute_nonfinite_rows (exact_rows.cuh says why), after its main loop.
// h0: the head of the tile (the group's first head when packed).
// kOutInPlace: out is not written; o is normalised in place for the caller to
// store (rows that write nothing are left as they are).
// kTerms: the kernel's calls may carry a bias. A used row whose every visible score
// is -inf through it keeps m = -inf and, from the fragments' base-0 exponents, l = 0:
// the 0 of a row that sees no key. IEEE (docs/api.md, "Non-finite values") makes it
// NaN; the two look alike here, so the row is written NaN and flagged, and the exact
// row (which tells them apart) redoes it.
template <class T, int kDimTiles, bool kOutInPlace = false, bool kTerms = false>
__device__ bool write_out_rows(const RowSoftmax& rows, const AttentionParams& p,
                               const SeqlenInfo& seq, float (&o)[kDimTiles * 4], int64_t b,
                               int64_t h0) {
  const int t = threadIdx.x % 4;
  float probe[2] = {0.0f, 0.0f};
  probe_nonfinite(o, probe);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float total = rows.l[r];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    const int64_t tile_row = rows.row + 8 * r, out_row = rows.query(tile_row);
    const int64_t h = rows.head(h0, tile_row);
    if (!rows.writes(p, seq, tile_row)) {
      probe[r] = 0.0f;
      continue;
    }
    const bool used = out_row < seq.seqlen_q;
    if (!used) probe[r] = 0.0f;
    const float sink = p.sinks && used ? p.sinks[b * p.heads_q + h] * kLog2e : kNegInf;
    const RowNormaliser normaliser(used ? rows.m[r] : kNegInf, total, sink, used,
                                   [](float x) { return fast_exp2(x); },
                                   [](float x) { return __log2f(x); });
    const bool exact = kTerms && p.bias && used && rows.m[r] == kNegInf;
    if (exact) probe[r] = kNaN;
    const float factor = exact ? kNaN : normaliser.factor;
    const float lse = exact ? kNaN : normaliser.lse / kLog2e;
    if constexpr (kOutInPlace) {
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        o[4 * n + 2 * r] *= factor;
        o[4 * n + 2 * r + 1] *= factor;
      }
    } else {
      T* dst = seq.q_at<T>(p.out, out_row, h);
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        const int col = n * 8 + 2 * t;
        if (col < p.head_dim_v)
          *reinterpret_cast<uint32_t*>(dst + col) =
              pack2<T>(o[4 * n + 2 * r] * factor, o[4 * n + 2 * r + 1] * factor);
      }
    }
    if (t == 0) *seq.q_at<float>(p.lse, out_row, h) = lse;
  }
  return probe[0] != probe[0] || probe[1] != probe[1];
}

// Writes a 16 x kHeadDim fragment (rows row0 + g, + 8, those below `rows`;
// columns col0 + [0, kHeadDim), those below `dim`) of one head, times scale,
// to the rows of `head_base` (row_stride elements apart), as load_tile reads.
template <class T, int kHeadDim>
__device__ __forceinline__ void store_rows(T* head_base, int64_t row_stride, int64_t rows,
                                           int64_t dim, int64_t row0,
                                           const float (&acc)[kHeadDim / 2], float scale,
                                           int col0 = 0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + g + 8 * r;
    if (row >= rows) continue;
    T* dst = head_base + row * row_stride;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      const int col = col0 + n * 8 + 2 * t;
      if (col < dim)
        *reinterpret_cast<uint32_t*>(dst + col) =
            pack2<T>(acc[4 * n + 2 * r] * scale, acc[4 * n + 2 * r + 1] * scale);
    }
  }
}

// One row's share of dsinks: d lse / d sink = p_sink and dL / d lse = -D, so the
// share is -exp(sink - lse) * D (0 for a row with no key); log2 units.
__device__ __forceinline__ float dsink_share(float sink2, float lse2, float D) {
  return lse2 == -kNegInf ? 0.0f : -fast_exp2(sink2 - lse2) * D;
}

// Each of a thread's two rows' share of dsinks (used rows of sequence b,
// head h; dsink_rows is laid out like lse).
__device__ __forceinline__ void write_dsink_rows(const AttentionParams& p, const SeqlenInfo& seq,
                                                 int64_t b, int64_t h, int64_t row,
                                                 const float (&lse2)[2], const float (&D)[2],
                                                 const TensorRef& dsink_rows) {
  if (!p.sinks || threadIdx.x % 4 != 0) return;
  const float sink2 = p.sinks[b * p.heads_q + h] * kLog2e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row + 8 * r;
    if (i < seq.seqlen_q) *seq.q_at<float>(dsink_rows, i, h) = dsink_share(sink2, lse2[r], D[r]);
  }
}

}  // namespace flashjax::cuda
