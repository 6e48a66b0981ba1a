// Turns XLA FFI buffers and attributes into flashjax::AttentionParams, checking
// every shape and dtype so that a bad call becomes an FFI error, never a crash.
// Shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <optional>

#include "flashjax/params.h"
#include "xla/ffi/api/ffi.h"

namespace flashjax::ffi_layer {

namespace ffi = xla::ffi;

// Every target's attributes, decoded as one struct (Python passes them all;
// causal is folded into window_right = 0). has_* say which optional inputs
// follow the required ones, in the order of OptionalInputs.
struct Options {
  float softmax_scale;
  int64_t window_left;
  int64_t window_right;
  float softcap;
  int64_t max_seqlen_q;  // packed targets: slot bound; dense: unused (0)
  int64_t max_seqlen_k;
  bool has_sinks;
  bool has_seqused_q;
  bool has_seqused_k;
  bool has_segment_ids;
  bool has_diagonal_offset;
  bool deterministic;    // backward only
  int64_t kernel_cap;    // KernelCap
};

// Attributes of the KV-cache target (flash_attention_with_kvcache). has_* say
// which optional inputs follow the required ones, in the order of
// KvcacheOptionalInputs.
struct KvcacheOptions {
  float softmax_scale;
  int64_t window_left;
  int64_t window_right;
  float softcap;
  int64_t num_splits;  // >= 1 (Python resolves 0, automatic)
  int64_t kernel_cap;  // KernelCap
  bool has_leftpad;
  bool has_batch_idx;
  bool has_page_table;
  bool has_sinks;
};

// The KV-cache target's required inputs. k_cache / v_cache are the buffers the
// kernels use: the (aliased) cache outputs when new rows are appended.
struct KvcacheInputs {
  ffi::AnyBuffer q, k_cache, v_cache, k_new, v_new, cache_seqlens;
  void* k_cache_data;
  void* v_cache_data;
};
// Fills p for a cache call: shapes, semantics, q, the caches and their
// metadata, the new rows and the optional inputs (leftpad, batch_idx,
// page_table, sinks, present ones in that order).
ffi::Error fill_kvcache_inputs(AttentionParams& p, const KvcacheInputs& in,
                               const ffi::RemainingArgs& rest, const KvcacheOptions& options);

// The optional inputs a call passes after its required ones, present ones
// only, in this order (no placeholder arrays).
struct OptionalInputs {
  std::optional<ffi::AnyBuffer> sinks, seqused_q, seqused_k, q_segment_ids, kv_segment_ids,
      diagonal_offset;
};
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
// Checks and sets sinks, seqused, segment ids and the diagonal offset (after
// fill_*_inputs).
ffi::Error fill_optional_inputs(AttentionParams& p, const OptionalInputs& inputs);

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

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    flashjax::ffi_layer::Options, ::xla::ffi::StructMember<float>("softmax_scale"),
    ::xla::ffi::StructMember<int64_t>("window_left"),
    ::xla::ffi::StructMember<int64_t>("window_right"),
    ::xla::ffi::StructMember<float>("softcap"),
    ::xla::ffi::StructMember<int64_t>("max_seqlen_q"),
    ::xla::ffi::StructMember<int64_t>("max_seqlen_k"),
    ::xla::ffi::StructMember<bool>("has_sinks"), ::xla::ffi::StructMember<bool>("has_seqused_q"),
    ::xla::ffi::StructMember<bool>("has_seqused_k"),
    ::xla::ffi::StructMember<bool>("has_segment_ids"),
    ::xla::ffi::StructMember<bool>("has_diagonal_offset"),
    ::xla::ffi::StructMember<bool>("deterministic"),
    ::xla::ffi::StructMember<int64_t>("kernel_cap"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    flashjax::ffi_layer::KvcacheOptions, ::xla::ffi::StructMember<float>("softmax_scale"),
    ::xla::ffi::StructMember<int64_t>("window_left"),
    ::xla::ffi::StructMember<int64_t>("window_right"),
    ::xla::ffi::StructMember<float>("softcap"), ::xla::ffi::StructMember<int64_t>("num_splits"),
    ::xla::ffi::StructMember<int64_t>("kernel_cap"),
    ::xla::ffi::StructMember<bool>("has_leftpad"), ::xla::ffi::StructMember<bool>("has_batch_idx"),
    ::xla::ffi::StructMember<bool>("has_page_table"),
    ::xla::ffi::StructMember<bool>("has_sinks"));
