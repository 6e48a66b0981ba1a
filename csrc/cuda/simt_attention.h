// The SIMT kernels: exact for every dtype, head dim and GPU generation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream);

// The workspace (BackwardWorkspace, backward_workspace.h) holds D = rowsum(dO * O) -
// dlse and each row's dsinks share: two float32 per (batch, head, query row).
cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

// The stages around the main backward kernels, used by every backward path.
cudaError_t backward_preprocess(const AttentionParams& p, float* D, cudaStream_t stream);
cudaError_t backward_dsinks(const AttentionParams& p, const float* dsink_rows,
                            cudaStream_t stream);

}  // namespace flashjax::cuda
