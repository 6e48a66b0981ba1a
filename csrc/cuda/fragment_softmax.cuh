// Online softmax on tensor-core accumulator fragments, shared by the mma.sync
// (sm_80) and wgmma (sm_90a) forward kernels. Both use the same per-warp
// layout: a thread holds rows g and g + 8 of its warp's 16-row slice
// (g = lane / 4) and, per 8-column tile n, columns 8n + 2t and 8n + 2t + 1
// (t = lane % 4), stored flat as frag[4n + e], e = 0, 1 (row g), 2, 3 (row g + 8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common.cuh"
#include "exact_rows.cuh"
#include "flashjax/seqlen.h"
#include "sequence_layout.h"

namespace flashjax::cuda {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// scale and softcap: raw q.k products become scores in log2 units.
template <int kN>
__device__ __forceinline__ void scores_log2(float (&s)[kN], const AttentionParams& p) {
  if (p.softcap > 0.0f) {
    const float inv_cap = p.softmax_scale / p.softcap, cap_log2 = p.softcap * kLog2e;
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] = cap_log2 * tanhf(s[i] * inv_cap);
  } else {
    const float scale_log2 = p.softmax_scale * kLog2e;
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] *= scale_log2;
  }
}

// The visible columns [first, last] of a fragment row as tile-relative ints
// [lo, hi], clamped to [-1, cols] (tiles are small; sequences < 2^31).
__device__ __forceinline__ void visible_columns(int64_t first, int64_t last, int64_t col0,
                                                int cols, int& lo, int& hi) {
  const int64_t l = first - col0, h = last - col0;
  lo = static_cast<int>(l < -1 ? -1 : (l > cols ? cols : l));
  hi = static_cast<int>(h < -1 ? -1 : (h > cols ? cols : h));
}

// -inf outside columns [lo[r], hi[r]] of row half r.
template <int kTiles>
__device__ __forceinline__ void mask_columns(float (&s)[kTiles * 4], const int (&lo)[2],
                                             const int (&hi)[2]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < kTiles; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e / 2, col = n * 8 + 2 * t + (e & 1);
      if (col < lo[r] || col > hi[r]) s[4 * n + e] = kNegInf;
    }
}

// The query rows of one thread and the running softmax statistics (log2 units).
struct RowSoftmax {
  int64_t row;  // first of the thread's two rows (the other is row + 8)
  // GQA packing (0: off): tile row r is query r % packed_rows of head
  // h + r / packed_rows, for the group's heads.
  int packed_rows = 0;  // (tile rows are then < 256: 32-bit arithmetic)
  float m[2] = {kNegInf, kNegInf};
  float l[2] = {0.0f, 0.0f};  // this thread's partial sums; the quad reduces at the end

  // Does every used row of the tile [q0, q_last] see every key of [k0, k0 + n)?
  // (q_last: the tile's last used row; rows past it are written as empty rows.)
  __device__ static bool tile_needs_mask(const SeqlenInfo& seq, int64_t q0, int64_t q_last,
                                         int64_t k0, int n, int64_t key_begin, int64_t key_end) {
    return k0 < key_begin || k0 + n > key_end || k0 < seq.first_key(q_last) ||
           k0 + n - 1 > seq.last_key(q0);
  }

  // Raw q.k products -> scores in log2 units, -inf where masked.
  template <int kKeyTiles>
  __device__ void scores(float (&s)[kKeyTiles * 4], const AttentionParams& p,
                         const SeqlenInfo& seq, int64_t k0, bool needs_mask) const {
    scores_log2(s, p);
    if (needs_mask) mask<kKeyTiles>(s, seq, k0);
  }

  // -inf where the thread's rows do not see key k0 + column (positions, windows, seqused).
  template <int kKeyTiles>
  __device__ void mask(float (&s)[kKeyTiles * 4], const SeqlenInfo& seq, int64_t k0) const {
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
      visible_columns(seq.first_key(query(row + 8 * r)), seq.last_key(query(row + 8 * r)), k0,
                      kKeyTiles * 8, lo[r], hi[r]);
    mask_columns<kKeyTiles>(s, lo, hi);
  }

  __device__ int64_t query(int64_t tile_row) const {
    return packed_rows ? static_cast<int>(tile_row) % packed_rows : tile_row;
  }

