// The Hopper backward's workspace: the common arrays (BackwardWorkspace), then
// per-row statistics padded to whole tiles (so that its producer can copy them
// with bulk copies), the float32 dQ buffer of the fused key kernel (with its
// order counters when deterministic, DqOrder), and for packed / seqused layouts
// the key and query kernels' work lists.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../common/backward_workspace.h"
#include "../common/sequence_layout.h"
#include "../common/work_list.h"
#include "flashjax/params.h"
#include "flashjax/seqlen.h"

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

struct HopperBackwardWorkspace : BackwardWorkspace {
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

  // dq_columns: the float32 dQ buffer's (0: none); ordered_dq: with dq_order.
  // base may be null to size the workspace only.
  HopperBackwardWorkspace(const AttentionParams& p, void* base, int64_t dq_columns,
                          bool ordered_dq)
      : padded(p), dq_cols(dq_columns) {
    WorkspaceCarver carver(base);
    carve(p, carver);
    const size_t padded_rows = static_cast<size_t>(padded.total());
    lse2_padded = carver.take_floats(padded_rows);
    D_padded = carver.take_floats(padded_rows);
    if (dq_cols > 0) {  // (the counters right after the buffer: zeroed with it)
      const size_t dq_floats = padded_rows * static_cast<size_t>(dq_cols);
      const size_t counters = ordered_dq ? padded_rows / kDqOrderRows : 0;
      dq_accum = carver.take_floats(dq_floats + counters);
      if (ordered_dq && dq_accum) dq_order = reinterpret_cast<int*>(dq_accum + dq_floats);
      if (dq_accum) {  // (whole float4s: within the array's kArrayAlign bytes)
        zeroed = dq_accum;
        zeroed_float4s = static_cast<int64_t>((dq_floats + counters + 3) / 4);
      }
    }
    if (layouts_of(p) != Layouts::kUniform) {
      key_list = VarlenWorkList(p, carver.take(VarlenWorkList::workspace_bytes(p)));
      query_list = VarlenWorkList(p, carver.take(VarlenWorkList::workspace_bytes(p)));
    }
    bytes = carver.bytes();
  }
};

}  // namespace flashjax::cuda
