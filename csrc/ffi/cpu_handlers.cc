// XLA FFI handlers for platform "cpu": the C++ CPU implementation.
#include "cpu/attention_cpu.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

struct CpuPlatform {
  static ffi::Error forward(const flashjax::AttentionParams& p) {
    flashjax::cpu::attention_forward(p);
    return ffi::Error::Success();
  }
  static ffi::Error backward(const flashjax::AttentionParams& p) {
    flashjax::cpu::attention_backward(p);
    return ffi::Error::Success();
  }
};

using CpuHandlers = flashjax::ffi_layer::Handlers<CpuPlatform>;

}  // namespace

FLASHJAX_DEFINE_HANDLERS(CpuHandlers, ffi::Ffi::Bind(), FlashjaxForwardCpu, FlashjaxBackwardCpu,
                         FlashjaxVarlenForwardCpu, FlashjaxVarlenBackwardCpu);
