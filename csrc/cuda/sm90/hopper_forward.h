// Hopper (sm_90a) forward kernel: TMA loads, wgmma, warp specialisation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

// True when the build has sm_90a kernels for this call and the GPU is Hopper.
bool hopper_forward_supports(const AttentionParams& p);
// The device workspace hopper_forward needs (0 for uniform layouts).
size_t hopper_forward_workspace_bytes(const AttentionParams& p);
// `workspace`: hopper_forward_workspace_bytes(p) bytes, 8-byte aligned.
cudaError_t hopper_forward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
