// The Hopper forward's persistent schedules: which query tiles each CTA does,
// in which order. A work item is a pair of query tiles of one head, tile j and
// tile q_tiles - 1 - j, done one after the other: under a causal mask their
// costs add up to the same total for every j, so items cost alike under any
// mask. gridDim.x CTAs (one per SM) take the items in rounds of gridDim.x,
// one head's items consecutive so that the CTAs running together read the
// same K and V from L2; odd rounds go in mirrored order (zig-zag) to even out
// what remains. The producer and the consumers of a CTA walk the same items.
//
// TileSchedule: uniform calls, every sequence alike, the items from the shapes.
// VarlenTileSchedule: packed / seqused calls, whose lengths only the device
// knows: a varlen work list (work_list.cuh) of pairs of query tiles, longest
// sequences first.
#pragma once

#include <cstdint>

#include "../common.cuh"
#include "work_list.cuh"

namespace flashjax::cuda {

enum class ScheduleStep { kTile, kSkip, kEnd };

// The item of this CTA's k-th tile (two tiles per item), zig-zag over rounds.
__device__ __forceinline__ int64_t scheduled_item(int64_t k) {
  const int64_t g = gridDim.x, round = k / 2;
  return round * g + ((round & 1) ? g - 1 - blockIdx.x : blockIdx.x);
}

// The k-th tile of a CTA whose item is the `local`-th of some heads' items
// (pairs per head, q_tiles tiles per head): pair j = local % pairs, the heavy
// tile q_tiles - 1 - j first, then j (kSkip: the missing half of a middle
// pair). head_of() gives QueryTile::bh, called only for a tile (it takes a
// 64-bit division).
template <class HeadOf>
__device__ __forceinline__ ScheduleStep tile_of_pair(int64_t k, int64_t local, int64_t pairs,
                                                     int64_t q_tiles, QueryTile& out,
                                                     HeadOf&& head_of) {
  const int64_t j = local % pairs, heavy = q_tiles - 1 - j;
  if (k % 2 == 1 && j == heavy) return ScheduleStep::kSkip;
  out = {k % 2 == 0 ? heavy : j, head_of()};
  return ScheduleStep::kTile;
}

// GQA packing: when a group's heads times seqlen_q fit in one tile
// (packed_rows = seqlen_q, e.g. decoding), a tile holds every query of a kv
// head's group of query heads, so K and V are read once for the group; the
// "heads" of the schedule are then the kv heads.
struct TileSchedule {
  int64_t q_tiles, pairs_per_head, total_pairs;
  int64_t packed_rows;  // 0: one query head per tile
  // The k-th tile of this CTA.
  __device__ ScheduleStep tile(int64_t k, QueryTile& out) const {
    const int64_t item = scheduled_item(k);
    if (item >= total_pairs) return ScheduleStep::kEnd;
    return tile_of_pair(k, item, pairs_per_head, q_tiles, out,
                        [&] { return item / pairs_per_head; });
  }
};

struct VarlenTileSchedule {
  static constexpr int64_t packed_rows = 0;  // (GQA packing is uniform-only)
  VarlenWorkList list;
  int64_t heads;

  __device__ ScheduleStep tile(int64_t k, QueryTile& out) const {
    const int64_t item = scheduled_item(k);
    if (item >= list.items()) return ScheduleStep::kEnd;
    const VarlenWorkList::Entry e = list.find(item);
    const int64_t pairs = (e.tiles + 1) / 2;
    return tile_of_pair(k, e.local, pairs, e.tiles, out,
                        [&] { return e.sequence * heads + e.local / pairs; });
  }
};

}  // namespace flashjax::cuda
