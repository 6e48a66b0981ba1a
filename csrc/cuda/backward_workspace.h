// The backward's device workspace (XLA scratch, declared by the FFI handler),
// carved into the arrays the chosen backward path needs. Every path uses D
// and dsink_rows (laid out like lse, so that kernels index them as they index
// lse) and, with segment ids, the segment-id ranges of the row tiles; the
// Hopper path (uniform layouts only) adds per-row statistics padded to whole
// tiles (so that its producer can copy them with bulk copies) and, when it
// accumulates dQ with atomics, a float32 dQ buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashjax/params.h"
#include "sequence_layout.h"

namespace flashjax::cuda {

struct BackwardWorkspace {
  static constexpr int64_t kRowAlign = 128;  // padded rows: a multiple of every tile height
  static constexpr size_t kArrayAlign = 256;

  TensorRef D;             // float32 like lse: rowsum(dO * O) - dlse (used rows only)
  TensorRef dsink_rows;    // float32 like lse: each used row's share of dsinks
  SegmentTiles segments;   // with segment ids only
  float* lse2_padded = nullptr;  // [b * hq * rows_padded]: lse in log2 units, +inf past sq
  float* D_padded = nullptr;     // [b * hq * rows_padded]: D, 0 past sq
  float* dq_accum = nullptr;     // [b * hq * rows_padded * dq_cols]: float32 dQ
  int64_t rows_padded = 0;
  int64_t dq_cols = 0;
  size_t bytes = 0;

  // base may be null to size the workspace only.
  BackwardWorkspace(const AttentionParams& p, void* base, bool padded_stats, int64_t dq_columns)
      : dq_cols(dq_columns) {
    rows_padded = (p.seqlen_q + kRowAlign - 1) / kRowAlign * kRowAlign;
    const size_t padded = static_cast<size_t>(p.batch * p.heads_q * rows_padded);
    char* at = static_cast<char*>(base);
    const auto take = [&](size_t array_bytes) {
      void* array = at ? at + bytes : nullptr;
      bytes += (array_bytes + kArrayAlign - 1) / kArrayAlign * kArrayAlign;
      return array;
    };
    const auto take_floats = [&](size_t floats) {
      return static_cast<float*>(take(floats * sizeof(float)));
    };
    const auto like_lse = [&](void* data) {
      return TensorRef{data, p.lse.batch_stride, p.lse.row_stride, p.lse.head_stride};
    };
    D = like_lse(take_floats(floats_like_lse(p)));
    dsink_rows = like_lse(take_floats(floats_like_lse(p)));
    segments = SegmentTiles(p, take(SegmentTiles::workspace_bytes(p)));
    if (padded_stats) {
      lse2_padded = take_floats(padded);
      D_padded = take_floats(padded);
    }
    if (dq_cols > 0) dq_accum = take_floats(padded * static_cast<size_t>(dq_cols));
  }

  // Floats spanned by an array with lse's strides over every row of the
  // query-side tensors (one batch entry of total_q rows when packed).
  static size_t floats_like_lse(const AttentionParams& p) {
    const int64_t batches = p.packed() ? 1 : p.batch;
    const int64_t rows = p.packed() ? p.total_q : p.seqlen_q;
    if (batches <= 0 || rows <= 0 || p.heads_q <= 0) return 0;
    return static_cast<size_t>((batches - 1) * p.lse.batch_stride +
                               (rows - 1) * p.lse.row_stride +
                               (p.heads_q - 1) * p.lse.head_stride + 1);
  }
};

}  // namespace flashjax::cuda
