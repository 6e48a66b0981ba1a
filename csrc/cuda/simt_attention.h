// The SIMT kernels: exact for every dtype, head dim and GPU generation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream);

// The workspace (BackwardWorkspace, backward_workspace.h) holds D = rowsum(dO * O) -
// dlse and each row's dsinks share, laid out like lse.
cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

// The stages around the main backward kernels, used by every backward path:
// D of every used row, and dsinks from the used rows' shares (both laid out
// like lse).
cudaError_t backward_preprocess(const AttentionParams& p, const TensorRef& D,
                                cudaStream_t stream);
cudaError_t backward_dsinks(const AttentionParams& p, const TensorRef& dsink_rows,
                            cudaStream_t stream);

}  // namespace flashjax::cuda
