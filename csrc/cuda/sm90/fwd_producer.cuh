// The Hopper forward's producer: one thread of warpgroup 0 issues the TMA
// loads of each work item, its Q tile and the K and V tiles it visits, into
// the shared-memory rings (fwd_smem.cuh), each tile once its stage is free.
// TMA writes the 128-byte swizzled layout that wgmma reads, so no thread
// touches the tiles.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "fwd_smem.cuh"
#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

// TMA maps of q, k and v (fwd_launch.cu makes them; float8: v's is V^T's,
// Float8Inputs::vt), and of out where the consumers store their rows by TMA
// (`store_out`: fwd_epilogue.cuh says when).
struct TensorMaps {
  CUtensorMap q, k, v, out;
  bool store_out = false;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The loads of work item w: Q once the previous item's Q is free (q_bytes:
// the tile's bytes, fewer when it packs a GQA group), then the item's K and V
// tiles (keys: its ItemKeys, walked here). kv (the ring position) and q_loads
// run on across items.
template <class Cfg, class Item, class Keys>
__device__ __forceinline__ void load_work_item(const ForwardSmem<Cfg>& sm,
                                               const TensorMaps& maps, const Item& w,
                                               Keys keys, int q_bytes, int64_t& kv,
                                               int64_t& q_loads) {
  constexpr int kHeadDim = Cfg::kHeadDim, kBytes = Cfg::kElementBytes;
  mbar_wait(sm.q_empty, (q_loads++ & 1) ^ 1);
  if constexpr (Keys::kMasked)  // (before Q's arrival, which releases it)
    st_shared_u64(smem_u32(sm.item_tiles), static_cast<uint64_t>(keys.count));
  mbar_expect_tx(sm.q_full, q_bytes);
  tma_tile<kHeadDim, Cfg::kBlockM, kBytes>(sm.q, &maps.q, sm.q_full, w.q_row(), w.h, w.batch());
  for (int64_t it = 0; it < keys.count; ++it, ++kv) {
    const int stage = kv % kStages, phase = (kv / kStages) & 1;
    // (a mask's tile: found while the stage frees, published once it has)
    [[maybe_unused]] PublishedTile tile{};
    int k0;
    if constexpr (Keys::kMasked) {
      tile = keys.next_tile();
      k0 = static_cast<int>(tile.k0);
    } else {
      k0 = static_cast<int>(keys.k0(it));
    }
    mbar_wait(&sm.k_empty[stage], phase ^ 1);
    if constexpr (Keys::kMasked) tile.publish(&sm.tiles[stage]);
    mbar_expect_tx(&sm.k_full[stage], Cfg::kKBytes);
    tma_tile<kHeadDim, Cfg::kBlockN, kBytes>(sm.k + stage * Cfg::kKBytes, &maps.k,
                                             &sm.k_full[stage], w.k_row(k0), w.hk, w.batch());
    mbar_wait(&sm.v_empty[stage], phase ^ 1);
    mbar_expect_tx(&sm.v_full[stage], Cfg::kVBytes);
    if constexpr (Cfg::kFloat8) {  // (V^T: [head dims][keys k0 ..], boxes of 128-byte rows)
#pragma unroll
      for (int c = 0; c < Cfg::kVtBlocks; ++c)
        tma_load(sm.v + stage * Cfg::kVBytes + c * Cfg::kPaddedDim * kSwizzleBytes, &maps.v,
                 &sm.v_full[stage], k0 + c * kSwizzleBytes, 0, w.hk, w.batch());
    } else {
      tma_tile<kHeadDim, Cfg::kBlockN, kBytes>(sm.v + stage * Cfg::kVBytes, &maps.v,
                                               &sm.v_full[stage], w.k_row(k0), w.hk, w.batch());
    }
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
