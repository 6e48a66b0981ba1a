// What the split-KV kernels of 16-bit and float8 caches share
// (kvcache_attention.cu, split_kv_float8.cuh): the CTA's share of the work
// (SplitCta), the pipeline of cache rows into shared memory (KeyStages), the
// float32 partials of the splits, and the merge of the warps' softmax states
// into the output rows. A CTA takes kCtaRows packed query rows of one kv head
// (GQA: every query row of the group's heads) and one split of the key tiles
// they see; its four warps take 16 keys each of a 64-key stage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "../common/block.cuh"
#include "../common/device.cuh"
#include "../common/fragment.cuh"
#include "../sm80/mma_sm80.cuh"
#include "flashjax/params.h"
#include "flashjax/seqlen.h"

namespace flashjax::cuda::split_kv {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeysPerWarp = 16;
constexpr int kBlockN = kWarps * kKeysPerWarp;  // keys per pipeline stage
constexpr int kStages = 3;
constexpr int kMaxSplits = 128;  // (kvcache.py's MAX_SPLITS)

// The cache's element C: q's 16-bit T, or float8 (KvCache's descales).
template <class C>
inline constexpr bool kFloat8 = sizeof(C) == 1;
// A float8 element's format, as cuda_fp8.h's conversions name it.
template <class C>
inline constexpr __nv_fp8_interpretation_t kFloat8Format =
    std::is_same_v<C, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;

// The packed query rows of one kv head: row R is query R % seqlen_q of the
// group's head R / seqlen_q (every head of the group shares the keys). 32-bit
// (split_kv_supports checks the count): a 64-bit division is a long
// subroutine, and the epilogue divides for every row it writes.
struct PackedRows {
  int seqlen_q, count;
  __device__ PackedRows(const AttentionParams& p)
      : seqlen_q(static_cast<int>(p.seqlen_q)),
        count(static_cast<int>(p.seqlen_q * p.group_size())) {}
  __device__ int query(int r) const { return r % seqlen_q; }
  __device__ int head(int r) const { return r / seqlen_q; }  // within the group
};

// float32 partial results of each split: out normalised by the split's own
// softmax sum, and that split's lse (log2 units; -inf: it saw no key).
struct Partials {
  float* out = nullptr;   // [splits][rows][head_dim_v]
  float* lse2 = nullptr;  // [splits][rows]
  int64_t rows = 0;       // batch * heads_q * seqlen_q, ordered (b, h, i)
  Partials(const AttentionParams& p, int splits, void* workspace) {
    if (splits <= 1 || !workspace) return;
    rows = p.batch * p.heads_q * p.seqlen_q;
    out = static_cast<float*>(workspace);
    lse2 = out + splits * rows * p.head_dim_v;
  }
  static size_t bytes(const AttentionParams& p, int splits) {
    if (splits <= 1) return 0;
    return sizeof(float) * static_cast<size_t>(splits) *
           static_cast<size_t>(p.batch * p.heads_q * p.seqlen_q * (p.head_dim_v + 1));
  }
  __device__ int64_t row(const AttentionParams& p, int64_t b, int64_t h, int64_t i) const {
    return (b * p.heads_q + h) * p.seqlen_q + i;
  }
};

// CTAs of a launch: (batch, kv head, tile of kCtaRows packed rows, split).
template <int kCtaRows>
int64_t split_kv_ctas(const AttentionParams& p, int splits) {
  return p.batch * p.heads_kv * ((p.seqlen_q * p.group_size() + kCtaRows - 1) / kCtaRows) * splits;
}

// The work of CTA blockIdx.x: sequence b, kv head hk, packed rows [row0,
// row0 + kCtaRows), and its split's share [tile_first, tile_end) of the
// kBlockN-key tiles those rows see.
template <int kCtaRows>
struct SplitCta {
  PackedRows rows;
  int split, row0;
  int64_t hk, b, h0;  // h0: the group's first query head
  SeqlenInfo seq;
  int64_t q_first, q_last;  // the queries of the rows: a range, or all when it wraps
  KeyRange keys;
  int tile_first, tile_end;  // (32-bit tile indices: the keys are rows of a pool of < 2^31 rows)

