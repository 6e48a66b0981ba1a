// The Hopper (sm_90a) backward kernels, warp-specialised like the forward and
// assembled from parts: each kernel carves its shared memory (bwd_smem.cuh),
// finds the rows its CTA owns (bwd_scheduler.cuh) and splits the warp roles
// and their registers: warpgroup 0 is the producer (bwd_producer.cuh) and, in
// the fused key kernel, the dQ writer (bwd_dq_writer.cuh); warpgroups 1 and 2
// are the consumers (bwd_mainloop.cuh, bwd_wide_mainloop.cuh), which also
// store their gradients.
#pragma once

#include <cstdint>
#include <type_traits>

#include "bwd_dq_writer.cuh"
#include "bwd_mainloop.cuh"
#include "bwd_params.h"
#include "bwd_producer.cuh"
#include "bwd_scheduler.cuh"
#include "bwd_smem.cuh"
#include "bwd_tile_config.h"
#include "bwd_wide_mainloop.cuh"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// setmaxnreg: warpgroup 0 gives registers up, the consumers take them.
template <class Config>
__device__ __forceinline__ void producer_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Config::kProducerRegs));
}
template <class Config>
__device__ __forceinline__ void consumer_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Config::kConsumerRegs));
}

// body(block) for this CTA's block (BlockSchedule); kMasked (the variants with a
// mask) narrows it to the span of the mask (the streamed tiles the mask hides from
// every owned row: skipped).
template <bool kMasked, class Block, class Body>
__device__ __forceinline__ void for_each_block(const AttentionParams& p,
                                               const VarlenWorkList& list,
                                               const SegmentTiles& segment_tiles,
                                               const MaskTiles& mask_tiles, bool ordered_dq,
                                               Body&& body) {
  for_each_work_tile(BlockSchedule<Block>{p, list, segment_tiles, ordered_dq},
                     [&](const Block& listed) {
    if constexpr (kMasked) {
      Block narrowed = listed;
      narrowed.narrow_to_mask(p, mask_tiles);
      body(narrowed);
    } else {
      body(listed);
    }
  });
}

// dK and dV of a block of 128 keys (and, with kFusedDq, its shares of dQ;
// dq_order: added in a fixed order, bwd_dq_writer.cuh's DqOrder, else null).
// kLayouts: any; `list`: the blocks of non-uniform ones; `segment_tiles`: kSegments'.
// kTerms: score terms and dropout (non-uniform layouts only).
template <class T, int kHeadDim, bool kFusedDq, Layouts kLayouts, TermSet kTerms>
__global__ void __launch_bounds__(TileConfig<kHeadDim>::kThreads, 1)
    hopper_key_kernel(const AttentionParams p, const __grid_constant__ BackwardMaps maps,
                      const RowStats stats, float* dq_accum, int* dq_order,
                      const VarlenWorkList list,
                      const __grid_constant__ SegmentTiles segment_tiles,
                      const __grid_constant__ MaskTiles mask_tiles) {
  using Config = TileConfig<kHeadDim>;
  start_after_prerequisite_grid();  // (launch_early, after stage_rows_kernel)
  extern __shared__ unsigned char smem_raw[];
  Smem<kHeadDim> sm(smem_raw);
  using Block = KeyBlock<Config, kLayouts>;
  const auto block = [&](const Block& kb) {
    sm.init();

    const int warpgroup = warpgroup_index();
    if (warpgroup == 0) {
      producer_registers<Config>();
      // (the variants with a mask stream only the tiles it lets through)
      using Tiles = std::conditional_t<has_mask(kTerms), MaskedTiles<Block>, AllTiles>;
      const Tiles tiles_of = [&] {
        if constexpr (has_mask(kTerms)) return Tiles{kb, p, mask_tiles};
        else return Tiles{};
      }();
      if (threadIdx.x == 0)
        produce(sm, maps, static_cast<int>(kb.sequence(p).k_row(kb.k0)),
                static_cast<int>(kb.hk), static_cast<int>(kb.sequence(p).batch), kb.tiles,
                kb.walk(p, stats.padded), stats, tiles_of);
      else if (kFusedDq && threadIdx.x % 32 == 0) {
        // (the writers: the first threads of warps 1, 2, ...)
        const int writer = threadIdx.x / 32 - 1;
        // (dq_order: deterministic, uniform layouts, consumers on their own dQ blocks)
        if constexpr (kOrderedDq && kLayouts == Layouts::kUniform && !Config::kDqOfOwnKeys &&
                      !Tiles::kSkips)
          if (dq_order) {
            if (writer < kDqWriters)
              write_dq<true>(sm, kb, p, stats, dq_accum, dq_order, tiles_of, writer);
            return;
          }
        if (writer < kDqWriters)
          write_dq<false>(sm, kb, p, stats, dq_accum, nullptr, tiles_of, writer);
      }
      return;
    }
    consumer_registers<Config>();
    key_consumer<T, kHeadDim, kFusedDq, kLayouts, kTerms>(
        sm, kb, p, maps, segment_tiles, warpgroup - 1, stats.nonfinite);
  };
  // (No block, a grid slot past the list's: the whole CTA returns.)
  for_each_block<has_mask(kTerms), Block>(p, list, segment_tiles, mask_tiles,
                                          dq_order != nullptr, block);
}

