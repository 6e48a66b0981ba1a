// The wide key kernel's consumers. Head dims 129-256 ("wide"): dK and dV of
// 128 keys do not fit in registers, so a CTA owns 64 keys and its two
// consumers split the work of each streamed tile of 64 queries two ways:
//  * consumer c computes S^T and dP^T for queries [32c, +32) (all 64 keys),
//    and stores P^T and dS^T (16-bit) to shared memory;
//  * after a 256-thread barrier, consumer c accumulates dV and dK for head
//    dims [128c, +128) from the whole P^T and dS^T tiles (operands from
//    shared memory), and computes those head dims of dQ_j = dS_j K as two
//    64-column products, handed in 32-column halves to the dQ writers, which
//    add them to the float32 buffer by bulk reductions (bwd_dq_writer.cuh).
// Registers: dK, dV 64 each, dQ 2 x 32; S^T, dP^T 16 each (dead by then).
// Tiles and shared memory: WideTileConfig in bwd_tile_config.h.
#pragma once

#include <cstdint>

#include "../common/epilogue.cuh"
#include "../common/exact_rows.cuh"
#include "../common/score_mod.cuh"
#include "bwd_dq_writer.cuh"
#include "bwd_epilogue.cuh"
#include "bwd_gradients.cuh"
#include "bwd_params.h"
#include "bwd_scheduler.cuh"
#include "bwd_smem.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Consumer c: dK and dV of head dims [128c, +128) of the block's 64 keys over
// its query tiles, and their shares of dQ (to its writer), then its columns of dk
// and dv.
template <class T>
__device__ __forceinline__ void wide_consumer(WideSmem& sm, const KeyBlock<WideTileConfig>& kb,
                                              const AttentionParams& p,
                                              const BackwardMaps& maps, const RowStats& stats,
                                              int c) {
  using C = WideTileConfig;
  constexpr int kHeadDim = C::kHeadDim, kKeys = C::kOwnRows, kStreamRows = C::kStreamRows;
  constexpr int kQStages = C::kQStages, kTileBytes = C::kTileBytes, kColBlock = C::kColBlock;
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int key_row = ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  float dk[64] = {}, dv[64] = {};
  mbar_wait(sm.owned, 0);
  for (int64_t it = 0; it < kb.tiles; ++it) {
    const int s = it % kQStages, phase = (it / kQStages) & 1;
    const unsigned char* q_tile = sm.q + s * kTileBytes;
    const unsigned char* do_tile = sm.dout;
    mbar_wait(&sm.q_full[s], phase);
    mbar_wait(sm.do_full, it & 1);
    // S^T = K Q^T and dP^T = V dO^T for this consumer's 32 queries.
    float st[16], dpt[16];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      wgmma_ss_n32<T>(st, k_major_desc<kKeys>(sm.k, kk),
                      k_major_desc<kStreamRows>(q_tile + c * 32 * 128, kk), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      wgmma_ss_n32<T>(dpt, k_major_desc<kKeys>(sm.v, kk),
                      k_major_desc<kStreamRows>(do_tile + c * 32 * 128, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(st);
    const int64_t col0 = kb.row(it) + 32 * c;
    if (scores_prescaled(p)) scores_log2(st, p);  // (else the scale rides in the exponent)
    kb.mask<4>(st, p, kb.k0 + key_row, col0);
    // Rows past seqlen_q have lse2 = +inf and D = 0 (padded), so P = dS = 0.
    const float* lse2 = sm.lse2 + s * kStreamRows + 32 * c;
    const float* D = sm.D + 32 * c;
    const auto column = [&](int i) { return (i / 4) * 8 + 2 * t + (i & 1); };
    probabilities_then_grad(st, dpt, p, exponent_scale(p),
                            [&](int i) { return lse2[column(i)]; },
                            [&](int i) { return D[column(i)]; }, [&] {
                              wgmma_wait<0>();
                              fence_operands(dpt);
                            });
    uint32_t frag[2][2][4];
    pack_fragments<T, 2>(frag[0], st);
    pack_fragments<T, 2>(frag[1], dpt);
    store_fragment(sm.pt(it), 0, 4 * c, frag[0]);
    store_fragment(sm.dst(it), 0, 4 * c, frag[1]);
    fence_proxy_async();
    // Both consumers' halves of P^T and dS^T are stored.
    named_sync(barrier_id(NamedBarrier::kDsStored));

    // dV += P^T dO, dQ_j = dS K (two 64-column products), dK += dS^T Q for
    // head dims [128c, +128); four commit groups, retired in order.
    float dq0[32], dq1[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dq0[i] = dq1[i] = 0.0f;
    // acc += A^T B: A = P^T or dS^T [keys][queries], B = column block pair of
    // this consumer's head dims of dO or Q.
    const auto accumulate = [&](float (&acc)[64], const unsigned char* a, const unsigned char* b) {
#pragma unroll
      for (int kk = 0; kk < kStreamRows / 16; ++kk)
        wgmma_ss_bmn_n128<T>(acc, k_major_desc<kKeys>(a, kk),
                             smem_desc(b + 2 * c * kColBlock + kk * 16 * 128, kColBlock, 1024), 1);
      wgmma_commit();
    };
    // dq = dS K for column block `block` of K.
    const auto dq_block = [&](float (&dq)[32], int block) {
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_ss_mn_n64<T>(dq, smem_desc(sm.dst(it) + kk * 16 * 128, 1024, 1024),
                           smem_desc(sm.k + block * kColBlock + kk * 16 * 128, 1024, 1024), kk > 0);
      wgmma_commit();
    };
    wgmma_fence();
    accumulate(dv, sm.pt(it), do_tile);
    dq_block(dq0, 2 * c);
    dq_block(dq1, 2 * c + 1);
    accumulate(dk, sm.dst(it), q_tile);
    wgmma_wait<3>();
    fence_operands(dv);
    if (lane == 0) mbar_arrive(sm.do_empty);
    wgmma_wait<2>();
    fence_operands(dq0);
    stage_dq_wide(sm, c, dq0, 2 * it);
    wgmma_wait<1>();
    fence_operands(dq1);
    stage_dq_wide(sm, c, dq1, 2 * it + 1);
    wgmma_wait<0>();
    fence_operands(dk);
    if (lane == 0) mbar_arrive(&sm.q_empty[s]);
  }
  store_wide_gradients<T>(sm, maps, kb, p, dk, dv, c);
  flag_nonfinite(stats.nonfinite, dk, dv);  // rows a tile product may have got wrong (exact_rows.cuh)
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
