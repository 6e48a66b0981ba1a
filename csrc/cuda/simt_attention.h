// The SIMT kernels: exact for every dtype, head dim and GPU generation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream);
size_t simt_backward_workspace_bytes(const AttentionParams& p);
cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
