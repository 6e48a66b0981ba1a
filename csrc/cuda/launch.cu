// Chooses a kernel for each call. Tensor-core kernels declare which calls
// they take; the SIMT path takes the rest, so no valid call is refused.
// p.kernel_cap (implementation="cuda:mma" / "cuda:simt") caps the choice for
// forward and backward (tests use it to run every path on one GPU). The rows of packed tensors
// that no sequence covers are written here, before whichever path runs.
#include "common/backward_workspace.h"
#include "common/sequence_layout.h"
#include "kvcache/kvcache_attention.h"
#include "launch.h"
#include "simt/simt_attention.h"
#include "sm80/tensor_core_backward.h"
#include "sm80/tensor_core_forward.h"
#include "sm90/hopper_backward.h"
#include "sm90/hopper_forward.h"

namespace flashjax::cuda {
namespace {

bool tensor_cores_allowed(const AttentionParams& p) { return p.kernel_cap != KernelCap::kSimt; }

// dbias starts at zero: the kernels store or add only the pairs they visit.
cudaError_t zero_bias_gradient(const AttentionParams& p, cudaStream_t stream) {
  const ScoreArray& d = p.dbias;
  if (!d) return cudaSuccess;
  const int64_t last = (p.batch / d.batch_div - 1) * d.batch_stride +
                       (p.heads_q / d.head_div - 1) * d.head_stride +
                       (p.seqlen_q - 1) * d.row_stride + p.seqlen_k;  // one past it
  if (last <= 0) return cudaSuccess;
  return cudaMemsetAsync(d.data, 0, sizeof(float) * static_cast<size_t>(last), stream);
}

}  // namespace

Kernel forward_kernel(const AttentionParams& p) {
  if (p.cache.active()) return tensor_cores_allowed(p) && split_kv_supports(p) ? Kernel::kSplitKv
                                                                               : Kernel::kSimt;
  if (p.kernel_cap == KernelCap::kAny && hopper_forward_supports(p)) return Kernel::kHopper;
  if (tensor_cores_allowed(p) && tensor_core_forward_supports(p)) return Kernel::kMma;
  return Kernel::kSimt;
}

Kernel backward_kernel(const AttentionParams& p) {
  if (p.kernel_cap == KernelCap::kAny && hopper_backward_supports(p)) return Kernel::kHopper;
  if (tensor_cores_allowed(p) && tensor_core_backward_supports(p)) return Kernel::kMma;
  return Kernel::kSimt;
}

const char* kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::kHopper: return "hopper";
    case Kernel::kMma: return "mma";
    case Kernel::kSplitKv: return "split-kv";
    case Kernel::kSimt: return "simt";
  }
  return "?";
}

// The Hopper path's varlen work list, else the segment-id tile ranges of the
// mma.sync path (the SIMT path needs none).
size_t forward_workspace_bytes(const AttentionParams& p) {
  if (forward_kernel(p) == Kernel::kHopper) return hopper_forward_workspace_bytes(p);
  return SegmentTiles::workspace_bytes(p);
}

cudaError_t forward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  if (cudaError_t e = fill_uncovered_rows(p, Pass::kForward, stream); e != cudaSuccess) return e;
  switch (forward_kernel(p)) {
    case Kernel::kHopper: return hopper_forward(p, workspace, stream);
    case Kernel::kMma: return tensor_core_forward(p, workspace, stream);
    default: return simt_forward(p, stream);
  }
}

size_t backward_workspace_bytes(const AttentionParams& p) {
  if (backward_kernel(p) == Kernel::kHopper) return hopper_backward_workspace_bytes(p);
  return BackwardWorkspace(p, nullptr).bytes;
}

cudaError_t backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  if (cudaError_t e = fill_uncovered_rows(p, Pass::kBackward, stream); e != cudaSuccess) return e;
  if (cudaError_t e = zero_bias_gradient(p, stream); e != cudaSuccess) return e;
  switch (backward_kernel(p)) {
    case Kernel::kHopper: return hopper_backward(p, workspace, stream);
    case Kernel::kMma: return tensor_core_backward(p, workspace, stream);
    default: return simt_backward(p, workspace, stream);
  }
}

size_t kvcache_workspace_bytes(const AttentionParams& p, int splits) {
  return forward_kernel(p) == Kernel::kSplitKv ? split_kv_workspace_bytes(p, splits) : 0;
}

cudaError_t kvcache_forward(const AttentionParams& p, int splits, void* workspace,
                            cudaStream_t stream) {
  if (cudaError_t e = append_to_cache(p, stream); e != cudaSuccess) return e;
  if (p.seqlen_q == 0) return cudaSuccess;  // an append only
  if (forward_kernel(p) == Kernel::kSplitKv) return split_kv_forward(p, splits, workspace, stream);
  return simt_forward(p, stream);
}

}  // namespace flashjax::cuda
