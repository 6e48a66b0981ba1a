// Longest-first work lists of the Hopper kernels for packed / seqused calls,
// whose lengths only the device knows. A one-block pre-kernel
// (build_work_list, work_list.cuh) orders the sequences by their used tiles,
// longest first, and writes where each one's items start; a kernel finds an
// item's sequence by binary search. What a sequence's items are is the
// WorkShape's: the forward's are pairs of query tiles per query head, the
// backward key kernel's key blocks per kv head, its query kernel's query
// blocks per query head.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashjax/params.h"

namespace flashjax::cuda {

// What a work list holds. Its entries are sequences: sequence b has
// ceil(slot / tile_rows) tiles of its query (or, with keys, key) slot, and
// `heads` items per tile (per pair of tiles with pairs), ordered by its used
// rows' tiles, where the cost is (the rest of a slot only gets zeros). With
// per_tile (segment ids: the cost of a tile is its segment-id key span, not
// its sequence's length), the entries are each sequence's query tiles
// instead, ordered by the keys their segment ids may meet.
struct WorkShape {
  int64_t tile_rows = 1, heads = 1;
  bool keys = false, pairs = false, per_tile = false;
  // At most this many items in all (the grid of a non-persistent kernel);
  // only inconsistent metadata (overlapping slots) reaches it.
  int64_t max_items = INT64_MAX;

  FJ_HOST_DEVICE int64_t items(int64_t tiles) const {
    return heads * (pairs ? (tiles + 1) / 2 : tiles);
  }
  // Entries of a call: sequences, or (per_tile) their tiles.
  int64_t entries(const AttentionParams& p) const {
    const int64_t slot = keys ? p.seqlen_k : p.seqlen_q;
    return per_tile ? p.batch * ((slot + tile_rows - 1) / tile_rows) : p.batch;
  }
};

// The work list (device memory), in schedule order: position i is entry
// tiles [first_tile[i], + tiles[i]) of sequence sequence[i], whose items are
// [first_item[i], first_item[i + 1]); first_item[entries] is the total.
struct VarlenWorkList {
  int64_t* first_item = nullptr;  // [entries + 1]
  int32_t* sequence = nullptr;    // [entries]
  int32_t* tiles = nullptr;       // [entries] (slots < 2^30 rows: int32)
  int32_t* first_tile = nullptr;  // [entries]
  int64_t entries = 0;

  static size_t workspace_bytes(int64_t entries) {
    const size_t n = static_cast<size_t>(entries);
    return sizeof(int64_t) * (n + 1) + 3 * sizeof(int32_t) * n;
  }
  VarlenWorkList() = default;
  // `workspace`: workspace_bytes(entries) bytes, 8-byte aligned.
  VarlenWorkList(int64_t n, void* workspace) : entries(n) {
    first_item = static_cast<int64_t*>(workspace);
    sequence = reinterpret_cast<int32_t*>(first_item + entries + 1);
    tiles = sequence + entries;
    first_tile = tiles + entries;
  }

  FJ_HOST_DEVICE int64_t items() const { return first_item[entries]; }

  // Item `item` (< items()): its entry's sequence, first tile and tiles, and
  // its index among the entry's items.
  struct Entry {
    int64_t sequence, first_tile, tiles, local;
  };
  FJ_HOST_DEVICE Entry find(int64_t item) const {
    // The last position whose items start at or before `item` (positions with
    // no items share their start with the next one, so it has items).
    int64_t lo = 0, hi = entries - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (first_item[mid] <= item) lo = mid;
      else hi = mid - 1;
    }
    return {sequence[lo], first_tile[lo], tiles[lo], item - first_item[lo]};
  }
};

}  // namespace flashjax::cuda
