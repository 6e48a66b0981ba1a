// Which rows a Hopper backward CTA owns and which tiles it streams past them:
// KeyBlock for the key kernels (keys of one kv head; query tiles of every
// query head of its group), QueryBlock for the query kernel (queries of one
// head; key tiles). One CTA per block (BlockSchedule, walked with
// for_each_work_tile as the forward's schedules are): uniform calls number
// the blocks from the shapes; packed / seqused calls take the longest-first
// work list (work_list.h), whose grid may have slots past its items (invalid
// blocks: the CTA has no work).
#pragma once

#include <cstdint>

#include "../common/block.cuh"
#include "../common/device.cuh"
#include "../common/mask.cuh"
#include "../common/mask_tiles.h"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/work_list.h"
#include "bwd_tile_config.h"
#include "bwd_workspace.h"
#include "flashjax/seqlen.h"
#include "tile_scheduler.cuh"

namespace flashjax::cuda::hopper_bwd {

// A block's streamed tiles in order, as the producer loads them and the dQ
// writer adds to them: the tile's first tensor row, its head and (key kernel)
// its first padded row (PaddedRows: statistics, dQ). Tiles run through
// `per_head` row tiles of a head, then the next head's; stepped without
// divisions (these loops run on few registers, and the consumers wait on the
// dQ writer's).
template <int kStreamRows>
struct StreamWalk {
  int64_t row, padded_row;
  int head;
  int64_t per_head, j = 0;
  int64_t head_padded;  // padded rows from one head's tile to the next head's
  int64_t first = 0;    // the tile each head's walk starts at (a rotated walk)
  __device__ void next() {
    row += kStreamRows;
    padded_row += kStreamRows;
    if (++j == per_head) {  // past the head's last tile: its first
      j = 0;
      row -= per_head * kStreamRows;
      padded_row -= per_head * kStreamRows;
    }
    if (j == first) {  // the head's tiles done: the next head's
      ++head;
      padded_row += head_padded;
    }
  }
};

// A block of `rows` tiles of a sequence: sequence b, head `head` (of `heads`
// in the work list's items), tile `tile`; valid = false past the list's items.
struct BlockIndex {
  int64_t b = 0, head = 0, tile = 0;
  bool valid = true;
};

// Uniform calls number a kernel's blocks (b, head) pair by pair, the pair's
// `tiles` blocks in a row. With `longest_first` (key kernels of causal calls,
// where a head's first key block sees every query and its last only the
// diagonal) they go in sections of `group` pairs, block-major within a section
// (FA3's order for its causal backward): a section is about one wave of CTAs
// (the SMs, %nsmid, over `tiles`; a power of two), so the L2 holds the same
// pairs' rows as in pair order while the longest blocks start first and the
// short ones fill the tail. (Pair order left SMs idle ~7% of the d128 2k causal
// key kernel, FA3's ~3%: ncu, H100, 2026-11-27.)
__device__ __forceinline__ void uniform_block(int64_t tiles, bool longest_first, int64_t& pair,
                                              int64_t& tile) {
  const uint32_t x = blockIdx.x, n = static_cast<uint32_t>(tiles);
  if (!longest_first) {
    pair = x / n;
    tile = x % n;
    return;
  }
  uint32_t sms;
  asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
  const uint32_t per_wave = max(sms / n, 1u);
  const uint32_t group = 1u << (31 - __clz(per_wave));
  const uint32_t pairs = gridDim.x / n, section = x / (group * n), first = section * group;
  const uint32_t in_section = x - first * n, width = min(group, pairs - first);
  pair = first + in_section % width;
  tile = in_section / width;
}

template <Layouts kLayouts>
__device__ __forceinline__ BlockIndex block_index(int64_t tiles_per_head, int64_t heads,
                                                  const VarlenWorkList& list,
                                                  bool longest_first = false) {
  BlockIndex i;
  if constexpr (kLayouts == Layouts::kUniform) {
    int64_t bh;
    uniform_block(tiles_per_head, longest_first, bh, i.tile);
    i.b = bh / heads;
    i.head = bh % heads;
  } else {
    i.valid = blockIdx.x < list.items();
    if (!i.valid) return i;
    const VarlenWorkList::Entry e = list.find(blockIdx.x);
    i.b = e.sequence;
    i.head = e.local / e.tiles;
    i.tile = e.local % e.tiles;
  }
  return i;
}

// The keys [k0, last_key] of kv head hk a key-kernel CTA owns (kRows of them;
// slot rows of sequence b, the used ones), and the streamed query tiles that
// see them: tile it is slot rows [row(it), +kStreamRows) of query head head(it).
// Config: the key kernel's (TileConfig or WideTileConfig).
template <class Config, Layouts kLayouts = Layouts::kUniform>
struct KeyBlock {
  static constexpr int kRows = Config::kOwnRows;
  static constexpr int kStreamRows = Config::kStreamRows;
  int64_t b, hk, k0, last_key, row_begin, q_tiles, tiles;
  // rotated: the block's walk over a head's tiles starts at tile first_tile and
  // wraps (ordered dQ of full attention: the blocks of a pair start spread over the
  // tiles instead of queueing behind each other at every tile, DqOrder).
  int64_t first_tile = 0;
  bool rotated = false;
  SeqlenInfo seq;
  bool valid;
  KeyBlock() = default;
  // ordered_dq: this launch adds dQ in a fixed order (DqOrder).
  __device__ KeyBlock(const AttentionParams& p, const VarlenWorkList& list,
                      const SegmentTiles& segment_tiles, bool ordered_dq) {
    // (Ordered dQ keeps pair order: a block whose dQ waits for later blocks of its
    // pair, DqOrder, finds them started. A mask: the causal order, a guess that
    // costs nothing where it is wrong: its blocks' lengths are unknown.)
    const BlockIndex i =
        block_index<kLayouts>(blocks(p), p.heads_kv, list,
                              (p.window_right == 0 || p.mask) && !ordered_dq);
    valid = i.valid;
    b = i.b;
    hk = i.head;
    k0 = i.tile * kRows;
    seq = sequence_info<kLayouts>(p, b);
    last_key = min(k0 + kRows, seq.seqlen_k) - 1;
    // (No used key, last_key < k0: no query tile; uniform calls have one.)
    row_begin = first_row(seq, k0);
    int64_t row_end = kLayouts != Layouts::kUniform && (last_key < k0 || !valid)
                          ? 0
                          : end_row(seq, k0);
    if constexpr (kLayouts == Layouts::kSegments) {
      int64_t lo, hi;  // (lo: a multiple of kStreamRows, as row_begin)
      segment_tiles.query_span(b, k0, kRows, lo, hi);
      row_begin = max(row_begin, lo);
      row_end = min(row_end, hi);
    }
    q_tiles = row_end > row_begin ? (row_end - row_begin + kStreamRows - 1) / kStreamRows : 0;
    tiles = q_tiles * p.group_size();
    // (Full attention: every block of the pair walks all q_tiles tiles from row 0.)
    rotated = kLayouts == Layouts::kUniform && ordered_dq && p.window_left < 0 &&
              p.window_right < 0;
    if (rotated) first_tile = k0 / kRows * q_tiles / blocks(p);
  }
  // Key blocks of a (sequence, kv head) pair (uniform layouts).
  __device__ static int64_t blocks(const AttentionParams& p) {
    return (p.seqlen_k + kRows - 1) / kRows;
  }
  // The first streamed row and the end of the query rows that see the block of
  // keys from k0 (its tiles: [first_row, end_row) rounded out to whole tiles;
  // both non-decreasing in k0, as the blocks' query spans in masks without gaps).
  __device__ static int64_t first_row(const SeqlenInfo& seq, int64_t k0) {
    return seq.first_query(k0) / kStreamRows * kStreamRows;
  }
  __device__ static int64_t end_row(const SeqlenInfo& seq, int64_t k0) {
    return seq.last_query(min(k0 + kRows, seq.seqlen_k) - 1) + 1;
  }
  // The sequence: uniform calls rebuild it from the shapes wherever it is
  // used (constants the compiler need not keep in registers).
  __device__ SeqlenInfo sequence(const AttentionParams& p) const {
    if constexpr (kLayouts == Layouts::kUniform) return SeqlenInfo::uniform(p, b);
    else return seq;
  }
  __device__ int64_t row(int64_t it) const { return row_begin + (it % q_tiles) * kStreamRows; }
  __device__ int64_t head(const AttentionParams& p, int64_t it) const {
    return hk * p.group_size() + it / q_tiles;
  }
  // The first padded row (PaddedRows: statistics and dQ rows) of query head h.
  __device__ int64_t padded_start(const AttentionParams& p, const PaddedRows& padded,
                                  int64_t h) const {
    // (Uniform calls are not packed: the dense formula, without the branch.)
    if constexpr (kLayouts == Layouts::kUniform) return padded.start_of<false>(seq, b, h);
    else return padded.start(seq, b, h);
  }
  __device__ StreamWalk<kStreamRows> walk(const AttentionParams& p,
                                          const PaddedRows& padded) const {
    const int64_t h0 = hk * p.group_size(), start = row_begin + first_tile * kStreamRows;
    return {sequence(p).q_row(start), padded_start(p, padded, h0) + start,
            static_cast<int>(h0), q_tiles, first_tile, padded.rows, first_tile};
  }
  // Do the owned keys reach past the used ones (non-uniform layouts: what
  // follows them is loaded, see zero_tile_rows), and from which owned row?
  __device__ bool owned_crosses_end() const {
    return kLayouts != Layouts::kUniform && k0 + kRows > seq.seqlen_k;
  }
  __device__ int first_unused_owned_row() const {
    return static_cast<int>(max(seq.seqlen_k - k0, int64_t(0)));
  }
  // The same for the streamed tile of first query row `row` and the used queries.
  __device__ bool tile_crosses_end(int64_t row) const {
    return kLayouts != Layouts::kUniform && row + kStreamRows > seq.seqlen_q;
  }
  __device__ int first_unused_row(int64_t row) const {
    return static_cast<int>(max(seq.seqlen_q - row, int64_t(0)));
  }
  // The first query row of the tile after the one at `row` (row(it + 1) from
  // row(it), without row()'s division: the next head's tiles start over).
  __device__ int64_t next_row(int64_t row) const {
    row += kStreamRows;
    return row == row_begin + q_tiles * kStreamRows ? row_begin : row;
  }

