// The Hopper backward's dQ reductions: each tile's share of dQ, staged in
// shared memory in a float32 block's layout (bwd_tile_config.h), is added to
// the float32 dQ buffer by one bulk reduction (cp.reduce.async.bulk) per
// block; convert_dq_kernel turns the buffer into dq. The consumers hand their
// blocks to writer threads (of the producer warpgroup) through mbarriers.
#pragma once

#include <cstdint>

#include "bwd_params.h"
#include "bwd_scheduler.cuh"
#include "bwd_smem.cuh"
#include "bwd_tile_config.h"
#include "bwd_workspace.h"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Stores columns [kCols * part, +kCols) of a consumer's dQ fragment (64 rows x
// 64 columns) in a float32 block's layout in shared memory, from where one
// bulk reduction adds it to the dQ buffer (per-thread atomics cost more than a
// third of the kernel's time).
template <int kCols>
__device__ __forceinline__ void stage_dq(float* stage, const float (&dq)[32], int part) {
  const int lane = threadIdx.x % 32;
  const int row0 = ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  // dq_block_offset's swizzle (rows row0 and row0 + 8 share it).
  const int swizzle = row0 % (kCols / 8);
  const uint32_t base = smem_u32(stage) + 4 * (row0 * kCols + 2 * (lane % 4));
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      const int i = 4 * (n + part * kCols / 8) + 2 * r;
      const uint32_t at = base + 4 * (8 * r * kCols + 8 * (n ^ swizzle));
      st_shared(at, dq[i], dq[i + 1]);
    }
}

// Deterministic dQ (`order`, uniform layouts): the key blocks of a (sequence,
// kv head) add to each query tile's rows of the dQ buffer one after another, in
// a fixed order, each waiting for its turn on the tile's counter
// (HopperBackwardWorkspace::dq_order). The blocks run in pair order (KeyBlock), and a
// block only waits for blocks of its own pair, which the host makes fit on the
// SMs at once: the first unfinished pair's blocks can always all be running, so
// it finishes (no deadlock). Non-causal: first to last; causal
// (window_right 0): last to first, the order in which they reach a tile (a
// block starts at its first visible tile: block n + 1 reaches each tile two
// tiles before block n, so no block waits long).
// Full attention (KeyBlock::rotated): block n walks the tiles from tile
// floor(n T / N) (T tiles, N blocks) and wraps, and a tile's order is the order in
// which the blocks reach it: first the block that started nearest at or before it,
// then the ones that started before that (a total order consistent with every
// block's progress: no cycle of waits).
template <class Block>
struct DqOrder {
  int* counters;  // per kDqOrderRows padded rows
  SeqlenInfo seq;
  int self, blocks;
  uint32_t q_tiles;
  bool last_first, rotated;

  __device__ DqOrder(int* counters_, const AttentionParams& p, const Block& kb)
      : counters(counters_),
        seq(kb.sequence(p)),
        self(static_cast<int>(kb.k0 / Block::kRows)),
        blocks(static_cast<int>(Block::blocks(p))),
        q_tiles(static_cast<uint32_t>(kb.q_tiles)),
        last_first(p.window_right == 0),
        rotated(kb.rotated) {}

  // This block's place among the blocks whose tiles include the one at slot row
  // `row` (a contiguous range of blocks: KeyBlock::first_row and end_row are
  // non-decreasing).
  __device__ int rank(int64_t row) const {
    if (rotated) {  // (row_begin 0; N q_tiles < 2^31: the host bounds N by the SMs)
      const uint32_t tile = static_cast<uint32_t>(row / Block::kStreamRows), n = blocks;
      // the last block that starts at or before `tile`: blocks m < ceil((tile + 1) N / T)
      const int nearest = static_cast<int>(min(n, ((tile + 1) * n + q_tiles - 1) / q_tiles)) - 1;
      return (nearest - self + blocks) % blocks;
    }
    if (last_first) {  // the last block with first_row <= row
      int lo = self, hi = blocks - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (Block::first_row(seq, int64_t(mid) * Block::kRows) <= row) lo = mid;
        else hi = mid - 1;
      }
      return lo - self;
    }
    int lo = 0, hi = self;  // the first block with end_row > row
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (Block::end_row(seq, int64_t(mid) * Block::kRows) > row) hi = mid;
      else lo = mid + 1;
    }
    return self - lo;
  }
  // Waits until the blocks before this one have added to the tile, then orders
  // the bulk reductions that follow after them.
  __device__ void wait_turn(int64_t padded_row, int64_t row) const {
    const int* counter = counters + padded_row / HopperBackwardWorkspace::kDqOrderRows;
    const int turn = rank(row);
    while (ld_acquire_gpu(counter) != turn) __nanosleep(kSpinNanoseconds);
    fence_proxy_async_global();
  }
  // Once this block's reductions to the tile are complete: the next block's turn.
  // (Passed right away: a block that kept its turn until it issued its next tile
  // would chain each block to the next one's progress; fifteenth session, v2.)
  __device__ void pass_turn(int64_t padded_row) const {
    bulk_wait_all();
    fence_proxy_async_global();
    red_release_gpu_add(counters + padded_row / HopperBackwardWorkspace::kDqOrderRows, 1);
  }
  static constexpr int kSpinNanoseconds = 64;
};

