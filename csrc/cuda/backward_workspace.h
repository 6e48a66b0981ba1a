// The backward's device workspace (XLA scratch, declared by the FFI handler),
// carved into the arrays the chosen backward path needs. Every path uses D
// and dsink_rows; the Hopper path adds per-row statistics padded to whole
// tiles (so that its producer can copy them with bulk copies) and, when it
// accumulates dQ with atomics, a float32 dQ buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashjax/params.h"

namespace flashjax::cuda {

struct BackwardWorkspace {
  static constexpr int64_t kRowAlign = 128;  // padded rows: a multiple of every tile height
  static constexpr size_t kArrayAlign = 256;

  float* D = nullptr;            // [b * hq * sq]: rowsum(dO * O) - dlse
  float* dsink_rows = nullptr;   // [b * hq * sq]: each row's share of dsinks
  float* lse2_padded = nullptr;  // [b * hq * rows_padded]: lse in log2 units, +inf past sq
  float* D_padded = nullptr;     // [b * hq * rows_padded]: D, 0 past sq
  float* dq_accum = nullptr;     // [b * hq * rows_padded * dq_cols]: float32 dQ
  int64_t rows_padded = 0;
  int64_t dq_cols = 0;
  size_t bytes = 0;

  // base may be null to size the workspace only.
  BackwardWorkspace(const AttentionParams& p, void* base, bool padded_stats, int64_t dq_columns)
      : dq_cols(dq_columns) {
    const size_t rows = static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q);
    rows_padded = (p.seqlen_q + kRowAlign - 1) / kRowAlign * kRowAlign;
    const size_t padded = static_cast<size_t>(p.batch * p.heads_q * rows_padded);
    char* at = static_cast<char*>(base);
    const auto take = [&](size_t floats) {
      float* array = at ? reinterpret_cast<float*>(at + bytes) : nullptr;
      bytes += (floats * sizeof(float) + kArrayAlign - 1) / kArrayAlign * kArrayAlign;
      return array;
    };
    D = take(rows);
    dsink_rows = take(rows);
    if (padded_stats) {
      lse2_padded = take(padded);
      D_padded = take(padded);
    }
    if (dq_cols > 0) dq_accum = take(padded * static_cast<size_t>(dq_cols));
  }
};

}  // namespace flashjax::cuda
