// Tensor-core (mma.sync) backward: which calls it takes and the dispatch of each
// backward stage to a head-dim bucket (tensor_core_backward_bucket.cuh has the kernels
// and a bucket's launches); run_backward_stages adds the stages every backward shares.
#include <cuda_runtime.h>

#include "../common/backward_stages.h"
#include "../common/backward_workspace.h"
#include "../common/device.cuh"
#include "../common/dispatch.h"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "flashjax/params.h"
#include "tensor_core_backward.h"
#include "tensor_core_backward_bucket.h"

namespace flashjax::cuda {

bool tensor_core_backward_supports(const AttentionParams& p) {
  return tensor_core_shapes(p) && compute_capability() >= 80;
}

cudaError_t tensor_core_backward(const AttentionParams& call, void* workspace,
                                 cudaStream_t stream) {
  const BackwardWorkspace ws(call, workspace);
  return run_backward_stages(call, ws, stream, [&](const AttentionParams& p) {
    if (p.has_segments()) {
      if (!ws.segments) return cudaErrorInvalidValue;  // no workspace
      if (cudaError_t e = compute_segment_tiles(p, ws.segments, stream); e != cudaSuccess)
        return e;
    }
    return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
      return sm80_bwd::BucketLaunch<decltype(dim)::value>::run(p, ws, stream);
    });
  });
}

}  // namespace flashjax::cuda
