// Which rows a Hopper backward CTA owns and which tiles it streams past them:
// KeyBlock for the key kernels (keys of one kv head; query tiles of every
// query head of its group), QueryBlock for the query kernel (queries of one
// head; key tiles). One CTA per block index, so the grids are the block
// counts.
#pragma once

#include <cstdint>

#include "../common.cuh"
#include "../fragment_softmax.cuh"
#include "bwd_tile_config.h"
#include "flashjax/seqlen.h"

namespace flashjax::cuda::hopper_bwd {

// The keys [k0, last_key] of kv head hk a key-kernel CTA owns (kRows of them),
// and the streamed query tiles that see them: tile it is rows [row(it),
// +kStreamRows) of query head head(it).
template <int kRows>
struct KeyBlock {
  int64_t b, hk, k0, last_key, row_begin, q_tiles, tiles;
  __device__ explicit KeyBlock(const AttentionParams& p) {
    const int64_t k_tiles = (p.seqlen_k + kRows - 1) / kRows;
    const int64_t k_tile = blockIdx.x % k_tiles, bhk = blockIdx.x / k_tiles;
    b = bhk / p.heads_kv;
    hk = bhk % p.heads_kv;
    k0 = k_tile * kRows;
    last_key = min(k0 + kRows, p.seqlen_k) - 1;
    const SeqlenInfo seq = SeqlenInfo::uniform(p, b);
    row_begin = seq.first_query(k0) / kStreamRows * kStreamRows;
    const int64_t row_end = seq.last_query(last_key) + 1;
    q_tiles = row_end > row_begin ? (row_end - row_begin + kStreamRows - 1) / kStreamRows : 0;
    tiles = q_tiles * p.group_size();
  }
  __device__ int64_t row(int64_t it) const { return row_begin + (it % q_tiles) * kStreamRows; }
  __device__ int64_t head(const AttentionParams& p, int64_t it) const {
    return hk * p.group_size() + it / q_tiles;
  }

  // Masks a thread's S^T fragment (keys key, key + 8; queries col0 + [0, 8 kTiles))
  // where some of the block's (key, query) pairs are invisible.
  template <int kTiles>
  __device__ void mask(float (&st)[kTiles * 4], const AttentionParams& p, int64_t key,
                       int64_t col0) const {
    constexpr int kCols = kTiles * 8;
    const SeqlenInfo seq = SeqlenInfo::uniform(p, b);
    if (col0 >= seq.first_query(last_key) && col0 + kCols - 1 <= seq.last_query(k0) &&
        col0 + kCols <= p.seqlen_q && last_key - k0 + 1 == kRows)
      return;
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t k = key + 8 * r;
      visible_columns(seq.first_query(k), min(seq.last_query(k), p.seqlen_q - 1), col0, kCols,
                      lo[r], hi[r]);
      if (k >= p.seqlen_k) hi[r] = -1;
    }
    mask_columns<kTiles>(st, lo, hi);
  }
};

// The query rows [q0, last_row] of head h a query-kernel CTA owns (kOwnRows of
// them), and the streamed key tiles they see: tile it is keys [key_tile(it),
// +kStreamRows) of kv head hk.
struct QueryBlock {
  int64_t b, h, hk, q0, last_row;
  SeqlenInfo seq;
  KeyRange keys;
  int64_t tiles;
  __device__ explicit QueryBlock(const AttentionParams& p)
      : QueryBlock(p, query_tile((p.seqlen_q + kOwnRows - 1) / kOwnRows)) {}
  __device__ QueryBlock(const AttentionParams& p, QueryTile tile)
      : b(tile.bh / p.heads_q),
        h(tile.bh % p.heads_q),
        hk(h / p.group_size()),
        q0(tile.tile * kOwnRows),
        last_row(min(q0 + kOwnRows, p.seqlen_q) - 1),
        seq(SeqlenInfo::uniform(p, b)),
        keys(seq, q0, last_row, kStreamRows),
        tiles(keys.tiles(kStreamRows)) {}
  __device__ int64_t key_tile(int64_t it) const { return keys.tile_begin + it * kStreamRows; }
};

}  // namespace flashjax::cuda::hopper_bwd