  // s becomes exp2(s - m_new); alpha = exp2(m_old - m_new) is what the output
  // accumulated so far must be scaled by.
  template <int kKeyTiles>
  __device__ void exponentiate(float (&s)[kKeyTiles * 4], float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == kNegInf ? 0.0f : mx;  // nothing visible yet: keep zeros
      alpha[r] = fast_exp2(m[r] - base);
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) {
        s[4 * n + 2 * r] = fast_exp2(s[4 * n + 2 * r] - base);
        s[4 * n + 2 * r + 1] = fast_exp2(s[4 * n + 2 * r + 1] - base);
        sum += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
      }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = mx;
    }
  }

  template <int kDimTiles>
  __device__ static void rescale(float (&o)[kDimTiles * 4], const float (&alpha)[2]) {
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      o[4 * n] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
  }

  template <int kKeyTiles, int kDimTiles>
  __device__ void update(float (&s)[kKeyTiles * 4], float (&o)[kDimTiles * 4]) {
    float alpha[2];
    exponentiate<kKeyTiles>(s, alpha);
    rescale<kDimTiles>(o, alpha);
  }

  // Zeros o in the rows past the used ones, for kernels whose tiles load
  // whatever rows follow them (the Hopper forward's TMA tiles: the next
  // sequence's or padding, NaN included), which write's o * 0 would pass on.
  template <int kDimTiles>
  __device__ void clear_unused_rows(float (&o)[kDimTiles * 4], const SeqlenInfo& seq) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (query(row + 8 * r) < seq.seqlen_q) continue;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) o[4 * n + 2 * r] = o[4 * n + 2 * r + 1] = 0.0f;
    }
  }

  // Folds in the sink, normalises o and writes out (head_dim_v % 8 == 0) and lse
  // for the rows of sequence b's slot; rows past the used ones get out 0 and
  // lse -inf (whatever o holds, as long as it is finite: see
  // clear_unused_rows; also with sinks). Returns whether a used row of the
  // thread's holds a non-finite value: the caller then has the warp run
  // recompute_nonfinite_rows (exact_rows.cuh says why), after its main loop.
  // h0: the head of the tile (the group's first head when packed).
  template <class T, int kDimTiles>
  __device__ bool write(const AttentionParams& p, const SeqlenInfo& seq,
                        const float (&o)[kDimTiles * 4], int64_t b, int64_t h0) const {
    const int t = threadIdx.x % 4;
    float probe[2] = {0.0f, 0.0f};
    probe_nonfinite(o, probe);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float total = l[r];
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      const int64_t tile_row = row + 8 * r, out_row = query(tile_row);
      const int64_t h = head(h0, tile_row);
      if (!writes(p, seq, tile_row)) {
        probe[r] = 0.0f;
        continue;
      }
      const bool used = out_row < seq.seqlen_q;
      if (!used) probe[r] = 0.0f;
      const float sink = p.sinks && used ? p.sinks[b * p.heads_q + h] * kLog2e : kNegInf;
      const RowNormaliser normaliser(used ? m[r] : kNegInf, total, sink, used,
                                     [](float x) { return fast_exp2(x); },
                                     [](float x) { return __log2f(x); });
      const float factor = normaliser.factor, lse = normaliser.lse / kLog2e;
      T* dst = seq.q_at<T>(p.out, out_row, h);
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        const int col = n * 8 + 2 * t;
        if (col < p.head_dim_v)
          *reinterpret_cast<uint32_t*>(dst + col) =
              pack2<T>(o[4 * n + 2 * r] * factor, o[4 * n + 2 * r + 1] * factor);
      }
      if (t == 0) *seq.q_at<float>(p.lse, out_row, h) = lse;
    }
    return probe[0] != probe[0] || probe[1] != probe[1];
  }

  // Recomputes pair by pair the used rows of the warp's 16 whose out (written
  // by write, by this warp) holds a NaN or inf. Call with the whole warp.
  template <class T>
  __device__ void recompute_nonfinite_rows(const AttentionParams& p, const SeqlenInfo& seq,
                                           int64_t b, int64_t h0) const {
    const int lane = threadIdx.x % 32;
    const int64_t warp_row0 = row - lane / 4;
    __syncwarp();  // the warp's stores of out come first
    for (int r = 0; r < 16; ++r) {
      const int64_t tile_row = warp_row0 + r, i = query(tile_row), h = head(h0, tile_row);
      if (!writes(p, seq, tile_row) || i >= seq.seqlen_q) continue;
      if (row_nonfinite(seq.q_at<const T>(p.out, i, h), p.head_dim_v, lane))
        exact_forward_row<T>(p, b, h, i, lane);
    }
  }

  // The query head of tile row tile_row (h0: the tile's, or its group's first when packed).
  __device__ int64_t head(int64_t h0, int64_t tile_row) const {
    return h0 + (packed_rows ? static_cast<int>(tile_row) / packed_rows : 0);
  }
  // Whether tile row tile_row is a row of the output (of sequence b's slot).
  __device__ bool writes(const AttentionParams& p, const SeqlenInfo& seq, int64_t tile_row) const {
    return !(packed_rows && tile_row >= packed_rows * p.group_size()) &&
           query(tile_row) < seq.q_slot;
  }
};

