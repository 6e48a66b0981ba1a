// The SIMT kernels: exact for every dtype, head dim and GPU generation.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../common/backward_stages.h"
#include "../common/backward_workspace.h"
#include "flashjax/params.h"

namespace flashjax::cuda {

cudaError_t simt_forward(const AttentionParams& p, cudaStream_t stream);

// The workspace (BackwardWorkspace, backward_workspace.h) holds D = rowsum(dO * O) -
// dlse and each row's dsinks share, laid out like lse.
cudaError_t simt_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

// (The stages around every backward path, defined with the SIMT kernels, the dbias
// pass simt_bias_gradient among them: backward_stages.h.)

}  // namespace flashjax::cuda
