// Tensor-core (mma.sync) forward: which calls it takes and the dispatch to a head-dim
// bucket (tensor_core_forward_bucket.cuh has the kernels and a bucket's launches).
#include <cuda_runtime.h>

#include "../common/device.cuh"
#include "../common/dispatch.h"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "flashjax/params.h"
#include "tensor_core_forward.h"
#include "tensor_core_forward_bucket.h"

namespace flashjax::cuda {

bool tensor_core_forward_supports(const AttentionParams& p) {
  return tensor_core_shapes(p) && compute_capability() >= 80;
}

cudaError_t tensor_core_forward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const SegmentTiles segment_tiles(p, workspace);
  if (p.has_segments()) {
    if (!segment_tiles) return cudaErrorInvalidValue;  // no workspace
    if (cudaError_t e = compute_segment_tiles(p, segment_tiles, stream); e != cudaSuccess) return e;
  }
  return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
    return sm80_fwd::BucketLaunch<decltype(dim)::value>::run(p, segment_tiles, stream);
  });
}

}  // namespace flashjax::cuda
