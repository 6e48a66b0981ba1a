// Segment-id tile ranges and the packed layout's uncovered rows (see
// sequence_layout.h).
#include "device.cuh"
#include "dispatch.h"
#include "sequence_layout.h"

namespace flashjax::cuda {
namespace {

constexpr int kThreadsPerBlock = 256;

unsigned blocks_for(int64_t threads) {
  return static_cast<unsigned>((threads + kThreadsPerBlock - 1) / kThreadsPerBlock);
}

// The segment-id tile of a warp (one warp per tile: the query tiles of every
// sequence, then the key tiles); false for the grid's spare warps.
struct WarpTile {
  int64_t tile, per_sequence;
  bool queries;
  int lane;
  __device__ bool find(const AttentionParams& p, const SegmentTiles& tiles) {
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t query_tiles = p.batch * tiles.q_tiles;
    lane = threadIdx.x % 32;
    if (warp >= query_tiles + p.batch * tiles.k_tiles) return false;
    queries = warp < query_tiles;
    tile = queries ? warp : warp - query_tiles;
    per_sequence = queries ? tiles.q_tiles : tiles.k_tiles;
    return true;
  }
};

// Each tile's id range.
__global__ void segment_tiles_kernel(const AttentionParams p, SegmentTiles tiles) {
  WarpTile w;
  if (!w.find(p, tiles)) return;  // (whole warps)
  const int64_t b = w.tile / w.per_sequence, row0 = w.tile % w.per_sequence * SegmentTiles::kRows;
  const SeqlenInfo seq(p, b);
  const SegmentIds ids(p, b);
  const int32_t* id = w.queries ? ids.q : ids.k;
  const int64_t end = min(row0 + SegmentTiles::kRows, w.queries ? seq.seqlen_q : seq.seqlen_k);
  IdRange range;
  for (int64_t i = row0 + w.lane; i < end; i += 32) range.add(id[i]);
  range.lo = __reduce_min_sync(0xffffffffu, range.lo);
  range.hi = __reduce_max_sync(0xffffffffu, range.hi);
  if (w.lane == 0) (w.queries ? tiles.q : tiles.k)[w.tile] = range;
}

// Each tile's span of the other side's tiles whose ranges meet its (lanes
// stride over them, then a min / max reduction).
__global__ void segment_spans_kernel(const AttentionParams p, SegmentTiles tiles) {
  WarpTile w;
  if (!w.find(p, tiles)) return;  // (whole warps)
  const int64_t others = w.queries ? tiles.k_tiles : tiles.q_tiles;
  const IdRange mine = (w.queries ? tiles.q : tiles.k)[w.tile];
  const IdRange* other = (w.queries ? tiles.k : tiles.q) + w.tile / w.per_sequence * others;
  int32_t first = INT32_MAX, last = -1;
  for (int64_t t = w.lane; t < others; t += 32)
    if (mine.meets(other[t])) {
      first = min(first, static_cast<int32_t>(t));
      last = max(last, static_cast<int32_t>(t));
    }
  first = __reduce_min_sync(0xffffffffu, first);
  last = __reduce_max_sync(0xffffffffu, last);
  if (w.lane == 0) (w.queries ? tiles.q_span : tiles.k_span)[w.tile] = {first, last};
}

// Is row `row` of the packed query (or key) tensors in a sequence's slot?
// Slots are disjoint and in order for non-decreasing cu_seqlens, so the only
// candidate is the last sequence whose (clamped) start is at most `row`.
__device__ bool covered(const AttentionParams& p, int64_t row, bool queries) {
  if (p.batch <= 0) return false;
  const SeqlenInfo seq(p, last_sequence_starting_by(p.batch, row, [&](int64_t b) {
                         const SeqlenInfo s(p, b);
                         return queries ? s.q_start : s.k_start;
                       }));
  const int64_t begin = queries ? seq.q_start : seq.k_start;
  const int64_t slot = queries ? seq.q_slot : seq.k_slot;
  return begin <= row && row < begin + slot;
}

template <class T>
__device__ void zero_row(const TensorRef& t, int64_t row, int64_t heads, int64_t dim) {
  for (int64_t h = 0; h < heads; ++h) {
    T* dst = t.at<T>(0, row, h);
    for (int64_t c = 0; c < dim; ++c) dst[c] = from_float<T>(0.0f);
  }
}

// One thread per packed tensor row (uncovered rows are rare: a plain loop).
template <class T>
__global__ void fill_uncovered_rows_kernel(const AttentionParams p, Pass pass) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row < p.total_q && !covered(p, row, true)) {
    if (pass == Pass::kForward) {
      zero_row<T>(p.out, row, p.heads_q, p.head_dim_v);
      for (int64_t h = 0; h < p.heads_q; ++h) *p.lse.at<float>(0, row, h) = kNegInf;
    } else {
      zero_row<T>(p.dq, row, p.heads_q, p.head_dim);
    }
  }
  if (pass == Pass::kBackward && row < p.total_k && !covered(p, row, false)) {
    zero_row<T>(p.dk, row, p.heads_kv, p.head_dim);
    zero_row<T>(p.dv, row, p.heads_kv, p.head_dim_v);
  }
}

}  // namespace

cudaError_t compute_segment_tiles(const AttentionParams& p, const SegmentTiles& tiles,
                                  cudaStream_t stream) {
  const int64_t warps = p.batch * (tiles.q_tiles + tiles.k_tiles);
  if (warps == 0) return cudaSuccess;
  segment_tiles_kernel<<<blocks_for(32 * warps), kThreadsPerBlock, 0, stream>>>(p, tiles);
  segment_spans_kernel<<<blocks_for(32 * warps), kThreadsPerBlock, 0, stream>>>(p, tiles);
  return cudaGetLastError();
}

cudaError_t fill_uncovered_rows(const AttentionParams& p, Pass pass, cudaStream_t stream) {
  const int64_t rows =
      pass == Pass::kForward ? p.total_q : (p.total_q > p.total_k ? p.total_q : p.total_k);
  if (!p.packed() || rows <= 0) return cudaSuccess;
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    fill_uncovered_rows_kernel<decltype(tag)>
        <<<blocks_for(rows), kThreadsPerBlock, 0, stream>>>(p, pass);
    return cudaGetLastError();
  });
}

}  // namespace flashjax::cuda
