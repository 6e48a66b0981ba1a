// Host entry points of the CUDA kernels. Each picks the fastest compiled
// kernel for the call (tensor-core paths for fp16/bf16, the SIMT path for
// everything else) and launches it on `stream` without synchronising.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

cudaError_t forward(const AttentionParams& p, cudaStream_t stream);

// Bytes of device workspace backward() needs (XLA provides it as scratch).
size_t backward_workspace_bytes(const AttentionParams& p);
cudaError_t backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
