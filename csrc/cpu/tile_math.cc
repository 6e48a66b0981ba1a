#include "tile_math.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>  // F16C's half conversion (the AVX2 and AVX-512 copies)
#endif

namespace flashjax::cpu {

// One copy of the kernels per instruction set. The register block fills the
// vector registers: 8 rows x 2 vectors of accumulators with 32 zmm registers,
// 6 x 2 with 16 ymm, 4 x 2 with 16 xmm.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FJ_HAVE_ISA_CLONES 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")
#define FJ_ISA avx512bf16  // (the AVX-512 copy plus row_dots_bf16)
#define FJ_VEC_WIDTH 16
#define FJ_GEMM_ROWS 8
#define FJ_BF16_PAIRS 1  // (the target pragma does not define __AVX512BF16__ in GCC 12)
#include "tile_kernels.inc"
#undef FJ_ISA
#undef FJ_VEC_WIDTH
#undef FJ_GEMM_ROWS
#undef FJ_BF16_PAIRS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define FJ_ISA avx512
#define FJ_VEC_WIDTH 16
#define FJ_GEMM_ROWS 8
#include "tile_kernels.inc"
#undef FJ_ISA
#undef FJ_VEC_WIDTH
#undef FJ_GEMM_ROWS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FJ_ISA avx2
#define FJ_VEC_WIDTH 8
#define FJ_GEMM_ROWS 6
#include "tile_kernels.inc"
#undef FJ_ISA
#undef FJ_VEC_WIDTH
#undef FJ_GEMM_ROWS
#pragma GCC pop_options
#endif

#define FJ_ISA baseline
#define FJ_VEC_WIDTH 4
#define FJ_GEMM_ROWS 4
#include "tile_kernels.inc"
#undef FJ_ISA
#undef FJ_VEC_WIDTH
#undef FJ_GEMM_ROWS

namespace {
const TileKernels& select_kernels() {
  const char* forced = std::getenv("FLASHJAX_CPU_ISA");
  auto allowed = [&](const char* name) { return !forced || std::strcmp(forced, name) == 0; };
#ifdef FJ_HAVE_ISA_CLONES
  __builtin_cpu_init();
  if (allowed("avx512bf16") && __builtin_cpu_supports("x86-64-v4") &&
      __builtin_cpu_supports("avx512bf16"))
    return avx512bf16::kKernels;
  if (allowed("avx512") && __builtin_cpu_supports("x86-64-v4")) return avx512::kKernels;
  if (allowed("avx2") && __builtin_cpu_supports("x86-64-v3")) return avx2::kKernels;
#endif
  (void)allowed;
  return baseline::kKernels;
}
}  // namespace

const TileKernels& tile_kernels() {
  static const TileKernels& kernels = select_kernels();
  return kernels;
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
