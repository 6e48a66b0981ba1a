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
// has a mask). kBlockM / kBlockN: the item's query rows and a tile's keys.
template <bool kMaskedKeys, int kBlockM, int kBlockN>
struct ItemKeys {
  static constexpr bool kMasked = false;
  int64_t begin, count;
  template <class Item>
  __device__ ItemKeys(const Item& w, const MaskTiles&)
      : begin(w.keys.tile_begin), count(w.n_tiles) {}
  __device__ int64_t k0(int64_t it) const { return begin + it * kBlockN; }
};

// With a mask, only the producer walks the tiles (next_tile, in order): it
// publishes each one to the consumers (fwd_smem.cuh's PublishedTile). Values,
// not the mask's Entry: the producer thread has kProducerRegs registers, and a
// tile's summary is the item's few summary bytes read at one address.
template <int kBlockM, int kBlockN>
struct ItemKeys<true, kBlockM, kBlockN> {
  static constexpr bool kMasked = true;
  static constexpr int64_t kTileKeys = MaskTiles::kRows;
  static constexpr int kRowTiles = kBlockM / kConsumerRows;  // (one per consumer)
  static constexpr int kColTiles = kBlockN / MaskTiles::kRows;
  static_assert(kConsumerRows == MaskTiles::kRows && kBlockN % MaskTiles::kRows == 0,
                "a consumer's rows are one mask row tile, a key tile whole column tiles");
  static constexpr uint32_t kVisible = 1;  // summary(): some row may see a key,
  static constexpr int kMixedShift = 1;    // consumer r's rows a hidden pair (bit 1 + r)
  const uint8_t* at = nullptr;  // the item's first row tile's summaries (null: no mask)
  uint32_t cols = 0, rows = 0;  // the mask's column tiles (a row's); the item's row tiles
  int32_t col = 0, end_col = 0;  // the next tile's first column tile (next_tile's
                                 // cursor), the range's end
  int32_t unranged_lo, unranged_hi;  // RowSoftmax::unmasked_tiles of the item
  int64_t count = 0;
  bool dense = true;  // every tile of the range is taken: no walk

  // The range is first narrowed to the span of the keys the mask lets the item's
  // rows see (MaskTiles::RowSpan, on the item's tile grid); a dense span's tiles
  // are all taken, the others' counted here and walked by next_tile.
  template <class Item>
  __device__ ItemKeys(const Item& w, const MaskTiles& mask_tiles) {
    RowSoftmax::unmasked_tiles(w.seq, w.q0, w.last_row, kBlockN, w.keys.key_begin,
                               w.keys.key_end, unranged_lo, unranged_hi);
    int64_t begin = w.keys.tile_begin, end = begin + w.n_tiles * kBlockN;
    const MaskTiles::Entry mask = mask_tiles.entry(w.b, w.h);
    if (mask) {
      const int64_t row0 = w.q0 / MaskTiles::kRows, used_rows = w.last_row - w.q0 + 1;
      at = mask.bits + row0 * mask.col_tiles;
      cols = static_cast<uint32_t>(mask.col_tiles);
      if (used_rows > 0) {  // (else no row: every tile, none mixed)
        rows = static_cast<uint32_t>(
            min(MaskTiles::tiles(w.last_row + 1), mask.row_tiles) - row0);
        const MaskTiles::RowSpan span = mask.span(w.q0, used_rows);
        const MaskTiles::Range r = MaskTiles::on_grid(span, begin, end, kBlockN);
        begin = r.begin;
        end = r.end;
        dense = span.dense != 0;
      }
    }
    col = static_cast<int32_t>(begin / kTileKeys);
    end_col = static_cast<int32_t>(end / kTileKeys);
    if (dense) {
      count = (end - begin) / kBlockN;
      return;
    }
#pragma unroll 4
    for (int32_t c = col; c < end_col; c += kColTiles)  // (independent loads: no walk)
      count += (summary(c) & kVisible) != 0;
  }
  // The summary of the key tile from column tile c: kVisible where the mask lets
  // some of the item's rows see one of its keys, bit kMixedShift + r where it
  // hides some pair from consumer r's rows (no mask: every consumer's).
  __device__ uint32_t summary(int32_t c) const {
    if (!at) return kVisible | ((1u << kRowTiles) - 1) << kMixedShift;
    uint32_t out = 0;
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) {
        const bool in = r < static_cast<int>(rows) && static_cast<uint32_t>(c + j) < cols;
        const uint8_t bits = in ? at[r * cols + c + j] : 0;
        out |= (bits & MaskTiles::kAnyAllowed ? kVisible : 0u) |
               (bits & MaskTiles::kAnyHidden ? 1u << (kMixedShift + r) : 0u);
      }
    return out;
  }
  // The next tile the item takes (count calls), as the producer publishes it.
  __device__ PublishedTile next_tile() {
    uint32_t s = summary(col);
    if (!dense)  // (count found that many visible tiles before end_col)
      while (!(s & kVisible) && col + kColTiles < end_col) s = summary(col += kColTiles);
    const int32_t k0 = col * static_cast<int32_t>(kTileKeys);
    const PublishedTile tile{k0, s >> kMixedShift, k0 < unranged_lo || k0 > unranged_hi};
    col += kColTiles;
    return tile;
  }
};

// The consumers' side of ItemKeys<true, ...>: what the producer published (the item's
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
