// The static options and optional inputs of flashjax's FFI targets, listed once
// (X-macros). csrc/ffi/ generates from these lists the attribute structs
// (Options, KvcacheOptions), their XLA FFI decodings, the optional inputs'
// slots, their checks and the AttentionParams fields they fill. The Python side
// of the same table is src/flashjax/_spec.py; tests/test_ffi.py checks that the
// two agree (through FlashjaxOperands(), csrc/ffi/introspection.cc).
//
// Adding an optional input is one X(...) line here (plus the kernels that read
// its AttentionParams field) and one entry in _spec.py.
#pragma once

// X(type, name): a static option, the FFI attribute `name`, copied into the
// AttentionParams field of the same name (every target has these).
#define FLASHJAX_SHARED_OPTIONS(X) \
  X(float, softmax_scale)          \
  X(int64_t, window_left)          \
  X(int64_t, window_right)         \
  X(float, softcap)                \
  X(int64_t, kernel_cap) /* KernelCap */

// The attention targets' options: the shared ones, then their own (the
// handlers read these).
#define FLASHJAX_ATTENTION_OPTIONS(X)                                       \
  FLASHJAX_SHARED_OPTIONS(X)                                                \
  X(int64_t, max_seqlen_q) /* packed targets: slot bound; dense: unused */ \
  X(int64_t, max_seqlen_k)                                                  \
  X(bool, deterministic) /* backward only */                                \
  X(bool, bias_gradient) /* backward with bias: also return dbias */        \
  X(double, dropout_rate) /* in [0, 1); with the dropout input (dropout.h) */

// X(name): a bool attribute saying whether the optional inputs that name it
// as their flag are present.
#define FLASHJAX_ATTENTION_FLAGS(X) \
  X(has_sinks)                      \
  X(has_seqused_q)                  \
  X(has_seqused_k)                  \
  X(has_segment_ids)                \
  X(has_diagonal_offset)            \
  X(has_bias)                       \
  X(has_mask)                       \
  X(has_alibi_slopes)               \
  X(has_dropout)

// X(name, flag, kind, field): an optional input, present when attribute `flag`
// is set; present ones follow the required inputs in this order (no
// placeholders). `kind` is its shape (InputKind, csrc/ffi/ffi_params.h) and
// `field` the AttentionParams member that points at it.
#define FLASHJAX_ATTENTION_INPUTS(X)                                   \
  X(sinks, has_sinks, kPerHead, sinks)                                 \
  X(seqused_q, has_seqused_q, kPerSequence, seqused_q)                 \
  X(seqused_k, has_seqused_k, kPerSequence, seqused_k)                 \
  X(q_segment_ids, has_segment_ids, kQueryRows, q_segment_ids)         \
  X(kv_segment_ids, has_segment_ids, kKeyRows, kv_segment_ids)         \
  X(diagonal_offset, has_diagonal_offset, kPerSequence, diagonal_offset) \
  X(bias, has_bias, kScores, bias)                                     \
  X(mask, has_mask, kScoreMask, mask)                                  \
  X(alibi_slopes, has_alibi_slopes, kPerHead, alibi_slopes)           \
  X(dropout, has_dropout, kDropout, dropout.words)

// The KV-cache target (flash_attention_with_kvcache).
#define FLASHJAX_KVCACHE_OPTIONS(X) \
  FLASHJAX_SHARED_OPTIONS(X)        \
  X(int64_t, num_splits) /* >= 1 (Python resolves 0, automatic) */

#define FLASHJAX_KVCACHE_FLAGS(X) \
  X(has_leftpad)                  \
  X(has_batch_idx)                \
  X(has_page_table)               \
  X(has_sinks)                    \
  X(has_descales)

#define FLASHJAX_KVCACHE_INPUTS(X)                                    \
  X(cache_leftpad, has_leftpad, kPerSequence, cache.leftpad)          \
  X(cache_batch_idx, has_batch_idx, kPerSequence, cache.batch_idx)    \
  X(page_table, has_page_table, kPageTable, cache.page_table)         \
  X(sinks, has_sinks, kPerHead, sinks)                                \
  /* float8 caches (params.h KvCache): float32 (sequences, heads_kv) */ \
  X(k_descale, has_descales, kPerKvHead, cache.k_descale)             \
  X(v_descale, has_descales, kPerKvHead, cache.v_descale)
