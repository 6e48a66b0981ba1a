// The Hopper forward's epilogue: each consumer writes its rows of a work item
// (out in the output type TOut, and lse), through shared memory and TMA
// stores or straight from registers, and flags its warp when a row came out
// non-finite; after the last item, the producer's spare warp recomputes the
// flagged warps' rows.
#pragma once

#include <cstdint>

#include "../common/epilogue.cuh"
#include "../common/nonfinite.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "flashjax/params.h"
#include "fwd_producer.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_smem.cuh"
#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Consumer warp `warp`'s rows of work item w from O (o) and the statistics
// (softmax); sm.nonfinite_warps[warp] is set (by lane 0) when one holds NaN or inf.
// Uniform layouts, unpacked items, Cfg::kStagesOut (maps.store_out): the
// consumer stages its 64 rows of out (stmatrix) and its first thread sends
// them by TMA stores (rows past seqlen_q, head dims past
// head_dim_v not written), which overlap the next item; per-thread stores
// wrote 8 rows x 16 bytes a warp instruction, 16 of them a row pair, with
// their 64-bit addresses: ~500 instructions an item and warp more than FA3's
// forward, ~6% of the 2k causal kernel's stall samples (ncu, H200, 2026-11-27).
template <class Cfg, class TOut, Layouts kLayouts, TermSet kTerms, int kN, class Item>
__device__ __forceinline__ void store_work_item(const ForwardSmem<Cfg>& sm, const TensorMaps& maps,
                                                const AttentionParams& p, const Item& w,
                                                bool packed, const RowSoftmax& softmax,
                                                float (&o)[kN], int consumer, int warp, int lane) {
  constexpr int kDimTiles = kN / 4;  // 8-column tiles of the fragment
  constexpr bool kBias = kTerms == TermSet::kAny;  // (the variants that may carry a bias)
  const auto flag = [&](bool nonfinite) {
    if (__any_sync(0xffffffffu, nonfinite) && lane == 0) sm.nonfinite_warps[warp] = 1;
  };
  if constexpr (kLayouts == Layouts::kUniform && Cfg::kStagesOut) {
    if (maps.store_out && !packed) {
      static_assert(sizeof(TOut) == 2, "out is staged as 16-bit rows");
      flag(write_out_rows<TOut, kDimTiles, true, kBias>(softmax, p, w.seq, o, w.b, w.h));
      unsigned char* rows = sm.out + consumer * Cfg::kOutBytes;
      const int barrier = kOutStagedBarrier + consumer;
      const bool sender = threadIdx.x % 128 == 0;
      if (sender) bulk_wait_reads();  // (the previous item's stores have read the buffer)
      named_sync(barrier, 128);
      uint32_t x[kDimTiles / 2][4];
      pack_fragments<TOut, kDimTiles / 2>(x, o);
      store_fragment<kDimTiles / 2, kConsumerRows>(rows, 0, 0, x);
      fence_proxy_async();  // (the stores, to the TMA unit)
      named_sync(barrier, 128);
      if (sender) {
        const int row = static_cast<int>(w.q0) + consumer * kConsumerRows;
#pragma unroll
        for (int c = 0; c < kColumnBlocks<Cfg::kPaddedDim, 2>; ++c)
          tma_store(&maps.out, rows + c * kConsumerRows * kSwizzleBytes, c * kSwizzleCols<2>,
                    row, static_cast<int>(w.h), static_cast<int>(w.b));
        bulk_commit();
      }
      return;
    }
  }
  if constexpr (kLayouts != Layouts::kUniform) clear_unused_rows<kDimTiles>(softmax, o, w.seq);
  flag(write_out_rows<TOut, kDimTiles, false, kBias>(softmax, p, w.seq, o, w.b, w.h));
}

// After a consumer's last item: its out stores are complete (before the rows
// they wrote may be recomputed: recompute_flagged_rows).
template <class Cfg>
__device__ __forceinline__ void finish_out_stores() {
  if constexpr (Cfg::kStagesOut)
    if (threadIdx.x % 128 == 0) bulk_wait_all();
}

// Rare: a row holding NaN or inf may be one a tile product got wrong
// (exact_rows.cuh). Once every consumer has written its rows, the producer's
// kRecomputeWarp walks the CTA's items again and recomputes, pair by pair,
// such rows of the consumer warps that flagged one (flags[4 * consumer +
// warp]). Done here, not in the consumers, whose main loop would otherwise
// keep registers for it (the kernel spills).
// kTerms: the kernel's score-terms variant (the recompute reads them too).
template <class Cfg, class TOut, bool kPacks, Layouts kLayouts, TermSet kTerms>
__device__ __forceinline__ void recompute_flagged_rows(const AttentionParams& p,
                                                       const ScheduleOf<kLayouts>& schedule,
                                                       const SegmentTiles& segment_tiles,
                                                       const int* flags) {
  using T = typename Cfg::Element;
  constexpr int kConsumerWarps = kWarpsPerGroup * Cfg::kConsumers;
  named_sync(kRowsDoneBarrier, 32 + 128 * Cfg::kConsumers);
  bool any = false;
  for (int f = 0; f < kConsumerWarps; ++f) any |= flags[f] != 0;
  if (!any) return;
  const bool packed = kPacks && schedule.packed_rows > 0;
  for_each_done_tile(schedule, [&](QueryTile tile) {
    const WorkItem<kLayouts, Cfg::kBlockM, Cfg::kBlockN> w(p, tile, packed, segment_tiles);
    for (int f = 0; f < kConsumerWarps; ++f)
      if (flags[f])
        recompute_nonfinite_rows<T, TOut, has_terms(kTerms) ? RowTerms::kRead : RowTerms::kNone>(
            item_rows<kPacks>(w, schedule, f / kWarpsPerGroup, f % kWarpsPerGroup), p, w.seq,
            w.b, w.h);
  });
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
