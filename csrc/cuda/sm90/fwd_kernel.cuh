// The Hopper (sm_90a) forward kernel, warp-specialised and assembled from
// parts: it carves its shared memory (fwd_smem.cuh), splits the warp roles
// and their registers, and has every role walk the CTA's work items
// (fwd_scheduler.cuh): warpgroup 0 produces (fwd_producer.cuh: TMA loads),
// the other warpgroups consume (fwd_mainloop.cuh) and write their rows
// (fwd_epilogue.cuh). Persistent: one CTA per SM.
#pragma once

#include <cstdint>

#include "../common/score_terms.cuh"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "flashjax/params.h"
#include "fwd_epilogue.cuh"
#include "fwd_mainloop.cuh"
#include "fwd_producer.cuh"
#include "fwd_scheduler.cuh"
#include "fwd_smem.cuh"
#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// T: the inputs' element type, TOut: out's. kLayouts: any (sequence_layout.h);
// kSegments narrows each tile's keys to its segment-id span and masks ids per
// element where a tile's are not all equal. kTerms: bias, mask, ALiBi and
// dropout (score_terms.cuh). kWideKeys: TileConfig's.
template <class T, class TOut, int kHeadDim, Layouts kLayouts, TermSet kTerms, bool kWideKeys>
__global__ void __launch_bounds__(TileConfig<T, kHeadDim, kWideKeys>::kThreads, 1)
    hopper_forward_kernel(const __grid_constant__ AttentionParams p,
                          const __grid_constant__ TensorMaps maps,
                          const __grid_constant__ ScheduleOf<kLayouts> schedule,
                          const __grid_constant__ SegmentTiles segment_tiles,
                          const __grid_constant__ MaskTiles mask_tiles) {
  using Cfg = TileConfig<T, kHeadDim, kWideKeys>;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kConsumers = Cfg::kConsumers;
  constexpr bool kPacks = packs_groups<kHeadDim, kLayouts, kTerms>();
  using Item = WorkItem<kLayouts, kBlockM, kBlockN>;
  using Keys = ItemKeys<has_mask(kTerms), kBlockM, kBlockN>;  // (a mask's empty tiles are skipped)
  extern __shared__ unsigned char smem_raw[];
  const ForwardSmem<Cfg> sm(smem_raw);
  if (threadIdx.x == 0) sm.init();
  __syncthreads();

  const bool packed = kPacks && schedule.packed_rows > 0;
  const int q_bytes = packed ? static_cast<int>(schedule.packed_rows * p.group_size()) *
                                   Cfg::kPaddedDim * Cfg::kElementBytes
                             : Cfg::kQBytes;
  // (kTerms and float8: through a shuffle, so that the Q descriptors live in uniform
  // registers: half the spills in the masked tile loop; float8 at head dim 256: no
  // reloads of spilled descriptors per tile; the plain 16-bit kernels keep
  // threadIdx.x, not measured better the other way)
  const int warpgroup = has_terms(kTerms) || Cfg::kFloat8
                            ? warpgroup_index()
                            : static_cast<int>(threadIdx.x / 128);
  if (warpgroup == 0) {  // producer
    release_registers<Cfg::kProducerRegs>();
    if (threadIdx.x / 32 == kRecomputeWarp)
      recompute_flagged_rows<Cfg, TOut, kPacks, kLayouts, kTerms>(p, schedule, segment_tiles,
                                                          sm.nonfinite_warps);
    if (threadIdx.x != 0) return;
    int64_t kv = 0, q_loads = 0;
    const auto load = [&](QueryTile tile) {
      const Item w(p, tile, packed, segment_tiles);
      load_work_item(sm, maps, w, Keys(w, mask_tiles), q_bytes, kv, q_loads);
    };
    if constexpr (kLayouts == Layouts::kUniform) {
      if (schedule.dynamic) {
        QueryTile tile;
        for (int64_t k = 0; publish_next_tile(schedule, sm, k, tile); ++k) load(tile);
        return;
      }
    }
    for_each_work_tile(schedule, load);
    return;
  }

  claim_registers<Cfg::kConsumerRegs>();
  const int consumer = warpgroup - 1, warp_in_group = (threadIdx.x / 32) % kWarpsPerGroup;
  using Mainloop = ForwardMainloop<Cfg, kLayouts>;
  Mainloop mainloop(sm, consumer);
  mainloop.open_turns();
  for_each_work_tile(ConsumerWalk<Cfg, ScheduleOf<kLayouts>>{schedule, sm}, [&](QueryTile tile) {
    const Item w(p, tile, packed, segment_tiles);
    float o[Mainloop::kDimTiles * 4] = {};
    RowSoftmax softmax = item_rows<kPacks>(w, schedule, consumer, warp_in_group);
    // (kSegments: this consumer's 64 rows are one segment-id tile.)
    const FragmentSegments<kLayouts> segments(p, segment_tiles, w.seq, w.b, FragmentRows::kQueries,
                                              w.q0 + consumer * kConsumerRows, softmax.row);
    FragmentTerms<kTerms, FragmentRows::kQueries> terms(p, w.seq, softmax.row);
    terms.head(p, w.seq, w.b, w.h);
    // (a mask: the keys as the producer's walk publishes them)
    if constexpr (Keys::kMasked)
      mainloop.compute(p, w, PublishedKeys{}, segments, terms, softmax, o);
    else
      mainloop.compute(p, w, Keys(w, mask_tiles), segments, terms, softmax, o);
    store_work_item<Cfg, TOut, kLayouts, kTerms>(sm, maps, p, w, packed, softmax, o, consumer,
                                         consumer * kWarpsPerGroup + warp_in_group, mainloop.lane);
  });
  finish_out_stores<Cfg>();
  named_arrive(kRowsDoneBarrier, 32 + 128 * kConsumers);  // (recompute_flagged_rows)
}

#else  // not compiled for sm_90a: never launched (hopper_forward_supports says no)

template <class T, class TOut, int kHeadDim, Layouts kLayouts, TermSet kTerms, bool kWideKeys>
__global__ void hopper_forward_kernel(const __grid_constant__ AttentionParams,
                                      const __grid_constant__ TensorMaps,
                                      const __grid_constant__ ScheduleOf<kLayouts>,
                                      const SegmentTiles, const MaskTiles) {}

#endif

}  // namespace flashjax::cuda::hopper_fwd
