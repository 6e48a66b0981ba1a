// The Hopper backward's launches of one head-dim bucket (bwd_launch_bucket.h):
// kernel attributes, tensor maps, grids and the launches of one call (bwd_kernel.cuh
// has the kernels): stage_rows_kernel (padded lse2 and D), then either the fused
// key kernel (dK, dV and dQ into the float32 buffer; the wide one above head dim
// 128) and convert_dq_kernel, or, with `deterministic`, the key kernel without dQ
// and the query kernel (dQ).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "../common/dispatch.h"
#include "../common/sequence_layout.h"
#include "bwd_kernel.cuh"
#include "bwd_launch_bucket.h"
#include "bwd_params.h"
#include "bwd_postprocess.cuh"
#include "bwd_preprocess.cuh"
#include "bwd_tile_config.h"
#include "bwd_workspace.h"
#include "flashjax/params.h"
#include "hopper_common.cuh"
#include "work_list.cuh"

namespace flashjax::cuda::hopper_bwd {
namespace {

// The general terms with the kUniform layouts run only non-deterministic calls
// (with_variant's kUniformBias): only the fused key kernel is compiled for them.
template <Layouts kLayouts, TermSet kTerms>
constexpr bool kFusedOnly = kTerms == TermSet::kAny && kLayouts == Layouts::kUniform;

// Kernel attributes are set once per instantiation.
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <class T, int kHeadDim, Layouts kLayouts, TermSet kTerms>
cudaError_t configure_kernels() {
  constexpr int kSmem = KeyKernelConfig<kHeadDim>::kSmemBytes;
  static DeviceOnce configured;
  return configured([] {
    if constexpr (kWide<kHeadDim>) {
      return allow_smem(hopper_wide_key_kernel<T>, kSmem);
    } else if constexpr (kFusedOnly<kLayouts, kTerms>) {
      return allow_smem(hopper_key_kernel<T, kHeadDim, true, kLayouts, kTerms>, kSmem);
    } else {  // (the query kernel's configuration is the key kernel's)
      cudaError_t status = cudaSuccess;
      for (cudaError_t e :
           {allow_smem(hopper_key_kernel<T, kHeadDim, true, kLayouts, kTerms>, kSmem),
            allow_smem(hopper_key_kernel<T, kHeadDim, false, kLayouts, kTerms>, kSmem),
            allow_smem(hopper_query_kernel<T, kHeadDim, kLayouts, kTerms>, kSmem)})
        if (e != cudaSuccess && status == cudaSuccess) status = e;
      return status;
    }
  });
}

// The grid of a kernel whose CTAs own `rows`-row blocks of each sequence's
// query (or key) slot, for `heads` heads: kVarlen's is a bound on the work
// list's blocks (a sequence's slot ends at the total, so the blocks number at
// most ceil(total / rows) + batch per head; the list is cut there should
// overlapping slots of inconsistent metadata exceed it).
int64_t block_grid(const AttentionParams& p, bool keys, int64_t rows, int64_t heads) {
  const int64_t slot = keys ? p.seqlen_k : p.seqlen_q, total = keys ? p.total_k : p.total_q;
  const int64_t per_sequence = (slot + rows - 1) / rows;
  int64_t blocks = p.batch * per_sequence;
  if (p.packed()) blocks = std::min(blocks, (total + rows - 1) / rows + p.batch);
  return blocks * heads;
}

// kVarlen: builds the work list of a kernel's blocks (longest sequences first).
cudaError_t build_blocks(const AttentionParams& p, const VarlenWorkList& list, bool keys,
                         int64_t rows, int64_t heads, int64_t grid, cudaStream_t stream) {
  WorkShape shape;
  shape.tile_rows = rows;
  shape.heads = heads;
  shape.keys = keys;
  shape.max_items = grid;
  return build_work_list(p, shape, list, stream);
}

template <class T, int kHeadDim, Layouts kLayouts, TermSet kTerms>
cudaError_t launch(const AttentionParams& p, const HopperBackwardWorkspace& ws,
                   cudaStream_t stream) {
  using KeyConfig = KeyKernelConfig<kHeadDim>;
  using QueryConfig = TileConfig<kHeadDim>;  // (used only up to head dim 128)
  constexpr int kSmem = KeyConfig::kSmemBytes, kThreads = KeyConfig::kThreads;
  constexpr int kKeysPerBlock = KeyConfig::kOwnRows;
  constexpr bool kVarlen = kLayouts != Layouts::kUniform;
  const bool fused = ws.dq_accum != nullptr;
  if (cudaError_t e = configure_kernels<T, kHeadDim, kLayouts, kTerms>(); e != cudaSuccess) return e;
  const MapExtent qe = query_extent(p), ke = key_extent(p);
  const auto map = [&](CUtensorMap* m, const TensorRef& t, const MapExtent& extent,
                       int64_t heads, int64_t dim, int rows) {
    return make_map(m, t, p.dtype, extent.batch, extent.rows, heads, dim, rows);
  };
  BackwardMaps key_maps, query_maps;
  if (!map(&key_maps.own_a, p.k, ke, p.heads_kv, p.head_dim, kKeysPerBlock) ||
      !map(&key_maps.own_b, p.v, ke, p.heads_kv, p.head_dim_v, kKeysPerBlock) ||
      !map(&key_maps.stream_a, p.q, qe, p.heads_q, p.head_dim, KeyConfig::kStreamRows) ||
      !map(&key_maps.stream_b, p.dout, qe, p.heads_q, p.head_dim_v, KeyConfig::kStreamRows))
    return cudaErrorInvalidValue;
  // dK and dV by TMA stores (uniform layouts: a box never reaches into another
  // sequence's rows), where their maps can be made (else per-thread stores).
  constexpr int kBox = KeyConfig::kStoreRows;
  key_maps.store_own = !kVarlen &&
                       map(&key_maps.grad_a, p.dk, ke, p.heads_kv, p.head_dim, kBox) &&
                       map(&key_maps.grad_b, p.dv, ke, p.heads_kv, p.head_dim_v, kBox);
  int64_t query_blocks = 0;
  if constexpr (!kWide<kHeadDim>) {  // (no query kernel above head dim 128)
    static_assert(QueryConfig::kSmemBytes == kSmem && QueryConfig::kThreads == kThreads,
                  "the key and query kernels share their launch shape");
    constexpr int kQueriesPerBlock = QueryConfig::kOwnRows;
    if (!map(&query_maps.own_a, p.q, qe, p.heads_q, p.head_dim, kQueriesPerBlock) ||
        !map(&query_maps.own_b, p.dout, qe, p.heads_q, p.head_dim_v, kQueriesPerBlock) ||
        !map(&query_maps.stream_a, p.k, ke, p.heads_kv, p.head_dim, QueryConfig::kStreamRows) ||
        !map(&query_maps.stream_b, p.v, ke, p.heads_kv, p.head_dim_v, QueryConfig::kStreamRows))
      return cudaErrorInvalidValue;
    query_blocks = block_grid(p, false, kQueriesPerBlock, p.heads_q);
  }
  const int64_t key_blocks = block_grid(p, true, kKeysPerBlock, p.heads_kv);
  if (key_blocks > 0x7fffffff || query_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if constexpr (kLayouts == Layouts::kSegments) {
    if (!ws.segments) return cudaErrorInvalidValue;  // no workspace
    if (cudaError_t e = compute_segment_tiles(p, ws.segments, stream); e != cudaSuccess) return e;
  }
  if constexpr (has_mask(kTerms))
    if (cudaError_t e = compute_mask_tiles(p, ws.masks, stream); e != cudaSuccess) return e;
  if constexpr (kVarlen) {
    if (cudaError_t e = build_blocks(p, ws.key_list, true, kKeysPerBlock, p.heads_kv, key_blocks,
                                     stream);
        e != cudaSuccess)
      return e;
    if (!fused)
      if (cudaError_t e = build_blocks(p, ws.query_list, false, QueryConfig::kOwnRows, p.heads_q,
                                       query_blocks, stream);
          e != cudaSuccess)
        return e;
  }
  const RowStats stats{ws.lse2_padded, ws.D_padded, ws.padded, ws.nonfinite};
  constexpr int kElementwiseThreads = 256;  // (of the grid-stride kernels' blocks)
  if (cudaError_t e = launch_early(stage_rows_kernel,
                                   resident_grid<stage_rows_kernel, kElementwiseThreads>(),
                                   kElementwiseThreads, 0, stream, p, ws, fused);
      e != cudaSuccess)
    return e;
  // A key kernel (with dQ or without: then ws.dq_accum and ws.dq_order are null).
  const auto launch_key_kernel = [&](auto kernel, auto... args) {
    if (key_blocks <= 0) return cudaSuccess;
    return launch_early(kernel, static_cast<unsigned>(key_blocks), kThreads, kSmem, stream, p,
                        key_maps, stats, ws.dq_accum, args...);
  };
  if (!fused) {  // deterministic, not ordered_dq: key kernel without dQ, then the query kernel
    if constexpr (kWide<kHeadDim> || kFusedOnly<kLayouts, kTerms>) {
      return cudaErrorNotSupported;  // hopper_backward_supports says no
    } else {
      if (cudaError_t e = launch_key_kernel(hopper_key_kernel<T, kHeadDim, false, kLayouts, kTerms>,
                                            ws.dq_order, ws.key_list, ws.segments, ws.masks);
          e != cudaSuccess)
        return e;
      if (query_blocks > 0)
        return launch_early(hopper_query_kernel<T, kHeadDim, kLayouts, kTerms>,
                            static_cast<unsigned>(query_blocks), kThreads, kSmem, stream, p,
                            query_maps, ws.D, ws.dsink_rows, ws.query_list, ws.segments,
                            ws.nonfinite, ws.masks);
      return cudaSuccess;
    }
  }
  // (backward_preprocess has zeroed ws.dq_accum)
  cudaError_t e;
  if constexpr (kWide<kHeadDim>)
    e = launch_key_kernel(hopper_wide_key_kernel<T>);
  else
    e = launch_key_kernel(hopper_key_kernel<T, kHeadDim, true, kLayouts, kTerms>, ws.dq_order,
                          ws.key_list, ws.segments, ws.masks);
  if (e != cudaSuccess) return e;
  constexpr auto convert = convert_dq_kernel<T, kHeadDim>;
  return launch_early(convert, resident_grid<convert, kElementwiseThreads>(), kElementwiseThreads,
                      0, stream, p, ws.dq_accum, ws.padded, ws.nonfinite);
}

}  // namespace

template <int kHeadDim>
cudaError_t BucketLaunch<kHeadDim>::run(const AttentionParams& p,
                                        const HopperBackwardWorkspace& ws,
                                        cudaStream_t stream) {
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_variant</*kLeanTerms=*/true, /*kUniformBias=*/true>(
        p, [&](auto terms, auto layouts) {
      constexpr Layouts kLayouts = decltype(layouts)::value;
      constexpr TermSet kTerms = decltype(terms)::value;
      // (hopper_backward_supports says no)
      if constexpr ((kWide<kHeadDim> && (kLayouts != Layouts::kUniform || has_terms(kTerms))) ||
                    (has_terms(kTerms) && kLayouts == Layouts::kSegments))
        return cudaErrorNotSupported;
      else
        return launch<T, kHeadDim, kLayouts, kTerms>(p, ws, stream);
    });
  });
}

}  // namespace flashjax::cuda::hopper_bwd
