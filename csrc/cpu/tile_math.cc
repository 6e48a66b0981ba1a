#include "tile_math.h"

#include <cstdint>

namespace flashjax::cpu {
FJ_MULTIVERSION
void matmul_acc(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                int64_t ldb, int64_t M, int64_t N, int64_t K) {
  // 4 rows x 16 columns of C live in 8 vector registers across the K loop.
  for (int64_t i = 0; i < M; i += 4) {
    const float* a0 = A + i * lda;
    const float* a1 = a0 + lda;
    const float* a2 = a1 + lda;
    const float* a3 = a2 + lda;
    for (int64_t j = 0; j < N; j += 16) {
      float* c = C + i * ldc + j;
      v8f c00 = load8(c), c01 = load8(c + 8);
      v8f c10 = load8(c + ldc), c11 = load8(c + ldc + 8);
      v8f c20 = load8(c + 2 * ldc), c21 = load8(c + 2 * ldc + 8);
      v8f c30 = load8(c + 3 * ldc), c31 = load8(c + 3 * ldc + 8);
      const float* b = B + j;
      for (int64_t k = 0; k < K; ++k, b += ldb) {
        const v8f b0 = load8(b), b1 = load8(b + 8);
        const v8f x0 = v8f{} + a0[k], x1 = v8f{} + a1[k];
        const v8f x2 = v8f{} + a2[k], x3 = v8f{} + a3[k];
        c00 += x0 * b0; c01 += x0 * b1;
        c10 += x1 * b0; c11 += x1 * b1;
        c20 += x2 * b0; c21 += x2 * b1;
        c30 += x3 * b0; c31 += x3 * b1;
      }
      store8(c, c00); store8(c + 8, c01);
      store8(c + ldc, c10); store8(c + ldc + 8, c11);
      store8(c + 2 * ldc, c20); store8(c + 2 * ldc + 8, c21);
      store8(c + 3 * ldc, c30); store8(c + 3 * ldc + 8, c31);
    }
  }
}

void transpose(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
               int64_t cols) {
  constexpr int64_t kBlock = 16;  // keeps both sides in cache lines
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock)
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock)
      for (int64_t r = r0; r < r0 + kBlock && r < rows; ++r)
        for (int64_t c = c0; c < c0 + kBlock && c < cols; ++c)
          dst[c * ld_dst + r] = src[r * ld_src + c];
}

float* Scratch::get(int64_t floats) {
  const int64_t need = floats + kRowAlign;
  if (static_cast<int64_t>(storage_.size()) < need) storage_.assign(need, 0.0f);
  auto addr = reinterpret_cast<std::uintptr_t>(storage_.data());
  auto aligned = (addr + 63) & ~static_cast<std::uintptr_t>(63);
  return reinterpret_cast<float*>(aligned);
}

}  // namespace flashjax::cpu
