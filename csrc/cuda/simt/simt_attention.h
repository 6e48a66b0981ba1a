// The SIMT kernels: exact for every dtype, head dim and GPU generation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "backward_workspace.h"
#include "flashjax/params.h"

namespace flashjax::cuda {

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream);

// The workspace (BackwardWorkspace, backward_workspace.h) holds D = rowsum(dO * O) -
// dlse and each row's dsinks share, laid out like lse.
cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

// The stages around the main backward kernels, used by every backward path:
// D of every used row (laid out like lse; also zeroes ws.nonfinite), and
// dsinks from the used rows' shares (laid out like lse).
cudaError_t backward_preprocess(const AttentionParams& p, const BackwardWorkspace& ws,
                                cudaStream_t stream);
// After a tensor-core backward: the gradient rows holding NaN or inf again,
// pair by pair, if one was flagged in ws.nonfinite (exact_rows.cuh says why).
cudaError_t recompute_nonfinite_gradients(const AttentionParams& p, const BackwardWorkspace& ws,
                                          cudaStream_t stream);
cudaError_t backward_dsinks(const AttentionParams& p, const TensorRef& dsink_rows,
                            cudaStream_t stream);

}  // namespace flashjax::cuda
