// The Hopper backward's configuration, in one place: per kernel shape
// (TileConfig for the key and query kernels at head dims 64 and 128,
// WideTileConfig for the wide key kernel) the tile rows, warp roles and their
// registers, pipeline depths and the shared-memory plan; the named barriers
// and the layout of the float32 dQ buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

// Named barriers among the consumers (id 0 is __syncthreads'); an id plus a
// consumer index is that consumer's own barrier (128 threads).
enum class NamedBarrier : int {
  // Key kernels: a consumer's dS^T is in shared memory (head dim 64: its own
  // 128 threads); wide: both consumers' halves of P^T and dS^T (256 threads).
  kDsStored = 3,
  // Key and query kernels (kVarlen): a consumer has zeroed a tile's rows past
  // the used ones (zero_tile_rows).
  kTileZeroed = 7,
  // Key kernel, TMA epilogue: no consumer reads the owned tiles any more (256
  // threads); a consumer's dK and dV rows are in shared memory (its own).
  kOwnedRead = 9,
  kGradientsStaged = 10,
};
__host__ __device__ constexpr int barrier_id(NamedBarrier barrier, int consumer = 0) {
  return static_cast<int>(barrier) + consumer;
}

// Deterministic dQ in the fused key kernel, added in a fixed order (DqOrder,
// bwd_dq_writer.cuh): 0 off, the query kernel computes deterministic dQ; 1 causal
// calls; 2 (default) all that bwd_launch.cu's ordered_dq admits. Measured
// (benchmarks/NOTES.md), backward TFLOP/s deterministic / default, d128, H200: the
// query kernel 0.81-0.83x; a turn kept until the next tile was issued (v2, fifteenth
// session) 16k causal 0.58x, the blocks chained; the turn passed on once a tile's
// reductions complete (v3) 0.81-0.84x, one tile per completion round trip; two
// writers taking alternate tiles (v4, this code, twenty-sixth session) 2k 0.84 /
// 0.88x, 8k 0.90 / 0.89x, 16k 0.91 / 0.87x (non-causal / causal).
#ifndef FLASHJAX_BWD_ORDERED_DQ
#define FLASHJAX_BWD_ORDERED_DQ 2
#endif
inline constexpr int kOrderedDq = FLASHJAX_BWD_ORDERED_DQ;

// dQ is accumulated in float32 blocks of 64 rows x kCols head dims (64; 32 in
// the wide kernel, whose shared memory holds only 8 KB stages), contiguous so
// that one bulk reduction adds a block: block (row tile of the padded rows,
// column block) starts at (tile * kHeadDim / kCols + column block) * 64 *
// kCols floats, and element (r, c) sits at r * kCols + (c ^ 8 * (r % (kCols /
// 8))) in it (pairs of columns swizzled by row, so that staging it in shared
// memory spreads banks).
template <int kCols>
constexpr int kDqBlock = 64 * kCols;
template <int kCols>
constexpr int kDqBlockBytes = kDqBlock<kCols> * 4;

template <int kCols>
__host__ __device__ __forceinline__ int64_t dq_block_offset(int64_t row, int64_t col) {
  const int64_t r = row % 64;
  return r * kCols + ((col % kCols) ^ (8 * (r % (kCols / 8))));
}

// The float32 block (in floats from the buffer's start) of padded rows
// [64 * (padded_row / 64), +64) (PaddedRows: a region starts at a multiple of
// 64) and head dims [kCols * col_block, +kCols).
template <int kHeadDim, int kCols>
__host__ __device__ __forceinline__ int64_t dq_block_start(int64_t padded_row,
                                                           int64_t col_block) {
  return (padded_row / 64 * (kHeadDim / kCols) + col_block) * kDqBlock<kCols>;
}

// The backward's tiles hold 16-bit elements (bf16 / fp16: the backward is not
// compiled for other input types).
constexpr int kElementBytes = 2;

// The key and query kernels at head dims 64 and 128: a CTA owns 128 rows (keys
// or queries), 64 per consumer warpgroup, and streams 64-row tiles of the
// other side (bwd_mainloop.cuh: S^T, dP^T or S, dP from shared memory; the
// updates dV, dK or dQ with their left operand in registers).
// A streamed tile as the key kernel's producer found it (key kernels with a mask,
// which skip the tiles it hides; bwd_scheduler.cuh's MaskedTiles): its first slot
// row, its query head and, bit c, whether the mask hides some of its pairs with
// consumer c's keys (then read per element). Each stage holds one in shared memory.
struct StreamedTile {
  static constexpr int64_t kEndRow = -1;  // (the block's tiles end before this stage)
  int64_t row;
  uint32_t head, mixed;
  __host__ __device__ bool end() const { return row == kEndRow; }
};