// The A fragment (16 rows x 16 keys) of P for key step kk, from s.
template <class T, int kKeyTiles>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&s)[kKeyTiles * 4],
                                           int kk) {
  a[0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
  a[1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
  a[2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
  a[3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
}

// P = exp2(S - lse) from log2-unit scores; `lse_log2(e)` gives the lse of
// element e's query (+inf for a row that saw nothing, so that P = 0).
template <int kN, class LseOf>
__device__ __forceinline__ void probabilities(float (&s)[kN], LseOf&& lse_log2) {
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = fast_exp2(s[i] - lse_log2(i));
}

// dP becomes dS = P * (dP - D) * softcap'(S); `d_of(e)` gives element e's D.
template <int kN, class DOf>
__device__ __forceinline__ void score_gradient(float (&dp)[kN], const float (&prob)[kN],
                                               const float (&s_log2)[kN],
                                               const AttentionParams& p, DOf&& d_of) {
  const float inv_cap_log2 = p.softcap > 0.0f ? 1.0f / (p.softcap * kLog2e) : 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float ds = prob[i] * (dp[i] - d_of(i));
    if (p.softcap > 0.0f) {
      const float t = prob[i] > 0.0f ? s_log2[i] * inv_cap_log2 : 0.0f;
      ds *= 1.0f - t * t;
    }
    dp[i] = ds;
  }
}

__device__ __forceinline__ float lse_to_log2(float lse) {
  return lse == kNegInf ? -kNegInf : lse * kLog2e;
}

// Writes a 16 x kHeadDim fragment (rows row0 + g, + 8, those below `rows`;
// columns col0 + [0, kHeadDim), those below `dim`) of one head, times scale,
// to the rows of `head_base` (row_stride elements apart), as load_tile reads.
template <class T, int kHeadDim>
__device__ __forceinline__ void store_rows(T* head_base, int64_t row_stride, int64_t rows,
                                           int64_t dim, int64_t row0,
                                           const float (&acc)[kHeadDim / 2], float scale,
                                           int col0 = 0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + g + 8 * r;
    if (row >= rows) continue;
    T* dst = head_base + row * row_stride;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      const int col = col0 + n * 8 + 2 * t;
      if (col < dim)
        *reinterpret_cast<uint32_t*>(dst + col) =
            pack2<T>(acc[4 * n + 2 * r] * scale, acc[4 * n + 2 * r + 1] * scale);
    }
  }
}

// One row's share of dsinks: d lse / d sink = p_sink and dL / d lse = -D, so the
// share is -exp(sink - lse) * D (0 for a row with no key); log2 units.
__device__ __forceinline__ float dsink_share(float sink2, float lse2, float D) {
  return lse2 == -kNegInf ? 0.0f : -fast_exp2(sink2 - lse2) * D;
}

// Each of a thread's two rows' share of dsinks (used rows of sequence b,
// head h; dsink_rows is laid out like lse).
__device__ __forceinline__ void write_dsink_rows(const AttentionParams& p, const SeqlenInfo& seq,
                                                 int64_t b, int64_t h, int64_t row,
                                                 const float (&lse2)[2], const float (&D)[2],
                                                 const TensorRef& dsink_rows) {
  if (!p.sinks || threadIdx.x % 4 != 0) return;
  const float sink2 = p.sinks[b * p.heads_q + h] * kLog2e;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row + 8 * r;
    if (i < seq.seqlen_q) *seq.q_at<float>(dsink_rows, i, h) = dsink_share(sink2, lse2[r], D[r]);
  }
}

