// Chooses a kernel for each call. Tensor-core kernels declare which calls
// they take; the SIMT path takes the rest, so no valid call is refused.
#include "launch.h"
#include "simt_attention.h"
#include "tensor_core_forward.h"

namespace flashjax::cuda {

cudaError_t forward(const AttentionParams& p, cudaStream_t stream) {
  if (tensor_core_forward_supports(p)) return tensor_core_forward(p, stream);
  return simt_forward(p, stream);
}

size_t backward_workspace_bytes(const AttentionParams& p) {
  return simt_backward_workspace_bytes(p);
}

cudaError_t backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  return simt_backward(p, workspace, stream);
}

}  // namespace flashjax::cuda
