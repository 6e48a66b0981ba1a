// Block ranges: which key tiles a query tile visits (KeyRange) and which
// query tiles a key tile visits (QueryRange), from SeqlenInfo's masks;
// segments.cuh narrows them to segment-id spans.
#pragma once

#include <cstdint>

#include "flashjax/seqlen.h"

namespace flashjax::cuda {

// The keys that the used query rows [q0, q_last] of a tile see (q_last: its
// last used row, < q0 when it has none), visited in tiles of n from the
// multiple of n at or below the first. (No used row: last_key(seqlen_q) = -1.)
struct KeyRange {
  int64_t key_begin, key_end, tile_begin;
  KeyRange() = default;
  __device__ KeyRange(const SeqlenInfo& seq, int64_t q0, int64_t q_last, int n)
      : key_begin(seq.first_key(q0)),
        key_end(seq.last_key(q_last < q0 ? seq.seqlen_q : q_last) + 1),
        tile_begin(key_begin / n * n) {}
  __device__ int64_t tiles(int n) const {
    return key_end > tile_begin ? (key_end - tile_begin + n - 1) / n : 0;
  }
  // Only keys in [lo, hi) too (a segment-id span, SegmentTiles::key_span).
  __device__ void narrow(int64_t lo, int64_t hi, int n) {
    key_begin = max(key_begin, lo);
    key_end = min(key_end, hi);
    tile_begin = key_begin / n * n;
  }
};

// The query rows that see the used keys [k0, k_last] of a tile (k_last: its
// last used key, < k0 when it has none), in tiles of n from the multiple of
// n at or below the first.
struct QueryRange {
  int64_t row_begin, row_end, tile_begin;
  __device__ QueryRange(const SeqlenInfo& seq, int64_t k0, int64_t k_last, int n)
      : row_begin(seq.first_query(k0)),
        row_end(seq.last_query(k_last < k0 ? seq.seqlen_k : k_last) + 1),
        tile_begin(row_begin / n * n) {}
  // Only rows in [lo, hi) too (a segment-id span, SegmentTiles::query_span).
  __device__ void narrow(int64_t lo, int64_t hi, int n) {
    row_begin = max(row_begin, lo);
    row_end = min(row_end, hi);
    tile_begin = row_begin / n * n;
  }
};

}  // namespace flashjax::cuda
