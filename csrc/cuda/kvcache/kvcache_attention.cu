// Split-KV attention over a KV cache (see kvcache_attention.h). Decoding reads
// every cached key once per step and computes little with it, so what matters
// is how many bytes are in flight: the keys of one sequence are split over
// enough CTAs to fill the GPU, each keeping two 64-key K and V tiles in flight
// (a three-stage cp.async pipeline) while it computes on a third. Cache rows
// are found through SeqlenInfo::k_location (contiguous, leftpad, batch index or
// page table alike), row by row, so any page size works; a tile's rows are
// located one iteration before its loads are issued. (Paged caches still
// decode 1.2-1.4x slower than contiguous ones; benchmarks/NOTES.md has what
// was measured and tried.) Float8 caches load as they are stored (half the
// bytes) and each warp widens its 16 keys' K, then V, into a half tile of its
// own before its mma loads read them (one conversion a pair of values: every
// e4m3 and e5m2 value is a half; bfloat16 queries are rescaled into halves once
// per CTA, query_to_half); the descales scale the scores and the output.
#include "kvcache_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "../common/block.cuh"
#include "../common/device.cuh"
#include "../common/dispatch.h"
#include "../common/fragment.cuh"
#include "../common/nonfinite.cuh"
#include "../common/softmax.cuh"
#include "../sm80/mma_sm80.cuh"

namespace flashjax::cuda {
namespace {

constexpr int kRows = 16;  // packed query rows per CTA: one mma row block
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeysPerWarp = 16;
constexpr int kBlockN = kWarps * kKeysPerWarp;  // keys per pipeline stage
constexpr int kStages = 3;
constexpr int kAppendThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int kCombineThreads = 256;  // a CTA per output row:
constexpr int kSplitGroups = 4;       // 4 groups of 64 threads (head_dim_v / 2 column pairs)
constexpr int kMaxSplits = 128;      // (kvcache.py's MAX_SPLITS)

// Programmatic dependent launch (Hopper): the combine kernel is launched
// once every split CTA is past its key loop (its launch latency hidden behind
// their epilogues) and waits until the split kernel's writes are visible.
__device__ __forceinline__ void allow_dependent_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The cache's element C: q's 16-bit T, or float8 (KvCache's descales).
template <class C>
inline constexpr bool kFloat8 = sizeof(C) == 1;

// The 16-bit type the mma computes in: q's, or half over float8 caches.
template <class T, class C>
using ComputeType = std::conditional_t<kFloat8<C>, __half, T>;

// Calls fn(C{}) with the cache element type of p (T: the cache holds q's dtype).
template <class T, class Fn>
cudaError_t with_cache_element(const AttentionParams& p, Fn&& fn) {
  switch (p.cache.element) {
    case CacheElement::kAsQuery: return fn(T{});
    case CacheElement::kFloat8E4M3: return fn(__nv_fp8_e4m3{});
    case CacheElement::kFloat8E5M2: return fn(__nv_fp8_e5m2{});
  }
  return cudaErrorInvalidValue;
}

// Shared memory: the query tile (16-bit), then kStages (K, V) tiles of cache
// elements C; a float8 stage's kKeysPerWarp keys of a warp are widened into a
// half tile of that warp's (K, then V once the scores are computed: 3 CTAs an
// SM at d128), and the query rows' score scales follow. The warps' merge of
// their softmax states reuses everything past the query.
template <int kHeadDim, class C>
struct SplitSmem {
  static constexpr int kQueryBytes = kRows * kHeadDim * 2;
  static constexpr int kStage = 2 * kBlockN * kHeadDim;  // K then V, elements
  static constexpr int kWarpWide = kKeysPerWarp * kHeadDim;  // 16-bit elements
  static constexpr int kWideOffset = kQueryBytes + kStages * kStage * int{sizeof(C)};
  static constexpr int kRowScaleOffset = kWideOffset + kWarps * kWarpWide * 2;  // float8 only
  static constexpr int kBytes =
      kFloat8<C> ? kRowScaleOffset + kRows * int{sizeof(float)} : kWideOffset;
  static constexpr int kMergeBytes = kWarps * kRows * (kHeadDim + 2) * 4;  // o, m, l
  static_assert(kMergeBytes <= kBytes - kQueryBytes, "the merge must fit past the query");
};

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

// A thread's share of a key tile's loads: 16-byte chunk threadIdx.x % kChunks
// of tile rows threadIdx.x / kChunks + kRowStep * i, for K and V alike, of
// cache elements C (16-bit tiles swizzled for ldmatrix; float8 rows as they
// are, read once by widen_rows).
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
      cp_async_16(tile + (kFloat8<C> ? row * kHeadDim + chunk * kChunkElements
                                     : swizzled<kHeadDim>(row, chunk)),
                  valid ? src : base, valid);
    }
  }
};

