// Segment-id logic on accumulator fragments (kernels compiled for
// Layouts::kSegments): block ranges narrowed to the tiles whose ids may meet,
// and per-element id masks where a tile's ids are not all one.
#pragma once

#include <cstdint>
#include <type_traits>

#include "block.cuh"
#include "device.cuh"
#include "flashjax/seqlen.h"
#include "sequence_layout.h"

namespace flashjax::cuda {

// Segment-id masking of a thread's two fragment rows (row, row + 8) of a
// SegmentTiles tile against tiles of columns: rows are queries and columns
// keys (forward, dQ) or, transposed, rows are keys and columns queries (dK,
// dV). Column tiles whose ids cannot meet the row tile's are skipped
// (next_tile), the others compared per element unless all ids are equal.
// Only kernels compiled for Layouts::kSegments do anything here.
enum class FragmentRows { kQueries, kKeys };

// kSegments: narrows the keys (a KeyRange) that sequence b's query rows
// [row0, row0 + rows) visit to those whose segment-id tiles may meet theirs
// (documents packed in order: their own documents'), or the query rows (a
// QueryRange) that its keys [row0, row0 + rows) visit; n: the visited tiles' rows.
template <Layouts kLayouts, class Range>
__device__ __forceinline__ void narrow_to_segments(Range& range, const SegmentTiles& tiles,
                                                   int64_t b, int64_t row0, int64_t rows, int n) {
  if constexpr (kLayouts == Layouts::kSegments) {
    int64_t lo, hi;
    if constexpr (std::is_same_v<Range, KeyRange>) tiles.key_span(b, row0, rows, lo, hi);
    else tiles.query_span(b, row0, rows, lo, hi);
    range.narrow(lo, hi, n);
  }
}

template <Layouts kLayouts>
struct FragmentSegments {
  __device__ FragmentSegments(const AttentionParams&, const SegmentTiles&, const SeqlenInfo&,
                              int64_t, FragmentRows, int64_t, int64_t) {}
  __device__ int64_t next_tile(int64_t c0, int64_t, int) const { return c0; }
  template <int kTiles>
  __device__ void mask(float (&)[kTiles * 4], int64_t) const {}
};

template <>
struct FragmentSegments<Layouts::kSegments> {
  const int32_t* col_ids;
  const IdRange* col_tiles;  // this sequence's column tiles
  int64_t cols_used;
  IdRange row_tile;
  int32_t row_id[2];

  // Sequence b's tile of rows from row0, of which this thread holds row, row + 8.
  __device__ FragmentSegments(const AttentionParams& p, const SegmentTiles& tiles,
                              const SeqlenInfo& seq, int64_t b, FragmentRows rows, int64_t row0,
                              int64_t row) {
    const SegmentIds ids(p, b);
    const bool queries = rows == FragmentRows::kQueries;
    const int32_t* row_ids = queries ? ids.q : ids.k;
    const int64_t rows_used = queries ? seq.seqlen_q : seq.seqlen_k;
    col_ids = queries ? ids.k : ids.q;
    col_tiles = queries ? tiles.k + b * tiles.k_tiles : tiles.q + b * tiles.q_tiles;
    cols_used = queries ? seq.seqlen_k : seq.seqlen_q;
    row_tile = queries ? tiles.query_tile(b, row0) : tiles.key_tile(b, row0);
#pragma unroll
    for (int r = 0; r < 2; ++r)  // (rows past the used ones see nothing anyway)
      row_id[r] = row + 8 * r < rows_used ? row_ids[row + 8 * r] : 0;
  }
  // The first column tile from c0 (tile-aligned), before end, that may meet the rows.
  __device__ int64_t next_tile(int64_t c0, int64_t end, int n) const {
    while (c0 < end && !row_tile.meets(col_tiles[c0 / SegmentTiles::kRows])) c0 += n;
    return c0;
  }
  // -inf where a row's id differs from the id of column c0 + col (c0 a
  // multiple of SegmentTiles::kRows; the columns may span several such tiles).
  template <int kTiles>
  __device__ void mask(float (&s)[kTiles * 4], int64_t c0) const {
    constexpr int kGroupsPerTile = SegmentTiles::kRows / 8;  // 8-column groups
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int tile = 0; tile < (kTiles + kGroupsPerTile - 1) / kGroupsPerTile; ++tile) {
      const int64_t tile_c0 = c0 + tile * SegmentTiles::kRows;
      if (tile_c0 < cols_used && row_tile.all_equal(col_tiles[tile_c0 / SegmentTiles::kRows]))
        continue;
#pragma unroll
      for (int n = tile * kGroupsPerTile; n < kTiles && n < (tile + 1) * kGroupsPerTile; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t c = c0 + n * 8 + 2 * t + e;
          const int32_t id = c < cols_used ? col_ids[c] : 0;
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (c >= cols_used || id != row_id[r]) s[4 * n + 2 * r + e] = kNegInf;
        }
    }
  }
};

}  // namespace flashjax::cuda
