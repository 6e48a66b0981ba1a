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
// knows: a one-block pre-kernel (build_work_list) orders the sequences by
// query tiles, longest first, and writes where each one's items start; the
// persistent kernel finds an item's sequence by binary search.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "../common.cuh"
#include "flashjax/seqlen.h"

namespace flashjax::cuda {

enum class ScheduleStep { kTile, kSkip, kEnd };

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

// The varlen work list (device memory), in schedule order: position i is
// sequence `sequence[i]`, of `q_tiles[i]` query tiles, whose heads x pairs
// items are [first_item[i], first_item[i + 1]); first_item[batch] is the total.
struct VarlenWorkList {
  int64_t* first_item = nullptr;  // [batch + 1]
  int32_t* sequence = nullptr;    // [batch]
  int32_t* q_tiles = nullptr;     // [batch] (slots < 2^30 rows: int32)
  int64_t batch = 0;

  static size_t workspace_bytes(const AttentionParams& p) {
    const size_t n = static_cast<size_t>(p.batch);
    return sizeof(int64_t) * (n + 1) + 2 * sizeof(int32_t) * n;
  }
  VarlenWorkList() = default;
  // `workspace`: workspace_bytes(p) bytes, 8-byte aligned.
  VarlenWorkList(const AttentionParams& p, void* workspace) : batch(p.batch) {
    first_item = static_cast<int64_t*>(workspace);
    sequence = reinterpret_cast<int32_t*>(first_item + batch + 1);
    q_tiles = sequence + batch;
  }
};

struct VarlenTileSchedule {
  static constexpr int64_t packed_rows = 0;  // (GQA packing is uniform-only)
  VarlenWorkList list;
  int64_t heads;

  __device__ ScheduleStep tile(int64_t k, QueryTile& out) const {
    const int64_t item = scheduled_item(k);
    if (item >= list.first_item[list.batch]) return ScheduleStep::kEnd;
    // The last position whose items start at or before `item` (positions with
    // no items share their start with the next one, so it has items).
    int64_t lo = 0, hi = list.batch - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (list.first_item[mid] <= item) lo = mid;
      else hi = mid - 1;
    }
    const int64_t q_tiles = list.q_tiles[lo], pairs = (q_tiles + 1) / 2;
    const int64_t local = item - list.first_item[lo];
    return tile_of_pair(k, local, pairs, q_tiles, out,
                        [&] { return list.sequence[lo] * heads + local / pairs; });
  }
};

// build_work_list's block, and the distinct query-tile counts it sorts
// exactly: sequences of more tiles share the first (longest) bin.
constexpr int kWorkListThreads = 512;
constexpr int kTileCountBins = 4096;  // 16 KB of shared memory
static_assert(kTileCountBins % kWorkListThreads == 0);

template <int kBlockM>
__device__ __forceinline__ int32_t slot_query_tiles(const AttentionParams& p, int64_t b) {
  return static_cast<int32_t>((SeqlenInfo(p, b).q_slot + kBlockM - 1) / kBlockM);
}
// The bin of a sequence: longest first. The cost is in the used rows (a
// slot's rows past them only get zeros), so those order the sequences.
template <int kBlockM>
__device__ __forceinline__ int tile_count_bin(const AttentionParams& p, int64_t b) {
  const int64_t used_tiles = (SeqlenInfo(p, b).seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t top = kTileCountBins - 1;
  return static_cast<int>(top - (used_tiles < top ? used_tiles : top));
}

// One block, any number of sequences: a counting sort of the sequences by
// used query tiles (descending; ties in any order, which changes no result:
// every tile is computed alike wherever it runs), then the items' prefix sums.
template <int kBlockM>
__global__ void __launch_bounds__(kWorkListThreads)
    build_work_list_kernel(const AttentionParams p, const VarlenWorkList list) {
  using Scan = cub::BlockScan<int64_t, kWorkListThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t bin_cursor[kTileCountBins];  // counts, then next free position
  __shared__ int64_t items_before;                // of the positions scanned so far
  const int tid = threadIdx.x;

  for (int i = tid; i < kTileCountBins; i += kWorkListThreads) bin_cursor[i] = 0;
  if (tid == 0) items_before = 0;
  __syncthreads();
  for (int64_t b = tid; b < p.batch; b += kWorkListThreads)
    atomicAdd(&bin_cursor[tile_count_bin<kBlockM>(p, b)], 1);
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
    const int32_t at = atomicAdd(&bin_cursor[tile_count_bin<kBlockM>(p, b)], 1);
    list.sequence[at] = static_cast<int32_t>(b);
    list.q_tiles[at] = slot_query_tiles<kBlockM>(p, b);
  }
  __syncthreads();  // (also makes the block's global writes visible to it)

  // first_item: prefix sums of heads x pairs over the positions, a block at a time.
  for (int64_t base = 0; base < p.batch; base += kWorkListThreads) {
    const int64_t i = base + tid;
    const int64_t items = i < p.batch ? p.heads_q * ((list.q_tiles[i] + 1) / 2) : 0;
    int64_t first, block_items;
    Scan(scan_storage).ExclusiveSum(items, first, block_items);
    if (i < p.batch) list.first_item[i] = items_before + first;
    __syncthreads();
    if (tid == 0) items_before += block_items;
    __syncthreads();
  }
  if (tid == 0) list.first_item[p.batch] = items_before;
}

template <int kBlockM>
cudaError_t build_work_list(const AttentionParams& p, const VarlenWorkList& list,
                            cudaStream_t stream) {
  build_work_list_kernel<kBlockM><<<1, kWorkListThreads, 0, stream>>>(p, list);
  return cudaGetLastError();
}

}  // namespace flashjax::cuda