// Two float8 values (the low and high byte of `pair`) as a pair of halves, in
// one instruction and exactly: every e4m3 and e5m2 value is a half.
template <class C>
__device__ __forceinline__ uint32_t widen_pair(uint16_t pair) {
  constexpr __nv_fp8_interpretation_t kKind =
      std::is_same_v<C, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, kKind);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
}

// A warp's kKeysPerWarp float8 rows (kHeadDim bytes each, as loaded) widened
// into a swizzled half tile, as the mma loads read it, then __syncwarp.
// A lane takes 8 elements at a time (8 bytes in, one 16-byte chunk out: 8
// lanes store a whole 128-byte row segment, no bank conflicts); every read is
// issued before the first conversion, up to kWidenBatch chunks at a time (one
// shared-memory latency, not one per chunk: the stores could alias the reads
// for all the compiler knows; a batch at d256 would spill).
constexpr int kWidenBatch = 8;
template <class C, int kHeadDim>
__device__ __forceinline__ void widen_rows(__half* wide, const C* rows, int lane) {
  constexpr int kChunks = kHeadDim / 8, kPerLane = kKeysPerWarp * kChunks / 32;
  constexpr int kBatch = kPerLane < kWidenBatch ? kPerLane : kWidenBatch;
  static_assert(kKeysPerWarp * kChunks % 32 == 0 && kPerLane % kBatch == 0, "whole batches");
#pragma unroll
  for (int first = 0; first < kPerLane; first += kBatch) {
    uint2 x[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i)
      x[i] = reinterpret_cast<const uint2*>(rows)[lane + 32 * (first + i)];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int chunk = lane + 32 * (first + i);
      const uint4 y = make_uint4(widen_pair<C>(x[i].x & 0xffffu), widen_pair<C>(x[i].x >> 16),
                                 widen_pair<C>(x[i].y & 0xffffu), widen_pair<C>(x[i].y >> 16));
      *reinterpret_cast<uint4*>(wide + swizzled<kHeadDim>(chunk / kChunks, chunk % kChunks)) = y;
    }
  }
  __syncwarp();
}

// Float8 caches under bfloat16 queries compute in half: each query row of the
// tile (in place, swizzled) is multiplied by the power of two 2^shift that
// brings its largest magnitude into [2^14, 2^15), exactly (a bfloat16's 8
// significant bits fit a half's 11 wherever a value is within 2^-28 of its
// row's largest; smaller ones round at 2^-39 of it), and unscale[row] =
// 2^-shift. kLanesPerRow threads share a row. (A row with inf keeps inf, and
// its scores are inf or NaN as in bfloat16; a NaN stays NaN.)
template <int kHeadDim>
__device__ void query_to_half(void* tile, float* unscale) {
  constexpr int kLanesPerRow = kThreads / kRows, kChunks = kHeadDim / 8;
  constexpr int kPerLane = kChunks / kLanesPerRow;
  constexpr int kTopShift = 141, kMaxShift = 126;  // 2^(141 - 127 - e): [2^14, 2^15)
  static_assert(kChunks % kLanesPerRow == 0 && 32 % kLanesPerRow == 0, "a row's lanes");
  const int row = threadIdx.x / kLanesPerRow, first = threadIdx.x % kLanesPerRow;
  uint4* chunks = static_cast<uint4*>(tile);
  uint4 x[kPerLane];
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = chunks[swizzled<kHeadDim>(row, first + kLanesPerRow * i) / 8];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&x[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      largest = fmaxf(largest, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int offset = 1; offset < kLanesPerRow; offset <<= 1)
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  const int exponent = static_cast<int>(__float_as_uint(largest) >> 23);  // (largest >= 0)
  const int shift = min(kMaxShift, kTopShift - exponent);
  const float scale = __uint_as_float(static_cast<uint32_t>(127 + shift) << 23);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&x[i]);
    uint4 y;
    __half2* halves = reinterpret_cast<__half2*>(&y);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      halves[j] = __floats2half2_rn(f.x * scale, f.y * scale);
    }
    chunks[swizzled<kHeadDim>(row, first + kLanesPerRow * i) / 8] = y;
  }
  if (first == 0) unscale[row] = __uint_as_float(static_cast<uint32_t>(127 - shift) << 23);
}

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

