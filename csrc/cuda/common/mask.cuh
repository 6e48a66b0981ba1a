// Masks on accumulator fragments (fragment.cuh's layout): -inf outside the
// columns a row sees (positions, windows, seqused; SeqlenInfo says which).
#pragma once

#include <cstdint>

#include "device.cuh"

namespace flashjax::cuda {

// The visible columns [first, last] of a fragment row as tile-relative ints
// [lo, hi], clamped to [-1, cols] (tiles are small; sequences < 2^31).
__device__ __forceinline__ void visible_columns(int64_t first, int64_t last, int64_t col0,
                                                int cols, int& lo, int& hi) {
  const int64_t l = first - col0, h = last - col0;
  lo = static_cast<int>(l < -1 ? -1 : (l > cols ? cols : l));
  hi = static_cast<int>(h < -1 ? -1 : (h > cols ? cols : h));
}

// -inf outside columns [lo[r], hi[r]] of row half r.
template <int kTiles>
__device__ __forceinline__ void mask_columns(float (&s)[kTiles * 4], const int (&lo)[2],
                                             const int (&hi)[2]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, col = n * 8 + 2 * t + (e & 1);
      if (col < lo[r] || col > hi[r]) s[4 * n + e] = kNegInf;
    }
}

}  // namespace flashjax::cuda
