// The Hopper forward's configuration, in one place: tile sizes per element
// type and head dim, warp roles and their registers, named barriers, the
// pipeline depth and the shared-memory layout.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/sequence_layout.h"
#include "hopper_common.cuh"

// Keys per float8 tile up to head dim 128: 192 measured 3-5% faster than 128 and ~1%
// than FA3's 224 (H200, thirtieth session); an A/B knob (an S width wgmma_ss_f8 has:
// 64, 128, 192, 224 or 256).
#ifndef FLASHJAX_FP8_D128_KEYS
#define FLASHJAX_FP8_D128_KEYS 192
#endif
#ifndef FLASHJAX_FWD_D64_CONSUMERS
#define FLASHJAX_FWD_D64_CONSUMERS 3
#endif

namespace flashjax::cuda::hopper_fwd {

constexpr int kStages = 2;  // K/V tiles in flight: a ring of full/empty mbarriers
// Tiles of a dynamic schedule published ahead to the consumers (fwd_scheduler.cuh).
constexpr int kItemSlots = 2;
constexpr int kConsumerRows = 64;  // query rows of a consumer warpgroup
constexpr int kWarpRows = 16;      // of a consumer warp (one wgmma row slice)
constexpr int kWarpsPerGroup = 4;
// float8 P = exp2(score - max + 8), in (0, 256] (e4m3 reaches 448): small
// probabilities keep e4m3's precision (FA3's Max_offset).
constexpr int kFloat8ExponentOffset = 8;

// Named barriers (id 0 is __syncthreads'): 1 + c is consumer c's turn to
// issue; kClearBarrier + c orders consumer c's zeroing of a V tile before its
// product (kVarlen); kRowsDoneBarrier: every consumer has written its last rows.
constexpr int kMaxConsumers = 3;
constexpr int kTurnBarrier = 1;
constexpr int kClearBarrier = kTurnBarrier + kMaxConsumers;
constexpr int kRowsDoneBarrier = kClearBarrier + kMaxConsumers;
// kOutStagedBarrier + c: consumer c's out rows are staged / its buffer is free.
constexpr int kOutStagedBarrier = kRowsDoneBarrier + 1;
// The producer warpgroup's warp that recomputes rows a tile product got wrong.
constexpr int kRecomputeWarp = 1;
// GQA packing is compiled for head dims up to 128 (at 256 its row arithmetic
// makes the kernel spill).
template <int kHeadDim>
constexpr bool kPacksGroups = kHeadDim <= 128;
// Whether a kernel variant packs a GQA group's rows into one item: uniform
// layouts without score terms (an item's terms are one query head's).
template <int kHeadDim, Layouts kLayouts, TermSet kTerms>
constexpr bool packs_groups() {
  return kPacksGroups<kHeadDim> && kLayouts == Layouts::kUniform && !has_terms(kTerms);
}

// Whether a kernel variant is also compiled with wide key tiles (kWideKeys):
// head dim 256, uniform layouts without score terms (the masks' and terms' tile
// grain is 64 keys). fwd_launch_bucket.cuh's wide_keys_pay picks it per call.
template <int kHeadDim, Layouts kLayouts, TermSet kTerms>
constexpr bool has_wide_keys() {
  return kHeadDim == 256 && kLayouts == Layouts::kUniform && !has_terms(kTerms);
}

// Tiles of element type T (the inputs Q, K, V) at head-dim bucket kHeadDim;
// kWideKeys: FA3's wider key tiles at head dim 256 (has_wide_keys).
template <class T, int kHeadDimBucket, bool kWideKeys = false>
struct TileConfig {
  using Element = T;
  static constexpr int kHeadDim = kHeadDimBucket;
  static constexpr int kElementBytes = sizeof(T);
  // float8 inputs (Float8Inputs): the 8-bit wgmma, V's tiles from its permuted
  // transpose ([head dims][keys], K-major: the only B operand 8-bit wgmma reads),
  // P packed to e4m3 from each thread's own accumulators.
  static constexpr bool kFloat8 = kElementBytes == 1;
  static_assert(!kFloat8 || !kWideKeys, "float8 tiles have their own key count");
  // Consumer warpgroups, 64 query rows each: three at head dim 64, where the
  // products are short and the softmax needs more warps to hide behind them
  // (FLASHJAX_FWD_D64_CONSUMERS=2: an A/B knob; at 3 the consumers' 160
  // registers are at the edge of spilling).
  static constexpr int kConsumers = kHeadDim == 64 ? FLASHJAX_FWD_D64_CONSUMERS : 2;
  static constexpr int kBlockM = kConsumerRows * kConsumers;  // query rows per tile
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Registers per thread: the producer gives its share to the consumers (float8: all
  // but 24, as FA3, for S, O and P: 208 a thread at head dim 256, 184 at 128 with 192
  // keys; with 232 ptxas serialised d256's wgmmas, C7512).
  static constexpr int kProducerRegs = kConsumers == 3 || kFloat8 ? 24 : 40;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : (kFloat8 ? 240 : 232);
  // Keys per tile: 128 up to head dim 128; above, 64, or 80 with kWideKeys (FA3's
  // d256 tile: fewer, longer products).
  // float8: 128 at head dim 256; up to 128, FLASHJAX_FP8_D128_KEYS (with 8-bit
  // products twice as fast, the per-tile work of the softmax, the O rescale, the
  // barriers and turns, is spread over more keys).
  static constexpr int kWideBlockN = 80;
  static constexpr int kBlockN =
      kFloat8 ? (kHeadDim <= 128 ? FLASHJAX_FP8_D128_KEYS : 128)
              : (kHeadDim <= 128 ? 128 : (kWideKeys ? kWideBlockN : 64));
  // Tiles are whole swizzle column blocks (96 -> 128 columns, zero-filled).
  static constexpr int kPaddedDim =
      kColumnBlocks<kHeadDim, kElementBytes> * kSwizzleCols<kElementBytes>;
  // Elements of a wgmma k-step: Q K^T steps over head dims, P V over keys.
  static constexpr int kMmaK = kMmaKBytes / kElementBytes;
  static constexpr int kQBytes = kBlockM * kPaddedDim * kElementBytes;
  static constexpr int kKBytes = kBlockN * kPaddedDim * kElementBytes;
  // float8's V^T tile ([head dims][keys]): whole 128-key swizzle column blocks, as TMA
  // boxes of 128-byte rows load them (keys past kBlockN come in unused: 192 keys load
  // 256, zeros past the end).
  static constexpr int kVtBlocks = kFloat8 ? (kBlockN + kSwizzleBytes - 1) / kSwizzleBytes : 0;
  static constexpr int kVBytes = kFloat8 ? kVtBlocks * kSwizzleBytes * kPaddedDim : kKBytes;
  static_assert(!kFloat8 || kBlockN % kMmaK == 0, "whole k-steps of P V");
  static constexpr int kOutBytes = kConsumerRows * kPaddedDim * 2;  // a consumer's rows
  // Shared memory (ForwardSmem carves it): Q, the K ring, the V ring, each consumer's
  // out rows (16-bit; kStagesOut), the mbarriers (Q full and empty, K and V full and
  // empty per stage, the item ring's full and empty per slot), a flag per consumer
  // warp, then, 16-byte words: the item's tile count and each K stage's PublishedTile
  // (kernels with a mask), the item ring's slots (a dynamic schedule's tiles;
  // fwd_smem.cuh).
  struct Offsets {
    int q, k, v, out;
    int q_full, q_empty, k_full, k_empty, v_full, v_empty, item_full, item_empty;
    int flags, item_tiles, tiles, items;
    int bytes;
  };
  static constexpr int kPublishedWord = 16;
  static constexpr Offsets layout(bool out_rows) {
    SmemPlan plan;
    Offsets at{};
    at.q = plan.append(kQBytes, kTileAlign);
    at.k = plan.append(kStages * kKBytes, kTileAlign);
    at.v = plan.append(kStages * kVBytes, kTileAlign);
    at.out = out_rows ? plan.append(kConsumers * kOutBytes, kTileAlign) : plan.end;
    at.q_full = plan.barriers(1);
    at.q_empty = plan.barriers(1);
    at.k_full = plan.barriers(kStages);
    at.k_empty = plan.barriers(kStages);
    at.v_full = plan.barriers(kStages);
    at.v_empty = plan.barriers(kStages);
    at.item_full = plan.barriers(kItemSlots);
    at.item_empty = plan.barriers(kItemSlots);
    at.flags = plan.append(4 * kWarpsPerGroup * kConsumers, 4);
    at.item_tiles = plan.append(kPublishedWord, kPublishedWord);
    at.tiles = plan.append(kStages * kPublishedWord, kPublishedWord);
    at.items = plan.append(kItemSlots * kPublishedWord, kPublishedWord);
    at.bytes = plan.smem_bytes();
    return at;
  }
  // Out stored by TMA from shared memory (fwd_epilogue.cuh) at head dims 64 and
  // 128 and in float8: at d64 the 2k causal kernel took 475 us instead of 485,
  // float8 gained 0.4-2% at d128 and 0.6-3.6% at d256 (8k/16k), 16-bit d128 1-4%
  // at 2k and 4% with a (1024, 0) window, level at 16k (H200, 2026-11-30; its
  // spills no longer grow: 624 B either way); 16-bit d256 rows do not fit.
  static constexpr bool kStagesOut =
      (kHeadDim == 64 || kHeadDim == 128 || kFloat8) && layout(true).bytes <= kSmemLimit;
  static constexpr Offsets kSmem = layout(kStagesOut);
  static constexpr int kSmemBytes = kSmem.bytes;
  static_assert(kSmemBytes <= kSmemLimit, "exceeds the opt-in shared memory of sm_90");
  static_assert(kConsumers <= kMaxConsumers, "named barrier ids overlap");
  static_assert(kOutStagedBarrier + kConsumers <= 16, "16 named barriers");
};

}  // namespace flashjax::cuda::hopper_fwd