  // Only the query tiles where a mask may let some query head of the group see some
  // of the owned keys: the union of the owned column tiles' spans (MaskTiles::RowSpan;
  // a contiguous span, as for segment ids). `tiles` counts the span's tiles; the
  // kernels stream only those the mask lets through (MaskedTiles).
  __device__ void narrow_to_mask(const AttentionParams& p, const MaskTiles& mask) {
    if (!mask || q_tiles == 0) return;
    MaskTiles::RowSpan all{0, 0, 0, 0};  // (the union of the heads' spans)
    for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
      const MaskTiles::RowSpan s = mask.entry(b, h).col_span(k0, kRows);
      if (s.first >= s.end) continue;
      all.first = all.first < all.end ? min(all.first, s.first) : s.first;
      all.end = max(all.end, s.end);
    }
    const MaskTiles::Range r =
        MaskTiles::on_grid(all, row_begin, row_begin + q_tiles * kStreamRows, kStreamRows);
    row_begin = r.begin;
    q_tiles = (r.end - r.begin) / kStreamRows;
    tiles = q_tiles * p.group_size();
  }

  // The owned keys as the mask's column tiles see them: kConsumerKeys (a
  // consumer's keys) to a tile, the first from k0 (a multiple of kRows).
  static constexpr int kConsumerKeys = MaskTiles::kRows;
  static_assert(kRows % kConsumerKeys == 0 && kStreamRows == MaskTiles::kRows,
                "a streamed tile is one mask row tile, a consumer's keys one column tile");

