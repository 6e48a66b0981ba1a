// XLA FFI handlers for platform "cpu": the C++ CPU implementation.
#include "cpu/attention_cpu.h"
#include "handlers.h"

namespace ffi = xla::ffi;
using flashjax::AttentionParams;
using flashjax::ffi_layer::Options;

namespace {

ffi::Error run_forward(const AttentionParams& p) {
  flashjax::cpu::attention_forward(p);
  return ffi::Error::Success();
}

ffi::Error run_backward(const AttentionParams& p) {
  flashjax::cpu::attention_backward(p);
  return ffi::Error::Success();
}

ffi::Error forward_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, float softmax_scale, int64_t window_left,
                       int64_t window_right, float softcap, bool has_sinks) {
  const Options options{softmax_scale, window_left, window_right, softcap, has_sinks};
  return flashjax::ffi_layer::forward_handler(q, k, v, sinks, *out, *lse, options, run_forward);
}

ffi::Error backward_cpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                        ffi::AnyBuffer dlse, ffi::AnyBuffer sinks,
                        ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                        ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dsinks,
                        float softmax_scale, int64_t window_left, int64_t window_right,
                        float softcap, bool has_sinks, bool deterministic) {
  const Options options{softmax_scale, window_left, window_right, softcap, has_sinks};
  return flashjax::ffi_layer::backward_handler(q, k, v, out, dout, lse, dlse, sinks, *dq, *dk,
                                               *dv, *dsinks, options, deterministic,
                                               run_backward);
}

}  // namespace

FLASHJAX_EXPORT_HANDLER(FlashjaxForwardCpu);
FLASHJAX_EXPORT_HANDLER(FlashjaxBackwardCpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashjaxForwardCpu, forward_cpu,
                              flashjax::ffi_layer::bind_forward(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashjaxBackwardCpu, backward_cpu,
                              flashjax::ffi_layer::bind_backward(ffi::Ffi::Bind()));