// Threads that write a fused key kernel's dQ: two. Unordered, one per consumer, each
// sending its consumer's blocks only: the consumers drift apart (kDqLagsTile), and a
// single writer serving both in turn freed a consumer's stage only once the other's
// block of the same tile had come (the consumer ahead waited at every tile: ncu, d128 2k
// causal, twenty-eighth session). Ordered (DqOrder): both consumers' blocks of
// alternate tiles, so that one writer waits for its tile's reductions to complete
// before passing the turn while the other takes the next tile (a single thread's
// writes ran one tile per completion round trip: fifteenth session, v3).
inline constexpr int kDqWriters = 2;

// The fused key kernel's dQ writer `writer` of kDqWriters (threads of the
// producer warpgroup, each in a warp of its own): it sends a consumer's staged dQ
// block (tile it, stage it % kDqStages) as a bulk reduction once the consumer's four
// warps have arrived on dq_full, and frees a stage (dq_empty) once the reduction has
// read it, so that consumers only wait when they are a whole ring ahead. Unordered:
// consumer `writer`'s blocks of every tile. kOrdered: deterministic, in the order of
// DqOrder (counters at dq_order), both consumers' blocks of tiles w, w + 2, ... (writer
// w) once the other writer has freed the stage of the tile before (one stage: its
// dq_empty phase orders the two; then dq_full's phase is the tile's).
// tiles_of: the block's tiles as the producer walks them (bwd_scheduler.cuh).
template <bool kOrdered, int kHeadDim, class Block, class Tiles>
__device__ void write_dq(Smem<kHeadDim>& sm, const Block& kb, const AttentionParams& p,
                         const RowStats& stats, float* dq_accum, int* dq_order,
                         const Tiles& tiles_of, int writer = 0) {
  using C = TileConfig<kHeadDim>;
  static_assert(C::kStreamRows == HopperBackwardWorkspace::kDqOrderRows, "a counter per tile");
  constexpr int kLag = C::kDqStages - 1;  // tiles whose reductions may still read
  auto tile = kb.walk(p, stats.padded);
  // (kDqOfOwnKeys: both consumers add to one block, which an order would serialise)
  static_assert(!kOrdered || !C::kDqOfOwnKeys, "ordered dQ: consumers add to their own blocks");
  // (A mask's skipped tiles would break the order: ordered_dq leaves masks out.)
  static_assert(!kOrdered || !Tiles::kSkips, "ordered dQ visits every tile");
  // (Ordered: the two writers share one stage, or own one each.)
  constexpr bool kStagePerWriter = kOrdered && C::kDqStages == kDqWriters;
  static_assert(!kOrdered || C::kDqStages == 1 || kStagePerWriter,
                "ordered dQ: the writers share one stage or own one each");
  static_assert(kOrdered || kDqWriters == C::kConsumers, "unordered: a writer per consumer");
  // The consumers whose blocks this writer sends, and its reductions a tile.
  const int first = kOrdered ? 0 : writer, end = kOrdered ? C::kConsumers : writer + 1;
  constexpr int kBlocks = kOrdered ? C::kConsumers : 1;
  const DqOrder<Block> order(dq_order, p, kb);
  for (int64_t it = 0; it < kb.tiles; ++it, tile.next()) {
    // (the tile the consumers compute next: found while they do, off their path)
    if (Tiles::kSkips && tiles_of.find(tile).end()) break;
    if (kOrdered && it % kDqWriters != writer) continue;
    const int s = it % C::kDqStages;
    if (kOrdered && !kStagePerWriter && it > 0) {
#pragma unroll
      for (int c = 0; c < C::kConsumers; ++c)
        mbar_wait_idle(&sm.dq_empty[c * C::kDqStages + s], (it - 1) & 1);
    }
#pragma unroll
    for (int c = first; c < end; ++c) {
      mbar_wait_idle(&sm.dq_full[c * C::kDqStages + s], (it / C::kDqStages) & 1);
      if (kOrdered && c == 0)
        order.wait_turn(tile.padded_row, kb.row_begin + tile.j * C::kStreamRows);
      // With kDqOfOwnKeys both consumers add to the same block.
      const int64_t block =
          dq_block_start<kHeadDim, C::kDqCols>(tile.padded_row, C::kDqOfOwnKeys ? 0 : c);
      bulk_reduce_add(dq_accum + block,
                      sm.dq_stage + (c * C::kDqStages + s) * kDqBlock<C::kDqCols>,
                      kDqBlockBytes<C::kDqCols>);
    }
    if constexpr (kStagePerWriter) {  // (this writer's own stage, once read)
      bulk_wait_reads<0>();
#pragma unroll
      for (int c = first; c < end; ++c) mbar_arrive(&sm.dq_empty[c * C::kDqStages + s]);
    } else {
      bulk_wait_reads<kBlocks * kLag>();
      if (it >= kLag) {
        const int freed = (it - kLag) % C::kDqStages;
#pragma unroll
        for (int c = first; c < end; ++c) mbar_arrive(&sm.dq_empty[c * C::kDqStages + freed]);
      }
    }
    // The tile's turn passes on once its reductions are complete (the stages are
    // free already: the consumers need not wait for the completion).
    if constexpr (kOrdered) order.pass_turn(tile.padded_row);
  }
  bulk_wait_all();
}

