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


// gqa_packed: a tile holds a whole query-head group (TileSchedule). float8: byte
// elements, and v's map is V^T's (Float8Inputs::vt: "rows" are head dims, columns
// keys; a box is 128 keys of every head dim).
template <class Cfg>
bool make_maps(const AttentionParams& p, bool gqa_packed, TensorMaps& maps) {
  const MapExtent qe = query_extent(p), ke = key_extent(p);
  const MapElement element = Cfg::kFloat8 ? kFloat8MapElement : map_element(p.dtype);
  const bool values =
      Cfg::kFloat8 ? make_map(&maps.v, p.float8.vt, element, p.batch, p.head_dim_v, p.heads_kv,
                              p.float8.vt_keys, static_cast<int>(p.head_dim_v))
                   : make_map(&maps.v, p.v, element, ke.batch, ke.rows, p.heads_kv,
                              p.head_dim_v, Cfg::kBlockN);
  return make_map(&maps.q, p.q, element, qe.batch, qe.rows, p.heads_q, p.head_dim,
                  gqa_packed ? static_cast<int>(p.seqlen_q) : Cfg::kBlockM,
                  gqa_packed ? static_cast<int>(p.group_size()) : 1) &&
         make_map(&maps.k, p.k, element, ke.batch, ke.rows, p.heads_kv, p.head_dim,
                  Cfg::kBlockN) &&
         values;
}

// Heads per section of a dynamic schedule (fwd_scheduler.cuh): as many as keep the
// keys and values their tiles read (a window's span of keys; a group of query heads
// shares its kv head's) within half of the L2 cache.
inline int64_t section_heads(const AttentionParams& p, size_t element_bytes, int block_rows,
                             int64_t heads) {
  static constexpr int64_t kL2Share = 2;  // (half of L2: the rest for Q, out and the others)
  const int64_t l2_bytes = current_device_attribute(cudaDevAttrL2CacheSize, 0);
  int64_t keys = p.seqlen_k;
  if (p.window_left >= 0 && p.window_right >= 0)
    keys = std::min<int64_t>(keys, p.window_left + p.window_right + block_rows);
  const int64_t bytes_per_head =
      std::max<int64_t>(1, keys * (p.head_dim + p.head_dim_v) *
                               static_cast<int64_t>(element_bytes) / p.group_size());
  return std::clamp<int64_t>(l2_bytes / kL2Share / bytes_per_head, 1, heads);
}

// `workspace`: hopper_forward_workspace_bytes(p) bytes (ForwardWorkspace).
// T: the inputs' element type, TOut: out's.
// kTerms: the score terms compiled in (with_variant); kWideKeys: TileConfig's.
template <class T, class TOut, int kHeadDim, Layouts kLayouts, TermSet kTerms, bool kWideKeys>
cudaError_t launch_layouts(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  using Cfg = TileConfig<T, kHeadDim, kWideKeys>;
  constexpr int kBlockM = Cfg::kBlockM;
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        return cudaFuncSetAttribute(
            hopper_forward_kernel<T, TOut, kHeadDim, kLayouts, kTerms, kWideKeys>,
            cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      });
      e != cudaSuccess)
    return e;
  ScheduleOf<kLayouts> schedule;
  int64_t items;  // (an upper bound for kVarlen: the device knows the count)
  const bool gqa_packed = packs_groups<kHeadDim, kLayouts, kTerms>() &&
                          p.group_size() > 1 && p.seqlen_q * p.group_size() <= kBlockM;
  if constexpr (kLayouts == Layouts::kUniform) {
    schedule = TileSchedule::make((p.seqlen_q + kBlockM - 1) / kBlockM,
                                  p.batch * (gqa_packed ? p.heads_kv : p.heads_q),
                                  gqa_packed ? p.seqlen_q : 0, multiprocessor_count());
    items = schedule.total_pairs;
  }
  const ForwardWorkspace ws(p, workspace);
  if constexpr (kLayouts == Layouts::kUniform) {
    // Where it measured faster (H200, twenty-fifth session): head dim 64, and sliding
    // windows up to head dim 128; not causal alone at head dim 128 (8k: -1%, within
    // noise at 2k and 16k), nor at head dim 256 (its tiles of 64 keys are few and
    // coarse: the replay has the static pairs as good or better there).
    const bool sliding = p.window_left >= 0;
    schedule.dynamic = (kHeadDim <= 64 || (kHeadDim <= 128 && sliding)) && ws.tile_counter &&
                       !gqa_packed && schedule.total_tiles > multiprocessor_count();
    if (schedule.dynamic) {
      schedule.section_heads = section_heads(p, sizeof(T), kBlockM, schedule.heads);
      schedule.later_tiles_first = p.window_right >= 0;
      schedule.counter = ws.tile_counter;
      schedule.owner = ws.tile_owner;
      items = schedule.total_tiles;
      if (cudaError_t e = cudaMemsetAsync(ws.tile_counter, 0, ws.bytes, stream); e != cudaSuccess)
        return e;
    }
  }
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
  hopper_forward_kernel<T, TOut, kHeadDim, kLayouts, kTerms, kWideKeys>
      <<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
          p, maps, schedule, ws.segments, ws.masks);
  return cudaGetLastError();
}

// Whether a call takes the wide key tiles where its variant has them (has_wide_keys):
// measured at head dim 256 (H200, twenty-seventh session), the forward ran 4.6-6.4%
// faster at 8k-16k, 1-4% at 4k and 1-8% at 2k without a mask, but 2.6% slower at 2k
// causal, where the diagonal's partly hidden tiles are a larger share of a row's keys;
// windows (a diagonal band throughout) were not measured: they keep 64 keys.
inline bool wide_keys_pay(const AttentionParams& p) {
  // (causal from 4k on: +1.9%; a causal call's rows see seqlen_k - seqlen_q / 2 keys
  // on average, bottom-right aligned)
  static constexpr int64_t kMinMeanKeys = 2048;
  if (p.window_left >= 0) return false;
  return p.window_right < 0 || p.seqlen_k - p.seqlen_q / 2 >= kMinMeanKeys;
}

// out is written in the inputs' type (an fp8 input type would pick its own).
template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  return with_variant<true>(p, [&](auto terms, auto layouts) {
    constexpr Layouts kLayouts = decltype(layouts)::value;
    constexpr TermSet kTerms = decltype(terms)::value;
    // (terms with segment ids: hopper_forward_supports says no)
    if constexpr (has_terms(kTerms) && kLayouts == Layouts::kSegments) {
      return cudaErrorNotSupported;
    } else {
      if constexpr (has_wide_keys<kHeadDim, kLayouts, kTerms>())
        if (wide_keys_pay(p))
          return launch_layouts<T, T, kHeadDim, kLayouts, kTerms, true>(p, workspace, stream);
      return launch_layouts<T, T, kHeadDim, kLayouts, kTerms, false>(p, workspace, stream);
    }
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
