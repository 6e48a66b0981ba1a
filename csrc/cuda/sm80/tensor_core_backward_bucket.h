// The tensor-core (mma.sync) backward's launches of one head-dim bucket: defined in
// tensor_core_backward_bucket.cuh, instantiated per compiled bucket in a unit of its own
// (cmake/cuda.cmake generates them from launch_bucket.cu.in) so that the buckets
// compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "../common/backward_workspace.h"
#include "flashjax/params.h"

namespace flashjax::cuda::sm80_bwd {

template <int kHeadDim>
struct BucketLaunch {
  // p: one backward stage's call (run_backward_stages); ws: the call's workspace.
  static cudaError_t run(const AttentionParams& p, const BackwardWorkspace& ws,
                         cudaStream_t stream);
};

}  // namespace flashjax::cuda::sm80_bwd