template <int kHeadDimBucket>
struct TileConfig {
  static constexpr int kHeadDim = kHeadDimBucket;
  static constexpr int kConsumers = 2;
  static constexpr int kOwnRows = 64 * kConsumers;  // rows a CTA owns
  static constexpr int kStreamRows = 64;            // rows of each streamed tile
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kStoreRows = kOwnRows / kConsumers;  // of a dK / dV TMA store box
  // Registers per thread (setmaxnreg): warpgroup 0 (the producer, and the
  // fused key kernel's dQ writer) gives its share to the consumers.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // (setmaxnreg.inc takes registers only from those its CTA's other warps gave up: more
  // than the launch's share in all and the consumers wait for them forever)
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <=
                    (1 + kConsumers) * (kRegisterFile / kThreads / 8 * 8),
                "the warpgroups' registers exceed the CTA's");
  // Streamed tile stages and dQ stages per consumer (2: a reduction's reads need
  // not finish before the next tile stages dQ). Head dim 64: 3 streamed stages (the
  // next tile loads while one is computed and one drains); 128: 2, for the shared
  // memory of the second dQ stage (with one, the key kernel's consumers waited for
  // each tile's reduction to be read: ncu, d128 2k causal, H200, 2026-11-29).
  static constexpr int kStages = kHeadDim == 64 ? 3 : 2;
  static constexpr int kDqStages = 2;
  static constexpr int kDqCols = 64;  // of a float32 dQ block
  // Fused dQ = dS K: at head dim 64 each consumer takes its own 64 keys and all
  // head dims (the reductions add the halves); at 128 the consumers split the
  // head dims and share all keys.
  static constexpr bool kDqOfOwnKeys = kHeadDim == 64;
  // There (fused dQ) a consumer computes tile j's dQ share with tile j + 1's
  // dK and dV updates: the other consumer's half of dS^T_j is long stored by
  // then (ds_full / ds_empty mbarriers hand the buffers over), so no 256-thread
  // barrier per tile holds both consumers in step. Key kernel, H200: d128 2k
  // causal 687 -> 679 us, 16k causal 4547 -> 4399, 2k full 1203 -> 1206;
  // starting consumer 1 a softmax later on top: 698 / 4483 / 1220 (2026-11-27).
  static constexpr bool kDqLagsTile = !kDqOfOwnKeys;

  static constexpr int kOwnBytes = kOwnRows * kHeadDim * kElementBytes;     // one owned tensor
  static constexpr int kStreamBytes = kStreamRows * kHeadDim * kElementBytes;  // a streamed tile
  static constexpr int kDsBytes = kOwnRows * kStreamRows * kElementBytes;  // dS^T [keys][queries]
  static constexpr int kStatBytes = 2 * kStreamRows * 4;          // a tile's lse2 and D
  static constexpr int kStreamedTileBytes = sizeof(StreamedTile);

  // Shared memory (Smem carves it): the owned tensors (a, b), the rings of
  // streamed tiles (a, b) and their rows' statistics, two dS^T buffers and
  // each consumer's dQ stages (fused key kernel), each stage's StreamedTile
  // (key kernels with a mask), then the mbarriers: owned;
  // full and empty per stage; dQ full and empty per consumer and dQ stage.
  struct Offsets {
    int own_a, own_b, stream_a, stream_b, ds, dq_stage, stats, streamed;
    int owned, full, empty, dq_full, dq_empty, ds_full, ds_empty;
    int bytes;
  };
  static constexpr Offsets kSmem = [] {
    SmemPlan plan;
    Offsets at{};
    at.own_a = plan.append(kOwnBytes, kTileAlign);
    at.own_b = plan.append(kOwnBytes, kTileAlign);
    at.stream_a = plan.append(kStages * kStreamBytes, kTileAlign);
    at.stream_b = plan.append(kStages * kStreamBytes, kTileAlign);
    at.ds = plan.append(2 * kDsBytes, kTileAlign);
    at.dq_stage = plan.append(kConsumers * kDqStages * kDqBlockBytes<kDqCols>, kBulkAlign);
    at.stats = plan.append(kStages * kStatBytes, kBulkAlign);
    at.streamed = plan.append(kStages * kStreamedTileBytes, kStreamedTileBytes);
    at.owned = plan.barriers(1);
    at.full = plan.barriers(kStages);
    at.empty = plan.barriers(kStages);
    at.dq_full = plan.barriers(kConsumers * kDqStages);
    at.dq_empty = plan.barriers(kConsumers * kDqStages);
    at.ds_full = plan.barriers(2);
    at.ds_empty = plan.barriers(2);
    at.bytes = plan.smem_bytes();
    return at;
  }();
  static constexpr int kSmemBytes = kSmem.bytes;
  static_assert(kSmemBytes <= kSmemLimit, "exceeds the opt-in shared memory of sm_90");
};