  // Masks a thread's S^T fragment (keys key, key + 8; queries col0 + [0, 8 kTiles))
  // where some of the block's (key, query) pairs are invisible.
  template <int kTiles>
  __device__ void mask(float (&st)[kTiles * 4], const AttentionParams& p, int64_t key,
                       int64_t col0) const {
    constexpr int kCols = kTiles * 8;
    const SeqlenInfo seq = sequence(p);
    if (col0 >= seq.first_query(last_key) && col0 + kCols - 1 <= seq.last_query(k0) &&
        col0 + kCols <= seq.seqlen_q && last_key - k0 + 1 == kRows)
      return;
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t k = key + 8 * r;
      visible_columns(seq.first_query(k), min(seq.last_query(k), seq.seqlen_q - 1), col0, kCols,
                      lo[r], hi[r]);
      if (k >= seq.seqlen_k) hi[r] = -1;
    }
    mask_columns<kTiles>(st, lo, hi);
  }
};

// The streamed tiles of a key block, as its producer and dQ writer walk them:
// every tile of the block (AllTiles), or with a mask only those it lets through
// (MaskedTiles: the producer publishes each one's StreamedTile to the consumers,
// and after the last one, if there are fewer than kb.tiles, an end mark: a
// StreamedTile with row kEndRow, which find returns past the block's tiles).
struct AllTiles {
  static constexpr bool kSkips = false;
  template <int kStreamRows>
  __device__ StreamedTile find(StreamWalk<kStreamRows>&) const { return {}; }
};
template <class Block>
struct MaskedTiles {
  static constexpr bool kSkips = true;
  static constexpr int kCols = Block::kRows / Block::kConsumerKeys;  // (one per consumer)
  static constexpr uint32_t kVisible = 1;  // find's summary: the tile has an allowed pair,
  static constexpr int kMixedShift = 1;    // consumer c's keys a hidden one (bit 1 + c)
  // (Values, not the block: the producer and the dQ writer keep them in the few
  // registers their warpgroup has, kProducerRegs; the mask is a kernel parameter.)
  const MaskTiles& mask;
  int64_t row_begin;
  uint32_t head_end, batch_entries, col0, cols;
  __device__ MaskedTiles(const Block& kb, const AttentionParams& p, const MaskTiles& mask_tiles)
      : mask(mask_tiles),
        row_begin(kb.row_begin),
        head_end(static_cast<uint32_t>((kb.hk + 1) * p.group_size())),
        batch_entries(mask_tiles.batch_entry(kb.b)),
        col0(static_cast<uint32_t>(kb.k0 / Block::kConsumerKeys)),
        cols(static_cast<uint32_t>(
            min(mask_tiles.col_tiles - kb.k0 / Block::kConsumerKeys, int64_t{kCols}))) {}
  // Moves w to its first tile from the current one that the mask lets through and
  // returns it (mixed: every consumer's keys where there are no summaries; row
  // kEndRow: none left).
  template <int kStreamRows>
  __device__ StreamedTile find(StreamWalk<kStreamRows>& w) const {
    for (; static_cast<uint32_t>(w.head) < head_end; w.next()) {
      const int64_t row = row_begin + w.j * kStreamRows;
      const uint32_t summary = of(static_cast<uint32_t>(w.head), row);
      if (summary & kVisible)
        return {row, static_cast<uint32_t>(w.head), summary >> kMixedShift};
    }
    return {StreamedTile::kEndRow, 0, 0};
  }
  // The summary of query head h's tile at slot row `row` (a multiple of the mask's
  // tile rows, KeyBlock) against the owned keys: its mask row tile's bytes of the
  // owned column tiles.
  __device__ uint32_t of(uint32_t h, int64_t row) const {
    if (!mask) return kVisible | ((1u << kCols) - 1) << kMixedShift;
    const uint8_t* at =
        mask.row_bits(batch_entries + mask.head_entry(h), row / MaskTiles::kRows) + col0;
    uint32_t out = 0;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const uint8_t bits = c < static_cast<int>(cols) ? at[c] : 0;
      out |= (bits & MaskTiles::kAnyAllowed ? kVisible : 0u) |
             (bits & MaskTiles::kAnyHidden ? 1u << (kMixedShift + c) : 0u);
    }
    return out;
  }
};

