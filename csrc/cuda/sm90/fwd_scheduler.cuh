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
  const int64_t j = mod_index(local, pairs), heavy = q_tiles - 1 - j;
  if (k % 2 == 1 && j == heavy) return ScheduleStep::kSkip;
  out = {k % 2 == 0 ? heavy : j, head_of()};
  return ScheduleStep::kTile;
}

// GQA packing: when a group's heads times seqlen_q fit in one tile
// (packed_rows = seqlen_q, e.g. decoding), a tile holds every query of a kv
// head's group of query heads, so K and V are read once for the group; the
// "heads" of the schedule are then the kv heads.
//
// An odd number of query tiles leaves a head's middle tile without a partner:
// an item of half the others' cost, which a static round robin cannot balance
// (head dim 64's 192-row tiles at 2k: 11 tiles; tools/schedule_balance.py: the
// busiest SM's load 1.13x the mean at the FA3 shape, 1.03-1.04x with the middles
// paired). Where the items fill more than one round (middles_paired), the middle
// tiles of heads 2m and 2m + 1 form one item: a block of two heads holds head
// 2m's pairs, head 2m + 1's pairs, then the middle item (a last, odd head's
// block: its pairs, then its middle tile alone).
//
// Dynamic (uniform calls that fill more than one round, at head dim 64 with a window,
// causal included, and with a sliding window up to head dim 128: where it measured
// faster, fwd_launch_bucket.cuh): tiles of unequal cost, which a static deal of pairs balances only to the
// fraction of its last round (tools/schedule_balance.py: the busiest SM 1.03-1.13x the
// mean at the FA3 shapes). Instead the producer takes one tile at a time from an
// atomic counter (publish_next_tile) and the consumers read it from shared memory
// (ConsumerWalk), in longest-first order: sections of section_heads heads (as many as
// keep their keys and values in half of L2; the remainder of the heads first, so that
// the schedule ends on a whole section's lightest tiles), each section's tiles
// heaviest first (from the last query tile to the first where the window's right
// side is bounded, causal included: later rows see more keys; else from the first),
// its heads interleaved. The producer takes a tile after the previous one's last
// loads, a K/V stage or two before the consumers finish that one (taking it a whole
// tile ahead would leave the busiest SM 1.02-1.18x the mean in the replay, against
// 1.00-1.04x: tools/schedule_balance.py).
struct TileSchedule {
  using Item = QueryTile;
  static constexpr bool kOneItemPerCta = false;
  int64_t q_tiles, pairs_per_head, total_pairs;  // (middles_paired: pairs_per_head = q_tiles / 2)
  int64_t heads;        // the schedule's heads (batch x heads, or kv heads when packed)
  int64_t packed_rows;  // 0: one query head per tile
  bool middles_paired;
  bool dynamic = false, later_tiles_first;  // (dynamic: the order within a section)
  int64_t section_heads, total_tiles;       // (dynamic)
  // (dynamic, both zeroed before the launch) the tiles handed out, and per tile 1 +
  // the CTA that took it (the recompute's walk; 0: not yet seen taken)
  unsigned long long* counter;
  int* owner;
  // The k-th tile of this CTA (static schedules).
  __device__ ScheduleStep tile(int64_t k, QueryTile& out) const {
    const int64_t item = scheduled_item(k);
    if (item >= total_pairs) return ScheduleStep::kEnd;
    if (!middles_paired)
      return tile_of_pair(k, item, pairs_per_head, q_tiles, out,
                          [&] { return div_index(item, pairs_per_head); });
    const int64_t block = 2 * pairs_per_head + 1, first_head = div_index(item, block) * 2,
                  r = mod_index(item, block);
    const int64_t middle_at = first_head + 1 < heads ? 2 * pairs_per_head : pairs_per_head;
    if (r < middle_at) {
      const int64_t second = r >= pairs_per_head ? 1 : 0;
      return tile_of_pair(k, r - second * pairs_per_head, pairs_per_head, q_tiles, out,
                          [&] { return first_head + second; });
    }
    const int64_t head = first_head + k % 2;  // the middle item: one tile of each head
    if (head >= heads) return ScheduleStep::kSkip;
    out = {pairs_per_head, head};
    return ScheduleStep::kTile;
  }
  // The host's side of a static schedule: q_tiles query tiles of `schedule_heads`
  // heads on `ctas` CTAs.
  static TileSchedule make(int64_t q_tiles, int64_t schedule_heads, int64_t packed_rows,
                           int64_t ctas) {
    TileSchedule s{};
    s.q_tiles = q_tiles;
    s.heads = schedule_heads;
    s.packed_rows = packed_rows;
    s.total_tiles = q_tiles * schedule_heads;
    const int64_t unpaired = (q_tiles + 1) / 2 * schedule_heads;
    s.middles_paired = q_tiles % 2 == 1 && schedule_heads > 1 && unpaired > ctas;
    s.pairs_per_head = s.middles_paired ? q_tiles / 2 : (q_tiles + 1) / 2;
    s.total_pairs = s.middles_paired ? schedule_heads / 2 * (2 * s.pairs_per_head + 1) +
                                           schedule_heads % 2 * (s.pairs_per_head + 1)
                                     : unpaired;
    return s;
  }
  // The i-th tile of the dynamic order.
  __device__ QueryTile dynamic_tile(int64_t i) const {
    const int64_t remainder = mod_index(heads, section_heads);
    const int64_t remainder_tiles = remainder * q_tiles;
    int64_t first = 0, in_section = remainder, r = i;  // (the remainder's section)
    if (i >= remainder_tiles) {
      const int64_t j = i - remainder_tiles, section = div_index(j, section_heads * q_tiles);
      first = remainder + section * section_heads;
      in_section = section_heads;
      r = j - section * section_heads * q_tiles;
    }
    const int64_t rank = div_index(r, in_section);
    return {later_tiles_first ? q_tiles - 1 - rank : rank, first + mod_index(r, in_section)};
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
                        [&] { return e.sequence * heads + div_index(e.local, pairs); });
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
      : b(div_index(t.bh, packed ? p.heads_kv : p.heads_q)),
        h(packed ? mod_index(t.bh, p.heads_kv) * div_index(p.heads_q, p.heads_kv)
                 : mod_index(t.bh, p.heads_q)),
        hk(div_index(h, div_index(p.heads_q, p.heads_kv))),
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

// A dynamic TileSchedule's tiles go from the producer to the consumers through a
// ring of kItemSlots slots in shared memory (fwd_smem.cuh): the producer takes the
// next tile from the counter, records this CTA as its owner and publishes it as the
// CTA's k-th tile (the end: bh = -1), before its loads.
template <class Cfg>
__device__ __forceinline__ bool publish_next_tile(const TileSchedule& s,
                                                  const ForwardSmem<Cfg>& sm, int64_t k,
                                                  QueryTile& out) {
  const int slot = static_cast<int>(k % kItemSlots);
  mbar_wait(&sm.item_empty[slot], static_cast<int>((k / kItemSlots) & 1) ^ 1);
  const int64_t i = static_cast<int64_t>(atomicAdd(s.counter, 1ull));
  const bool more = i < s.total_tiles;
  out = more ? s.dynamic_tile(i) : QueryTile{0, -1};
  if (more) s.owner[i] = static_cast<int>(blockIdx.x) + 1;
  st_shared_u64(smem_u32(&sm.items[slot].tile), static_cast<uint64_t>(out.tile));
  st_shared_u64(smem_u32(&sm.items[slot].bh), static_cast<uint64_t>(out.bh));
  mbar_arrive(&sm.item_full[slot]);  // (release: the owner entry and the slot)
  return more;
}

// The consumers' walk of a schedule: a dynamic one's tiles as the producer publishes
// them (each consumer warp frees a slot once it has read it), the others' as the
// schedule computes them.
template <class Cfg, class Schedule>
struct ConsumerWalk {
  using Item = QueryTile;
  static constexpr bool kOneItemPerCta = false;
  const Schedule& schedule;
  const ForwardSmem<Cfg>& sm;
  __device__ ScheduleStep tile(int64_t k, QueryTile& out) const {
    if constexpr (std::is_same_v<Schedule, TileSchedule>) {
      if (schedule.dynamic) {
        const int slot = static_cast<int>(k % kItemSlots);
        mbar_wait(&sm.item_full[slot], static_cast<int>((k / kItemSlots) & 1));
        out.tile = static_cast<int64_t>(ld_shared_u64(smem_u32(&sm.items[slot].tile)));
        out.bh = static_cast<int64_t>(ld_shared_u64(smem_u32(&sm.items[slot].bh)));
        warp_arrive(&sm.item_empty[slot]);
        return out.bh < 0 ? ScheduleStep::kEnd : ScheduleStep::kTile;
      }
    }
    return schedule.tile(k, out);
  }
};

// Calls visit(tile) for every tile this CTA did, once its consumers are done (the
// recompute's walk): a dynamic schedule's from the owner entries (written by this
// CTA's producer before it published each tile, which the consumers acquired before
// the barrier that precedes this walk; another CTA's entry may still read 0, never
// this CTA's number).
template <class Schedule, class Visit>
__device__ __forceinline__ void for_each_done_tile(const Schedule& schedule, Visit&& visit) {
  if constexpr (std::is_same_v<Schedule, TileSchedule>) {
    if (schedule.dynamic) {
      const volatile int* owner = schedule.owner;
      for (int64_t i = 0; i < schedule.total_tiles; ++i)
        if (owner[i] == static_cast<int>(blockIdx.x) + 1) visit(schedule.dynamic_tile(i));
      return;
    }
  }
  for_each_work_tile(schedule, visit);
}

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
