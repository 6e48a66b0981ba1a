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

// A consumer's 64 x kHeadDim accumulator, times scale, as 16-bit T at rows
// row0 + [0, 64) of a swizzled [kOwnRows][kHeadDim] tile.
template <class T, int kHeadDim, int kTileRows>
__device__ __forceinline__ void stage_rows(unsigned char* tile, int row0,
                                           const float (&acc)[kHeadDim / 2], float scale) {
  float scaled[kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) scaled[i] = acc[i] * scale;
  uint32_t x[kHeadDim / 16][4];
  pack_fragments<T, kHeadDim / 16>(x, scaled);
  store_fragment<kHeadDim / 16, kTileRows>(tile, row0, 0, x);
}

// The key kernel's dK and dV rows of a consumer. Uniform layouts: staged in
// the owned K and V tiles' rows of this consumer and sent by TMA stores, one
// box per column block (rows past seqlen_k and head dims past the tensors' are
// not written): the per-thread stores wrote 8 rows x 16 bytes a warp
// instruction, 64 of them a thread, and kept ~10% of a 2k causal backward's
// warps waiting at the CTA's end (ncu, H100, 2026-11-27). V's rows are this
// consumer's alone (dP^T); K's are read by both consumers' dQ products, so dK
// waits for both to finish.
template <class T, int kHeadDim, Layouts kLayouts>
__device__ __forceinline__ void store_key_gradients(
    Smem<kHeadDim>& sm, const BackwardMaps& maps,
    const KeyBlock<TileConfig<kHeadDim>, kLayouts>& kb, const AttentionParams& p,
    const float (&dk)[kHeadDim / 2], const float (&dv)[kHeadDim / 2], int consumer) {
  using C = TileConfig<kHeadDim>;
  constexpr int kRows = C::kOwnRows, kConsumerRows = kRows / C::kConsumers;
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
  stage_rows<T, kHeadDim, kRows>(sm.own_b, my_rows, dv, 1.0f);
  named_sync(barrier_id(NamedBarrier::kOwnedRead), 128 * C::kConsumers);
  stage_rows<T, kHeadDim, kRows>(sm.own_a, my_rows, dk, p.softmax_scale);
  fence_proxy_async();  // (the stores, to the TMA unit)
  named_sync(barrier_id(NamedBarrier::kGradientsStaged, consumer), 128);
  if (threadIdx.x % 128 != 0) return;
  const int row = static_cast<int>(row0), head = static_cast<int>(kb.hk);
  const int batch = static_cast<int>(kb.b);
#pragma unroll
  for (int c = 0; c < kColumnBlocks<kHeadDim, 2>; ++c) {
    const int at = c * kRows * kSwizzleBytes + my_rows * kSwizzleBytes;
    tma_store(&maps.grad_a, sm.own_a + at, c * kSwizzleCols<2>, row, head, batch);
    tma_store(&maps.grad_b, sm.own_b + at, c * kSwizzleCols<2>, row, head, batch);
  }
  bulk_commit();
  bulk_wait_reads();  // (the CTA's shared memory must outlive the stores' reads)
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
