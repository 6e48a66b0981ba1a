// The Hopper forward's launches of one head-dim bucket (fwd_launch_bucket.h):
// tensor maps, the work list and tile summaries of the calls that need them, the
// persistent grid, and the kernel instantiations (element type x layouts x score
// terms); the kernel and its parts are fwd_kernel.cuh's.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <type_traits>

#include "../common/dispatch.h"
#include "../common/mask_tiles.h"
#include "../common/sequence_layout.h"
#include "flashjax/params.h"
#include "fwd_kernel.cuh"
#include "fwd_launch_bucket.h"
#include "fwd_scheduler.cuh"
#include "fwd_tile_config.h"
#include "fwd_workspace.h"
#include "hopper_common.cuh"
#include "work_list.cuh"

namespace flashjax::cuda::hopper_fwd {
namespace {


// gqa_packed: a tile holds a whole query-head group (TileSchedule).
template <class Cfg>
bool make_maps(const AttentionParams& p, bool gqa_packed, TensorMaps& maps) {
  const MapExtent qe = query_extent(p), ke = key_extent(p);
  return make_map(&maps.q, p.q, p.dtype, qe.batch, qe.rows, p.heads_q, p.head_dim,
                  gqa_packed ? static_cast<int>(p.seqlen_q) : Cfg::kBlockM,
                  gqa_packed ? static_cast<int>(p.group_size()) : 1) &&
         make_map(&maps.k, p.k, p.dtype, ke.batch, ke.rows, p.heads_kv, p.head_dim,
                  Cfg::kBlockN) &&
         make_map(&maps.v, p.v, p.dtype, ke.batch, ke.rows, p.heads_kv, p.head_dim_v,
                  Cfg::kBlockN);
}

// `workspace`: hopper_forward_workspace_bytes(p) bytes (ForwardWorkspace).
// T: the inputs' element type, TOut: out's.
// kTerms: the score terms compiled in (with_variant).
template <class T, class TOut, int kHeadDim, Layouts kLayouts, TermSet kTerms>
cudaError_t launch_layouts(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  using Cfg = TileConfig<T, kHeadDim>;
  constexpr int kBlockM = Cfg::kBlockM;
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        return cudaFuncSetAttribute(hopper_forward_kernel<T, TOut, kHeadDim, kLayouts, kTerms>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      });
      e != cudaSuccess)
    return e;
  ScheduleOf<kLayouts> schedule;
  int64_t items;  // (an upper bound for kVarlen: the device knows the count)
  const bool gqa_packed = packs_groups<kHeadDim, kLayouts, kTerms>() &&
                          p.group_size() > 1 && p.seqlen_q * p.group_size() <= kBlockM;
  if constexpr (kLayouts == Layouts::kUniform) {
    schedule.packed_rows = gqa_packed ? p.seqlen_q : 0;
    schedule.q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
    schedule.pairs_per_head = (schedule.q_tiles + 1) / 2;
    schedule.total_pairs =
        schedule.pairs_per_head * p.batch * (gqa_packed ? p.heads_kv : p.heads_q);
    items = schedule.total_pairs;
  }
  const ForwardWorkspace ws(p, workspace);
  if constexpr (has_mask(kTerms))
    if (cudaError_t e = compute_mask_tiles(p, ws.masks, stream); e != cudaSuccess) return e;
  if constexpr (kLayouts != Layouts::kUniform) {
    if (!workspace) return cudaErrorInvalidValue;
    items = p.batch * p.heads_q * (((p.seqlen_q + kBlockM - 1) / kBlockM + 1) / 2);
    if (items == 0) return cudaSuccess;
    if constexpr (kLayouts == Layouts::kSegments)
      if (cudaError_t e = compute_segment_tiles(p, ws.segments, stream); e != cudaSuccess)
        return e;
    schedule.list = ws.list;
    schedule.heads = p.heads_q;
    WorkShape shape;
    shape.tile_rows = kBlockM;
    shape.heads = p.heads_q;
    shape.pairs = true;
    if (cudaError_t e = build_work_list(p, shape, schedule.list, stream); e != cudaSuccess)
      return e;
  }
  TensorMaps maps;
  if (!make_maps<Cfg>(p, gqa_packed, maps)) return cudaErrorInvalidValue;
  // Out by TMA stores (store_work_item): uniform layouts (a box never reaches
  // into another sequence's rows), unpacked items, where its map can be made.
  static_assert(sizeof(TOut) == 2, "out's map is of 16-bit p.dtype elements");
  maps.store_out = kLayouts == Layouts::kUniform && Cfg::kStagesOut && !gqa_packed &&
                   make_map(&maps.out, p.out, p.dtype, p.batch, p.seqlen_q, p.heads_q,
                            p.head_dim_v, kConsumerRows);
  const int64_t blocks = std::min<int64_t>(items, multiprocessor_count());
  hopper_forward_kernel<T, TOut, kHeadDim, kLayouts, kTerms>
      <<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
          p, maps, schedule, ws.segments, ws.masks);
  return cudaGetLastError();
}

// out is written in the inputs' type (an fp8 input type would pick its own).
template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  return with_variant<true>(p, [&](auto terms, auto layouts) {
    constexpr Layouts kLayouts = decltype(layouts)::value;
    // (terms with segment ids: hopper_forward_supports says no)
    if constexpr (has_terms(decltype(terms)::value) && kLayouts == Layouts::kSegments)
      return cudaErrorNotSupported;
    else
      return launch_layouts<T, T, kHeadDim, kLayouts, decltype(terms)::value>(p, workspace,
                                                                               stream);
  });
}

}  // namespace

template <int kHeadDim>
cudaError_t BucketLaunch<kHeadDim>::run(const AttentionParams& p, void* workspace,
                                        cudaStream_t stream) {
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    return launch<decltype(tag), kHeadDim>(p, workspace, stream);
  });
}

}  // namespace flashjax::cuda::hopper_fwd
