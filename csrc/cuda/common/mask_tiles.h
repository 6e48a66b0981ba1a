// Tile summaries of a boolean mask (params.h's ScoreArray `mask`): per mask entry
// and block of kRows query rows x kRows keys, whether any pair of the block is
// allowed and whether any is hidden. compute_mask_tiles fills them on the device
// before the attention kernels, which then skip the key tiles a mask hides
// completely and read the mask per element only on tiles that mix both.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flashjax/params.h"

namespace flashjax::cuda {

struct MaskTiles {
  static constexpr int64_t kRows = 64;
  static constexpr uint8_t kAnyAllowed = 1, kAnyHidden = 2;
  // A row tile's column tiles with an allowed pair: [first, end) (empty: first >= end);
  // dense: every column tile in it has one (causal, prefix-LM and sliding-window masks),
  // so that a kernel takes the span's tiles without asking for each one. The same of
  // a column tile's row tiles (col_spans).
  struct RowSpan {
    int32_t first, end, dense, unused;
  };
  static constexpr size_t kSpansAlign = alignof(RowSpan);
  uint8_t* bits = nullptr;  // [batch entries][head entries][row_tiles][col_tiles]; null: no mask
  RowSpan* spans = nullptr;      // [batch entries][head entries][row_tiles]
  RowSpan* col_spans = nullptr;  // [batch entries][head entries][col_tiles]
  int64_t row_tiles = 0, col_tiles = 0, head_entries = 0;
  int64_t batch_div = 1, head_div = 1;

  FJ_HOST_DEVICE static int64_t tiles(int64_t n) { return (n + kRows - 1) / kRows; }
  FJ_HOST_DEVICE static int64_t entries(const AttentionParams& p) {
    return (p.batch / p.mask.batch_div) * (p.heads_q / p.mask.head_div);
  }
  static size_t bits_bytes(const AttentionParams& p) {
    const auto n = static_cast<size_t>(entries(p) * tiles(p.seqlen_q) * tiles(p.seqlen_k));
    return (n + kSpansAlign - 1) / kSpansAlign * kSpansAlign;
  }
  static size_t workspace_bytes(const AttentionParams& p) {
    if (!p.mask) return 0;
    return bits_bytes(p) + static_cast<size_t>(entries(p) * (tiles(p.seqlen_q) +
                                                             tiles(p.seqlen_k))) *
                               sizeof(RowSpan);
  }
  MaskTiles() = default;
  // `workspace`: workspace_bytes(p) bytes, or null (no summaries).
  MaskTiles(const AttentionParams& p, void* workspace) {
    if (!p.mask || !workspace) return;
    bits = static_cast<uint8_t*>(workspace);
    spans = reinterpret_cast<RowSpan*>(bits + bits_bytes(p));
    col_spans = spans + entries(p) * tiles(p.seqlen_q);
    row_tiles = tiles(p.seqlen_q);
    col_tiles = tiles(p.seqlen_k);
    head_entries = p.heads_q / p.mask.head_div;
    batch_div = p.mask.batch_div;
    head_div = p.mask.head_div;
  }
  explicit FJ_HOST_DEVICE operator bool() const { return bits != nullptr; }

