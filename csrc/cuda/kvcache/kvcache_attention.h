// Attention over a KV cache (flash_attention_with_kvcache): the append of the
// new rows into the cache, and split-KV decoding. A CTA takes 16 packed query
// rows (8 over a float8 cache; every query row of the group's heads of one kv
// head, GQA-packed) and one split of the sequence's keys; the four warps take
// 16 keys each of a 64-key tile, merge their softmax states at the end, and
// write either the final rows or float32 partials (out, lse) that a combine
// kernel merges.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "flashjax/params.h"

namespace flashjax::cuda {

// Writes p.cache.k_new / v_new into the caches p.k / p.v (rows past the
// capacity, or in an entry or page outside the cache, are skipped).
cudaError_t append_to_cache(const AttentionParams& p, cudaStream_t stream);

// Can the split-KV kernel run p (fp16/bf16, a tensor-core head-dim bucket, sm_80+)?
bool split_kv_supports(const AttentionParams& p);
// float32 partial outputs and lse of `splits` splits (0 for one split).
size_t split_kv_workspace_bytes(const AttentionParams& p, int splits);
// out and lse of a cache call (p.cache active), its keys split `splits` ways.
cudaError_t split_kv_forward(const AttentionParams& p, int splits, void* workspace,
                             cudaStream_t stream);

}  // namespace flashjax::cuda
