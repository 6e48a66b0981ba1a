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

// Sequence b has ceil(slot / tile_rows) tiles of its query (or, with keys, key)
// slot, and `heads` items per tile (per pair of tiles with pairs). It is
// ordered by its used rows' tiles, where the cost is (the rest of a slot only
// gets zeros).
struct WorkShape {
  int64_t tile_rows = 1, heads = 1;
  bool keys = false, pairs = false;
  // At most this many items in all (the grid of a non-persistent kernel);
  // only inconsistent metadata (overlapping slots) reaches it.
  int64_t max_items = INT64_MAX;

  FJ_HOST_DEVICE int64_t items(int64_t tiles) const { return heads * (pairs ? (tiles + 1) / 2 : tiles); }
};

// The work list (device memory), in schedule order: position i is sequence
// `sequence[i]`, of `tiles[i]` tiles, whose items are [first_item[i],
// first_item[i + 1]); first_item[batch] is the total.
struct VarlenWorkList {
  int64_t* first_item = nullptr;  // [batch + 1]
  int32_t* sequence = nullptr;    // [batch]
  int32_t* tiles = nullptr;       // [batch] (slots < 2^30 rows: int32)
  int64_t batch = 0;

  static size_t workspace_bytes(const AttentionParams& p) {
    const size_t n = static_cast<size_t>(p.batch);
    return sizeof(int64_t) * (n + 1) + 2 * sizeof(int32_t) * n;
  }
  VarlenWorkList() = default;
  // `workspace`: workspace_bytes(p) bytes, 8-byte aligned.
  VarlenWorkList(const AttentionParams& p, void* workspace) : batch(p.batch) {
    first_item = static_cast<int64_t*>(workspace);
    sequence = reinterpret_cast<int32_t*>(first_item + batch + 1);
    tiles = sequence + batch;
  }

  FJ_HOST_DEVICE int64_t items() const { return first_item[batch]; }

  // Item `item` (< items()): its sequence, that sequence's tiles, and its
  // index among the sequence's items.
  struct Entry {
    int64_t sequence, tiles, local;
  };
  FJ_HOST_DEVICE Entry find(int64_t item) const {
    // The last position whose items start at or before `item` (positions with
    // no items share their start with the next one, so it has items).
    int64_t lo = 0, hi = batch - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (first_item[mid] <= item) lo = mid;
      else hi = mid - 1;
    }
    return {sequence[lo], tiles[lo], item - first_item[lo]};
  }
};

}  // namespace flashjax::cuda
