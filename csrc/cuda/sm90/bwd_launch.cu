// The Hopper backward's host side: which calls it takes, its workspace, and the
// dispatch of each backward stage to a head-dim bucket (bwd_launch_bucket.cuh has
// a bucket's launches, bwd_kernel.cuh the kernels); run_backward_stages adds the
// stages every backward shares (D, the exact rows, dsinks).
#include <cuda_runtime.h>

#include "../common/backward_stages.h"
#include "../common/dispatch.h"
#include "../common/sequence_layout.h"
#include "bwd_launch_bucket.h"
#include "bwd_tile_config.h"
#include "bwd_workspace.h"
#include "flashjax/params.h"
#include "hopper_backward.h"
#include "hopper_common.cuh"

namespace flashjax::cuda {

bool hopper_backward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  // Layouts as the forward's. Above head dim 128
  // only the fused (non-deterministic) kernel exists, for uniform layouts:
  // the mma.sync path takes the other calls there.
  const bool narrow = head_dim_bucket(kTensorCoreBuckets, p) <= 128;
  // Score terms and dropout: not with segment ids (with_variant has the variants).
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

// Deterministic calls the fused key kernel takes with kOrderedDq (bwd_tile_config.h;
// on by default), adding dQ in a fixed order (DqOrder, bwd_dq_writer.cuh):
// uniform layouts, head dims 65-128 (at 64 both consumers add to one dQ block,
// which an order would serialise), causal (window_right 0; kOrderedDq 2: all),
// where a head's key blocks fit on the SMs at once (a block waits for the
// others of its head). The others compute dQ in the query kernel (7 products
// a tile pair to the fused kernel's 5).
bool ordered_dq(const AttentionParams& p) {
  const int64_t bucket = head_dim_bucket(kTensorCoreBuckets, p);
  // (Not with score terms: the variants with a mask skip tiles, MaskedTiles.)
  if (!hopper_bwd::kOrderedDq || !p.deterministic || layouts_of(p) != Layouts::kUniform ||
      p.has_pair_terms() ||
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
    return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
      return hopper_bwd::BucketLaunch<decltype(dim)::value>::run(p, ws, stream);
    });
  });
}

}  // namespace flashjax::cuda
