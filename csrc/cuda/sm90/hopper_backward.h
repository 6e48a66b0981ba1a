// Hopper (sm_90a) backward (csrc/cuda/sm90/bwd_*): TMA loads, wgmma, warp
// specialisation. dQ is added to a float32 buffer by bulk reductions, or
// computed by a second kernel when deterministic. Uniform layouts only (for now).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

bool hopper_backward_supports(const AttentionParams& p);
// The bytes of hopper_backward's workspace (HopperBackwardWorkspace).
size_t hopper_backward_workspace_bytes(const AttentionParams& p);
// `workspace`: backward_workspace_bytes(p) bytes (launch.h).
cudaError_t hopper_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
