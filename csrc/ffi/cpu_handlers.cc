// XLA FFI handlers for platform "cpu": the C++ CPU implementation.
#include <string>

#include "cpu/attention_cpu.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

struct CpuPlatform {
  static ffi::Error forward(const flashjax::AttentionParams& p) {
    if (p.float8.active())
      return ffi::Error::InvalidArgument(
          "flashjax: float8 q, k, v run on the Hopper kernel only (flash_attention dequantises "
          "them on every other path)");
    flashjax::cpu::attention_forward(p);
    return ffi::Error::Success();
  }
  static ffi::Error backward(const flashjax::AttentionParams& p) {
    flashjax::cpu::attention_backward(p);
    return ffi::Error::Success();
  }
  static ffi::Error kvcache(const flashjax::AttentionParams& p, int, void*, size_t) {
    if (p.cache.float8() && !flashjax::cpu::kvcache_decodes(p))
      return ffi::Error::InvalidArgument(
          "flashjax: the CPU KV-cache kernel reads float8 caches for decoding blocks only "
          "(at most " + std::to_string(flashjax::cpu::kKvcacheDecodeMaxRows) +
          " query rows per kv head; flash_attention_with_kvcache dequantises the others in "
          "JAX)");
    if (p.cache.new_rows > 0) flashjax::cpu::append_to_cache(p);
    flashjax::cpu::kvcache_forward(p);
    return ffi::Error::Success();
  }
};

using CpuHandlers = flashjax::ffi_layer::Handlers<CpuPlatform>;
using CpuKvcacheHandler = flashjax::ffi_layer::KvcacheHandler<CpuPlatform>;

}  // namespace

FLASHJAX_DEFINE_HANDLERS(CpuHandlers, ffi::Ffi::Bind(), FlashjaxForwardCpu, FlashjaxBackwardCpu,
                         FlashjaxVarlenForwardCpu, FlashjaxVarlenBackwardCpu,
                         FlashjaxFloat8ForwardCpu);
FLASHJAX_DEFINE_KVCACHE_HANDLER(CpuKvcacheHandler, ffi::Ffi::Bind(), FlashjaxKvcacheCpu);
