// Platform-independent bodies of the flashjax FFI handlers: validate, fill
// AttentionParams, then call the platform's `run(params)`. The CPU and CUDA
// handler files only bind these to XLA with their own context.
#pragma once

#include "ffi_params.h"

// The library is built with hidden visibility; handler symbols are its API.
#define FLASHJAX_EXPORT_HANDLER(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*)

namespace flashjax::ffi_layer {

// Forward: (q, k, v, sinks) -> (out, lse).
template <class Run>
ffi::Error forward_handler(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                           const ffi::AnyBuffer& v, const ffi::AnyBuffer& sinks,
                           ffi::AnyBuffer out, ffi::AnyBuffer lse, const Options& options,
                           Run&& run) {
  AttentionParams p;
  if (ffi::Error e = fill_forward_inputs(p, q, k, v, sinks, options); e.failure()) return e;
  if (ffi::Error e = expect_output("out", out, q, p); e.failure()) return e;
  if (ffi::Error e = expect_rows("lse", lse, p, p.seqlen_q); e.failure()) return e;
  p.out = out.untyped_data();
  p.lse = static_cast<float*>(lse.untyped_data());
  if (p.batch == 0) return ffi::Error::Success();  // vmap over an empty axis: nothing to do
  return run(p);
}

// Backward: (q, k, v, out, dout, lse, dlse, sinks) -> (dq, dk, dv, dsinks).
template <class Run>
ffi::Error backward_handler(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const ffi::AnyBuffer& out,
                            const ffi::AnyBuffer& dout, const ffi::AnyBuffer& lse,
                            const ffi::AnyBuffer& dlse, const ffi::AnyBuffer& sinks,
                            ffi::AnyBuffer dq, ffi::AnyBuffer dk, ffi::AnyBuffer dv,
                            ffi::AnyBuffer dsinks, const Options& options, bool deterministic,
                            Run&& run) {
  AttentionParams p;
  if (ffi::Error e = fill_forward_inputs(p, q, k, v, sinks, options); e.failure()) return e;
  if (ffi::Error e = expect_output("out", out, q, p); e.failure()) return e;
  if (ffi::Error e = expect_like("dout", dout, out); e.failure()) return e;
  if (ffi::Error e = expect_rows("lse", lse, p, p.seqlen_q); e.failure()) return e;
  if (ffi::Error e = expect_like("dlse", dlse, lse); e.failure()) return e;
  if (ffi::Error e = expect_like("dq", dq, q); e.failure()) return e;
  if (ffi::Error e = expect_like("dk", dk, k); e.failure()) return e;
  if (ffi::Error e = expect_like("dv", dv, v); e.failure()) return e;
  if (ffi::Error e = expect_rows("dsinks", dsinks, p, 0); e.failure()) return e;
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  // The forward's lse is only read here.
  p.lse = static_cast<float*>(lse.untyped_data());
  p.dlse = static_cast<const float*>(dlse.untyped_data());
  p.dq = dq.untyped_data();
  p.dk = dk.untyped_data();
  p.dv = dv.untyped_data();
  p.dsinks = static_cast<float*>(dsinks.untyped_data());
  p.deterministic = deterministic;
  if (p.batch == 0) return ffi::Error::Success();  // (no zero-block kernel launches)
  return run(p);
}

// The XLA binding of the forward's buffers and attributes, after any context.
template <class Binding>
auto bind_forward(Binding binding) {
  return bind_options(std::move(binding).template Arg<ffi::AnyBuffer>()  // q
                          .template Arg<ffi::AnyBuffer>()     // k
                          .template Arg<ffi::AnyBuffer>()     // v
                          .template Arg<ffi::AnyBuffer>()     // sinks
                          .template Ret<ffi::AnyBuffer>()     // out
                          .template Ret<ffi::AnyBuffer>());   // lse
}

template <class Binding>
auto bind_backward(Binding binding) {
  return bind_options(std::move(binding).template Arg<ffi::AnyBuffer>()  // q
                          .template Arg<ffi::AnyBuffer>()     // k
                          .template Arg<ffi::AnyBuffer>()     // v
                          .template Arg<ffi::AnyBuffer>()     // out
                          .template Arg<ffi::AnyBuffer>()     // dout
                          .template Arg<ffi::AnyBuffer>()     // lse
                          .template Arg<ffi::AnyBuffer>()     // dlse
                          .template Arg<ffi::AnyBuffer>()     // sinks
                          .template Ret<ffi::AnyBuffer>()     // dq
                          .template Ret<ffi::AnyBuffer>()     // dk
                          .template Ret<ffi::AnyBuffer>()     // dv
                          .template Ret<ffi::AnyBuffer>())    // dsinks
      .template Attr<bool>("deterministic");
}

}  // namespace flashjax::ffi_layer
