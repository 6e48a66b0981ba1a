// Forward kernel on the tensor cores (mma.sync m16n8k16, fp16/bf16 inputs,
// float32 accumulation): FlashAttention-2 style tiling with cp.async loads. Score
// terms (bias, mask, ALiBi, dropout) run kernels compiled with them (with_variant, common/sequence_layout.h).
#pragma once

#include <cuda_runtime.h>

#include "flashjax/params.h"

namespace flashjax::cuda {

// True when a compiled tensor-core kernel handles this call on this GPU.
bool tensor_core_forward_supports(const AttentionParams& p);
// `workspace`: forward_workspace_bytes(p) bytes (launch.h).
cudaError_t tensor_core_forward(const AttentionParams& p, void* workspace, cudaStream_t stream);

}  // namespace flashjax::cuda