// CTA (b, kv head, 16-row tile, split): attention of the tile's packed query
// rows over the split's share of the 64-key tiles the rows see.
// Float8 caches at d <= 128 keep 3 CTAs an SM (shared memory allows it; the
// widening's instructions need the warps); 0: no bound (ptxas' own choice).
template <class C, int kHeadDim>
inline constexpr int kMinCtasPerSm = kFloat8<C> && kHeadDim <= 128 ? 3 : 0;

template <class T, class C, int kHeadDim>
__global__ void __launch_bounds__(kThreads, (kMinCtasPerSm<C, kHeadDim>))
    split_kv_kernel(const __grid_constant__ AttentionParams p, int splits,
                    const __grid_constant__ Partials partials) {
  using Smem = SplitSmem<kHeadDim, C>;
  using U = ComputeType<T, C>;
  constexpr bool kRescaledQuery = !std::is_same_v<U, T>;  // (query_to_half)
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  C* stages = reinterpret_cast<C*>(smem_raw + Smem::kQueryBytes);

  const PackedRows rows(p);
  const int row_tiles = (rows.count + kRows - 1) / kRows;
  int block = blockIdx.x;  // (32-bit divisions, as PackedRows')
  const int split = block % splits;
  block /= splits;
  const int row0 = block % row_tiles * kRows;
  block /= row_tiles;
  const int heads_kv = static_cast<int>(p.heads_kv);
  const int64_t hk = block % heads_kv, b = block / heads_kv, h0 = hk * p.group_size();
  const SeqlenInfo seq(p, b);
  const Descales<C> descales(p.cache, b, hk, heads_kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The queries of the tile's rows: a range, or all of them when it wraps.
  const int row_end = min(row0 + kRows, rows.count);
  const bool wraps = rows.head(row0) != rows.head(row_end - 1);
  const int64_t q_first = wraps ? 0 : rows.query(row0);
  const int64_t q_last = wraps ? p.seqlen_q - 1 : rows.query(row_end - 1);
  const KeyRange keys(seq, q_first, q_last, kBlockN);
  // (32-bit tile indices: the keys are rows of a pool of < 2^31 rows)
  const int tiles = static_cast<int>(keys.tiles(kBlockN)), per_split = (tiles + splits - 1) / splits;
  const int tile_first = min(tiles, split * per_split);
  const int tile_end = min(tiles, tile_first + per_split);

  constexpr int kQueryChunks = kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kRows * kQueryChunks; idx += kThreads) {
    const int r = idx / kQueryChunks, chunk = idx % kQueryChunks;
    const int row = row0 + r;
    const bool valid = row < rows.count && chunk * 8 < p.head_dim;
    const T* src = valid ? seq.q_at<const T>(p.q, rows.query(row), h0 + rows.head(row)) + chunk * 8
                         : static_cast<const T*>(p.q.data);
    cp_async_16(sQ + swizzled<kHeadDim>(r, chunk), src, valid);
  }
  if constexpr (kRescaledQuery) cp_async_commit();  // (its own group: converted first)
  // Tiles t + 1 and t + 2 load while tile t is computed on; every iteration
  // commits one group (empty past the end), so that wait<kStages - 1> leaves
  // exactly the two later tiles in flight. Rows of tile t + 3 are located
  // while tile t is computed on.
  using Rows = KeyTileRows<kHeadDim, C>;
  Rows next_rows;
  const int32_t slot_rows = static_cast<int32_t>(p.cache.slot_rows);
  const int column = threadIdx.x % Rows::kChunks * Rows::kChunkElements;
  const C* k_base = p.k.at<const C>(0, 0, hk) + column;
  const C* v_base = p.v.at<const C>(0, 0, hk) + column;
  const uint32_t k_row_bytes = static_cast<uint32_t>(p.k.row_stride * sizeof(C));
  const uint32_t v_row_bytes = static_cast<uint32_t>(p.v.row_stride * sizeof(C));
  const auto tile_k0 = [&](int tile) { return keys.tile_begin + tile * kBlockN; };
  const auto load_next = [&](int tile) {  // tile's rows are in next_rows
    if (tile < tile_end) {
      C* sK = stages + tile % kStages * Smem::kStage;
      next_rows.issue(sK, k_base, k_row_bytes, column < p.head_dim);
      next_rows.issue(sK + kBlockN * kHeadDim, v_base, v_row_bytes, column < p.head_dim_v);
      if (tile + 1 < tile_end) next_rows.locate(seq, tile_k0(tile + 1), slot_rows);
    }
    cp_async_commit();
  };
  if (tile_first < tile_end) next_rows.locate(seq, tile_k0(tile_first), slot_rows);
  for (int s = 0; s < kStages - 1; ++s) load_next(tile_first + s);  // (the first with the query)

  constexpr int kDimTiles = kHeadDim / 8, kKeyTiles = kKeysPerWarp / 8;
  // Float8 caches: the raw scores' scale per row of the thread (k_descale, and
  // the inverse of query_to_half's rescaling).
  float score_scale[2] = {descales.k, descales.k};
  if constexpr (kRescaledQuery) {
    float* unscale = reinterpret_cast<float*>(smem_raw + Smem::kRowScaleOffset);
    cp_async_wait<kStages - 1>();  // the query's group
    __syncthreads();
    query_to_half<kHeadDim>(sQ, unscale);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) score_scale[r] *= unscale[lane / 4 + 8 * r];
  }
  RowSoftmax softmax{row0 + lane / 4, static_cast<int>(p.seqlen_q)};
  float o[kDimTiles * 4] = {};
  for (int tile = tile_first; tile < tile_end; ++tile) {
    load_next(tile + kStages - 1);  // into the stage tile - 1 freed
    cp_async_wait<kStages - 1>();
    __syncthreads();  // tile landed for every thread
    const C* stage_k = stages + tile % kStages * Smem::kStage + warp * kKeysPerWarp * kHeadDim;
    const C* stage_v = stage_k + kBlockN * kHeadDim;
    const int64_t k0 = keys.tile_begin + tile * kBlockN + warp * kKeysPerWarp;
    if (k0 < keys.key_end && k0 + kKeysPerWarp > keys.key_begin) {
      // The 16-bit K and V tiles: the stage's, or (float8) the warp's widened tile,
      // K's and then V's (the previous tile's reads of it ended at its __syncthreads).
      const U* sK = reinterpret_cast<const U*>(stage_k);
      const U* sV = reinterpret_cast<const U*>(stage_v);
      U* wide = reinterpret_cast<U*>(smem_raw + Smem::kWideOffset) + warp * Smem::kWarpWide;
      if constexpr (kFloat8<C>) {
        widen_rows<C, kHeadDim>(wide, stage_k, lane);
        sK = sV = wide;
      }
      float s[kKeyTiles * 4];
      gemm_abt<U, kHeadDim, kKeysPerWarp>(s, reinterpret_cast<const U*>(sQ), 0, sK);
      if constexpr (kFloat8<C>) {
#pragma unroll
        for (int i = 0; i < kKeyTiles * 4; ++i) s[i] *= score_scale[i / 2 % 2];  // (row i/2 % 2)
        __syncwarp();  // every lane's K reads are done
        widen_rows<C, kHeadDim>(wide, stage_v, lane);
      }
      const bool masked = RowSoftmax::tile_needs_mask(seq, q_first, q_last, k0, kKeysPerWarp,
                                                      keys.key_begin, keys.key_end);
      softmax.scores<kKeyTiles>(s, p, seq, k0, masked);
      softmax.update<kKeyTiles, kDimTiles>(s, o);
      // A masked slice whose V holds NaN or inf takes the exact product
      // (common/nonfinite.cuh says why); the check costs masked slices only.
      if (masked && __any_sync(0xffffffffu, tile_has_nonfinite<U>(sV, kKeysPerWarp * kHeadDim,
                                                                  lane, 32))) {
        float hidden[kKeyTiles * 4] = {};
        softmax.mask<kKeyTiles>(hidden, seq, k0);
        gemm_ab_masked<U, kHeadDim, kKeysPerWarp>(o, s, hidden, SwizzledRows<U, kHeadDim>{sV});
      } else {
        gemm_ab<U, kHeadDim, kKeysPerWarp>(o, s, sV);
      }
    }
    __syncthreads();  // every warp is done with the stage before it is refilled
  }
  cp_async_wait<0>();
  allow_dependent_grid_launch();

  // Merge the warps' softmax states through shared memory (past the query).
  float* merge_o = reinterpret_cast<float*>(stages);  // [warp][row][kHeadDim]
  float* merge_m = merge_o + kWarps * kRows * kHeadDim;  // [warp][row], log2 units
  float* merge_l = merge_m + kWarps * kRows;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r, slot = warp * kRows + row;
    float l = softmax.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
      merge_m[slot] = softmax.m[r];
      merge_l[slot] = l;
    }
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      merge_o[slot * kHeadDim + 8 * n + 2 * t] = o[4 * n + 2 * r];
      merge_o[slot * kHeadDim + 8 * n + 2 * t + 1] = o[4 * n + 2 * r + 1];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * kHeadDim / 2; idx += kThreads) {
    const int row = idx / (kHeadDim / 2), col = 2 * (idx % (kHeadDim / 2));
    const int packed_row = row0 + row;
    if (packed_row >= rows.count || col >= p.head_dim_v) continue;
    float m = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, merge_m[w * kRows + row]);
    const float base = m == kNegInf ? 0.0f : m;
    float l = 0.0f, o0 = 0.0f, o1 = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int slot = w * kRows + row;
      const float a = fast_exp2(merge_m[slot] - base);
      l += a * merge_l[slot];
      o0 += a * merge_o[slot * kHeadDim + col];
      o1 += a * merge_o[slot * kHeadDim + col + 1];
    }
    // l == 0: no key (out 0, lse -inf); a NaN l (a NaN score) makes the row NaN.
    const bool seen = l != 0.0f;
    const float lse2 = seen ? base + __log2f(l) : kNegInf;
    const float inv = seen ? descales.v / l : 0.0f;  // (v * v_descale: 1 unless float8)
    const int64_t i = rows.query(packed_row), h = h0 + rows.head(packed_row);
    if (splits == 1) {
      write_output<T>(p, b, i, h, col, lse2, o0 * inv, o1 * inv);
    } else {
      const int64_t at = split * partials.rows + partials.row(p, b, h, i);
      *reinterpret_cast<float2*>(partials.out + at * p.head_dim_v + col) =
          make_float2(o0 * inv, o1 * inv);
      if (col == 0) partials.lse2[at] = lse2;
    }
  }
}


