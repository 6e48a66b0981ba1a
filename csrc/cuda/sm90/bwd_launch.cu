// The Hopper backward's host side: kernel attributes, tensor maps, grids and
// the launches of one call (bwd_kernel.cuh has the kernels):
//   backward_preprocess (D, simt_attention.cu), stage_rows_kernel (padded lse2
//   and D), then either the fused key kernel (dK, dV and dQ into the float32
//   buffer; the wide one above head dim 128) and convert_dq_kernel, or, with
//   `deterministic`, the key kernel without dQ and the query kernel (dQ);
//   last, dsinks.
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include "../backward_workspace.h"
#include "../dispatch.h"
#include "../hopper_backward.h"
#include "../hopper_common.cuh"
#include "../simt_attention.h"
#include "bwd_kernel.cuh"
#include "bwd_params.h"
#include "bwd_postprocess.cuh"
#include "bwd_preprocess.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"

namespace flashjax::cuda {
namespace hopper_bwd {
namespace {

// Kernel attributes are set once per instantiation.
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <class T, int kHeadDim>
cudaError_t configure_kernels() {
  constexpr int kSmem = smem_bytes<kHeadDim>();
  static std::once_flag configured;
  static cudaError_t config_status = cudaSuccess;
  std::call_once(configured, [] {
    if constexpr (kWide<kHeadDim>) {
      config_status = allow_smem(hopper_wide_key_kernel<T>, kSmem);
    } else {
      for (cudaError_t e : {allow_smem(hopper_key_kernel<T, kHeadDim, true>, kSmem),
                            allow_smem(hopper_key_kernel<T, kHeadDim, false>, kSmem),
                            allow_smem(hopper_query_kernel<T, kHeadDim>, kSmem)})
        if (e != cudaSuccess && config_status == cudaSuccess) config_status = e;
    }
  });
  return config_status;
}

template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, const BackwardWorkspace& ws, cudaStream_t stream) {
  constexpr int kSmem = smem_bytes<kHeadDim>();
  constexpr int kKeysPerBlock = kKeysPerCta<kHeadDim>;
  const bool fused = ws.dq_accum != nullptr;
  if (cudaError_t e = configure_kernels<T, kHeadDim>(); e != cudaSuccess) return e;
  const auto map = [&](CUtensorMap* m, const TensorRef& t, int64_t seqlen, int64_t heads,
                       int64_t dim, int rows) {
    return make_map(m, t, p.dtype, p.batch, seqlen, heads, dim, rows);
  };
  BackwardMaps key_maps, query_maps;
  if (!map(&key_maps.own_a, p.k, p.seqlen_k, p.heads_kv, p.head_dim, kKeysPerBlock) ||
      !map(&key_maps.own_b, p.v, p.seqlen_k, p.heads_kv, p.head_dim_v, kKeysPerBlock) ||
      !map(&key_maps.stream_a, p.q, p.seqlen_q, p.heads_q, p.head_dim, kStreamRows) ||
      !map(&key_maps.stream_b, p.dout, p.seqlen_q, p.heads_q, p.head_dim_v, kStreamRows) ||
      !map(&query_maps.own_a, p.q, p.seqlen_q, p.heads_q, p.head_dim, kOwnRows) ||
      !map(&query_maps.own_b, p.dout, p.seqlen_q, p.heads_q, p.head_dim_v, kOwnRows) ||
      !map(&query_maps.stream_a, p.k, p.seqlen_k, p.heads_kv, p.head_dim, kStreamRows) ||
      !map(&query_maps.stream_b, p.v, p.seqlen_k, p.heads_kv, p.head_dim_v, kStreamRows))
    return cudaErrorInvalidValue;
  const int64_t key_blocks =
      (p.seqlen_k + kKeysPerBlock - 1) / kKeysPerBlock * p.batch * p.heads_kv;
  const int64_t query_blocks = (p.seqlen_q + kOwnRows - 1) / kOwnRows * p.batch * p.heads_q;
  if (key_blocks > 0x7fffffff || query_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const RowStats stats{ws.lse2_padded, ws.D_padded, ws.rows_padded};
  const unsigned elementwise_blocks = 8 * multiprocessor_count();  // grid-stride kernels
  stage_rows_kernel<<<elementwise_blocks, 256, 0, stream>>>(p, ws, fused);
  if (!fused) {  // deterministic: key kernel without dQ, then the query kernel
    if constexpr (kWide<kHeadDim>) {
      return cudaErrorNotSupported;  // hopper_backward_supports says no
    } else {
      hopper_key_kernel<T, kHeadDim, false>
          <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(p, key_maps, stats,
                                                                            nullptr);
      hopper_query_kernel<T, kHeadDim>
          <<<static_cast<unsigned>(query_blocks), kThreads, kSmem, stream>>>(p, query_maps, ws.D,
                                                                              ws.dsink_rows);
      return cudaGetLastError();
    }
  }
  const size_t accum_bytes =
      sizeof(float) * static_cast<size_t>(p.batch * p.heads_q * ws.rows_padded * ws.dq_cols);
  if (cudaError_t e = cudaMemsetAsync(ws.dq_accum, 0, accum_bytes, stream); e != cudaSuccess)
    return e;
  if constexpr (kWide<kHeadDim>)
    hopper_wide_key_kernel<T><<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(
        p, key_maps, stats, ws.dq_accum);
  else
    hopper_key_kernel<T, kHeadDim, true>
        <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(p, key_maps, stats,
                                                                          ws.dq_accum);
  convert_dq_kernel<T, kHeadDim><<<elementwise_blocks, 256, 0, stream>>>(p, ws.dq_accum,
                                                                         ws.rows_padded);
  return cudaGetLastError();
}

}  // namespace
}  // namespace hopper_bwd

bool hopper_backward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  // As the forward (uniform layouts only, for now). Above head dim 128 only
  // the fused (non-deterministic) kernel exists; deterministic mode takes the
  // mma.sync path there.
  return p.uniform() && tensor_core_shapes(p) &&
         (head_dim_bucket(kTensorCoreBuckets, p) <= 128 || !p.deterministic) &&
         p.head_dim >= 64 && p.head_dim_v >= 64 && p.seqlen_q < (1 << 30) &&
         p.seqlen_k < (1 << 30) && compute_capability() == 90 && encode_fn() != nullptr;
#else
  (void)p;
  return false;
#endif
}

BackwardWorkspace hopper_backward_workspace(const AttentionParams& p, void* base) {
  // Deterministic mode computes dQ in its own kernel, without the float32 buffer.
  return BackwardWorkspace(p, base, true,
                           p.deterministic ? 0 : head_dim_bucket(kTensorCoreBuckets, p));
}

cudaError_t hopper_backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const BackwardWorkspace ws = hopper_backward_workspace(p, workspace);
  if (cudaError_t e = backward_preprocess(p, ws.D, stream); e != cudaSuccess) return e;
  cudaError_t status = with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
      return hopper_bwd::launch<decltype(tag), decltype(dim)::value>(p, ws, stream);
    });
  });
  if (status != cudaSuccess) return status;
  return backward_dsinks(p, ws.dsink_rows, stream);
}

}  // namespace flashjax::cuda
