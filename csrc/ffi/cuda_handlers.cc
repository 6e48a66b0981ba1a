// XLA FFI handlers for platform "CUDA": validate like the CPU handlers, then
// launch on the stream XLA gives. Launch errors become FFI errors.
#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "cuda/launch.h"
#include "handlers.h"

namespace ffi = xla::ffi;
using flashjax::AttentionParams;
using flashjax::ffi_layer::Options;

namespace {

ffi::Error to_ffi_error(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("flashjax: ") + what + " failed: " +
                              cudaGetErrorString(status));
}

ffi::Error forward_cuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, float softmax_scale,
                        int64_t window_left, int64_t window_right, float softcap,
                        bool has_sinks) {
  const Options options{softmax_scale, window_left, window_right, softcap, has_sinks};
  return flashjax::ffi_layer::forward_handler(
      q, k, v, sinks, *out, *lse, options, [&](const AttentionParams& p) {
        return to_ffi_error(flashjax::cuda::forward(p, stream), "forward kernel launch");
      });
}

ffi::Error backward_cuda(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                         ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                         ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                         ffi::AnyBuffer sinks, ffi::Result<ffi::AnyBuffer> dq,
                         ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                         ffi::Result<ffi::AnyBuffer> dsinks, float softmax_scale,
                         int64_t window_left, int64_t window_right, float softcap,
                         bool has_sinks, bool deterministic) {
  const Options options{softmax_scale, window_left, window_right, softcap, has_sinks};
  return flashjax::ffi_layer::backward_handler(
      q, k, v, out, dout, lse, dlse, sinks, *dq, *dk, *dv, *dsinks, options, deterministic,
      [&](const AttentionParams& p) {
        std::optional<void*> workspace =
            scratch.Allocate(flashjax::cuda::backward_workspace_bytes(p));
        if (!workspace.has_value())
          return ffi::Error::Internal("flashjax: could not allocate backward workspace");
        return to_ffi_error(flashjax::cuda::backward(p, *workspace, stream),
                            "backward kernel launch");
      });
}

}  // namespace

FLASHJAX_EXPORT_HANDLER(FlashjaxForwardCuda);
FLASHJAX_EXPORT_HANDLER(FlashjaxBackwardCuda);
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashjaxForwardCuda, forward_cuda,
    flashjax::ffi_layer::bind_forward(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashjaxBackwardCuda, backward_cuda,
    flashjax::ffi_layer::bind_backward(ffi::Ffi::Bind()
                                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                           .Ctx<ffi::ScratchAllocator>()));
