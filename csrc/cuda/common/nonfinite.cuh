// Non-finite values on the tensor-core paths (exact_rows.cuh says why a tile
// product can make a row NaN that should not be): rows past the used ones
// cleared before the write, a warp's flagged rows recomputed pair by pair, and
// the KV-cache kernel's check of a masked slice's V.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device.cuh"
#include "exact_rows.cuh"
#include "flashjax/params.h"
#include "flashjax/seqlen.h"
#include "softmax.cuh"

namespace flashjax::cuda {

// Zeros o in the rows past the used ones, for kernels whose tiles load
// whatever rows follow them (the Hopper forward's TMA tiles: the next
// sequence's or padding, NaN included), which write_out_rows' o * 0 would pass on.
template <int kDimTiles>
__device__ void clear_unused_rows(const RowSoftmax& rows, float (&o)[kDimTiles * 4],
                                  const SeqlenInfo& seq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (rows.query(rows.row + 8 * r) < seq.seqlen_q) continue;
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) o[4 * n + 2 * r] = o[4 * n + 2 * r + 1] = 0.0f;
  }
}

// Recomputes pair by pair the used rows of the warp's 16 whose out (written
// by write_out_rows, by this warp) holds a NaN or inf. Call with the whole warp.
// T: the inputs' element type, TOut: out's; kTerms: the score terms' form (a kernel
// compiled for calls with or without them passes kRead or kNone).
template <class T, class TOut = T, RowTerms kTerms = RowTerms::kPerCall>
__device__ void recompute_nonfinite_rows(const RowSoftmax& rows, const AttentionParams& p,
                                         const SeqlenInfo& seq, int64_t b, int64_t h0) {
  const int lane = threadIdx.x % 32;
  const int64_t warp_row0 = rows.row - lane / 4;
  __syncwarp();  // the warp's stores of out come first
  for (int r = 0; r < 16; ++r) {
    const int64_t tile_row = warp_row0 + r, i = rows.query(tile_row), h = rows.head(h0, tile_row);
    if (!rows.writes(p, seq, tile_row) || i >= seq.seqlen_q) continue;
    if (!row_nonfinite(seq.q_at<const TOut>(p.out, i, h), p.head_dim_v, lane)) continue;
    with_row_terms<kTerms>(p, [&](auto terms) {
      exact_forward_row<T, TOut, decltype(terms)::value>(p, b, h, i, lane);
    });
  }
}

// ------------------------------------------------ non-finite V in a masked KV-cache slice
// The KV-cache kernel's split products (gemm_ab) compute 0 * v for the pairs a
// slice's mask hides, NaN when v is NaN or inf (exact_rows.cuh says why that
// matters). Its rows are not recomputed afterwards (paged caches, splits), so a
// masked slice checks its V (tile_has_nonfinite: cheap, masked slices only) and
// in the rare case it holds one takes the exact scalar product gemm_ab_masked.

// Whether one of the two 16-bit values packed in x is NaN or inf (all exponent bits set).
template <class T>
__device__ __forceinline__ bool nonfinite_pair(uint32_t x) {
  constexpr uint32_t kExp = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
  return (x & kExp) == kExp || ((x >> 16) & kExp) == kExp;
}

// This thread's share (`thread` of `threads`) of the check of `elements`
// 16-bit values of T from `tile` (16-byte aligned, elements % 8 == 0); the
// callers combine the shares (__any_sync).
template <class T>
__device__ __forceinline__ bool tile_has_nonfinite(const void* tile, int elements, int thread,
                                                   int threads) {
  static_assert(sizeof(T) == 2, "the split-KV kernel's fp16 / bf16 tiles");
  const uint4* chunks = static_cast<const uint4*>(tile);
  bool found = false;
  for (int i = thread; i < elements / 8; i += threads) {
    const uint4 c = chunks[i];
    found |= nonfinite_pair<T>(c.x) | nonfinite_pair<T>(c.y) | nonfinite_pair<T>(c.z) |
             nonfinite_pair<T>(c.w);
  }
  return found;
}

// acc(16 x kHeadDim) += P(16 x kK) V summed over the visible pairs only, each
// adding p * v as IEEE arithmetic does (NaN, inf, 0 * inf = NaN where p
// underflowed): frag is P as gemm_ab takes it (rounded to T here as gemm_ab
// rounds it), `hidden` a fragment like it, -inf where the mask hides the pair;
// v_at(j, c) reads V[j][c] as float. Scalar and slow: only for the rare slices
// that need it.
template <class T, int kHeadDim, int kK, class VAt>
__device__ void gemm_ab_masked(float (&acc)[kHeadDim / 2], const float (&frag)[kK / 2],
                               const float (&hidden)[kK / 2], VAt&& v_at) {
  const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll 1
  for (int j = 0; j < kK; ++j) {
    // Key j is element 4 * (j / 8) + 2 * r + (j % 2) of lane (lane & ~3) + (j % 8) / 2;
    // every lane offers its own element at that index (static indices: a
    // dynamic one would move the fragment to local memory), then takes its
    // quad's by shuffle.
    const int n = j / 8, e = j % 2, src = (lane & ~3) | ((j % 8) / 2);
    float mine[2] = {0.0f, 0.0f};
    bool mine_hidden[2] = {true, true};
#pragma unroll
    for (int nn = 0; nn < kK / 8; ++nn)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int ee = 0; ee < 2; ++ee) {
          const int idx = 4 * nn + 2 * r + ee;
          if (nn == n && ee == e) {
            mine[r] = to_float(from_float<T>(frag[idx]));
            mine_hidden[r] = hidden[idx] == kNegInf;
          }
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float pij = __shfl_sync(0xffffffffu, mine[r], src);
      if (__shfl_sync(0xffffffffu, static_cast<int>(mine_hidden[r]), src)) continue;
#pragma unroll
      for (int c = 0; c < kHeadDim / 8; ++c) {
        acc[4 * c + 2 * r] += pij * v_at(j, 8 * c + 2 * t);
        acc[4 * c + 2 * r + 1] += pij * v_at(j, 8 * c + 2 * t + 1);
      }
    }
  }
}

}  // namespace flashjax::cuda
