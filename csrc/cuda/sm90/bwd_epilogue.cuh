// The Hopper backward consumers' epilogues: each writes the gradient rows it
// owns (dK and dV in the key kernels, dQ in the query kernel) from its
// accumulators, scaled and rounded to the gradient's type, either straight from
// registers or, in the key kernel of uniform layouts, through shared memory and
// TMA stores.
#pragma once

#include <cstdint>

#include "../common/epilogue.cuh"
#include "bwd_gradients.cuh"
#include "bwd_params.h"
#include "bwd_scheduler.cuh"
#include "bwd_smem.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Writes rows row0 + [0, 64) of a consumer's 64 x kHeadDim accumulator.
template <class T, int kHeadDim>
__device__ __forceinline__ void store_block(T* head_base, int64_t row_stride, int64_t rows,
                                            int64_t dim, int64_t row0,
                                            const float (&acc)[kHeadDim / 2], float scale) {
  store_rows<T, kHeadDim>(head_base, row_stride, rows, dim, row0 + ((threadIdx.x / 32) % 4) * 16,
                          acc, scale);
}

// A consumer's 64 x kCols accumulator, times scale, as 16-bit T at rows
// row0 + [0, 64) and columns 8 chunk0 + [0, kCols) of a swizzled tile of
// kTileRows rows.
template <class T, int kCols, int kTileRows>
__device__ __forceinline__ void stage_rows(unsigned char* tile, int row0, int chunk0,
                                           const float (&acc)[kCols / 2], float scale) {
  float scaled[kCols / 2];
#pragma unroll
  for (int i = 0; i < kCols / 2; ++i) scaled[i] = acc[i] * scale;
  uint32_t x[kCols / 16][4];
  pack_fragments<T, kCols / 16>(x, scaled);
  store_fragment<kCols / 16, kTileRows>(tile, row0, chunk0, x);
}

// Sends column blocks [block0, block0 + kBlocks) of rows [row_in_tile, +box
// rows) of the staged dK (in tile k) and dV (in tile v), both of kTileRows
// rows, to rows `row` of kv head `head` of sequence `batch` by TMA stores, and
// waits until they have read shared memory (which must outlive the reads).
// One thread calls it, after its warpgroup's fence_proxy_async and barrier.
template <int kBlocks, int kTileRows>
__device__ __forceinline__ void send_key_gradients(const BackwardMaps& maps,
                                                   const unsigned char* k, const unsigned char* v,
                                                   int block0, int row_in_tile, int64_t row,
                                                   int64_t head, int64_t batch) {
#pragma unroll
  for (int c = block0; c < block0 + kBlocks; ++c) {
    const int at = (c * kTileRows + row_in_tile) * kSwizzleBytes, col = c * kSwizzleCols<2>;
    tma_store(&maps.grad_a, k + at, col, static_cast<int>(row), static_cast<int>(head),
              static_cast<int>(batch));
    tma_store(&maps.grad_b, v + at, col, static_cast<int>(row), static_cast<int>(head),
              static_cast<int>(batch));
  }
  bulk_commit();
  bulk_wait_reads();
}