// The wide kernel's dQ: each consumer stages the two 32-column halves of each of
// its two 64-column products a tile (four blocks) in its ring of
// kDqStagesPerConsumer stages, handing each over by dq_full (stage_dq_wide); a
// writer thread per consumer sends each as a bulk reduction and frees the stage
// (dq_empty) once the reduction has read it (write_dq_wide), so that a consumer only
// waits when its ring is full (it used to wait for its own reductions' reads at every
// half, with two named barriers around each staging).
// use: the consumer's product count (2 it + product), each product one ring round.
__device__ __forceinline__ void stage_dq_wide(WideSmem& sm, int consumer, const float (&dq)[32],
                                              int64_t use) {
  using C = WideTileConfig;
  const int phase = static_cast<int>(use & 1);
#pragma unroll
  for (int part = 0; part < C::kDqStagesPerConsumer; ++part) {
    const int slot = consumer * C::kDqStagesPerConsumer + part;
    mbar_wait(&sm.dq_empty[slot], phase ^ 1);
    stage_dq<C::kDqCols>(sm.dq_stage + slot * C::kDqStageFloats, dq, part);
    fence_proxy_async();
    warp_arrive(&sm.dq_full[slot]);
  }
}

// Consumer `consumer`'s writer (a thread of the producer warpgroup): its staged
// blocks in order, each added to column block 2 (2 consumer + product) + part of
// the tile's rows.
__device__ void write_dq_wide(WideSmem& sm, const KeyBlock<WideTileConfig>& kb,
                              const AttentionParams& p, const RowStats& stats, float* dq_accum,
                              int consumer) {
  using C = WideTileConfig;
  constexpr int kParts = C::kDqStagesPerConsumer;
  int previous = -1;  // the slot of the last reduction issued (its reads may be pending)
  for (int64_t it = 0; it < kb.tiles; ++it) {
    const int64_t padded_row = kb.padded_start(p, stats.padded, kb.head(p, it)) + kb.row(it);
#pragma unroll
    for (int product = 0; product < 2; ++product) {
#pragma unroll
      for (int part = 0; part < kParts; ++part) {
        const int slot = consumer * kParts + part;
        mbar_wait_idle(&sm.dq_full[slot], product);  // (each product one ring round)
        const int column_block = 2 * (2 * consumer + product) + part;
        bulk_reduce_add(dq_accum + dq_block_start<C::kHeadDim, C::kDqCols>(padded_row,
                                                                           column_block),
                        sm.dq_stage + slot * C::kDqStageFloats, kDqBlockBytes<C::kDqCols>);
        bulk_wait_reads<1>();  // (all but this one read: the previous stage is free)
        if (previous >= 0) mbar_arrive(&sm.dq_empty[previous]);
        previous = slot;
      }
    }
  }
  bulk_wait_all();
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
