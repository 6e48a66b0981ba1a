// Backward on the tensor cores (mma.sync m16n8k16, sm_80+), deterministic (a shared
// dbias entry is added atomically, except in deterministic mode, where the exact pass
// sums it). Score terms (bias, mask, ALiBi, dropout, dbias) run kernels
// compiled with them (with_variant, common/sequence_layout.h).
#pragma once

#include <cuda_runtime.h>

#include "flashjax/params.h"

namespace flashjax::cuda {

bool tensor_core_backward_supports(const AttentionParams& p);
// `workspace`: backward_workspace_bytes(p) bytes (launch.h).
cudaError_t tensor_core_backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
