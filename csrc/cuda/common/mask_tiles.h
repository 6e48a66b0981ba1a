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
  uint8_t* bits = nullptr;  // [batch entries][head entries][row_tiles][col_tiles]; null: no mask
  int64_t row_tiles = 0, col_tiles = 0, head_entries = 0;
  int64_t batch_div = 1, head_div = 1;

  FJ_HOST_DEVICE static int64_t tiles(int64_t n) { return (n + kRows - 1) / kRows; }
  FJ_HOST_DEVICE static int64_t entries(const AttentionParams& p) {
    return (p.batch / p.mask.batch_div) * (p.heads_q / p.mask.head_div);
  }
  static size_t workspace_bytes(const AttentionParams& p) {
    if (!p.mask) return 0;
    return static_cast<size_t>(entries(p) * tiles(p.seqlen_q) * tiles(p.seqlen_k));
  }
  MaskTiles() = default;
  // `workspace`: workspace_bytes(p) bytes, or null (no summaries).
  MaskTiles(const AttentionParams& p, void* workspace) {
    if (!p.mask || !workspace) return;
    bits = static_cast<uint8_t*>(workspace);
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
  };
  // Sequence b, query head h's entry: made once per (sequence, head) by a kernel that
  // asks for many tiles of it (the entry's index divides; 32-bit: b and h are small).
  FJ_HOST_DEVICE Entry entry(int64_t b, int64_t h) const {
    if (!bits) return {};
    const auto eb = static_cast<uint32_t>(b) / static_cast<uint32_t>(batch_div),
               eh = static_cast<uint32_t>(h) / static_cast<uint32_t>(head_div);
    return {bits + (eb * head_entries + eh) * row_tiles * col_tiles, row_tiles, col_tiles};
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
