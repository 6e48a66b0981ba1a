// Dense float32 tile arithmetic for the CPU path: a register-blocked matmul,
// a vectorisable exp, and element conversions. Tiles are row-major, padded so
// that rows are multiples of kRowAlign floats and row counts multiples of 4.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

// Hot loops get an AVX2+FMA clone chosen at load time, so one binary is fast
// on modern x86 and still runs on any x86-64.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FJ_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FJ_MULTIVERSION
#endif
#define FJ_INLINE inline __attribute__((always_inline))

namespace flashjax::cpu {

inline constexpr int64_t kRowAlign = 16;  // floats: one 64-byte line
inline constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// C[M][N] += A[M][K] * B[K][N]; M % 4 == 0, N % 16 == 0, 32-byte aligned rows.
void matmul_acc(float* C, int64_t ldc, const float* A, int64_t lda, const float* B,
                int64_t ldb, int64_t M, int64_t N, int64_t K);

// dst[c][r] = src[r][c] for r < rows, c < cols.
void transpose(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
               int64_t cols);

// exp(x) to ~2e-7 relative error; exactly 0 below -87 (and for -inf).
FJ_INLINE float exp_approx(float x) {
  const bool underflow = !(x >= -87.0f);
  x = underflow ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float t = x * 1.4426950408889634f;
  const int n = static_cast<int>(t + (t < 0.0f ? -0.5f : 0.5f));
  const float nf = static_cast<float>(n);
  const float r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

// Vector reductions, written out because the compiler may not reorder float
// sums by itself. n % 8 == 0.
typedef float v8f __attribute__((vector_size(32)));
FJ_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
FJ_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
FJ_INLINE float horizontal_sum(v8f v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
FJ_INLINE float row_sum(const float* x, int64_t n) {
  v8f acc{};
  for (int64_t j = 0; j < n; j += 8) acc += load8(x + j);
  return horizontal_sum(acc);
}
FJ_INLINE float row_max(const float* x, int64_t n) {
  v8f acc = load8(x);
  for (int64_t j = 8; j < n; j += 8) {
    const v8f v = load8(x + j);
    acc = v > acc ? v : acc;
  }
  float m = acc[0];
  for (int i = 1; i < 8; ++i) m = acc[i] > m ? acc[i] : m;
  return m;
}

// 64-byte aligned scratch that only grows; one per thread.
class Scratch {
 public:
  float* get(int64_t floats);

 private:
  std::vector<float> storage_;
};

}  // namespace flashjax::cpu
