// The accumulator fragment layout of the tensor-core kernels (mma.sync on
// sm_80, wgmma on sm_90a): per warp, a thread holds rows g and g + 8 of the
// warp's 16-row slice (g = lane / 4) and, per 8-column tile n, columns 8n + 2t
// and 8n + 2t + 1 (t = lane % 4), stored flat as frag[4n + e], e = 0, 1 (row
// g), 2, 3 (row g + 8). Packing such a fragment into 16-bit A operands.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flashjax::cuda {

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// The A fragment (16 rows x 16 keys) of P for key step kk, from s.
template <class T, int kKeyTiles>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&s)[kKeyTiles * 4],
                                           int kk) {
  a[0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
  a[1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
  a[2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
  a[3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
}

// A fragment of kK 16-column k-steps (x: 8 kK floats) as kK k-steps of A-operand registers.
template <class T, int kK>
__device__ __forceinline__ void pack_fragments(uint32_t (&a)[kK][4], const float (&x)[kK * 8]) {
#pragma unroll
  for (int kk = 0; kk < kK; ++kk) p_fragment<T, 2 * kK>(a[kk], x, kk);
}

}  // namespace flashjax::cuda
