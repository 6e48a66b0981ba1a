// mma.sync (sm_80+) building blocks shared by the tensor-core kernels:
// cp.async tile loads into XOR-swizzled shared memory, ldmatrix, m16n8k16 MMA.
// A tile is [rows][kHeadDim] 16-bit elements; 16-byte chunk c of row r lives
// at chunk c ^ (r % 8), so that ldmatrix reads are free of bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../common/device.cuh"
#include "../common/fragment.cuh"

namespace flashjax::cuda {

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
// Waits until at most kPending of this thread's latest commit groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
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
  for (int idx = threadIdx.x; idx < kRows * kChunks; idx += blockDim.x) {
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool valid = row0 + row < rows_valid && chunk * 8 < dim;
    const T* src = valid ? head_base + (row0 + row) * row_stride + chunk * 8 : head_base;
    cp_async_16(tile + swizzled<kHeadDim>(row, chunk), src, valid);
  }
}

// C(16 x kN) = A(16 rows of a from a_row0, kHeadDim) * B(kN rows of b, kHeadDim)^T,
// both swizzled [rows][kHeadDim] tiles: a warp's slice of S = Q K^T and friends.
template <class T, int kHeadDim, int kN>
__device__ __forceinline__ void gemm_abt(float (&c)[kN / 2], const T* a, int a_row0, const T* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) c[i] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t af[4];
    ldmatrix_x4(af, a + swizzled<kHeadDim>(a_row0 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t bf[4];
      ldmatrix_x4(bf, b + swizzled<kHeadDim>(nn * 16 + lane % 8 + (lane / 16) * 8,
                                             kk * 2 + (lane / 8) % 2));
      mma<T>(tile4(c, 2 * nn), af, bf[0], bf[1]);
      mma<T>(tile4(c, 2 * nn + 1), af, bf[2], bf[3]);
    }
  }
}

// acc(16 x kHeadDim) += A(16 x kK, float fragment `frag`, rounded to T) *
// B(kK rows of b, kHeadDim): a warp's slice of O += P V and friends.
template <class T, int kHeadDim, int kK>
__device__ __forceinline__ void gemm_ab(float (&acc)[kHeadDim / 2], const float (&frag)[kK / 2],
                                        const T* b) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t af[4];
    p_fragment<T, kK / 8>(af, frag, kk);
#pragma unroll
    for (int nn = 0; nn < kHeadDim / 16; ++nn) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, b + swizzled<kHeadDim>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8,
                                                   nn * 2 + lane / 16));
      mma<T>(tile4(acc, 2 * nn), af, bf[0], bf[1]);
      mma<T>(tile4(acc, 2 * nn + 1), af, bf[2], bf[3]);
    }
  }
}

// gemm_ab_masked's v_at for a swizzled [rows][kHeadDim] tile (load_tile's layout).
template <class T, int kHeadDim>
struct SwizzledRows {
  const T* tile;
  __device__ float operator()(int row, int col) const {
    return to_float(tile[swizzled<kHeadDim>(row, col / 8) + col % 8]);
  }
};

}  // namespace flashjax::cuda