// Reduces x over the CTA with op (a warp's shuffles, then the warps' results
// through shared memory); every thread gets the result.
template <int kThreadsPerCta, class Op>
__device__ float cta_reduce(float x, Op op, float (&warp_results)[kThreadsPerCta / 32]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = x;
  __syncthreads();
  x = warp_results[0];
#pragma unroll
  for (int w = 1; w < kThreadsPerCta / 32; ++w) x = op(x, warp_results[w]);
  __syncthreads();  // warp_results may be reused
  return x;
}

// One CTA per output row: merges the splits' partial results. A thread per
// split reads its lse and the CTA reduces them to the keys' lse and each
// split's weight (no serial loop over the splits: the merge is
// latency-bound); then kSplitGroups groups of threads each sum every
// kSplitGroups-th split of their columns with independent loads, and shared
// memory adds the groups up (partials just written are in L2).
template <class T>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ AttentionParams p, int splits,
                   const __grid_constant__ Partials partials) {
  static_assert(kMaxSplits <= kCombineThreads, "a thread per split");
  wait_for_prerequisite_grid();
  constexpr int kGroupThreads = kCombineThreads / kSplitGroups;
  __shared__ float split_weight[kMaxSplits];
  __shared__ float warp_results[kCombineThreads / 32];
  __shared__ float2 group_sums[kSplitGroups][kGroupThreads];
  // (rows < 2^31: launch_split_kv checks)
  const int row = blockIdx.x, seqlen_q = static_cast<int>(p.seqlen_q);
  const int i = row % seqlen_q, h = row / seqlen_q % static_cast<int>(p.heads_q),
            b = row / (seqlen_q * static_cast<int>(p.heads_q));
  const int split = threadIdx.x;
  const float lse2 = split < splits ? partials.lse2[split * partials.rows + row] : kNegInf;
  const float m = cta_reduce<kCombineThreads>(lse2, [](float x, float y) { return fmaxf(x, y); },
                                              warp_results);
  // A split that saw no key wrote out 0 and lse -inf: weight 0.
  const float e = lse2 == kNegInf ? 0.0f : fast_exp2(lse2 - (m == kNegInf ? 0.0f : m));
  const float total = cta_reduce<kCombineThreads>(e, [](float x, float y) { return x + y; },
                                                  warp_results);
  // total == 0: no split saw a key; a NaN split (fmaxf dropped it from m) makes
  // total, the lse and every weight NaN, as that row's out and lse must be.
  const bool seen = total != 0.0f;
  const float keys_lse2 = seen ? m + __log2f(total) : kNegInf;
  if (split < splits) split_weight[split] = seen ? e / total : 0.0f;
  __syncthreads();
  const int group = threadIdx.x / kGroupThreads, lane = threadIdx.x % kGroupThreads;
  for (int col0 = 0; col0 < p.head_dim_v; col0 += 2 * kGroupThreads) {
    const int col = col0 + 2 * lane;
    float2 sum = make_float2(0.0f, 0.0f);
    if (col < p.head_dim_v) {
#pragma unroll 4
      for (int s = group; s < splits; s += kSplitGroups) {  // (no branch: loads back to back)
        const float w = split_weight[s];
        const float2 x = *reinterpret_cast<const float2*>(
            partials.out + (s * partials.rows + row) * p.head_dim_v + col);
        sum.x += w * x.x;
        sum.y += w * x.y;
      }
    }
    group_sums[group][lane] = sum;
    __syncthreads();
    if (group == 0 && col < p.head_dim_v) {
#pragma unroll
      for (int g = 1; g < kSplitGroups; ++g) {
        sum.x += group_sums[g][lane].x;
        sum.y += group_sums[g][lane].y;
      }
      write_output<T>(p, b, i, h, col, keys_lse2, sum.x, sum.y);
    }
    __syncthreads();
  }
}

