// Turns XLA FFI buffers and attributes into flashjax::AttentionParams, checking
// every shape and dtype so that a bad call becomes an FFI error, never a crash.
// Shared by the CPU and CUDA handlers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "flashjax/params.h"
#include "xla/ffi/api/ffi.h"

namespace flashjax::ffi_layer {

namespace ffi = xla::ffi;

// Attributes common to forward and backward (Python folds causal into
// window_right = 0).
struct Options {
  float softmax_scale;
  int64_t window_left;
  int64_t window_right;
  float softcap;
  bool has_sinks;
};

// Bind() fragment declaring the attributes of Options, in order.
template <class Binding>
auto bind_options(Binding binding) {
  return std::move(binding).template Attr<float>("softmax_scale")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<bool>("has_sinks");
}

// Fills the shape/semantics part of `p` and its forward input pointers.
ffi::Error fill_forward_inputs(AttentionParams& p, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::AnyBuffer& sinks, const Options& options);

// Checks that `buffer` has the element type and dimensions of `like`.
ffi::Error expect_like(const char* name, const ffi::AnyBuffer& buffer,
                       const ffi::AnyBuffer& like);

// Checks a float32 per-row buffer: [batch.., heads_q] when rows_per_head == 0
// (sinks), else [batch.., heads_q, rows_per_head] (lse).
ffi::Error expect_rows(const char* name, const ffi::AnyBuffer& buffer, const AttentionParams& p,
                       int64_t rows_per_head);

// Checks the forward output shape: q's with head_dim replaced by head_dim_v.
ffi::Error expect_output(const char* name, const ffi::AnyBuffer& buffer,
                         const ffi::AnyBuffer& q, const AttentionParams& p);

}  // namespace flashjax::ffi_layer
