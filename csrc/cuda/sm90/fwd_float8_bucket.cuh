// The Hopper forward's float8 kernels of one head-dim bucket (fwd_launch_bucket.h's
// Float8BucketLaunch): e4m3 or e5m2 q, k, v (one type), bfloat16 or float16 out,
// uniform layouts without score terms (hopper_forward_supports checks). A translation
// unit of their own per bucket (cmake/cuda.cmake), compiled beside the 16-bit kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "flashjax/params.h"
#include "fwd_launch_bucket.cuh"

namespace flashjax::cuda::hopper_fwd {

template <int kHeadDim>
cudaError_t Float8BucketLaunch<kHeadDim>::run(const AttentionParams& p, void* workspace,
                                              cudaStream_t stream) {
  const auto with_out = [&](auto element) {
    using T = decltype(element);
    return p.dtype == DType::kFloat16
               ? launch_layouts<T, __half, kHeadDim, Layouts::kUniform, TermSet::kNone, false>(
                     p, workspace, stream)
               : launch_layouts<T, __nv_bfloat16, kHeadDim, Layouts::kUniform, TermSet::kNone,
                                false>(p, workspace, stream);
  };
  return p.float8.element == CacheElement::kFloat8E5M2 ? with_out(__nv_fp8_e5m2{})
                                                       : with_out(__nv_fp8_e4m3{});
}

}  // namespace flashjax::cuda::hopper_fwd
