// Same-process A/B of the CPU tile kernels the KV-cache decode path runs (row_dots,
// gemm_b_rows; bf16 or float8 rows read in place), for hosts too noisy to compare two
// builds end to end: tools/cpu_kernels_ab.sh REV builds this with REV's
// tile_kernels.inc ("before", namespace before) and the working tree's ("after"),
// AVX-512 copies (AVX2 on hosts without), the flags of csrc/CMakeLists.txt, and prints
// the best of many runs of each, alternated. (REV at or after bed27e4, which typed the
// rows RowType: both copies share the working tree's tile_math.h.)
// Args: kv heads (the cache's row stride), head dim, packed query rows (the group;
// gemm_b_rows gets them rounded up to 2, as the decode path passes them), and the rows'
// type (bf16, e4m3, e4m3-nan-free: the working tree's kernels told the rows hold no NaN
// code, or e5m2).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "tile_math.h"

namespace flashjax::cpu {
// (hosts without AVX-512, AB_AVX2: the AVX2 copies, as tile_math.cc builds them)
#ifdef AB_AVX2
#define FJ_VEC_WIDTH 8
#define FJ_GEMM_ROWS 6
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#else
#define FJ_VEC_WIDTH 16
#define FJ_GEMM_ROWS 8
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#endif
#define FJ_ISA before
#include "before.inc"
#undef FJ_ISA
#pragma GCC pop_options
#pragma GCC push_options
#ifdef AB_AVX2
#pragma GCC target("arch=x86-64-v3")
#else
#pragma GCC target("arch=x86-64-v4,avx512bf16")  // (after: with row_dots_bf16 where it exists)
#define FJ_BF16_PAIRS 1
#endif
#define FJ_ISA after
#include "after.inc"
#undef FJ_BF16_PAIRS
#undef FJ_ISA
#pragma GCC pop_options
}  // namespace flashjax::cpu

namespace {
constexpr int64_t kKeys = 4096, kTile = 128, kRuns = 200;
}

int main(int argc, char** argv) {
  using namespace flashjax::cpu;
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s KV_HEADS HEAD_DIM ROWS [bf16|e4m3|e4m3-nan-free|e5m2]\n",
                 argv[0]);
    return 2;
  }
  const int64_t heads = std::atoi(argv[1]), d = std::atoi(argv[2]), rows = std::atoi(argv[3]);
  const std::string kind = argc == 5 ? argv[4] : "bf16";
  const RowType type = kind.rfind("e4m3", 0) == 0 ? RowType::kFloat8E4M3
                       : kind == "e5m2"            ? RowType::kFloat8E5M2
                                                   : RowType::kBFloat16;
  // (e4m3-nan-free: the working tree's kernels read the rows as NaN-free codes, REV's
  // as plain e4m3; the rows hold no NaN code then)
  const RowType types[2] = {
      type, kind == "e4m3-nan-free" ? RowType::kFloat8E4M3NanFree : type};
  const int64_t element = type == RowType::kBFloat16 ? 2 : 1;  // bytes
  const int64_t pad_rows = (rows + 3) / 4 * 4, value_rows = (rows + 1) / 2 * 2;
  std::vector<uint16_t> cache(kKeys * heads * d);
  for (auto& x : cache) x = static_cast<uint16_t>(0x3f80 + (std::rand() & 0x7f));  // bf16 1..2
  // (float8 rows: the same bytes read as codes; 0x7f / 0x80-ish, finite but for e4m3's
  // 0x7f NaN, which the timing does not mind; e4m3-nan-free: 0x7f bytes made 0x7e)
  if (kind == "e4m3-nan-free")
    for (auto& x : cache)
      for (int shift : {0, 8})
        if (((x >> shift) & 0x7f) == 0x7f) x = static_cast<uint16_t>(x - (1 << shift));
  std::vector<float> q(pad_rows * d, 0.01f), s(pad_rows * kTile), o(pad_rows * d);
  std::vector<const void*> key_rows(kKeys);
  const auto* bytes = reinterpret_cast<const char*>(cache.data());
  for (int64_t j = 0; j < kKeys; ++j) key_rows[j] = bytes + j * heads * d * element;  // kv head 0
  const TileKernels* kernels[2] = {&before::kKernels, &after::kKernels};
  double dots[2] = {1e30, 1e30}, pv[2] = {1e30, 1e30}, pairs = 0.0;  // (0: not run)
  std::vector<uint16_t> q_bf16(pad_rows * d, 0x3c23);  // bf16 0.01
  using clock = std::chrono::steady_clock;
  const auto us = [](clock::time_point a, clock::time_point b) {
    return std::chrono::duration<double, std::micro>(b - a).count();
  };
  for (int run = 0; run < kRuns; ++run)
    for (int w = 0; w < 2; ++w) {
      const auto t0 = clock::now();
      for (int64_t j = 0; j < kKeys; j += kTile)
        kernels[w]->row_dots(s.data(), kTile, q.data(), d, rows, key_rows.data() + j,
                             types[w], kTile, d);
      const auto t1 = clock::now();
      for (int64_t j = 0; j < kKeys; j += kTile)
        kernels[w]->gemm_b_rows(o.data(), d, s.data(), kTile, key_rows.data() + j,
                                types[w], value_rows, d, kTile);
      const auto t2 = clock::now();
      dots[w] = std::min(dots[w], us(t0, t1));
      pv[w] = std::min(pv[w], us(t1, t2));
      if (w == 1 && after::kKernels.row_dots_bf16 && d % 32 == 0 && type == RowType::kBFloat16) {
        const auto t3 = clock::now();
        for (int64_t j = 0; j < kKeys; j += kTile)
          after::kKernels.row_dots_bf16(s.data(), kTile, q_bf16.data(), d, rows,
                                        key_rows.data() + j, kTile, d);
        const double t = us(t3, clock::now());
        pairs = pairs == 0.0 ? t : std::min(pairs, t);
      }
    }
  std::printf("kv heads %ld, d %ld, %ld rows, %ld keys (best of %ld): row_dots %.1f -> %.1f us, "
              "gemm_b_rows %.1f -> %.1f us; row_dots_bf16 (after) %.1f us\n",
              static_cast<long>(heads), static_cast<long>(d), static_cast<long>(rows),
              static_cast<long>(kKeys), static_cast<long>(kRuns), dots[0], dots[1], pv[0], pv[1],
              pairs);
}
