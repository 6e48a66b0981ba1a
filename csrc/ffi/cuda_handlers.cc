// XLA FFI handlers for platform "CUDA": validate like the CPU handlers, then
// launch on the stream XLA gives, with workspace from XLA's scratch
// allocator. Launch errors become FFI errors.
#include <cuda_runtime.h>

#include <optional>
#include <string>

#include "cuda/launch.h"
#include "handlers.h"

namespace ffi = xla::ffi;
using flashjax::AttentionParams;

namespace {

ffi::Error to_ffi_error(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("flashjax: ") + what + " failed: " +
                              cudaGetErrorString(status));
}

// Makes XLA's device for this call current: the kernel choice (its compute
// capability) and kernel attributes are per device, and one process may drive
// several GPUs of different kinds. (XLA's device ordinal, not a query of the
// stream: the KV-cache call runs inside CUDA graph capture.)
ffi::Error use_device(int32_t device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return ffi::Error::Success();
  return to_ffi_error(cudaSetDevice(device), "selecting the call's device");
}

// Workspace of `bytes` from XLA (null when none is needed).
std::optional<void*> workspace(ffi::ScratchAllocator& scratch, size_t bytes) {
  if (bytes == 0) return static_cast<void*>(nullptr);
  return scratch.Allocate(bytes);
}

struct CudaPlatform {
  static ffi::Error forward(int32_t device, cudaStream_t stream,
                            ffi::ScratchAllocator& scratch, const AttentionParams& p) {
    if (ffi::Error e = use_device(device); e.failure()) return e;
    if (p.float8.active() && flashjax::cuda::forward_kernel(p) != flashjax::cuda::Kernel::kHopper)
      return ffi::Error::InvalidArgument(
          "flashjax: float8 q, k, v need the Hopper kernel: an sm_90 GPU, float8_e4m3fn or "
          "float8_e5m2, bfloat16 or float16 out, head dims 128 or 256 (equal, compiled), "
          "dense layouts without segment ids, positions, bias, mask, ALiBi or dropout");
    std::optional<void*> ws = workspace(scratch, flashjax::cuda::forward_workspace_bytes(p));
    if (!ws) return ffi::Error::Internal("flashjax: could not allocate forward workspace");
    return to_ffi_error(flashjax::cuda::forward(p, *ws, stream), "forward kernel launch");
  }
  static ffi::Error backward(int32_t device, cudaStream_t stream,
                             ffi::ScratchAllocator& scratch, const AttentionParams& p) {
    if (ffi::Error e = use_device(device); e.failure()) return e;
    std::optional<void*> ws = workspace(scratch, flashjax::cuda::backward_workspace_bytes(p));
    if (!ws) return ffi::Error::Internal("flashjax: could not allocate backward workspace");
    return to_ffi_error(flashjax::cuda::backward(p, *ws, stream), "backward kernel launch");
  }
  static ffi::Error kvcache(int32_t device, cudaStream_t stream, const AttentionParams& p,
                            int splits, void* workspace, size_t workspace_bytes) {
    if (ffi::Error e = use_device(device); e.failure()) return e;
    if (p.cache.float8() &&
        flashjax::cuda::forward_kernel(p) != flashjax::cuda::Kernel::kSplitKv)
      return ffi::Error::InvalidArgument(
          "flashjax: float8 caches need the split-KV kernel: float16 / bfloat16 q, head dims "
          "multiples of 16 up to 256, tensor cores allowed (not implementation='cuda:simt'), "
          "compute capability >= 8.0");
    if (workspace_bytes < flashjax::cuda::kvcache_workspace_bytes(p, splits))
      return ffi::Error::InvalidArgument("flashjax: the KV-cache workspace is too small for " +
                                         std::to_string(splits) + " splits");
    return to_ffi_error(flashjax::cuda::kvcache_forward(p, splits, workspace, stream),
                        "KV-cache kernel launch");
  }
};

using CudaHandlers =
    flashjax::ffi_layer::Handlers<CudaPlatform, int32_t, cudaStream_t, ffi::ScratchAllocator>;
using CudaKvcacheHandler = flashjax::ffi_layer::KvcacheHandler<CudaPlatform, int32_t, cudaStream_t>;

}  // namespace

FLASHJAX_DEFINE_HANDLERS(CudaHandlers,
                         ffi::Ffi::Bind()
                             .Ctx<ffi::DeviceOrdinal>()
                             .Ctx<ffi::PlatformStream<cudaStream_t>>()
                             .Ctx<ffi::ScratchAllocator>(),
                         FlashjaxForwardCuda, FlashjaxBackwardCuda, FlashjaxVarlenForwardCuda,
                         FlashjaxVarlenBackwardCuda, FlashjaxFloat8ForwardCuda);
FLASHJAX_DEFINE_KVCACHE_HANDLER(CudaKvcacheHandler,
                                ffi::Ffi::Bind()
                                    .Ctx<ffi::DeviceOrdinal>()
                                    .Ctx<ffi::PlatformStream<cudaStream_t>>(),
                                FlashjaxKvcacheCuda);