// New element x (of q's dtype T) as a cache of elements C stores it: as it is,
// or x * (1 / descales[at]) rounded to the nearest float8 (out of range: e4m3's
// NaN, e5m2's inf; as jnp.asarray(x * (1 / descale), float8 dtype)).
template <class C, class T>
__device__ __forceinline__ C cache_element(T x, const float* descales, int64_t at) {
  if constexpr (kFloat8<C>) {
    constexpr __nv_fp8_interpretation_t kKind =
        std::is_same_v<C, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
    C y;
    y.__x = __nv_cvt_float_to_fp8(static_cast<float>(x) * (1.0f / descales[at]), __NV_NOSAT,
                                  kKind);
    return y;
  } else {
    return x;
  }
}

// A CTA row (blockIdx.y, striding) per new row (b, j); threads over its kv
// heads' elements, k's then v's (32-bit index arithmetic within a row).
template <class T, class C>
__global__ void append_kernel(const __grid_constant__ AttentionParams p) {
  const KvCache& c = p.cache;
  const int per_head = static_cast<int>(p.head_dim + p.head_dim_v);
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= per_head * p.heads_kv) return;
  const int hk = e / per_head, element = e % per_head;
  for (int64_t new_row = blockIdx.y; new_row < p.batch * c.new_rows; new_row += gridDim.y) {
    const int64_t b = new_row / c.new_rows, j = new_row % c.new_rows;
    int64_t slot, row;
    if (!c.append_location(b, j, slot, row)) continue;
    const int64_t at = b * p.heads_kv + hk;  // (descales: float8 caches only)
    if (element < p.head_dim)
      p.k.at<C>(slot, row, hk)[element] =
          cache_element<C>(c.k_new.at<const T>(b, j, hk)[element], c.k_descale, at);
    else
      p.v.at<C>(slot, row, hk)[element - p.head_dim] = cache_element<C>(
          c.v_new.at<const T>(b, j, hk)[element - p.head_dim], c.v_descale, at);
  }
}

