// The backward's device workspace (XLA scratch, declared by the FFI handler),
// carved into the arrays the chosen backward path needs. Every path uses D
// and dsink_rows (laid out like lse, so that kernels index them as they index
// lse) and, with segment ids, the segment-id ranges of the row tiles; the
// Hopper path adds per-row statistics padded to whole tiles (so that its
// producer can copy them with bulk copies), when it accumulates dQ with
// atomics a float32 dQ buffer, and for packed / seqused layouts its work lists.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashjax/params.h"
#include "mask_tiles.h"
#include "sequence_layout.h"
#include "work_list.h"

namespace flashjax::cuda {

// Where the Hopper backward keeps each (sequence, query head)'s rows padded to
// whole tiles: its row statistics and its float32 dQ buffer share this layout
// of regions of kAlign-row multiples. Dense and seqused: region (b * heads + h)
// of `rows` rows (seqlen_q rounded up). Packed: head h's regions lie in rows
// [h * rows, +rows) and sequence b's starts at round_up(q_start, kAlign) +
// kAlign * b: disjoint for non-decreasing cu_seqlens, and inside the head's
// rows for any (a slot ends at total_q at most).
struct PaddedRows {
  static constexpr int64_t kAlign = 128;  // a multiple of every tile height
  int64_t rows = 0;
  int64_t heads = 0, batch = 0;
  bool packed = false;

  PaddedRows() = default;
  explicit PaddedRows(const AttentionParams& p)
      : rows(p.packed() ? round_up(p.total_q) + kAlign * p.batch : round_up(p.seqlen_q)),
        heads(p.heads_q),
        batch(p.batch),
        packed(p.packed()) {}
  FJ_HOST_DEVICE int64_t total() const { return (packed ? 1 : batch) * heads * rows; }
  // The first padded row of sequence b (seq = SeqlenInfo(p, b)), head h.
  // kPacked: whether the call is packed, when the caller knows it at compile time.
  template <bool kPacked>
  FJ_HOST_DEVICE int64_t start_of(const SeqlenInfo& seq, int64_t b, int64_t h) const {
    if constexpr (kPacked) return h * rows + round_up(seq.q_start) + kAlign * b;
    else return (b * heads + h) * rows;
  }
  FJ_HOST_DEVICE int64_t start(const SeqlenInfo& seq, int64_t b, int64_t h) const {
    return packed ? start_of<true>(seq, b, h) : start_of<false>(seq, b, h);
  }
  FJ_HOST_DEVICE static int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

  // Whose padded row `at` (< total()) is: sequence b's slot row i of head h
  // (i outside [0, seq.q_slot): padding).
  struct Row {
    int64_t b, h, i;
    SeqlenInfo seq;
  };
  __device__ Row locate(const AttentionParams& p, int64_t at) const {
    Row r;
    if (!packed) {
      const int64_t bh = at / rows;
      r.b = bh / heads;
      r.h = bh % heads;
      r.i = at % rows;
      r.seq = SeqlenInfo(p, r.b);
      return r;
    }
    r.h = at / rows;
    const int64_t row = at % rows;
    const auto region = [&](int64_t b) { return start(SeqlenInfo(p, b), b, 0); };
    r.b = last_sequence_starting_by(batch, row, region);
    r.seq = SeqlenInfo(p, r.b);
    r.i = row - region(r.b);
    return r;
  }
};

struct BackwardWorkspace {
  static constexpr size_t kArrayAlign = 256;

  TensorRef D;             // float32 like lse: rowsum(dO * O) - dlse (used rows only)
  TensorRef dsink_rows;    // float32 like lse: each used row's share of dsinks
  // Set by a tensor-core kernel that stored a NaN or inf gradient (zeroed by
  // backward_preprocess; read by recompute_nonfinite_gradients).
  int* nonfinite = nullptr;
  SegmentTiles segments;   // with segment ids only
  MaskTiles masks;         // with a mask only (the Hopper kernels narrow their blocks by it)
  PaddedRows padded;             // the layout of the next three
  float* lse2_padded = nullptr;  // lse in log2 units, +inf past the used rows
  float* D_padded = nullptr;     // D, 0 past the used rows
  float* dq_accum = nullptr;     // float32 dQ, dq_cols a row
  // Deterministic fused dQ: one counter per kDqOrderRows padded rows, the key blocks
  // that have added to those rows of dq_accum so far (they add in a fixed order).
  static constexpr int64_t kDqOrderRows = 64;
  int* dq_order = nullptr;
  // Packed / seqused layouts: the key and query kernels' work lists.
  VarlenWorkList key_list, query_list;
  int64_t dq_cols = 0;
  size_t bytes = 0;

  // base may be null to size the workspace only.
  // dq_columns: the float32 dQ buffer's (0: none); ordered_dq: with dq_order.
  BackwardWorkspace(const AttentionParams& p, void* base, bool padded_stats, int64_t dq_columns,
                    bool ordered_dq = false)
      : padded(p), dq_cols(dq_columns) {
    const size_t padded_rows = static_cast<size_t>(padded.total());
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
    nonfinite = static_cast<int*>(take(sizeof(int)));
    segments = SegmentTiles(p, take(SegmentTiles::workspace_bytes(p)));
    masks = MaskTiles(p, take(MaskTiles::workspace_bytes(p)));
    if (padded_stats) {
      lse2_padded = take_floats(padded_rows);
      D_padded = take_floats(padded_rows);
    }
    if (dq_cols > 0) {  // (the counters right after the buffer: zeroed with it)
      const size_t dq_floats = padded_rows * static_cast<size_t>(dq_cols);
      dq_accum = take_floats(dq_floats + (ordered_dq ? dq_order_counters() : 0));
      if (ordered_dq && dq_accum) dq_order = reinterpret_cast<int*>(dq_accum + dq_floats);
    }
    if (padded_stats && layouts_of(p) != Layouts::kUniform) {
      key_list = VarlenWorkList(p, take(VarlenWorkList::workspace_bytes(p)));
      query_list = VarlenWorkList(p, take(VarlenWorkList::workspace_bytes(p)));
    }
  }

  size_t dq_order_counters() const {
    return static_cast<size_t>(padded.total() / kDqOrderRows);
  }
  // The float4s backward_preprocess zeroes: the dQ buffer and its counters.
  int64_t zeroed_float4s() const {
    if (!dq_accum) return 0;
    const size_t words = static_cast<size_t>(padded.total()) * static_cast<size_t>(dq_cols) +
                         (dq_order ? dq_order_counters() : 0);
    return static_cast<int64_t>((words + 3) / 4);  // (within the array's kArrayAlign bytes)
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
