// The pre-kernel that builds a VarlenWorkList (work_list.h) on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "../common.cuh"
#include "../sequence_layout.h"
#include "flashjax/seqlen.h"
#include "work_list.h"

namespace flashjax::cuda {

// build_work_list's block, and the distinct costs (in tiles) it sorts
// exactly: entries that cost more share the first (longest) bin.
constexpr int kWorkListThreads = 512;
constexpr int kTileCountBins = 4096;  // 16 KB of shared memory
static_assert(kTileCountBins % kWorkListThreads == 0);

// An entry of the list being built: sequence b's tiles [first_tile, +tiles),
// and its bin (longest first: lower bins first).
struct ListEntry {
  int64_t b, first_tile, tiles;
  int bin;
};
__device__ __forceinline__ int cost_bin(int64_t cost_tiles) {
  const int64_t top = kTileCountBins - 1;
  return static_cast<int>(top - (cost_tiles < top ? cost_tiles : top));
}
__device__ __forceinline__ ListEntry list_entry(const AttentionParams& p, const WorkShape& shape,
                                                const SegmentTiles& segment_tiles, int64_t e) {
  const int64_t n = shape.tile_rows;
  if (!shape.per_tile) {
    const SeqlenInfo seq(p, e);
    const int64_t slot = shape.keys ? seq.k_slot : seq.q_slot;
    const int64_t used = shape.keys ? seq.seqlen_k : seq.seqlen_q;
    return {e, 0, (slot + n - 1) / n, cost_bin((used + n - 1) / n)};
  }
  const int64_t per_sequence = ((shape.keys ? p.seqlen_k : p.seqlen_q) + n - 1) / n;
  const int64_t b = e / per_sequence, tile = e % per_sequence;
  const SeqlenInfo seq(p, b);
  int64_t lo = 0, hi = 0;  // (per_tile: query tiles of segment-id layouts)
  segment_tiles.key_span(b, tile * n, n, lo, hi);
  return {b, tile, tile * n < seq.q_slot ? 1 : 0,
          cost_bin(hi > lo ? (hi - lo) / SegmentTiles::kRows : 0)};
}

// One block, any number of entries: a counting sort of the entries by cost
// (descending; ties in any order, which changes no result: every tile is
// computed alike wherever it runs), then the items' prefix sums.
// (Internal linkage: each translation unit that builds lists has its copy.)
static __global__ void __launch_bounds__(kWorkListThreads)
    build_work_list_kernel(const AttentionParams p, const WorkShape shape,
                           const SegmentTiles segment_tiles, const VarlenWorkList list) {
  using Scan = cub::BlockScan<int64_t, kWorkListThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t bin_cursor[kTileCountBins];  // counts, then next free position
  __shared__ int64_t items_before;                // of the positions scanned so far
  const int tid = threadIdx.x;
  const int64_t entries = list.entries;

  for (int i = tid; i < kTileCountBins; i += kWorkListThreads) bin_cursor[i] = 0;
  if (tid == 0) items_before = 0;
  __syncthreads();
  for (int64_t e = tid; e < entries; e += kWorkListThreads)
    atomicAdd(&bin_cursor[list_entry(p, shape, segment_tiles, e).bin], 1);
  __syncthreads();

  // Each bin's first position: an exclusive scan, consecutive bins per thread.
  constexpr int kBinsPerThread = kTileCountBins / kWorkListThreads;
  int32_t* bins = bin_cursor + tid * kBinsPerThread;
  int64_t count = 0, position;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) count += bins[i];
  Scan(scan_storage).ExclusiveSum(count, position);
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    const int32_t n = bins[i];
    bins[i] = static_cast<int32_t>(position);
    position += n;
  }
  __syncthreads();

  for (int64_t e = tid; e < entries; e += kWorkListThreads) {
    const ListEntry entry = list_entry(p, shape, segment_tiles, e);
    const int32_t at = atomicAdd(&bin_cursor[entry.bin], 1);
    list.sequence[at] = static_cast<int32_t>(entry.b);
    list.first_tile[at] = static_cast<int32_t>(entry.first_tile);
    list.tiles[at] = static_cast<int32_t>(entry.tiles);
  }
  __syncthreads();  // (also makes the block's global writes visible to it)

  // first_item: prefix sums of the items over the positions, a block at a time.
  for (int64_t base = 0; base < entries; base += kWorkListThreads) {
    const int64_t i = base + tid;
    const int64_t items = i < entries ? shape.items(list.tiles[i]) : 0;
    int64_t first, block_items;
    Scan(scan_storage).ExclusiveSum(items, first, block_items);
    if (i < entries) list.first_item[i] = min(items_before + first, shape.max_items);
    __syncthreads();
    if (tid == 0) items_before += block_items;
    __syncthreads();
  }
  if (tid == 0) list.first_item[entries] = min(items_before, shape.max_items);
}

// `list`: of shape.entries(p) entries; segment_tiles: per_tile's.
inline cudaError_t build_work_list(const AttentionParams& p, const WorkShape& shape,
                                   const VarlenWorkList& list, cudaStream_t stream,
                                   const SegmentTiles& segment_tiles = SegmentTiles{}) {
  build_work_list_kernel<<<1, kWorkListThreads, 0, stream>>>(p, shape, segment_tiles, list);
  return cudaGetLastError();
}

}  // namespace flashjax::cuda