template <class T, class C, int kHeadDim>
cudaError_t launch_split_kv(const AttentionParams& p, int splits, void* workspace,
                            cudaStream_t stream) {
  using Smem = SplitSmem<kHeadDim, C>;
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        return cudaFuncSetAttribute(split_kv_kernel<T, C, kHeadDim>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Smem::kBytes);
      });
      e != cudaSuccess)
    return e;
  const Partials partials(p, splits, workspace);
  if (splits > 1 && !partials.out) return cudaErrorInvalidValue;  // no workspace
  const int64_t row_tiles = (p.seqlen_q * p.group_size() + kRows - 1) / kRows;
  const int64_t blocks = p.batch * p.heads_kv * row_tiles * splits;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  split_kv_kernel<T, C, kHeadDim><<<static_cast<unsigned>(blocks), kThreads, Smem::kBytes,
                                    stream>>>(p, splits, partials);
  if (splits == 1) return cudaGetLastError();
  if (partials.rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(partials.rows));
  config.blockDim = dim3(kCombineThreads);
  config.stream = stream;
  cudaLaunchAttribute early_launch = {};
  early_launch.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early_launch.val.programmaticStreamSerializationAllowed = 1;
  if (compute_capability() >= 90) {  // (see wait_for_prerequisite_grid)
    config.attrs = &early_launch;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, combine_kernel<T>, p, splits, partials);
}

}  // namespace