  __device__ SplitCta(const AttentionParams& p, int splits) : rows(p) {
    const int row_tiles = (rows.count + kCtaRows - 1) / kCtaRows;
    int block = blockIdx.x;  // (32-bit divisions, as PackedRows')
    split = block % splits;
    block /= splits;
    row0 = block % row_tiles * kCtaRows;
    block /= row_tiles;
    const int heads_kv = static_cast<int>(p.heads_kv);
    hk = block % heads_kv;
    b = block / heads_kv;
    h0 = hk * p.group_size();
    seq = SeqlenInfo(p, b);
    const int row_end = min(row0 + kCtaRows, rows.count);
    const bool wraps = rows.head(row0) != rows.head(row_end - 1);
    q_first = wraps ? 0 : rows.query(row0);
    q_last = wraps ? p.seqlen_q - 1 : rows.query(row_end - 1);
    keys = KeyRange(seq, q_first, q_last, kBlockN);
    const int tiles = static_cast<int>(keys.tiles(kBlockN)),
              per_split = (tiles + splits - 1) / splits;
    tile_first = min(tiles, split * per_split);
    tile_end = min(tiles, tile_first + per_split);
  }
  // The first key of tile `tile` (of the sequence's keys).
  __device__ int64_t tile_k0(int tile) const { return keys.tile_begin + tile * kBlockN; }
};

// Starts the copies of the CTA's query rows into a swizzled [kCtaRows][kHeadDim]
// 16-bit tile (zero past the rows and the head dim).
template <class T, int kHeadDim, int kCtaRows>
__device__ void load_query(const AttentionParams& p, const SplitCta<kCtaRows>& cta, T* sQ) {
  constexpr int kQueryChunks = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kCtaRows * kQueryChunks; idx += kThreads) {
    const int r = idx / kQueryChunks, chunk = idx % kQueryChunks;
    const int row = cta.row0 + r;
    const bool valid = row < cta.rows.count && chunk * 8 < p.head_dim;
    const int64_t i = cta.rows.query(row), h = cta.h0 + cta.rows.head(row);
    const T* src = valid ? cta.seq.template q_at<const T>(p.q, i, h) + chunk * 8
                         : static_cast<const T*>(p.q.data);
    cp_async_16(sQ + swizzled<kHeadDim>(r, chunk), src, valid);
  }
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kHeadDim-byte
// float8 rows, XOR-swizzled so that the 8 rows of an ldmatrix read of one
// chunk fall in distinct banks: chunk ^ row % 8 for rows of 8 or more chunks
// (as the 16-bit tiles), and for 64-byte rows (two a 128-byte line) chunk ^
// (row / 2) % 4.
template <int kHeadDim>
__device__ __forceinline__ int float8_swizzled(int row, int chunk) {
  constexpr int kChunks = kHeadDim / 16;
  static_assert(kChunks >= 8 || kChunks == 4, "64-byte rows or multiples of 128 bytes");
  const int x = kChunks >= 8 ? row & 7 : (row >> 1) & 3;
  return row * kHeadDim + ((chunk ^ x) << 4);
}

// A thread's share of a key tile's loads: 16-byte chunk threadIdx.x % kChunks
// of tile rows threadIdx.x / kChunks + kRowStep * i, for K and V alike, of
// cache elements C (16-bit tiles swizzled for ldmatrix, float8 ones by
// float8_swizzled).
// locate() finds the rows in the cache pool (page-table reads for a paged
// cache); issue() starts their copies into a swizzled tile (zero past the
// sequence's keys and past the cache's columns). A row is kept as its index
// in the pool (slot * slot_rows + row: the caches are dense, and
// split_kv_supports checks that the pool's rows fit 32 bits), so that its
// address is one multiply-add from the thread's base pointer: the 64-bit
// (slot, row, head) arithmetic per row and per cache made up most of the
// instructions of a tile.
template <int kHeadDim, class C>
struct KeyTileRows {
  static constexpr int kChunkElements = 16 / int{sizeof(C)};
  static constexpr int kChunks = kHeadDim / kChunkElements;
  static constexpr int kRowStep = kThreads / kChunks;
  static constexpr int kRowsPerThread = kBlockN / kRowStep;
  static_assert(kBlockN % kRowStep == 0, "whole rows per thread");
  int32_t pool_row[kRowsPerThread];  // -1: past the sequence's keys