// The wide key kernel (head dims 129-256, bwd_wide_mainloop.cuh): dK and dV of
// 128 keys do not fit in registers, so a CTA owns 64 keys and its consumers
// split each streamed tile's queries (S^T, dP^T) and then the head dims (dV,
// dK, dQ), with every update's operands in shared memory.
struct WideTileConfig {
  static constexpr int kHeadDim = 256;  // tiles span it whole
  static constexpr int kConsumers = 2;
  static constexpr int kOwnRows = 64;     // keys a CTA owns
  static constexpr int kStreamRows = 64;  // queries of each streamed tile
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kStoreRows = kOwnRows;  // of a dK / dV TMA store box: the block
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // Q stages (with their rows' lse2) and one dO stage (with D): dO is released
  // after dV, the first update; a second stage measured no faster.
  static constexpr int kQStages = 2;
  static constexpr int kDqCols = 32;  // of a float32 dQ block: a dQ stage is 8 KB
  static constexpr int kDqStagesPerConsumer = 2;  // one 64-column product's halves

  static constexpr int kTileBytes = 64 * kHeadDim * kElementBytes;  // K, V, a Q or a dO tile
  static constexpr int kGradBytes = kOwnRows * kStreamRows * kElementBytes;  // a P^T or dS^T tile
  // A tile's P^T and dS^T, double-buffered (the other consumer may still read tile
  // it - 1's while one writes tile it's).
  static constexpr int kGradPairBytes = 2 * kGradBytes;
  static constexpr int kGradBuffers = 2;
  static constexpr int kColBlock = 64 * 128;  // one 64-column block of a 64-row tile
  static constexpr int kDqStageFloats = kDqBlock<kDqCols>;
  static constexpr int kStatBytes = kStreamRows * 4;  // a tile's lse2 (with Q) or D (with dO)

  // Shared memory (WideSmem carves it): K, V, the Q ring, dO, two P^T/dS^T
  // pairs, each consumer's dQ stages, lse2 per Q stage and D, then the
  // mbarriers: owned; Q full and empty per stage; dO full and empty; dQ full and
  // empty per consumer and dQ stage. 224 KB.
  struct Offsets {
    int k, v, q, dout, grads, dq_stage, lse2, D;
    int owned, q_full, q_empty, do_full, do_empty, dq_full, dq_empty;
    int bytes;
  };
  static constexpr Offsets kSmem = [] {
    SmemPlan plan;
    Offsets at{};
    at.k = plan.append(kTileBytes, kTileAlign);
    at.v = plan.append(kTileBytes, kTileAlign);
    at.q = plan.append(kQStages * kTileBytes, kTileAlign);
    at.dout = plan.append(kTileBytes, kTileAlign);
    at.grads = plan.append(kGradBuffers * kGradPairBytes, kTileAlign);
    at.dq_stage =
        plan.append(kConsumers * kDqStagesPerConsumer * kDqStageFloats * 4, kBulkAlign);
    at.lse2 = plan.append(kQStages * kStatBytes, kBulkAlign);
    at.D = plan.append(kStatBytes, kBulkAlign);
    at.owned = plan.barriers(1);
    at.q_full = plan.barriers(kQStages);
    at.q_empty = plan.barriers(kQStages);
    at.do_full = plan.barriers(1);
    at.do_empty = plan.barriers(1);
    at.dq_full = plan.barriers(kConsumers * kDqStagesPerConsumer);
    at.dq_empty = plan.barriers(kConsumers * kDqStagesPerConsumer);
    at.bytes = plan.smem_bytes();
    return at;
  }();
  static constexpr int kSmemBytes = kSmem.bytes;
  static_assert(kSmemBytes <= kSmemLimit, "exceeds the opt-in shared memory of sm_90");
};

// Head dims above 128 take the wide key kernel (fused dQ only).
template <int kHeadDim>
constexpr bool kWide = kHeadDim > 128;
// The key kernel's configuration at a head dim (the query kernel's is TileConfig).
template <int kHeadDim>
using KeyKernelConfig = std::conditional_t<kWide<kHeadDim>, WideTileConfig, TileConfig<kHeadDim>>;

}  // namespace flashjax::cuda::hopper_bwd
