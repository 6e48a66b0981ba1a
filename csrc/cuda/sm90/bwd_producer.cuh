// The Hopper backward's producer (one thread of warpgroup 0): TMA loads of a
// CTA's owned tiles once, then of the streamed tiles (and their rows'
// statistics) into the shared-memory rings, paced by the rings' mbarriers.
#pragma once

#include <cstdint>

#include "bwd_params.h"
#include "bwd_scheduler.cuh"
#include "bwd_smem.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Producer: owned tensors once (tensor row own_row), then `tiles` streamed
// pairs, from the walk's first, as tiles_of finds them (AllTiles, MaskedTiles:
// then each stage's StreamedTile published too). With stats.lse2, also those
// rows' lse2 and D.
template <int kHeadDim, class Tiles = AllTiles>
__device__ void produce(Smem<kHeadDim>& sm, const BackwardMaps& maps, int own_row, int own_head,
                        int batch, int64_t tiles,
                        StreamWalk<TileConfig<kHeadDim>::kStreamRows> tile,
                        const RowStats& stats, const Tiles& tiles_of = {}) {
  using C = TileConfig<kHeadDim>;
  mbar_expect_tx(sm.owned, 2 * C::kOwnBytes);
  tma_tile<kHeadDim, C::kOwnRows>(sm.own_a, &maps.own_a, sm.owned, own_row, own_head, batch);
  tma_tile<kHeadDim, C::kOwnRows>(sm.own_b, &maps.own_b, sm.owned, own_row, own_head, batch);
  for (int64_t it = 0; it < tiles; ++it) {
    const int stage = it % C::kStages, phase = (it / C::kStages) & 1;
    const StreamedTile found = tiles_of.find(tile);  // (AllTiles: nothing)
    mbar_wait_idle(&sm.empty[stage], phase ^ 1);
    if constexpr (Tiles::kSkips) {
      publish(&sm.streamed[stage], found);
      if (found.end()) {  // (the consumers stop at this stage)
        mbar_arrive(&sm.full[stage]);
        return;
      }
    }
    mbar_expect_tx(&sm.full[stage], 2 * C::kStreamBytes + (stats.lse2 ? C::kStatBytes : 0));
    if (stats.lse2) {
      float* dst = sm.stats + stage * (C::kStatBytes / 4);
      bulk_load(dst, stats.lse2 + tile.padded_row, C::kStatBytes / 2, &sm.full[stage]);
      bulk_load(dst + C::kStreamRows, stats.D + tile.padded_row, C::kStatBytes / 2,
                &sm.full[stage]);
    }
    const int row = static_cast<int>(tile.row);
    tma_tile<kHeadDim, C::kStreamRows>(sm.stream_a + stage * C::kStreamBytes, &maps.stream_a,
                                       &sm.full[stage], row, tile.head, batch);
    tma_tile<kHeadDim, C::kStreamRows>(sm.stream_b + stage * C::kStreamBytes, &maps.stream_b,
                                       &sm.full[stage], row, tile.head, batch);
    tile.next();
  }
}

// The wide kernel's producer: K and V once, then per tile Q (with its rows'
// lse2) and dO (with D), each in its own ring: Q is released after dK, dO
// after dV.
inline __device__ void produce_wide(WideSmem& sm, const BackwardMaps& maps,
                                    const KeyBlock<WideTileConfig>& kb, const AttentionParams& p,
                                    const RowStats& stats) {
  using C = WideTileConfig;
  constexpr int kHeadDim = C::kHeadDim, kKeys = C::kOwnRows, kStreamRows = C::kStreamRows;
  constexpr int kQStages = C::kQStages, kTileBytes = C::kTileBytes, kStatBytes = C::kStatBytes;
  const int batch = static_cast<int>(kb.b), k0 = static_cast<int>(kb.k0);
  mbar_expect_tx(sm.owned, 2 * kTileBytes);
  tma_tile<kHeadDim, kKeys>(sm.k, &maps.own_a, sm.owned, k0, static_cast<int>(kb.hk), batch);
  tma_tile<kHeadDim, kKeys>(sm.v, &maps.own_b, sm.owned, k0, static_cast<int>(kb.hk), batch);
  for (int64_t it = 0; it < kb.tiles; ++it) {
    const int64_t slot_row = kb.row(it), head64 = kb.head(p, it);
    const int row = static_cast<int>(slot_row), head = static_cast<int>(head64);
    const int64_t at = kb.padded_start(p, stats.padded, head64) + slot_row;
    const int s = it % kQStages, phase = ((it / kQStages) & 1) ^ 1;
    mbar_wait_idle(&sm.q_empty[s], phase);
    mbar_expect_tx(&sm.q_full[s], kTileBytes + kStatBytes);
    bulk_load(sm.lse2 + s * kStreamRows, stats.lse2 + at, kStatBytes, &sm.q_full[s]);
    tma_tile<kHeadDim, kStreamRows>(sm.q + s * kTileBytes, &maps.stream_a, &sm.q_full[s], row,
                                    head, batch);
    mbar_wait_idle(sm.do_empty, (it & 1) ^ 1);
    mbar_expect_tx(sm.do_full, kTileBytes + kStatBytes);
    bulk_load(sm.D, stats.D + at, kStatBytes, sm.do_full);
    tma_tile<kHeadDim, kStreamRows>(sm.dout, &maps.stream_b, sm.do_full, row, head, batch);
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
