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
static_assert(sizeof(QueryTile) <= 16, "an item slot is one 16-byte word");

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
    constexpr auto at = Cfg::kSmem;
    unsigned char* base = align_smem(raw);
    const auto region = [base](int offset) { return base + offset; };
    const auto barriers = [base](int offset) { return reinterpret_cast<uint64_t*>(base + offset); };
    q = region(at.q);
    k = region(at.k);
    v = region(at.v);
    out = region(at.out);
    q_full = barriers(at.q_full);
    q_empty = barriers(at.q_empty);
    k_full = barriers(at.k_full);
    k_empty = barriers(at.k_empty);
    v_full = barriers(at.v_full);
    v_empty = barriers(at.v_empty);
    item_full = barriers(at.item_full);
    item_empty = barriers(at.item_empty);
    nonfinite_warps = reinterpret_cast<int*>(region(at.flags));
    item_tiles = reinterpret_cast<int64_t*>(region(at.item_tiles));
    tiles = reinterpret_cast<PublishedTile*>(region(at.tiles));
    items = reinterpret_cast<QueryTile*>(region(at.items));
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