// The query rows [q0, last_row] of head h a query-kernel CTA owns (kOwnRows of
// them), and the streamed key tiles they see: tile it is slot keys
// [key_tile(it), +kStreamRows) of kv head hk. Config: a TileConfig.
template <class Config, Layouts kLayouts = Layouts::kUniform>
struct QueryBlock {
  static constexpr int kOwnRows = Config::kOwnRows;
  static constexpr int kStreamRows = Config::kStreamRows;
  int64_t b, h, hk, q0;
  SeqlenInfo seq;
  int64_t last_row;
  KeyRange keys;
  int64_t tiles;
  bool valid;
  QueryBlock() = default;
  // (ordered_dq: key blocks' only; the query kernel's dQ needs no order)
  __device__ QueryBlock(const AttentionParams& p, const VarlenWorkList& list,
                        const SegmentTiles& segment_tiles, bool /*ordered_dq*/)
      : QueryBlock(p, query_index(p, list)) {
    narrow_to_segments<kLayouts>(keys, segment_tiles, b, q0, kOwnRows, kStreamRows);
    tiles = valid ? keys.tiles(kStreamRows) : 0;
  }
  __device__ int64_t key_tile(int64_t it) const { return keys.tile_begin + it * kStreamRows; }
  // Only the key tiles where a mask may let some owned row see some key: the union
  // of the owned row tiles' spans (KeyBlock::narrow_to_mask).
  __device__ void narrow_to_mask(const AttentionParams&, const MaskTiles& mask) {
    if (!mask || tiles == 0) return;
    const int64_t begin = keys.tile_begin;
    const MaskTiles::Range r = MaskTiles::on_grid(mask.entry(b, h).span(q0, kOwnRows), begin,
                                                  begin + tiles * kStreamRows, kStreamRows);
    keys.narrow(r.begin, r.end, kStreamRows);
    tiles = r.end > r.begin ? keys.tiles(kStreamRows) : 0;
  }
  // As KeyBlock's: the owned queries past the used ones, streamed keys past theirs.
  __device__ bool owned_crosses_end() const {
    return kLayouts != Layouts::kUniform && q0 + kOwnRows > seq.seqlen_q;
  }
  __device__ int first_unused_owned_row() const {
    return static_cast<int>(max(seq.seqlen_q - q0, int64_t(0)));
  }
  __device__ bool tile_crosses_end(int64_t it) const {
    return kLayouts != Layouts::kUniform && key_tile(it) + kStreamRows > seq.seqlen_k;
  }
  __device__ int first_unused_row(int64_t it) const {
    return static_cast<int>(max(seq.seqlen_k - key_tile(it), int64_t(0)));
  }
  __device__ StreamWalk<kStreamRows> walk() const {  // (one head, no statistics)
    return {seq.k_row(keys.tile_begin), 0, static_cast<int>(hk), tiles, 0, 0, 0};
  }

