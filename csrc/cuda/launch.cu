// Chooses a kernel for each call. Tensor-core kernels declare which calls
// they take; the SIMT path takes the rest, so no valid call is refused.
// FLASHJAX_FORWARD_KERNEL=simt|mma caps the choice for forward and backward
// (tests use it to run every path on one GPU). The rows of packed tensors
// that no sequence covers are written here, before whichever path runs.
#include <cstdlib>
#include <cstring>

#include "backward_workspace.h"
#include "hopper_backward.h"
#include "hopper_forward.h"
#include "kvcache_attention.h"
#include "launch.h"
#include "sequence_layout.h"
#include "simt_attention.h"
#include "tensor_core_backward.h"
#include "tensor_core_forward.h"

namespace flashjax::cuda {
namespace {

enum class ForwardCap { kHopper, kMma, kSimt };

ForwardCap forward_cap() {
  const char* env = std::getenv("FLASHJAX_FORWARD_KERNEL");
  if (env && std::strcmp(env, "simt") == 0) return ForwardCap::kSimt;
  if (env && std::strcmp(env, "mma") == 0) return ForwardCap::kMma;
  return ForwardCap::kHopper;
}

bool use_split_kv(const AttentionParams& p) {
  return forward_cap() != ForwardCap::kSimt && split_kv_supports(p);
}

bool use_hopper_forward(const AttentionParams& p) {
  return forward_cap() == ForwardCap::kHopper && hopper_forward_supports(p);
}

bool use_hopper_backward(const AttentionParams& p) {
  return forward_cap() == ForwardCap::kHopper && hopper_backward_supports(p);
}

}  // namespace

// The Hopper path's varlen work list, else the segment-id tile ranges of the
// mma.sync path (the SIMT path needs none).
size_t forward_workspace_bytes(const AttentionParams& p) {
  if (use_hopper_forward(p)) return hopper_forward_workspace_bytes(p);
  return SegmentTiles::workspace_bytes(p);
}

cudaError_t forward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  if (cudaError_t e = fill_uncovered_rows(p, Pass::kForward, stream); e != cudaSuccess) return e;
  if (use_hopper_forward(p)) return hopper_forward(p, workspace, stream);
  const ForwardCap cap = forward_cap();
  if (cap != ForwardCap::kSimt && tensor_core_forward_supports(p))
    return tensor_core_forward(p, workspace, stream);
  return simt_forward(p, stream);
}

size_t backward_workspace_bytes(const AttentionParams& p) {
  if (use_hopper_backward(p)) return hopper_backward_workspace(p, nullptr).bytes;
  return BackwardWorkspace(p, nullptr, false, 0).bytes;
}

cudaError_t backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  if (cudaError_t e = fill_uncovered_rows(p, Pass::kBackward, stream); e != cudaSuccess) return e;
  if (use_hopper_backward(p)) return hopper_backward(p, workspace, stream);
  if (forward_cap() != ForwardCap::kSimt && tensor_core_backward_supports(p))
    return tensor_core_backward(p, workspace, stream);
  return simt_backward(p, workspace, stream);
}

size_t kvcache_workspace_bytes(const AttentionParams& p, int splits) {
  return use_split_kv(p) ? split_kv_workspace_bytes(p, splits) : 0;
}

cudaError_t kvcache_forward(const AttentionParams& p, int splits, void* workspace,
                            cudaStream_t stream) {
  if (cudaError_t e = append_to_cache(p, stream); e != cudaSuccess) return e;
  if (p.seqlen_q == 0) return cudaSuccess;  // an append only
  if (use_split_kv(p)) return split_kv_forward(p, splits, workspace, stream);
  return simt_forward(p, stream);
}

}  // namespace flashjax::cuda
