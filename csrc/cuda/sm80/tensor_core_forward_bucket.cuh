// Tensor-core forward: each CTA owns kBlockM query rows of one (batch, head);
// each of its 4 warps owns 16 rows. K and V tiles stream through shared
// memory with cp.async: V_j loads while S = Q K_j^T and the softmax run, and
// K_{j+1} loads while O += P V_j runs. Shared-memory rows are XOR-swizzled in
// 16-byte chunks so that ldmatrix reads are free of bank conflicts.
// One head-dim bucket's kernels and launches (tensor_core_forward_bucket.h), instantiated
// per compiled bucket in a unit of its own (cmake/cuda.cmake, launch_bucket.cu.in).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "../common/block.cuh"
#include "../common/device.cuh"
#include "../common/dispatch.h"
#include "../common/epilogue.cuh"
#include "../common/nonfinite.cuh"
#include "../common/score_terms.cuh"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "mma_sm80.cuh"
#include "tensor_core_forward_bucket.h"

namespace flashjax::cuda::sm80_fwd {
namespace {


constexpr int kBlockM = 64;  // query rows per CTA
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <int kHeadDim>
constexpr int smem_bytes() {
  return (kBlockM + 2 * kBlockN) * kHeadDim * 2;
}

static_assert(kBlockM == SegmentTiles::kRows && kBlockN == SegmentTiles::kRows,
              "segment-id ranges are kept per tile");

// kLayouts: the sequence layouts this instantiation takes (sequence_layout.h);
// kTerms: whether the scores take bias, mask, ALiBi and dropout (score_terms.cuh;
// without, `terms` is an empty struct and the code is the plain kernel's).
template <class T, int kHeadDim, Layouts kLayouts, bool kTerms>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const __grid_constant__ AttentionParams p,
                   const __grid_constant__ SegmentTiles segment_tiles) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kHeadDim;
  T* sV = sK + kBlockN * kHeadDim;

  const int64_t q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const auto [q_tile, bh] = query_tile(q_tiles);
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group_size();
  const SeqlenInfo seq = sequence_info<kLayouts>(p, b);
  const int64_t q0 = q_tile * kBlockM;
  if (q0 >= seq.q_slot) return;  // past this sequence's slot
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const T* q_base = seq.q_at<const T>(p.q, 0, h);
  const T* k_base = seq.k_at<const T>(p.k, 0, hk);
  const T* v_base = seq.k_at<const T>(p.v, 0, hk);

  const int64_t last_row = min(q0 + kBlockM, seq.seqlen_q) - 1;  // last used row (< q0: none)
  KeyRange keys(seq, q0, last_row, kBlockN);
  narrow_to_segments<kLayouts>(keys, segment_tiles, b, q0, kBlockM, kBlockN);
  RowSoftmax softmax{q0 + warp * 16 + lane / 4};
  const FragmentSegments<kLayouts> segments(p, segment_tiles, seq, b, FragmentRows::kQueries, q0,
                                            softmax.row);
  FragmentTerms<kTerms ? TermSet::kAny : TermSet::kNone, FragmentRows::kQueries> terms(
      p, seq, softmax.row);
  terms.head(p, seq, b, h);

  // Only used rows and keys are read (the rest of a tile is zero): padding
  // may hold anything, NaN included.
  load_tile<T, kHeadDim, kBlockM>(sQ, q_base, p.q.row_stride, q0, seq.seqlen_q, p.head_dim);
  int64_t k0 = segments.next_tile(keys.tile_begin, keys.key_end, kBlockN);
  if (k0 < keys.key_end)
    load_tile<T, kHeadDim, kBlockN>(sK, k_base, p.k.row_stride, k0, seq.seqlen_k, p.head_dim);
  cp_async_commit();

  constexpr int kKeyTiles = kBlockN / 8, kDimTiles = kHeadDim / 8;
  float o[kDimTiles * 4] = {};

  while (k0 < keys.key_end) {
    cp_async_wait_all();
    __syncthreads();  // K_j landed; every warp is done with V_{j-1}
    load_tile<T, kHeadDim, kBlockN>(sV, v_base, p.v.row_stride, k0, seq.seqlen_k, p.head_dim_v);
    cp_async_commit();
    // kTerms: the tile's terms and dropout bits while V loads, before S is live.
    float term[kKeyTiles * 4];
    [[maybe_unused]] uint32_t keep = ~0u;
    if constexpr (kTerms) {
      terms.template terms_of<kKeyTiles>(term, k0);
      if (terms.dropping()) keep = terms.template keep_bits<kKeyTiles>(k0);
    }

    float s[kKeyTiles * 4];
    gemm_abt<T, kHeadDim, kBlockN>(s, sQ, warp * 16, sK);
    softmax.scores<kKeyTiles>(s, p, seq, k0,
                              RowSoftmax::tile_needs_mask(seq, q0, last_row, k0, kBlockN,
                                                          keys.key_begin, keys.key_end));
    segments.template mask<kKeyTiles>(s, k0);
    // Terms on the log2-unit scores (RowSoftmax::scores scaled them), after the masks;
    // dropout after the statistics (l, hence lse, is undropped), before P V.
    if constexpr (kTerms) terms.template add_terms<kKeyTiles>(s, term);
    softmax.update<kKeyTiles, kDimTiles>(s, o);
    if (terms.dropping()) terms.template apply_keep<kKeyTiles>(s, keep);

    cp_async_wait_all();
    __syncthreads();  // V_j landed; every warp is done with K_j
    const int64_t k_next = segments.next_tile(k0 + kBlockN, keys.key_end, kBlockN);
    if (k_next < keys.key_end)
      load_tile<T, kHeadDim, kBlockN>(sK, k_base, p.k.row_stride, k_next, seq.seqlen_k,
                                      p.head_dim);
    cp_async_commit();

    gemm_ab<T, kHeadDim, kBlockN>(o, s, sV);
    k0 = k_next;
  }
  cp_async_wait_all();
  const bool nonfinite = write_out_rows<T, kDimTiles, false, kTerms>(softmax, p, seq, o, b, h);
  if (__any_sync(0xffffffffu, nonfinite)) recompute_nonfinite_rows<T, T, kTerms ? RowTerms::kRead : RowTerms::kNone>(
        softmax, p, seq, b, h);
}

template <class T, int kHeadDim, Layouts kLayouts, bool kTerms>
cudaError_t launch(const AttentionParams& p, const SegmentTiles& segment_tiles,
                   cudaStream_t stream) {
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        return cudaFuncSetAttribute(forward_kernel<T, kHeadDim, kLayouts, kTerms>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    smem_bytes<kHeadDim>());
      });
      e != cudaSuccess)
    return e;
  const int64_t q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t blocks = q_tiles * p.batch * p.heads_q;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (blocks == 0) return cudaSuccess;
  forward_kernel<T, kHeadDim, kLayouts, kTerms>
      <<<static_cast<unsigned>(blocks), kThreads, smem_bytes<kHeadDim>(), stream>>>(
          p, segment_tiles);
  return cudaGetLastError();
}

}  // namespace

template <int kHeadDim>
cudaError_t BucketLaunch<kHeadDim>::run(const AttentionParams& p,
                                        const SegmentTiles& segment_tiles,
                                        cudaStream_t stream) {
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    return with_variant(p, [&](auto terms, auto layouts) {
      return launch<decltype(tag), kHeadDim, decltype(layouts)::value,
                    has_terms(decltype(terms)::value)>(p, segment_tiles, stream);
    });
  });
}

}  // namespace flashjax::cuda::sm80_fwd
