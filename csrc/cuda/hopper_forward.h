// Hopper (sm_90a) forward kernel: TMA loads, wgmma, warp specialisation.
#pragma once

#include <cuda_runtime.h>

#include "flashjax/params.h"

namespace flashjax::cuda {

// True when the build has sm_90a kernels for this call and the GPU is Hopper.
bool hopper_forward_supports(const AttentionParams& p);
cudaError_t hopper_forward(const AttentionParams& p, cudaStream_t stream);

}  // namespace flashjax::cuda
