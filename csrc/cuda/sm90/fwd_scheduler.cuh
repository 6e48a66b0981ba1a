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
//
// Every role walks the items the same way (for_each_work_tile,
// tile_scheduler.cuh), and WorkItem says what an item is: its rows, its
// sequence and the key tiles it visits.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/block.cuh"
#include "../common/device.cuh"
#include "../common/mask_tiles.h"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "flashjax/params.h"
#include "flashjax/seqlen.h"
#include "fwd_smem.cuh"
#include "fwd_tile_config.h"
#include "tile_scheduler.cuh"
#include "work_list.cuh"

namespace flashjax::cuda::hopper_fwd {

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
  using Item = QueryTile;
  static constexpr bool kOneItemPerCta = false;
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
  using Item = QueryTile;
  static constexpr bool kOneItemPerCta = false;
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

// The schedule type of a layout (TileSchedule's GQA packing: uniform only).
template <Layouts kLayouts>
using ScheduleOf =
    std::conditional_t<kLayouts == Layouts::kUniform, TileSchedule, VarlenTileSchedule>;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// One work item of a CTA: a tile of kBlockM query rows (slot rows from q0)
// of one head of sequence b, whose rows seq locates.
// (GQA packing: bh indexes batch * heads_kv, h is the group's first query head.)
template <Layouts kLayouts, int kBlockM, int kBlockN>
struct WorkItem {
  int64_t b, h, hk, q0;
  SeqlenInfo seq;
  int64_t last_row;  // the tile's last used row (< q0: none, the tile only writes zeros)
  KeyRange keys;
  int64_t n_tiles;
  __device__ WorkItem(const AttentionParams& p, QueryTile t, bool packed,
                      const SegmentTiles& segment_tiles)
      : b(t.bh / (packed ? p.heads_kv : p.heads_q)),
        h(packed ? t.bh % p.heads_kv * p.group_size() : t.bh % p.heads_q),
        hk(h / p.group_size()),
        q0(t.tile * kBlockM),
        seq(sequence_info<kLayouts>(p, b)),
        last_row(min(q0 + kBlockM, seq.seqlen_q) - 1),
        keys(seq, q0, last_row, kBlockN) {
    narrow_to_segments<kLayouts>(keys, segment_tiles, b, q0, kBlockM, kBlockN);
    n_tiles = keys.tiles(kBlockN);
  }

  // TMA coordinates (int32: the tensors' rows are < 2^30): the tensor rows of
  // the tile's first query and of slot key k0, and the batch entry. A tile
  // that crosses the end of its sequence's used rows loads the rows that
  // follow (padding, or the next sequence's: TMA only zero-fills past the
  // tensor). Such queries only reach their own rows, cleared before the write
  // (clear_unused_rows); such keys are masked to P = 0 and their V rows zeroed
  // (clear_values_past_end), so a non-finite value there (NaN, inf: e.g.
  // uninitialised padding of a seqused KV cache) does not reach this sequence.
  __device__ int q_row() const { return static_cast<int>(seq.q_row(q0)); }
  __device__ int k_row(int64_t k0) const { return static_cast<int>(seq.k_row(k0)); }
  __device__ int batch() const { return static_cast<int>(seq.batch); }
};

// The key tiles a work item visits, tile it from key k0(it): its contiguous range
// (kMasked false), or the tiles of that range that a mask does not hide
// completely for any of the item's rows (MaskTiles; kTerms kernels, when the call
// has a mask). k0 is asked for in order of it (the masked walk steps forward).
template <bool kMaskedKeys>
struct ItemKeys {
  static constexpr bool kMasked = false;
  int64_t begin, count;
  int n;
  template <class Item>
  __device__ ItemKeys(const Item& w, const MaskTiles&, int tile_keys)
      : begin(w.keys.tile_begin), count(w.n_tiles), n(tile_keys) {}
  __device__ int64_t k0(int64_t it) const { return begin + it * n; }
};

template <>
struct ItemKeys<true> {
  static constexpr bool kMasked = true;
  MaskTiles::Entry mask;  // the item's (sequence, head)'s summaries
  int64_t q0, rows, begin, end, count = 0;
  int n;
  bool dense = true;  // every tile of [begin, end) is taken: no walk
  mutable int64_t at_it = 0, at_k0 = 0;
  // The range is first narrowed to the span of the keys the mask lets the item's
  // rows see (MaskTiles::RowSpan, on the item's tile grid); a dense span's tiles
  // are all taken, the others' are walked (only the producer walks: it publishes
  // the tiles to the consumers, fwd_smem.cuh's PublishedTile).
  template <class Item>
  __device__ ItemKeys(const Item& w, const MaskTiles& mask_tiles, int tile_keys)
      : mask(mask_tiles.entry(w.b, w.h)),
        q0(w.q0),
        rows(w.last_row - w.q0 + 1),
        begin(w.keys.tile_begin),
        end(w.keys.tile_begin + w.n_tiles * tile_keys),
        n(tile_keys) {
    if (mask && rows > 0) {
      const MaskTiles::RowSpan span = mask.span(q0, rows);
      const MaskTiles::Range r = MaskTiles::on_grid(span, begin, end, n);
      begin = r.begin;
      end = r.end;
      dense = span.dense != 0;
    }
    at_k0 = dense ? begin : next(begin);
    if (dense) {
      count = (end - begin) / n;
    } else {
#pragma unroll 4
      for (int64_t k = begin; k < end; k += n)  // (independent loads: no walk)
        count += (mask.of(q0, rows, k, n) & MaskTiles::kAnyAllowed) != 0;
    }
  }
  // The first tile from k0 (tile-aligned) that the mask lets any row see.
  __device__ int64_t next(int64_t k0) const {
    if (!mask || rows <= 0) return k0;
    while (k0 < end && !(mask.of(q0, rows, k0, n) & MaskTiles::kAnyAllowed)) k0 += n;
    return k0;
  }
  __device__ int64_t k0(int64_t it) const {
    if (dense) return begin + it * n;
    for (; at_it < it; ++at_it) at_k0 = next(at_k0 + n);
    return at_k0;
  }
  // Tile it as the producer publishes it to `consumers` warpgroups of
  // kConsumerRows rows from q0 (fwd_smem.cuh's PublishedTile).
  __device__ PublishedTile published(int64_t it, int64_t q0_of_item, int consumers) const {
    PublishedTile tile{k0(it), 0};
    for (int c = 0; c < consumers; ++c)
      if (!mask || (mask.of(q0_of_item + c * kConsumerRows, kConsumerRows, tile.k0, n) &
                    MaskTiles::kAnyHidden))
        tile.mixed |= uint64_t{1} << c;
    return tile;
  }
};

// The consumers' side of ItemKeys<true>: what the producer published (the item's
// count once its Q tile is in, a tile's first key once its K tile is).
struct PublishedKeys {
  static constexpr bool kMasked = true;
  int64_t count = 0;
};

// The rows of work item w that warp `warp_in_group` of consumer warpgroup
// `consumer` holds (as lane threadIdx.x % 32); kPacks: GQA packing compiled in.
template <bool kPacks, int kBlockM, int kBlockN, Layouts kLayouts>
__device__ __forceinline__ RowSoftmax item_rows(const WorkItem<kLayouts, kBlockM, kBlockN>& w,
                                                const ScheduleOf<kLayouts>& schedule,
                                                int consumer, int warp_in_group) {
  return RowSoftmax{w.q0 + consumer * kConsumerRows + warp_in_group * kWarpRows +
                        (threadIdx.x % 32) / 4,
                    kPacks ? static_cast<int>(schedule.packed_rows) : 0};
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
