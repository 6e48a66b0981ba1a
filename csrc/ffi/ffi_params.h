// Turns XLA FFI buffers and attributes into flashjax::AttentionParams, checking
// every shape and dtype so that a bad call becomes an FFI error, never a crash.
// Shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "flashjax/operands.h"
#include "flashjax/params.h"
#include "xla/ffi/api/ffi.h"

namespace flashjax::ffi_layer {

namespace ffi = xla::ffi;

// The attribute structs of the targets, generated from the lists in
// flashjax/operands.h: a member per static option and per has_* flag (Python
// passes them all; causal is folded into window_right = 0).
#define FLASHJAX_OPTION_MEMBER(type, name) type name;
#define FLASHJAX_FLAG_MEMBER(name) bool name;
struct Options {
  FLASHJAX_ATTENTION_OPTIONS(FLASHJAX_OPTION_MEMBER)
  FLASHJAX_ATTENTION_FLAGS(FLASHJAX_FLAG_MEMBER)
};
struct KvcacheOptions {
  FLASHJAX_KVCACHE_OPTIONS(FLASHJAX_OPTION_MEMBER)
  FLASHJAX_KVCACHE_FLAGS(FLASHJAX_FLAG_MEMBER)
};

// The shapes of optional inputs (the `kind` of the operands.h lists).
enum class InputKind {
  kPerHead,       // float32 [batch.., heads_q] (sinks: one row per sequence)
  kPerKvHead,     // float32 [batch, heads_kv] (a float8 cache's descales)
  kPerSequence,   // int32 [batch..]
  kQueryRows,     // int32 [batch.., seqlen_q] (dense layout only)
  kKeyRows,       // int32 [batch.., seqlen_k] (dense layout only)
  kPageTable,     // int32 [batch, max_pages >= 1]
  kScores,        // float32 [batch.. | 1, heads_q | heads_kv | 1, seqlen_q, seqlen_k] (bias)
  kScoreMask,     // bool, the same shapes (mask); dense layout only, like kScores
  kDropout,       // uint32 [batch.., heads_q, 4] (params.h Dropout::words)
};

// A slot per optional input of a target, filled when present.
#define FLASHJAX_INPUT_SLOT(name, flag, kind, field) std::optional<ffi::AnyBuffer> name;
struct OptionalInputs {
  FLASHJAX_ATTENTION_INPUTS(FLASHJAX_INPUT_SLOT)
};
struct KvcacheOptionalInputs {
  FLASHJAX_KVCACHE_INPUTS(FLASHJAX_INPUT_SLOT)
};

// The KV-cache target's required inputs. k_cache / v_cache are the buffers the
// kernels use: the (aliased) cache outputs when new rows are appended.
struct KvcacheInputs {
  ffi::AnyBuffer q, k_cache, v_cache, k_new, v_new, cache_seqlens;
  void* k_cache_data;
  void* v_cache_data;
};
// Fills p for a cache call: shapes, semantics, q, the caches and their
// metadata, the new rows and the optional inputs (FLASHJAX_KVCACHE_INPUTS).
ffi::Error fill_kvcache_inputs(AttentionParams& p, const KvcacheInputs& in,
                               const ffi::RemainingArgs& rest, const KvcacheOptions& options);

// Takes the optional inputs the attributes announce (present ones only, in
// the order of FLASHJAX_ATTENTION_INPUTS, no placeholder arrays).
ffi::Error take_optional_inputs(const ffi::RemainingArgs& rest, const Options& options,
                                OptionalInputs& inputs);

// Fills shapes, semantics and q/k/v of a dense call: (batch.., seqlen, heads, dim).
ffi::Error fill_dense_inputs(AttentionParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                             const ffi::AnyBuffer& v, const Options& options);
// The same for a packed call: (total, heads, dim) and cu_seqlens (num_seqs + 1,).
ffi::Error fill_packed_inputs(AttentionParams& p, const ffi::AnyBuffer& q,
                              const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& cu_seqlens_q,
                              const ffi::AnyBuffer& cu_seqlens_k, const Options& options);
// Checks each present optional input and points its AttentionParams field at
// it (after fill_*_inputs).
ffi::Error fill_optional_inputs(AttentionParams& p, const OptionalInputs& inputs);

// The float8 forward (Float8Inputs): before fill_*_inputs, q's float8 type and out's
// dtype (p.dtype); after, V^T and the descales (score_descale, v_descale), checked
// against the call's shapes.
ffi::Error start_float8(AttentionParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& out);
ffi::Error fill_float8_inputs(AttentionParams& p, const ffi::AnyBuffer& q,
                              const ffi::AnyBuffer& vt,
                              std::initializer_list<const ffi::AnyBuffer*> descales);

// A ScoreArray view of a checked kScores / kScoreMask buffer (or of dbias, shaped
// like its bias).
ScoreArray score_array(const AttentionParams& p, const ffi::AnyBuffer& buffer);

// Checks dbias: float32 and shaped like the call's bias.
ffi::Error expect_dbias(const ffi::AnyBuffer& buffer, const AttentionParams& p);

// Per-layout views of a buffer shaped like q/k (query_side) with `heads` and
// `dim`, and of an lse-like per-row float32 array.
TensorRef row_tensor(const AttentionParams& p, void* data, bool query_side, int64_t heads,
                     int64_t dim);
TensorRef row_stats(const AttentionParams& p, void* data);

// Checks that `buffer` has the element type and dimensions of `like`.
ffi::Error expect_like(const char* name, const ffi::AnyBuffer& buffer,
                       const ffi::AnyBuffer& like);
// Checks the forward output shape: q's with head_dim replaced by head_dim_v.
ffi::Error expect_output(const char* name, const ffi::AnyBuffer& buffer,
                         const ffi::AnyBuffer& q, const AttentionParams& p);
// Checks an lse-like float32 array: [batch.., heads_q, seqlen_q], or packed [heads_q, total_q].
ffi::Error expect_row_stats(const char* name, const ffi::AnyBuffer& buffer,
                            const AttentionParams& p);
// Checks a float32 [batch.., heads_q] array (sinks, dsinks).
ffi::Error expect_per_head(const char* name, const ffi::AnyBuffer& buffer,
                           const AttentionParams& p);

}  // namespace flashjax::ffi_layer

// The XLA FFI decodings of the attribute structs, by member name, from the same
// lists (FLASHJAX_APPLY expands the generated member list before the XLA macro
// splits its arguments).
#define FLASHJAX_APPLY(macro, ...) macro(__VA_ARGS__)
#define FLASHJAX_DECODE_OPTION(type, name) , ::xla::ffi::StructMember<type>(#name)
#define FLASHJAX_DECODE_FLAG(name) , ::xla::ffi::StructMember<bool>(#name)
FLASHJAX_APPLY(XLA_FFI_REGISTER_STRUCT_ATTR_DECODING,
               flashjax::ffi_layer::Options FLASHJAX_ATTENTION_OPTIONS(FLASHJAX_DECODE_OPTION)
                   FLASHJAX_ATTENTION_FLAGS(FLASHJAX_DECODE_FLAG));
FLASHJAX_APPLY(XLA_FFI_REGISTER_STRUCT_ATTR_DECODING,
               flashjax::ffi_layer::KvcacheOptions FLASHJAX_KVCACHE_OPTIONS(FLASHJAX_DECODE_OPTION)
                   FLASHJAX_KVCACHE_FLAGS(FLASHJAX_DECODE_FLAG));
