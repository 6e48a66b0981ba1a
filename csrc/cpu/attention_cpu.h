// The CPU implementation of flashjax: the same tiled online-softmax algorithm
// as the GPU kernels, in float32 arithmetic, multi-threaded over tiles. Memory
// is O(tile) per thread: no seqlen_q x seqlen_k matrix is ever formed.
#pragma once

#include <cstdint>

#include "flashjax/params.h"

namespace flashjax::cpu {

// Writes p.out and p.lse from p.q, p.k, p.v (and p.sinks when set).
void attention_forward(const AttentionParams& p);

// Writes p.cache.k_new / v_new into the caches p.k / p.v at each sequence's
// rows cache.seqlens.. (rows past the capacity, or in an entry or page outside
// the cache, are skipped). attention_forward then reads the keys from the cache.
void append_to_cache(const AttentionParams& p);

// The KV-cache call's attention (after append_to_cache): split-K over the cache's
// key tiles for decoding (kvcache_decodes: a few query rows per kv head; the only
// path for float8 caches), else attention_forward.
void kvcache_forward(const AttentionParams& p);
bool kvcache_decodes(const AttentionParams& p);
// Packed query rows (group * seqlen_q) the decode path takes; more go to the dense
// forward, whose GEMMs reuse each key tile over up to 256 rows (the decode path's
// score kernel re-reads a tile from L1 per row).
inline constexpr int64_t kKvcacheDecodeMaxRows = 32;

// Writes p.dq, p.dk, p.dv (and p.dsinks when p.sinks is set) from the forward
// inputs, p.out, p.lse, p.dout and p.dlse. Always deterministic.
void attention_backward(const AttentionParams& p);

}  // namespace flashjax::cpu