// The key kernel's dK and dV rows of a consumer. Uniform layouts: staged in
// the owned K and V tiles' rows of this consumer and sent by TMA stores, one
// box per column block (rows past seqlen_k and head dims past the tensors' are
// not written): the per-thread stores wrote 8 rows x 16 bytes a warp
// instruction, 64 of them a thread, and kept ~10% of a 2k causal backward's
// warps waiting at the CTA's end (ncu, H200, 2026-11-27). V's rows are this
// consumer's alone (dP^T); K's are read by both consumers' dQ products, so dK
// waits for both to finish.
template <class T, int kHeadDim, Layouts kLayouts>
__device__ __forceinline__ void store_key_gradients(
    Smem<kHeadDim>& sm, const BackwardMaps& maps,
    const KeyBlock<TileConfig<kHeadDim>, kLayouts>& kb, const AttentionParams& p,
    const float (&dk)[kHeadDim / 2], const float (&dv)[kHeadDim / 2], int consumer) {
  using C = TileConfig<kHeadDim>;
  constexpr int kRows = C::kOwnRows, kConsumerRows = C::kStoreRows;  // (the maps' box rows)
  const int64_t row0 = kb.k0 + consumer * kConsumerRows;
  const SeqlenInfo seq = kb.sequence(p);
  if (kLayouts != Layouts::kUniform || !maps.store_own) {
    store_block<T, kHeadDim>(seq.template k_at<T>(p.dk, 0, kb.hk), p.dk.row_stride, seq.k_slot,
                             p.head_dim, row0, dk, p.softmax_scale);
    store_block<T, kHeadDim>(seq.template k_at<T>(p.dv, 0, kb.hk), p.dv.row_stride, seq.k_slot,
                             p.head_dim_v, row0, dv, 1.0f);
    return;
  }
  const int my_rows = consumer * kConsumerRows;
  stage_rows<T, kHeadDim, kRows>(sm.own_b, my_rows, 0, dv, 1.0f);
  named_sync(barrier_id(NamedBarrier::kOwnedRead), 128 * C::kConsumers);
  stage_rows<T, kHeadDim, kRows>(sm.own_a, my_rows, 0, dk, p.softmax_scale);
  fence_proxy_async();  // (the stores, to the TMA unit)
  named_sync(barrier_id(NamedBarrier::kGradientsStaged, consumer), 128);
  if (threadIdx.x % 128 == 0)
    send_key_gradients<kColumnBlocks<kHeadDim, 2>, kRows>(maps, sm.own_a, sm.own_b, 0, my_rows,
                                                          row0, kb.hk, kb.b);
}

// The wide kernel's: consumer c's head dims [128c, +128) of dK and dV of the
// block's 64 keys, staged in its own column blocks of K and V (its dQ products
// read only those of K; both consumers' S^T and dP^T products, which read all
// of K and V, finished before the last tile's dS^T barrier) and sent as the
// key kernel's are (uniform layouts, the only ones of the wide kernel).
template <class T>
__device__ __forceinline__ void store_wide_gradients(WideSmem& sm, const BackwardMaps& maps,
                                                     const KeyBlock<WideTileConfig>& kb,
                                                     const AttentionParams& p,
                                                     const float (&dk)[64], const float (&dv)[64],
                                                     int c) {
  using C = WideTileConfig;
  constexpr int kCols = 128, kBlocks = kCols / kSwizzleCols<2>;
  constexpr int kRows = C::kStoreRows;  // (the maps' box rows: all the block's keys)
  if (!maps.store_own) {
    const int64_t row0 = kb.k0 + ((threadIdx.x / 32) % 4) * 16;
    store_rows<T, kCols>(p.dk.at<T>(kb.b, 0, kb.hk), p.dk.row_stride, p.seqlen_k, p.head_dim,
                         row0, dk, p.softmax_scale, kCols * c);
    store_rows<T, kCols>(p.dv.at<T>(kb.b, 0, kb.hk), p.dv.row_stride, p.seqlen_k,
                         p.head_dim_v, row0, dv, 1.0f, kCols * c);
    return;
  }
  constexpr int kChunksPerBlock = kSwizzleBytes / 16;
  stage_rows<T, kCols, kRows>(sm.v, 0, kBlocks * kChunksPerBlock * c, dv, 1.0f);
  stage_rows<T, kCols, kRows>(sm.k, 0, kBlocks * kChunksPerBlock * c, dk, p.softmax_scale);
  fence_proxy_async();
  named_sync(barrier_id(NamedBarrier::kGradientsStaged, c), 128);
  if (threadIdx.x % 128 == 0)
    send_key_gradients<kBlocks, kRows>(maps, sm.k, sm.v, kBlocks * c, 0, kb.k0, kb.hk, kb.b);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