  // The kChunks lanes that share a thread's rows locate them, one row each
  // (lane `leader + i` locates row i), and the others take the results by
  // shuffle: the page-table reads of a tile are independent loads in flight
  // together, not a chain of one load per row (1.38x -> 1.08x of contiguous
  // at batch 128, 8k keys, page 16).
  __device__ void locate(const SeqlenInfo& seq, int64_t k0, int32_t slot_rows) {
    static_assert(kChunks <= 32 && (kChunks & (kChunks - 1)) == 0, "a row's lanes in one warp");
    static_assert(kRowsPerThread <= kChunks, "a lane per row");
    const int lane = threadIdx.x % 32, leader = lane & ~(kChunks - 1), mine = lane - leader;
    int32_t located = -1;
    const int64_t j = k0 + threadIdx.x / kChunks + kRowStep * mine;
    if (mine < kRowsPerThread && j < seq.seqlen_k) {
      int64_t slot, row;
      seq.k_location(j, slot, row);
      located = static_cast<int32_t>(slot) * slot_rows + static_cast<int32_t>(row);
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
      pool_row[i] = __shfl_sync(0xffffffffu, located, leader + i);
  }
  // base: this thread's chunk of (slot 0, row 0, the kv head) of a cache;
  // in_dim: whether that chunk is within the cache's head dim. (An unsigned
  // 32 x 32 -> 64-bit product: one wide multiply-add per row.)
  __device__ void issue(C* tile, const C* base, uint32_t row_bytes, bool in_dim) const {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const bool valid = pool_row[i] >= 0 && in_dim;
      const void* src = reinterpret_cast<const char*>(base) +
                        static_cast<uint64_t>(static_cast<uint32_t>(pool_row[i])) * row_bytes;
      const int row = threadIdx.x / kChunks + kRowStep * i, chunk = threadIdx.x % kChunks;
      cp_async_16(tile + (kFloat8<C> ? float8_swizzled<kHeadDim>(row, chunk)
                                     : swizzled<kHeadDim>(row, chunk)),
                  valid ? src : base, valid);
    }
  }
};

// The kStages-stage pipeline of the CTA's key tiles: K then V of a tile in a
// stage of `stages`. Tiles t + 1 and t + 2 load while tile t is computed on;
// every load() commits one group (empty past the split's end), so that
// cp_async_wait<kStages - 1> leaves exactly the two later tiles in flight. The
// rows of tile t + 1 are located when tile t's loads are issued.
template <int kHeadDim, class C, int kCtaRows>
struct KeyStages {
  static constexpr int kStage = 2 * kBlockN * kHeadDim;  // K then V, elements
  using Rows = KeyTileRows<kHeadDim, C>;
  const SplitCta<kCtaRows>& cta;
  C* stages;
  Rows next_rows;
  int32_t slot_rows;
  int column;
  const C* k_base;
  const C* v_base;
  uint32_t k_row_bytes, v_row_bytes;
  bool k_in_dim, v_in_dim;