cudaError_t append_to_cache(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.cache.new_rows;
  const int64_t per_row = p.heads_kv * (p.head_dim + p.head_dim_v);
  if (rows == 0) return cudaSuccess;
  if (per_row > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>((per_row + kAppendThreads - 1) / kAppendThreads),
                  static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));  // y strides
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_cache_element<T>(p, [&](auto cache_tag) {
      append_kernel<T, decltype(cache_tag)><<<grid, kAppendThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

// KeyTileRows addresses a cache row by its 32-bit index in the pool of dense
// (slots, slot_rows, heads_kv, dim) caches.
bool pool_rows_fit_32_bits(const AttentionParams& p) {
  const KvCache& c = p.cache;
  const auto dense = [&](const TensorRef& t) {
    return t.batch_stride == c.slot_rows * t.row_stride && t.row_stride <= INT32_MAX / 2;
  };
  return c.slots * c.slot_rows <= INT32_MAX && dense(p.k) && dense(p.v);
}

bool split_kv_supports(const AttentionParams& p) {
  // (float8 rows load in 16-byte chunks of 16 elements)
  const bool whole_chunks = !p.cache.float8() || (p.head_dim % 16 == 0 && p.head_dim_v % 16 == 0);
  return p.cache.active() && tensor_core_shapes(p) && whole_chunks && pool_rows_fit_32_bits(p) &&
         p.seqlen_q * p.group_size() <= INT32_MAX && compute_capability() >= 80;
}

size_t split_kv_workspace_bytes(const AttentionParams& p, int splits) {
  return Partials::bytes(p, splits);
}

cudaError_t split_kv_forward(const AttentionParams& p, int splits, void* workspace,
                             cudaStream_t stream) {
  if (splits < 1 || splits > kMaxSplits || !p.cache.active()) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // (an append only)
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_cache_element<T>(p, [&](auto cache_tag) {
      return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
        return launch_split_kv<T, decltype(cache_tag), decltype(dim)::value>(p, splits,
                                                                            workspace, stream);
      });
    });
  });
}

}  // namespace flashjax::cuda
