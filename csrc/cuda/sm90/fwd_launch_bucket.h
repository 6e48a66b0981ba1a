// The Hopper forward's launches of one head-dim bucket: defined in
// fwd_launch_bucket.cuh and instantiated once per compiled bucket, each in a
// translation unit of its own (cmake/cuda.cmake generates them from
// launch_bucket.cu.in), so that the buckets compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "flashjax/params.h"

namespace flashjax::cuda::hopper_fwd {

template <int kHeadDim>
struct BucketLaunch {
  // `workspace`: hopper_forward_workspace_bytes(p) bytes (ForwardWorkspace).
  static cudaError_t run(const AttentionParams& p, void* workspace, cudaStream_t stream);
};

// The float8 kernels (fwd_float8_bucket.cuh; units of their own, beside the 16-bit
// ones) of the head dims that have one (the bucket is the head dim: 128-byte rows of
// Q, K and V^T tiles, and an 8-bit wgmma of N = head dim for P V^T).
template <int kHeadDim>
struct Float8BucketLaunch {
  static cudaError_t run(const AttentionParams& p, void* workspace, cudaStream_t stream);
};

}  // namespace flashjax::cuda::hopper_fwd
