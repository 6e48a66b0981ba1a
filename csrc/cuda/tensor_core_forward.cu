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
#include "fragment_softmax.cuh"
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

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile.
template <int kHeadDim>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The 4 accumulators of 8-column tile n of a flat fragment.
template <int kN>
__device__ __forceinline__ float (&tile4(float (&frag)[kN], int n))[4] {
  return *reinterpret_cast<float(*)[4]>(&frag[4 * n]);
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// D += A * B for one m16n8k16 tile.
template <class T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Copies rows [row0, row0 + kRows) of one head (zero beyond `rows_valid` rows
// and `dim` columns) into a swizzled shared tile.
template <class T, int kHeadDim, int kRows>
__device__ __forceinline__ void load_tile(T* tile, const T* head_base, int64_t row_stride,
                                          int64_t row0, int64_t rows_valid, int64_t dim) {
  constexpr int kChunks = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += kThreads) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row0 + row < rows_valid && chunk * 8 < dim;
    const T* src = valid ? head_base + (row0 + row) * row_stride + chunk * 8 : head_base;
    cp_async_16(tile + swizzled<kHeadDim>(row, chunk), src, valid);
  }
}

template <class T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) forward_kernel(AttentionParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kHeadDim;
  T* sV = sK + kBlockN * kHeadDim;

  // Heaviest (latest, for causal) query tiles first.
  const int64_t q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t bh_count = p.batch * p.heads_q;
  const int64_t q_tile = q_tiles - 1 - blockIdx.x / bh_count;
  const int64_t bh = blockIdx.x % bh_count;
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

    float s[kKeyTiles * 4] = {};
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, sQ + swizzled<kHeadDim>(warp * 16 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
      for (int nn = 0; nn < kBlockN / 16; ++nn) {
        uint32_t bfrag[4];
        ldmatrix_x4(bfrag, sK + swizzled<kHeadDim>(nn * 16 + lane % 8 + (lane / 16) * 8,
                                                    kk * 2 + (lane / 8) % 2));
        mma<T>(tile4(s, 2 * nn), a, bfrag[0], bfrag[1]);
        mma<T>(tile4(s, 2 * nn + 1), a, bfrag[2], bfrag[3]);
      }
    }
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

#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      p_fragment<T, kKeyTiles>(a, s, kk);
#pragma unroll
      for (int nn = 0; nn < kHeadDim / 16; ++nn) {
        uint32_t bfrag[4];
        ldmatrix_x4_trans(bfrag, sV + swizzled<kHeadDim>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                          nn * 2 + lane / 16));
        mma<T>(tile4(o, 2 * nn), a, bfrag[0], bfrag[1]);
        mma<T>(tile4(o, 2 * nn + 1), a, bfrag[2], bfrag[3]);
      }
    }
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

template <class T>
cudaError_t launch_for_dim(const AttentionParams& p, int bucket, cudaStream_t stream) {
  switch (bucket) {
#ifdef FLASHJAX_TC_HEAD_DIM_64
    case 64: return launch<T, 64>(p, stream);
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
    case 128: return launch<T, 128>(p, stream);
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
    case 256: return launch<T, 256>(p, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

// Smallest compiled head-dim bucket holding both head dims, or 0.
int head_dim_bucket(const AttentionParams& p) {
  const int64_t d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  constexpr int kBuckets[] = {
#ifdef FLASHJAX_TC_HEAD_DIM_64
      64,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
      128,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
      256,
#endif
      0};
  for (int bucket : kBuckets)
    if (bucket >= d) return bucket;
  return 0;
}

bool device_has_mma() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  return major >= 8;
}

}  // namespace

bool tensor_core_forward_supports(const AttentionParams& p) {
  // 16-byte cp.async rows need head dims that are multiples of 8 elements.
  return p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0 &&
         head_dim_bucket(p) != 0 && device_has_mma();
}

cudaError_t tensor_core_forward(const AttentionParams& p, cudaStream_t stream) {
  const int bucket = head_dim_bucket(p);
  if (p.dtype == DType::kFloat16) return launch_for_dim<__half>(p, bucket, stream);
  return launch_for_dim<__nv_bfloat16>(p, bucket, stream);
}

}  // namespace flashjax::cuda
