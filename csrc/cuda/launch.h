// Host entry points of the CUDA kernels. Each picks the fastest compiled
// kernel for the call (tensor-core paths for fp16/bf16, the SIMT path for
// everything else) and launches it on `stream` without synchronising.
// Workspaces are device memory of the sizes asked (XLA provides them as
// scratch); a size of 0 means the pointer may be null.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

// The kernel a call runs on the current device: the one place that chooses.
enum class Kernel { kHopper, kMma, kSplitKv, kSimt };
Kernel forward_kernel(const AttentionParams& p);  // (KV-cache calls: split-KV or SIMT)
Kernel backward_kernel(const AttentionParams& p);
const char* kernel_name(Kernel kernel);

size_t forward_workspace_bytes(const AttentionParams& p);
cudaError_t forward(const AttentionParams& p, void* workspace, cudaStream_t stream);

size_t backward_workspace_bytes(const AttentionParams& p);
cudaError_t backward(const AttentionParams& p, void* workspace, cudaStream_t stream);

// A KV-cache call (p.cache active): appends the new rows to the cache, then
// writes out and lse, the keys split `splits` ways on the split-KV kernel
// (fp16/bf16), or on the SIMT path.
size_t kvcache_workspace_bytes(const AttentionParams& p, int splits);
cudaError_t kvcache_forward(const AttentionParams& p, int splits, void* workspace,
                            cudaStream_t stream);

}  // namespace flashjax::cuda