  __device__ KeyStages(const AttentionParams& p, const SplitCta<kCtaRows>& cta, C* stages)
      : cta(cta),
        stages(stages),
        slot_rows(static_cast<int32_t>(p.cache.slot_rows)),
        column(threadIdx.x % Rows::kChunks * Rows::kChunkElements),
        k_base(p.k.at<const C>(0, 0, cta.hk) + column),
        v_base(p.v.at<const C>(0, 0, cta.hk) + column),
        k_row_bytes(static_cast<uint32_t>(p.k.row_stride * sizeof(C))),
        v_row_bytes(static_cast<uint32_t>(p.v.row_stride * sizeof(C))),
        k_in_dim(column < p.head_dim),
        v_in_dim(column < p.head_dim_v) {
    if (cta.tile_first < cta.tile_end)
      next_rows.locate(cta.seq, cta.tile_k0(cta.tile_first), slot_rows);
  }
  __device__ C* stage(int tile) const { return stages + tile % kStages * kStage; }
  // Starts tile's loads (its rows are in next_rows) and commits a group.
  __device__ void load(int tile) {
    if (tile < cta.tile_end) {
      C* sK = stage(tile);
      next_rows.issue(sK, k_base, k_row_bytes, k_in_dim);
      next_rows.issue(sK + kBlockN * kHeadDim, v_base, v_row_bytes, v_in_dim);
      if (tile + 1 < cta.tile_end) next_rows.locate(cta.seq, cta.tile_k0(tile + 1), slot_rows);
    }
    cp_async_commit();
  }
  // The first kStages - 1 tiles' loads.
  __device__ void start() {
    for (int s = 0; s < kStages - 1; ++s) load(cta.tile_first + s);
  }
};

// The descales of a float8 cache for sequence b, kv head hk, by which the
// scores and the output are scaled (1 at compile time for other caches).
template <class C>
struct Descales {
  float k = 1.0f, v = 1.0f;
  __device__ Descales(const KvCache& c, int64_t b, int64_t hk, int64_t heads_kv) {
    if constexpr (kFloat8<C>) {
      k = c.k_descale[b * heads_kv + hk];
      v = c.v_descale[b * heads_kv + hk];
    }
  }
};

// Writes columns col, col + 1 of output row (b, i, h) from the keys' lse (log2
// units) and normalised output, folding in the sink; lse too from column 0.
// (A cache call's queries are dense: out and lse are indexed directly.)
template <class T>
__device__ void write_output(const AttentionParams& p, int64_t b, int64_t i, int64_t h, int col,
                             float keys_lse2, float o0, float o1) {
  const float sink2 = p.sinks ? p.sinks[b * p.heads_q + h] * kLog2e : kNegInf;
  const float m = fmaxf(keys_lse2, sink2);
  float weight = 0.0f, lse2 = kNegInf;  // no key and no sink: out 0, lse -inf
  if (m != kNegInf || isnan(keys_lse2)) {  // (a NaN row: fmaxf drops the NaN)
    lse2 = m + __log2f(fast_exp2(keys_lse2 - m) + fast_exp2(sink2 - m));
    weight = fast_exp2(keys_lse2 - lse2);
  }
  *reinterpret_cast<uint32_t*>(p.out.at<T>(b, i, h) + col) = pack2<T>(o0 * weight, o1 * weight);
  if (col == 0) *p.lse.at<float>(b, i, h) = lse2 == kNegInf ? kNegInf : lse2 / kLog2e;
}

// The warps' softmax states of the CTA's rows, in shared memory past the query
// (each kernel stores its own fragments there): o [warp][row][kHeadDim]
// unnormalised, m and l [warp][row] (log2 units, l summed over the warp).
template <int kHeadDim, int kCtaRows>
struct WarpStates {
  static constexpr int kBytes = kWarps * kCtaRows * (kHeadDim + 2) * 4;
  float* o;
  float* m;
  float* l;
  __device__ explicit WarpStates(void* at)
      : o(static_cast<float*>(at)), m(o + kWarps * kCtaRows * kHeadDim), l(m + kWarps * kCtaRows) {}

  // Merges the warps' states (after a __syncthreads) and writes the CTA's
  // rows: the output rows (one split), or the split's float32 partials.
  // v_descale scales the output (1 unless float8).
  template <class T>
  __device__ void write(const AttentionParams& p, const SplitCta<kCtaRows>& cta, int splits,
                        const Partials& partials, float v_descale) const {
    for (int idx = threadIdx.x; idx < kCtaRows * kHeadDim / 2; idx += kThreads) {
      const int row = idx / (kHeadDim / 2), col = 2 * (idx % (kHeadDim / 2));
      const int packed_row = cta.row0 + row;
      if (packed_row >= cta.rows.count || col >= p.head_dim_v) continue;
      float mx = kNegInf;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m[w * kCtaRows + row]);
      const float base = mx == kNegInf ? 0.0f : mx;
      float sum = 0.0f, o0 = 0.0f, o1 = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const int slot = w * kCtaRows + row;
        const float a = fast_exp2(m[slot] - base);
        sum += a * l[slot];
        o0 += a * o[slot * kHeadDim + col];
        o1 += a * o[slot * kHeadDim + col + 1];
      }
      // sum == 0: no key (out 0, lse -inf); a NaN sum (a NaN score) makes the row NaN.
      const bool seen = sum != 0.0f;
      const float lse2 = seen ? base + __log2f(sum) : kNegInf;
      const float inv = seen ? v_descale / sum : 0.0f;
      const int64_t i = cta.rows.query(packed_row), h = cta.h0 + cta.rows.head(packed_row);
      if (splits == 1) {
        write_output<T>(p, cta.b, i, h, col, lse2, o0 * inv, o1 * inv);
      } else {
        const int64_t at = cta.split * partials.rows + partials.row(p, cta.b, h, i);
        *reinterpret_cast<float2*>(partials.out + at * p.head_dim_v + col) =
            make_float2(o0 * inv, o1 * inv);
        if (col == 0) partials.lse2[at] = lse2;
      }
    }
  }
};

}  // namespace flashjax::cuda::split_kv
