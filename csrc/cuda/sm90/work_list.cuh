// The pre-kernel that builds a VarlenWorkList (work_list.h) on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "../common/device.cuh"
#include "../common/work_list.h"
#include "flashjax/seqlen.h"

namespace flashjax::cuda {

// build_work_list's block, and the distinct tile counts it sorts exactly:
// sequences of more tiles share the first (longest) bin.
constexpr int kWorkListThreads = 512;
constexpr int kTileCountBins = 4096;  // 16 KB of shared memory
static_assert(kTileCountBins % kWorkListThreads == 0);

__device__ __forceinline__ int64_t slot_rows(const SeqlenInfo& seq, const WorkShape& shape) {
  return shape.keys ? seq.k_slot : seq.q_slot;
}
__device__ __forceinline__ int64_t used_rows(const SeqlenInfo& seq, const WorkShape& shape) {
  return shape.keys ? seq.seqlen_k : seq.seqlen_q;
}
// The bin of a sequence: longest first.
__device__ __forceinline__ int tile_count_bin(const SeqlenInfo& seq, const WorkShape& shape) {
  const int64_t used_tiles = (used_rows(seq, shape) + shape.tile_rows - 1) / shape.tile_rows;
  const int64_t top = kTileCountBins - 1;
  return static_cast<int>(top - (used_tiles < top ? used_tiles : top));
}

// One block, any number of sequences: a counting sort of the sequences by
// used tiles (descending; ties in any order, which changes no result: every
// tile is computed alike wherever it runs), then the items' prefix sums.
// (Internal linkage: each translation unit that builds lists has its copy.)
static __global__ void __launch_bounds__(kWorkListThreads)
    build_work_list_kernel(const AttentionParams p, const WorkShape shape,
                           const VarlenWorkList list) {
  using Scan = cub::BlockScan<int64_t, kWorkListThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t bin_cursor[kTileCountBins];  // counts, then next free position
  __shared__ int64_t items_before;                // of the positions scanned so far
  const int tid = threadIdx.x;

  for (int i = tid; i < kTileCountBins; i += kWorkListThreads) bin_cursor[i] = 0;
  if (tid == 0) items_before = 0;
  __syncthreads();
  for (int64_t b = tid; b < p.batch; b += kWorkListThreads)
    atomicAdd(&bin_cursor[tile_count_bin(SeqlenInfo(p, b), shape)], 1);
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

  for (int64_t b = tid; b < p.batch; b += kWorkListThreads) {
    const SeqlenInfo seq(p, b);
    const int32_t at = atomicAdd(&bin_cursor[tile_count_bin(seq, shape)], 1);
    list.sequence[at] = static_cast<int32_t>(b);
    list.tiles[at] = static_cast<int32_t>((slot_rows(seq, shape) + shape.tile_rows - 1) /
                                          shape.tile_rows);
  }
  __syncthreads();  // (also makes the block's global writes visible to it)

  // first_item: prefix sums of the items over the positions, a block at a time.
  for (int64_t base = 0; base < p.batch; base += kWorkListThreads) {
    const int64_t i = base + tid;
    const int64_t items = i < p.batch ? shape.items(list.tiles[i]) : 0;
    int64_t first, block_items;
    Scan(scan_storage).ExclusiveSum(items, first, block_items);
    if (i < p.batch) list.first_item[i] = min(items_before + first, shape.max_items);
    __syncthreads();
    if (tid == 0) items_before += block_items;
    __syncthreads();
  }
  if (tid == 0) list.first_item[p.batch] = min(items_before, shape.max_items);
}

inline cudaError_t build_work_list(const AttentionParams& p, const WorkShape& shape,
                                   const VarlenWorkList& list, cudaStream_t stream) {
  build_work_list_kernel<<<1, kWorkListThreads, 0, stream>>>(p, shape, list);
  return cudaGetLastError();
}

}  // namespace flashjax::cuda