 private:
  // Uniform calls take their query tiles last to first (query_tile).
  __device__ static BlockIndex query_index(const AttentionParams& p, const VarlenWorkList& list) {
    if constexpr (kLayouts == Layouts::kUniform) {
      const QueryTile t = query_tile((p.seqlen_q + kOwnRows - 1) / kOwnRows);
      return {t.bh / p.heads_q, t.bh % p.heads_q, t.tile, true};
    } else {
      return block_index<kLayouts>(0, p.heads_q, list);
    }
  }
  __device__ QueryBlock(const AttentionParams& p, BlockIndex i)
      : b(i.b),
        h(i.head),
        hk(h / p.group_size()),
        q0(i.tile * kOwnRows),
        seq(sequence_info<kLayouts>(p, b)),
        last_row(min(q0 + kOwnRows, seq.seqlen_q) - 1),
        keys(seq, q0, last_row, kStreamRows),
        tiles(i.valid ? keys.tiles(kStreamRows) : 0),
        valid(i.valid) {}
};

// The backward's schedule: each CTA does one block (Block: a KeyBlock or a
// QueryBlock, which finds its own from blockIdx.x), none where the grid
// reaches past the work list's blocks; ordered_dq: the key kernel adds dQ in a
// fixed order (its blocks in pair order).
template <class Block>
struct BlockSchedule {
  using Item = Block;
  static constexpr bool kOneItemPerCta = true;
  const AttentionParams& p;
  const VarlenWorkList& list;
  const SegmentTiles& segment_tiles;
  bool ordered_dq;
  __device__ ScheduleStep tile(int64_t, Block& out) const {
    out = Block(p, list, segment_tiles, ordered_dq);
    return out.valid ? ScheduleStep::kTile : ScheduleStep::kEnd;
  }
};

}  // namespace flashjax::cuda::hopper_bwd
