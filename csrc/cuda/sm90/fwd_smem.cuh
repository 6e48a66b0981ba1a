// The Hopper forward's shared memory: fwd_tile_config.h's layout carved into
// the Q tile, the K and V rings and their mbarriers, and the barriers'
// initialisation.
#pragma once

#include <cstdint>

#include "../common/device.cuh"
#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// What the producer's walk over a mask's tile summaries found for one K stage
// (kernels with a mask: ItemKeys<true, ...>), so that the consumers need not walk
// them: the tile's first key, bit c of `mixed` set where the mask hides some of the
// tile's pairs from consumer c's rows (then they read it per element), and `ranged`
// where positions, windows or the sequence's end hide some of its pairs
// (RowSoftmax::tile_needs_mask: the consumers' k0 is not warp-uniform to the
// compiler, so they would test it in 64-bit vector registers). Written and read as
// two 64-bit shared words (publish / read), ordered by the K stage's barriers.
struct PublishedTile {
  int64_t k0;
  uint32_t mixed;
  bool ranged;
  __device__ void publish(PublishedTile* slot) const {
    st_shared_u64(smem_u32(&slot->k0), static_cast<uint64_t>(k0));
    st_shared_u64(smem_u32(&slot->mixed), mixed | static_cast<uint64_t>(ranged) << 32);
  }
  __device__ static PublishedTile read(const PublishedTile* slot) {
    const uint64_t flags = ld_shared_u64(smem_u32(&slot->mixed));
    return {static_cast<int64_t>(ld_shared_u64(smem_u32(&slot->k0))),
            static_cast<uint32_t>(flags), (flags >> 32) != 0};
  }
};
static_assert(sizeof(PublishedTile) == 16, "two 64-bit shared words");

// Q has its own full/empty pair so that the next item's Q loads during the
// current item's last products; the K and V rings have one pair per stage.
template <class Cfg>
struct ForwardSmem {
  unsigned char *q, *k, *v;  // k, v: kStages tiles each
  unsigned char* out;        // Cfg::kStagesOut: each consumer's out rows
  uint64_t *q_full, *q_empty, *k_full, *k_empty, *v_full, *v_empty;
  // Per consumer warp: whether a row it wrote holds NaN or inf (in shared
  // memory: the main loop has no register to spare for it).
  int* nonfinite_warps;
  // Kernels with a mask: the item's tile count (written before its Q load, read
  // after it) and each K stage's PublishedTile (written before its K load).
  int64_t* item_tiles;
  PublishedTile* tiles;
  // A dynamic schedule's tiles (fwd_scheduler.cuh): kItemSlots slots and their
  // full (the producer's arrival) and empty (one per consumer warp) barriers.
  QueryTile* items;
  uint64_t *item_full, *item_empty;

  __device__ explicit ForwardSmem(unsigned char* raw) {
    unsigned char* base = align_smem(raw);
    q = base;
    k = q + Cfg::kQBytes;
    v = k + kStages * Cfg::kKVBytes;
    out = base + Cfg::kOutOffset;
    q_full = reinterpret_cast<uint64_t*>(base + Cfg::kBarrierOffset);
    q_empty = q_full + 1;
    k_full = q_empty + 1;
    k_empty = k_full + kStages;
    v_full = k_empty + kStages;
    v_empty = v_full + kStages;
    item_full = v_empty + kStages;
    item_empty = item_full + kItemSlots;
    nonfinite_warps = reinterpret_cast<int*>(base + Cfg::kFlagOffset);
    item_tiles = reinterpret_cast<int64_t*>(base + Cfg::kPublishedOffset);
    tiles = reinterpret_cast<PublishedTile*>(base + Cfg::kPublishedOffset + 16);
    items = reinterpret_cast<QueryTile*>(tiles + kStages);
  }

  // (One thread, before the CTA's first __syncthreads.) The full barriers
  // complete on the producer's arrival and the TMA bytes, the empty ones on
  // one arrival per consumer warp.
  __device__ void init() const {
    constexpr int kConsumerWarps = kWarpsPerGroup * Cfg::kConsumers;
    mbar_init(q_full, 1);
    mbar_init(q_empty, kConsumerWarps);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&k_empty[s], kConsumerWarps);
      mbar_init(&v_empty[s], kConsumerWarps);
    }
    for (int s = 0; s < kItemSlots; ++s) {
      mbar_init(&item_full[s], 1);
      mbar_init(&item_empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int w = 0; w < kConsumerWarps; ++w) nonfinite_warps[w] = 0;
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
