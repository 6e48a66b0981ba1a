// Dense float32 tile arithmetic for the CPU path. Tiles are row-major, padded
// so that rows are multiples of kRowAlign floats and row counts multiples of 4.
//
// The hot kernels (tile_kernels.inc) are compiled once per instruction set
// (AVX-512, AVX2+FMA, baseline x86-64) and the best one the CPU supports is
// picked at load time, so one binary is fast on modern x86 and still runs on
// any x86-64.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "flashjax/params.h"

#define FJ_INLINE inline __attribute__((always_inline))

namespace flashjax::cpu {

inline constexpr int64_t kRowAlign = 16;  // floats: one 64-byte line (an AVX-512 vector)
inline constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline constexpr float kNegInfinity = -std::numeric_limits<float>::infinity();

// The element types of rows the tile kernels read where they lie (a KV cache's, read in
// place, widened to float in registers): q's dtypes, and float8 caches' codes (e4m3fn
// rows known to hold no NaN code take a shorter widening: kFloat8E4M3NanFree).
enum class RowType : int32_t {
  kFloat32, kFloat16, kBFloat16, kFloat8E4M3, kFloat8E4M3NanFree, kFloat8E5M2
};
// e4m3fn codes read by the tile kernels come out as their values over this (a
// half's exponent bias is 8 more than e4m3's, and the widening leaves it so): the
// callers fold it into their scales (float8_to_float's rows are exact).
inline constexpr float kFloat8E4M3ReadUnit = 256.0f;
inline RowType row_type(DType t) {
  return t == DType::kBFloat16 ? RowType::kBFloat16
         : t == DType::kFloat16 ? RowType::kFloat16
                                : RowType::kFloat32;
}
inline RowType row_type(CacheElement e) {
  return e == CacheElement::kFloat8E4M3 ? RowType::kFloat8E4M3 : RowType::kFloat8E5M2;
}

struct TileKernels {
  // C[M][N] (+)= A B with A[M][K] row-major, or A given transposed (A[K][M],
  // trans_a) so that P^T and dS^T need no copy. M % 4 == 0, N % kRowAlign == 0.
  void (*gemm)(float* C, int64_t ldc, const float* A, int64_t lda, bool trans_a, const float* B,
               int64_t ldb, int64_t M, int64_t N, int64_t K, bool accumulate);
  // C[M][N] += A B with B's row k at B_rows[k], elements of `type` (rows anywhere, e.g.
  // a KV cache's read in place, widened to float in registers; float8 codes as their
  // values, unscaled, e4m3fn's over kFloat8E4M3ReadUnit). M % 2 == 0 (a last block of 2
  // rows: the decode path's GQA pairs), N % kRowAlign == 0.
  void (*gemm_b_rows)(float* C, int64_t ldc, const float* A, int64_t lda,
                      const void* const* B_rows, RowType type, int64_t M, int64_t N, int64_t K);
  // S[r][j] = Q[r] . rows[j] over d elements (rows of `type`), r < M, j < n: the scores
  // of a few query rows against keys read in place (no K^T to build). n, d % kRowAlign
  // == 0.
  void (*row_dots)(float* S, int64_t lds, const float* Q, int64_t ldq, int64_t M,
                   const void* const* rows, RowType type, int64_t n, int64_t d);
  // One online-softmax step over n scores per row (n % kRowAlign == 0): S
  // becomes P = exp(S - m_new), m and l are updated and O's rows rescaled by
  // exp(m_old - m_new). NaN scores make the row NaN. Rows in [rows, pad_rows)
  // and rows with nothing visible yet get P = 0.
  void (*softmax_step)(float* S, int64_t lds, int64_t rows, int64_t pad_rows, int64_t n,
                       float* m, float* l, float* O, int64_t ldo);
  // The backward's P = exp(S - lse) and dS = P * (dP - D) (dS holds dP on
  // entry), times the softcap derivative when cap > 0. Masked pairs (S = -inf),
  // padding rows and rows that saw nothing get exactly 0 in both.
  void (*backward_scores)(const float* S, float* P, float* dS, int64_t ld, int64_t rows,
                          int64_t pad_rows, int64_t n, const float* lse, const float* D,
                          float cap);
  // dst[i] = float(src[i]), i < n, from bfloat16 / IEEE half bits (caches converted
  // where they are used).
  void (*bf16_to_float)(float* dst, const uint16_t* src, int64_t n);
  void (*f16_to_float)(float* dst, const uint16_t* src, int64_t n);
  // dst[i] = value(src[i]) * scale, i < n: float8 codes of `format` (a float8 cache's,
  // scale its descale) as float8.h's table has their values, one rounding of the product.
  void (*float8_to_float)(float* dst, const uint8_t* src, int64_t n, CacheElement format,
                          float scale);
  // No inf or NaN among x[0, n), n % kRowAlign == 0.
  bool (*all_finite)(const float* x, int64_t n);
  // row_dots for bfloat16 query rows (Q: bf16 bits, unscaled) against bfloat16 rows,
  // by pairs of elements in one instruction (AVX512-BF16 `vdpbf16ps`: products exact,
  // float sums; bf16 denormal inputs count as 0). d % 32 == 0. Null on CPUs without it.
  void (*row_dots_bf16)(float* S, int64_t lds, const uint16_t* Q, int64_t ldq, int64_t M,
                        const void* const* rows, int64_t n, int64_t d);
};

// The kernels for this CPU (FLASHJAX_CPU_ISA=avx512bf16|avx512|avx2|baseline forces a
// set, for tests and A/B timing).
const TileKernels& tile_kernels();

// dst[c][r] = src[r][c] for r < rows, c < cols.
void transpose(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows,
               int64_t cols);

// NaN-propagating max (std::max drops a NaN in its second argument).
inline float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// 64-byte aligned scratch that only grows; one per thread.
class Scratch {
 public:
  float* get(int64_t floats);

 private:
  std::vector<float> storage_;
};

}  // namespace flashjax::cpu
