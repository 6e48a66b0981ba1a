// Hopper (sm_90a) backward: TMA loads, wgmma, warp specialisation; deterministic.
#pragma once

#include <cuda_runtime.h>

#include "flashjax/params.h"

namespace flashjax::cuda {

bool hopper_backward_supports(const AttentionParams& p);
// `workspace`: backward_workspace_bytes(p) bytes (launch.h).
cudaError_t hopper_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
