// The Hopper backward's host side: kernel attributes, tensor maps, grids and
// the launches of one call (bwd_kernel.cuh has the kernels):
//   backward_preprocess (D, simt_attention.cu), stage_rows_kernel (padded lse2
//   and D), then either the fused key kernel (dK, dV and dQ into the float32
//   buffer; the wide one above head dim 128) and convert_dq_kernel, or, with
//   `deterministic`, the key kernel without dQ and the query kernel (dQ);
//   last, dsinks.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "../common/backward_stages.h"
#include "../common/dispatch.h"
#include "bwd_kernel.cuh"
#include "bwd_params.h"
#include "bwd_postprocess.cuh"
#include "bwd_preprocess.cuh"
#include "bwd_tile_config.h"
#include "bwd_workspace.h"
#include "flashjax/params.h"
#include "hopper_backward.h"
#include "hopper_common.cuh"
#include "work_list.cuh"

namespace flashjax::cuda {
namespace hopper_bwd {
namespace {

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
  const unsigned elementwise_blocks = 8 * multiprocessor_count();  // grid-stride kernels
  stage_rows_kernel<<<elementwise_blocks, 256, 0, stream>>>(p, ws, fused);
  if (!fused) {  // deterministic, not ordered_dq: key kernel without dQ, then the query kernel
    if constexpr (kWide<kHeadDim>) {
      return cudaErrorNotSupported;  // hopper_backward_supports says no
    } else {
      if (key_blocks > 0)
        hopper_key_kernel<T, kHeadDim, false, kLayouts, kTerms>
            <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(
                p, key_maps, stats, nullptr, nullptr, ws.key_list, ws.segments, ws.masks);
      if (query_blocks > 0)
        hopper_query_kernel<T, kHeadDim, kLayouts, kTerms>
            <<<static_cast<unsigned>(query_blocks), kThreads, kSmem, stream>>>(
                p, query_maps, ws.D, ws.dsink_rows, ws.query_list, ws.segments, ws.nonfinite,
                ws.masks);
      return cudaGetLastError();
    }
  }
  // (backward_preprocess has zeroed ws.dq_accum)
  if (key_blocks > 0) {
    if constexpr (kWide<kHeadDim>)
      hopper_wide_key_kernel<T><<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(
          p, key_maps, stats, ws.dq_accum);
    else
      hopper_key_kernel<T, kHeadDim, true, kLayouts, kTerms>
          <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(
              p, key_maps, stats, ws.dq_accum, ws.dq_order, ws.key_list, ws.segments,
              ws.masks);
  }
  convert_dq_kernel<T, kHeadDim><<<elementwise_blocks, 256, 0, stream>>>(p, ws.dq_accum,
                                                                         ws.padded, ws.nonfinite);
  return cudaGetLastError();
}

}  // namespace
}  // namespace hopper_bwd

bool hopper_backward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  // Layouts as the forward's. Above head dim 128
  // only the fused (non-deterministic) kernel exists, for uniform layouts:
  // the mma.sync path takes the other calls there.
  const bool narrow = head_dim_bucket(kTensorCoreBuckets, p) <= 128;
  // Score terms and dropout: the kVarlen layouts' kernels (not with segment ids).
  return hopper_layouts_supported(p) && tensor_core_shapes(p) &&
         !(p.has_pair_terms() && p.has_segments()) &&
         (narrow || (!p.deterministic && layouts_of(p) == Layouts::kUniform)) &&
         p.head_dim >= 64 && p.head_dim_v >= 64 && p.seqlen_q < (1 << 30) &&
         p.seqlen_k < (1 << 30) && compute_capability() == 90 && encode_fn() != nullptr;
#else
  (void)p;
  return false;
#endif
}

namespace {

// Deterministic calls the fused key kernel takes with kOrderedDq (an A/B knob,
// bwd_tile_config.h), adding dQ in a fixed order (DqOrder, bwd_dq_writer.cuh):
// uniform layouts, head dims 65-128 (at 64 both consumers add to one dQ block,
// which an order would serialise), causal (window_right 0; kOrderedDq 2: all),
// where a head's key blocks fit on the SMs at once (a block waits for the
// others of its head). The others compute dQ in the query kernel (7 products
// a tile pair to the fused kernel's 5).
bool ordered_dq(const AttentionParams& p) {
  const int64_t bucket = head_dim_bucket(kTensorCoreBuckets, p);
  if (!hopper_bwd::kOrderedDq || !p.deterministic || layouts_of(p) != Layouts::kUniform ||
      bucket > 128 ||
      (hopper_bwd::TileConfig<64>::kDqOfOwnKeys && bucket <= 64))
    return false;
  const int64_t rows = hopper_bwd::TileConfig<128>::kOwnRows;  // (every narrow bucket's)
  const int64_t blocks_per_head = (p.seqlen_k + rows - 1) / rows;
  return blocks_per_head <= multiprocessor_count() &&
         (p.window_right == 0 || hopper_bwd::kOrderedDq == 2);
}

// The float32 dQ buffer for the fused key kernel: every call but the
// deterministic ones ordered_dq leaves to the query kernel.
HopperBackwardWorkspace hopper_backward_workspace(const AttentionParams& p, void* base) {
  const bool ordered = ordered_dq(p);
  const bool fused = !p.deterministic || ordered;
  return HopperBackwardWorkspace(p, base, fused ? head_dim_bucket(kTensorCoreBuckets, p) : 0,
                                 ordered);
}

}  // namespace

size_t hopper_backward_workspace_bytes(const AttentionParams& p) {
  return hopper_backward_workspace(p, nullptr).bytes;
}

cudaError_t hopper_backward(const AttentionParams& call, void* workspace, cudaStream_t stream) {
  const HopperBackwardWorkspace ws = hopper_backward_workspace(call, workspace);
  return run_backward_stages(call, ws, stream, [&](const AttentionParams& p) {
    return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
      return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
        constexpr int kHeadDim = decltype(dim)::value;
        using T = decltype(tag);
        return with_variant<true>(p, [&](auto terms, auto layouts) {
          constexpr Layouts kLayouts = decltype(layouts)::value;
          constexpr TermSet kTerms = decltype(terms)::value;
          // (hopper_backward_supports says no)
          if constexpr ((hopper_bwd::kWide<kHeadDim> &&
                         (kLayouts != Layouts::kUniform || has_terms(kTerms))) ||
                        (has_terms(kTerms) && kLayouts == Layouts::kSegments))
            return cudaErrorNotSupported;
          else
            return hopper_bwd::launch<T, kHeadDim, kLayouts, kTerms>(p, ws, stream);
        });
      });
    });
  });
}

}  // namespace flashjax::cuda