// The keys that the used query rows [q0, q_last] of a tile see (q_last: its
// last used row, < q0 when it has none), visited in tiles of n from the
// multiple of n at or below the first. (No used row: last_key(seqlen_q) = -1.)
struct KeyRange {
  int64_t key_begin, key_end, tile_begin;
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

// ------------------------------------------------ non-finite V in a masked KV-cache slice
// The KV-cache kernel's split products (gemm_ab) compute 0 * v for the pairs a
// slice's mask hides, NaN when v is NaN or inf (exact_rows.cuh says why that
// matters). Its rows are not recomputed afterwards (paged caches, splits), so a
// masked slice checks its V (tile_has_nonfinite: cheap, masked slices only) and
// in the rare case it holds one takes the exact scalar product gemm_ab_masked.

// Whether one of the two 16-bit values packed in x is NaN or inf (all exponent bits set).
template <class T>
__device__ __forceinline__ bool nonfinite_pair(uint32_t x) {
  constexpr uint32_t kExp = std::is_same_v<T, __half> ? 0x7C00u : 0x7F80u;
  return (x & kExp) == kExp || ((x >> 16) & kExp) == kExp;
}

// This thread's share (`thread` of `threads`) of the check of `elements`
// 16-bit values of T from `tile` (16-byte aligned, elements % 8 == 0); the
// callers combine the shares (__any_sync).
template <class T>
__device__ __forceinline__ bool tile_has_nonfinite(const void* tile, int elements, int thread,
                                                   int threads) {
  static_assert(sizeof(T) == 2, "the split-KV kernel's fp16 / bf16 tiles");
  const uint4* chunks = static_cast<const uint4*>(tile);
  bool found = false;
  for (int i = thread; i < elements / 8; i += threads) {
    const uint4 c = chunks[i];
    found |= nonfinite_pair<T>(c.x) | nonfinite_pair<T>(c.y) | nonfinite_pair<T>(c.z) |
             nonfinite_pair<T>(c.w);
  }
  return found;
}

// acc(16 x kHeadDim) += P(16 x kK) V summed over the visible pairs only, each
// adding p * v as IEEE arithmetic does (NaN, inf, 0 * inf = NaN where p
// underflowed): frag is P as gemm_ab takes it (rounded to T here as gemm_ab
// rounds it), `hidden` a fragment like it, -inf where the mask hides the pair;
// v_at(j, c) reads V[j][c] as float. Scalar and slow: only for the rare slices
// that need it.
template <class T, int kHeadDim, int kK, class VAt>
__device__ void gemm_ab_masked(float (&acc)[kHeadDim / 2], const float (&frag)[kK / 2],
                               const float (&hidden)[kK / 2], VAt&& v_at) {
  const int lane = threadIdx.x % 32, t = lane % 4;
#pragma unroll 1
  for (int j = 0; j < kK; ++j) {
    // Key j is element 4 * (j / 8) + 2 * r + (j % 2) of lane (lane & ~3) + (j % 8) / 2;
    // every lane offers its own element at that index (static indices: a
    // dynamic one would move the fragment to local memory), then takes its
    // quad's by shuffle.
    const int n = j / 8, e = j % 2, src = (lane & ~3) | ((j % 8) / 2);
    float mine[2] = {0.0f, 0.0f};
    bool mine_hidden[2] = {true, true};
#pragma unroll
    for (int nn = 0; nn < kK / 8; ++nn)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int ee = 0; ee < 2; ++ee) {
          const int idx = 4 * nn + 2 * r + ee;
          if (nn == n && ee == e) {
            mine[r] = to_float(from_float<T>(frag[idx]));
            mine_hidden[r] = hidden[idx] == kNegInf;
          }
        }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float pij = __shfl_sync(0xffffffffu, mine[r], src);
      if (__shfl_sync(0xffffffffu, static_cast<int>(mine_hidden[r]), src)) continue;
#pragma unroll
      for (int c = 0; c < kHeadDim / 8; ++c) {
        acc[4 * c + 2 * r] += pij * v_at(j, 8 * c + 2 * t);
        acc[4 * c + 2 * r + 1] += pij * v_at(j, 8 * c + 2 * t + 1);
      }
    }
  }
}

}  // namespace flashjax::cuda
