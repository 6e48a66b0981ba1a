// The Hopper backward's launches of one head-dim bucket: defined in
// bwd_launch_bucket.cuh and instantiated once per compiled bucket, each in a
// translation unit of its own (cmake/cuda.cmake generates them from
// launch_bucket.cu.in), so that the buckets compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "bwd_workspace.h"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_bwd {

template <int kHeadDim>
struct BucketLaunch {
  // p: one backward stage's call (run_backward_stages); ws: the call's workspace.
  static cudaError_t run(const AttentionParams& p, const HopperBackwardWorkspace& ws,
                         cudaStream_t stream);
};

}  // namespace flashjax::cuda::hopper_bwd
