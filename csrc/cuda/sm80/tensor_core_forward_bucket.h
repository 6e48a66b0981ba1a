// The tensor-core (mma.sync) forward's launches of one head-dim bucket: defined in
// tensor_core_forward_bucket.cuh, instantiated per compiled bucket in a unit of its own
// (cmake/cuda.cmake generates them from launch_bucket.cu.in) so that the buckets
// compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "../common/segments.cuh"
#include "flashjax/params.h"

namespace flashjax::cuda::sm80_fwd {

template <int kHeadDim>
struct BucketLaunch {
  // segment_tiles: the call's (filled), or empty without segment ids.
  static cudaError_t run(const AttentionParams& p, const SegmentTiles& segment_tiles,
                         cudaStream_t stream);
};

}  // namespace flashjax::cuda::sm80_fwd
