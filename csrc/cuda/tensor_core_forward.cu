// Tensor-core forward: each CTA owns kBlockM query rows of one (batch, head);
// each of its 4 warps owns 16 rows. K and V tiles stream through shared
// memory with cp.async: V_j loads while S = Q K_j^T and the softmax run, and
// K_{j+1} loads while O += P V_j runs. Shared-memory rows are XOR-swizzled in
// 16-byte chunks so that ldmatrix reads are free of bank conflicts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>
#include <type_traits>

#include "common.cuh"
#include "dispatch.h"
#include "fragment_softmax.cuh"
#include "mma_sm80.cuh"
#include "tensor_core_forward.h"

namespace flashjax::cuda {
namespace {

constexpr int kBlockM = 64;  // query rows per CTA
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

template <int kHeadDim>
constexpr int smem_bytes() {
  return (kBlockM + 2 * kBlockN) * kHeadDim * 2;
}


template <class T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) forward_kernel(AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kHeadDim;
  T* sV = sK + kBlockN * kHeadDim;

  const int64_t q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const auto [q_tile, bh] = query_tile(q_tiles);
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group_size();
  const int64_t q0 = q_tile * kBlockM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const T* q_base = static_cast<const T*>(p.q) + (b * p.seqlen_q * p.heads_q + h) * p.head_dim;
  const T* k_base =
      static_cast<const T*>(p.k) + (b * p.seqlen_k * p.heads_kv + hk) * p.head_dim;
  const T* v_base =
      static_cast<const T*>(p.v) + (b * p.seqlen_k * p.heads_kv + hk) * p.head_dim_v;
  const int64_t q_stride = p.heads_q * p.head_dim, k_stride = p.heads_kv * p.head_dim;
  const int64_t v_stride = p.heads_kv * p.head_dim_v;

  const int64_t last_row = min(q0 + kBlockM, p.seqlen_q) - 1;
  const KeyRange keys(p, q0, last_row, kBlockN);

  load_tile<T, kHeadDim, kBlockM>(sQ, q_base, q_stride, q0, p.seqlen_q, p.head_dim);
  if (keys.tiles(kBlockN) > 0)
    load_tile<T, kHeadDim, kBlockN>(sK, k_base, k_stride, keys.tile_begin, p.seqlen_k,
                                    p.head_dim);
  cp_async_commit();

  constexpr int kKeyTiles = kBlockN / 8, kDimTiles = kHeadDim / 8;
  float o[kDimTiles * 4] = {};
  RowSoftmax softmax{q0 + warp * 16 + lane / 4};

  for (int64_t k0 = keys.tile_begin; k0 < keys.key_end; k0 += kBlockN) {
    cp_async_wait_all();
    __syncthreads();  // K_j landed; every warp is done with V_{j-1}
    load_tile<T, kHeadDim, kBlockN>(sV, v_base, v_stride, k0, p.seqlen_k, p.head_dim_v);
    cp_async_commit();

    float s[kKeyTiles * 4];
    gemm_abt<T, kHeadDim, kBlockN>(s, sQ, warp * 16, sK);
    softmax.scores<kKeyTiles>(s, p, k0,
                              RowSoftmax::tile_needs_mask(p, q0, last_row, k0, kBlockN,
                                                          keys.key_begin, keys.key_end));
    softmax.update<kKeyTiles, kDimTiles>(s, o);

    cp_async_wait_all();
    __syncthreads();  // V_j landed; every warp is done with K_j
    if (k0 + kBlockN < keys.key_end) {
      load_tile<T, kHeadDim, kBlockN>(sK, k_base, k_stride, k0 + kBlockN, p.seqlen_k,
                                      p.head_dim);
    }
    cp_async_commit();

    gemm_ab<T, kHeadDim, kBlockN>(o, s, sV);
  }
  cp_async_wait_all();
  softmax.write<T, kDimTiles>(p, o, b, h);
}

template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, cudaStream_t stream) {
  static std::once_flag configured;
  static cudaError_t config_status = cudaSuccess;
  std::call_once(configured, [] {
    config_status = cudaFuncSetAttribute(forward_kernel<T, kHeadDim>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         smem_bytes<kHeadDim>());
  });
  if (config_status != cudaSuccess) return config_status;
  const int64_t q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t blocks = q_tiles * p.batch * p.heads_q;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  forward_kernel<T, kHeadDim>
      <<<static_cast<unsigned>(blocks), kThreads, smem_bytes<kHeadDim>(), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool tensor_core_forward_supports(const AttentionParams& p) {
  return tensor_core_shapes(p) && compute_capability() >= 80;
}

cudaError_t tensor_core_forward(const AttentionParams& p, cudaStream_t stream) {
  return with_half_type(p.dtype, [&](auto tag) {
    return with_bucket(head_dim_bucket(p), [&](auto dim) {
      return launch<decltype(tag), decltype(dim)::value>(p, stream);
    });
  });
}

}  // namespace flashjax::cuda