  // The summaries of one mask entry: that of sequence b, query head h (entry()).
  struct Entry {
    const uint8_t* bits = nullptr;  // null: no mask
    const RowSpan *spans = nullptr, *col_spans = nullptr;
    int64_t row_tiles = 0, col_tiles = 0;
    explicit FJ_HOST_DEVICE operator bool() const { return bits != nullptr; }
    // The summary bits (kAnyAllowed | kAnyHidden, OR-ed) of query rows [r0, r0 + rows)
    // x keys [c0, c0 + cols) (slot rows, r0 and c0 >= 0; blocks past the mask's end
    // are left out).
    FJ_HOST_DEVICE uint8_t of(int64_t r0, int64_t rows, int64_t c0, int64_t cols) const {
      uint8_t out = 0;
      const uint64_t r_end = static_cast<uint64_t>(r0 + rows + kRows - 1) / kRows,
                     c_end = static_cast<uint64_t>(c0 + cols + kRows - 1) / kRows;
      const auto row_n = static_cast<uint64_t>(row_tiles), col_n = static_cast<uint64_t>(col_tiles);
      for (uint64_t r = static_cast<uint64_t>(r0) / kRows; r < r_end && r < row_n; ++r)
        for (uint64_t c = static_cast<uint64_t>(c0) / kRows; c < c_end && c < col_n; ++c)
          out |= bits[r * col_tiles + c];
      return out;
    }
    // The union of the spans of query rows [r0, r0 + rows)'s row tiles (r0 >= 0): the
    // column tiles some of them may see; dense where each non-empty span is and they
    // overlap or touch (one interval).
    FJ_HOST_DEVICE RowSpan span(int64_t r0, int64_t rows) const {
      return union_of(spans, r0, rows, row_tiles);
    }
    // The same of keys [c0, c0 + cols): the row tiles that may see some of them.
    FJ_HOST_DEVICE RowSpan col_span(int64_t c0, int64_t cols) const {
      return union_of(col_spans, c0, cols, col_tiles);
    }
    FJ_HOST_DEVICE static RowSpan union_of(const RowSpan* of_tile, int64_t x0, int64_t n,
                                           int64_t tiles) {
      RowSpan out{0, 0, 1, 0};
      int32_t max_first = 0, min_end = 0;
      bool any = false;
      const int64_t t_end = (x0 + n + kRows - 1) / kRows;
      for (int64_t t = x0 / kRows; t < t_end && t < tiles; ++t) {
        const RowSpan s = of_tile[t];
        if (s.first >= s.end) continue;
        out.first = any ? (s.first < out.first ? s.first : out.first) : s.first;
        out.end = any ? (s.end > out.end ? s.end : out.end) : s.end;
        max_first = any ? (s.first > max_first ? s.first : max_first) : s.first;
        min_end = any ? (s.end < min_end ? s.end : min_end) : s.end;
        out.dense &= s.dense;
        any = true;
      }
      if (any && max_first > min_end) out.dense = 0;  // (a gap between the spans)
      return out;
    }
  };
  // The rows (or keys) [begin', end') a kernel with tiles of n rows from `begin` takes
  // for a span (its first and end tiles of kRows): the span clipped to [begin, end)
  // (end: begin + a multiple of n) and rounded out to whole tiles of that grid;
  // [begin, begin) where nothing is left.
  struct Range {
    int64_t begin, end;
  };
  FJ_HOST_DEVICE static Range on_grid(const RowSpan& s, int64_t begin, int64_t end, int64_t n) {
    const int64_t lo = s.first * kRows > begin ? s.first * kRows : begin,
                  hi = s.end * kRows < end ? s.end * kRows : end;
    if (hi <= lo) return {begin, begin};
    return {begin + (lo - begin) / n * n, begin + (hi - begin + n - 1) / n * n};
  }
  // The index of sequence b, query head h's entry: batch_entry(b) + head_entry(h)
  // (divisions: a kernel that asks for many tiles keeps the parts it reuses; 32-bit:
  // b and h are small).
  FJ_HOST_DEVICE uint32_t batch_entry(int64_t b) const {
    return static_cast<uint32_t>(b) / static_cast<uint32_t>(batch_div) *
           static_cast<uint32_t>(head_entries);
  }
  FJ_HOST_DEVICE uint32_t head_entry(int64_t h) const {
    return static_cast<uint32_t>(h) / static_cast<uint32_t>(head_div);
  }
  // Entry e's summaries of row tile r: col_tiles bytes, one per column tile.
  FJ_HOST_DEVICE const uint8_t* row_bits(uint32_t e, int64_t r) const {
    return bits + (e * row_tiles + r) * col_tiles;
  }
  // Sequence b, query head h's entry: made once per (sequence, head) by a kernel that
  // asks for many tiles of it.
  FJ_HOST_DEVICE Entry entry(int64_t b, int64_t h) const {
    if (!bits) return {};
    const uint32_t e = batch_entry(b) + head_entry(h);
    return {row_bits(e, 0), spans + e * row_tiles, col_spans + e * col_tiles, row_tiles,
            col_tiles};
  }
  FJ_HOST_DEVICE uint8_t of(int64_t b, int64_t h, int64_t r0, int64_t rows, int64_t c0,
                            int64_t cols) const {
    return entry(b, h).of(r0, rows, c0, cols);
  }
};

// Fills `tiles` (of p's mask) on `stream`.
cudaError_t compute_mask_tiles(const AttentionParams& p, const MaskTiles& tiles,
                               cudaStream_t stream);

}  // namespace flashjax::cuda