// dQ of a block of 128 query rows, and those rows' shares of dsinks.
template <class T, int kHeadDim, Layouts kLayouts, TermSet kTerms>
__global__ void __launch_bounds__(TileConfig<kHeadDim>::kThreads, 1)
    hopper_query_kernel(const AttentionParams p, const __grid_constant__ BackwardMaps maps,
                        const __grid_constant__ TensorRef D_all,
                        const __grid_constant__ TensorRef dsink_rows, const VarlenWorkList list,
                        const __grid_constant__ SegmentTiles segment_tiles, int* nonfinite,
                        const __grid_constant__ MaskTiles mask_tiles) {
  using Config = TileConfig<kHeadDim>;
  start_after_prerequisite_grid();  // (launch_early, after the key kernel)
  extern __shared__ unsigned char smem_raw[];
  Smem<kHeadDim> sm(smem_raw);
  using Block = QueryBlock<Config, kLayouts>;
  const auto block = [&](const Block& qb) {
    sm.init();

    const int warpgroup = threadIdx.x / 128;  // (uniform: the query consumer spilled)
    if (warpgroup == 0) {
      producer_registers<Config>();
      if (threadIdx.x == 0)
        produce(sm, maps, static_cast<int>(qb.seq.q_row(qb.q0)), static_cast<int>(qb.h),
                static_cast<int>(qb.seq.batch), qb.tiles, qb.walk(), RowStats{});
      return;
    }
    consumer_registers<Config>();
    query_consumer<T, kHeadDim, kLayouts, kTerms>(sm, qb, p, segment_tiles, mask_tiles,
                                                  warpgroup - 1, D_all, dsink_rows, nonfinite);
  };
  for_each_block<has_mask(kTerms), Block>(p, list, segment_tiles, mask_tiles,
                                          /*ordered_dq=*/false, block);
}

// dK, dV and the shares of dQ of a block of 64 keys, head dims 129-256.
template <class T>
__global__ void __launch_bounds__(WideTileConfig::kThreads, 1)
    hopper_wide_key_kernel(const AttentionParams p, const __grid_constant__ BackwardMaps maps,
                           const RowStats stats, float* dq_accum) {
  using Config = WideTileConfig;
  start_after_prerequisite_grid();  // (launch_early, after stage_rows_kernel)
  extern __shared__ unsigned char smem_raw[];
  WideSmem sm(smem_raw);
  using Block = KeyBlock<Config>;
  using Schedule = BlockSchedule<Block>;  // (uniform layouts only: no list, no segments)
  for_each_work_tile(Schedule{p, VarlenWorkList{}, SegmentTiles{}, false}, [&](const Block& kb) {
    const int warpgroup = warpgroup_index();
    if (warpgroup == 0) {
      producer_registers<Config>();
      if (threadIdx.x == 0) produce_wide(sm, maps, kb, p, stats);
      // (the writers: the first threads of warps 1, 2)
      else if (threadIdx.x % 32 == 0 && threadIdx.x / 32 <= Config::kConsumers)
        write_dq_wide(sm, kb, p, stats, dq_accum, threadIdx.x / 32 - 1);
      return;
    }
    consumer_registers<Config>();
    wide_consumer<T>(sm, kb, p, maps, stats, warpgroup - 1);
  });
}

#else  // not compiled for sm_90a: never launched (hopper_backward_supports says no)

template <class T, int kHeadDim, bool kFusedDq, Layouts kLayouts, TermSet kTerms>
__global__ void hopper_key_kernel(const AttentionParams, const __grid_constant__ BackwardMaps,
                                  const RowStats, float*, int*, const VarlenWorkList,
                                  const SegmentTiles, const MaskTiles) {}
template <class T, int kHeadDim, Layouts kLayouts, TermSet kTerms>
__global__ void hopper_query_kernel(const AttentionParams, const __grid_constant__ BackwardMaps,
                                    const __grid_constant__ TensorRef,
                                    const __grid_constant__ TensorRef, const VarlenWorkList,
                                    const SegmentTiles, int*, const MaskTiles) {}
template <class T>
__global__ void hopper_wide_key_kernel(const AttentionParams, const __grid_constant__ BackwardMaps,
                                       const RowStats, float*) {}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
