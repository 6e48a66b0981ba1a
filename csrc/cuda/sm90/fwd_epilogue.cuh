// The Hopper forward's epilogue: each consumer writes its rows of a work item
// (out in the output type TOut, and lse) straight from registers, and flags
// its warp when a row came out non-finite; after the last item, the
// producer's spare warp recomputes the flagged warps' rows.
#pragma once

#include <cstdint>

#include "../common/epilogue.cuh"
#include "../common/nonfinite.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "flashjax/params.h"
#include "fwd_scheduler.cuh"
#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Consumer warp `warp`'s rows of work item w from O (o) and the statistics
// (softmax); nonfinite_warps[warp] is set (by lane 0) when one holds NaN or inf.
template <class TOut, Layouts kLayouts, int kN, class Item>
__device__ __forceinline__ void store_work_item(const AttentionParams& p, const Item& w,
                                                const RowSoftmax& softmax, float (&o)[kN],
                                                int* nonfinite_warps, int warp, int lane) {
  constexpr int kDimTiles = kN / 4;  // 8-column tiles of the fragment
  if constexpr (kLayouts != Layouts::kUniform) clear_unused_rows<kDimTiles>(softmax, o, w.seq);
  const bool nonfinite = write_out_rows<TOut, kDimTiles>(softmax, p, w.seq, o, w.b, w.h);
  if (__any_sync(0xffffffffu, nonfinite) && lane == 0) nonfinite_warps[warp] = 1;
}

// Rare: a row holding NaN or inf may be one a tile product got wrong
// (exact_rows.cuh). Once every consumer has written its rows, the producer's
// kRecomputeWarp walks the CTA's items again and recomputes, pair by pair,
// such rows of the consumer warps that flagged one (flags[4 * consumer +
// warp]). Done here, not in the consumers, whose main loop would otherwise
// keep registers for it (the kernel spills).
// kTerms: the kernel's score-terms variant (the recompute reads them too).
template <class Cfg, class TOut, bool kPacks, Layouts kLayouts, bool kTerms>
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
  for_each_work_tile(schedule, [&](QueryTile tile) {
    const WorkItem<kLayouts, Cfg::kBlockM, Cfg::kBlockN> w(p, tile, packed, segment_tiles);
    for (int f = 0; f < kConsumerWarps; ++f)
      if (flags[f])
        recompute_nonfinite_rows<T, TOut, kTerms ? RowTerms::kRead : RowTerms::kNone>(
            item_rows<kPacks>(w, schedule, f / kWarpsPerGroup, f % kWarpsPerGroup), p, w.seq,
            w.b, w.h);
  });
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
