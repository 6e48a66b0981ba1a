// The Hopper backward's configuration, in one place: tile sizes, warp roles
// and their registers, named barriers, pipeline depths, the kernels'
// shared-memory layouts and the layout of the float32 dQ buffer.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashjax::cuda::hopper_bwd {

constexpr int kOwnRows = 128;   // rows a CTA owns (keys or queries): 64 per consumer
constexpr int kStreamRows = 64; // rows of each streamed tile
constexpr int kThreads = 384;
// Registers per thread (setmaxnreg): warpgroup 0 (the producer, and the fused
// key kernel's dQ writer) gives its share to the two consumer warpgroups.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;

// Named barriers among the consumers (id 0 is __syncthreads'); an id plus a
// consumer index is that consumer's own barrier (128 threads).
enum class NamedBarrier : int {
  // Key kernels: both consumers' halves of dS^T (wide: and of P^T) are in
  // shared memory (256 threads); at head dim 64, each consumer's own.
  kDsStored = 3,
  // Wide kernel: a consumer's dQ stage is written / may be written again.
  kDqStage = 5,
  // Key and query kernels (kVarlen): a consumer has zeroed a tile's rows past
  // the used ones (zero_tile_rows).
  kTileZeroed = 7,
};
__host__ __device__ constexpr int barrier_id(NamedBarrier barrier, int consumer = 0) {
  return static_cast<int>(barrier) + consumer;
}

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

// Head dims above 128 take the wide key kernel (fused dQ only).
template <int kHeadDim>
constexpr bool kWide = kHeadDim > 128;
template <int kHeadDim>
constexpr int kDqCols = kWide<kHeadDim> ? 32 : 64;

// The key and query kernels' shared memory (Smem carves it).
template <int kHeadDim>
struct Layout {
  // Streamed tile stages (3: the next tile loads while one is computed and one
  // drains) and dQ stages per consumer (2: a reduction's reads need not finish
  // before the next tile stages dQ).
  static constexpr int kStages = 3;
  static constexpr int kDqStages = kHeadDim == 64 ? 2 : 1;
  static constexpr int kOwnBytes = kOwnRows * kHeadDim * 2;       // one owned tensor
  static constexpr int kStreamBytes = kStreamRows * kHeadDim * 2; // one streamed tile
  static constexpr int kDsBytes = kOwnRows * kStreamRows * 2;     // dS^T [keys][queries]
  static constexpr int kStatBytes = 2 * kStreamRows * 4;          // a tile's lse2 and D
  static constexpr int kDsOffset = 2 * kOwnBytes + 2 * kStages * kStreamBytes;
  static constexpr int kDqStageOffset = kDsOffset + 2 * kDsBytes;  // dS^T double-buffered
  static constexpr int kStatOffset = kDqStageOffset + 2 * kDqStages * kDqBlockBytes<64>;
  static constexpr int kBarrierOffset = kStatOffset + kStages * kStatBytes;
  static constexpr int kBarriers = 1 + 2 * kStages + 2 * 2 * kDqStages;
  static constexpr int kSmemBytes = kBarrierOffset + 8 * kBarriers + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
};

// The wide key kernel (head dims 129-256, bwd_wide_mainloop.cuh): a CTA owns
// 64 keys. Shared memory (WideSmem carves it): K, V, two Q stages and one dO
// stage (dO is released after dV, the first update; a second stage measured no
// faster), two P^T/dS^T pairs and two 8 KB dQ stages per consumer: 224 KB.
namespace wide {
constexpr int kKeys = 64;
constexpr int kHeadDim = 256;
constexpr int kQStages = 2;
constexpr int kTileBytes = 64 * kHeadDim * 2;  // K, V, a Q or a dO tile
constexpr int kGradBytes = kKeys * kStreamRows * 2;  // one P^T or dS^T tile
constexpr int kColBlock = 64 * 128;  // one 64-column block of a 64-row tile
constexpr int kDqStageFloats = kDqBlock<kDqCols<kHeadDim>>;
constexpr int kQOffset = 2 * kTileBytes;
constexpr int kDoOffset = kQOffset + kQStages * kTileBytes;
constexpr int kGradOffset = kDoOffset + kTileBytes;
constexpr int kDqStageOffset = kGradOffset + 2 * 2 * kGradBytes;
constexpr int kStatOffset = kDqStageOffset + 2 * 2 * kDqStageFloats * 4;
constexpr int kStatBytes = kStreamRows * 4;  // a tile's lse2 (with Q) or D (with dO)
constexpr int kBarrierOffset = kStatOffset + (kQStages + 1) * kStatBytes;
constexpr int kSmemBytes = kBarrierOffset + 8 * (1 + 2 * kQStages + 2) + 1024;
static_assert(kSmemBytes <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
}  // namespace wide

template <int kHeadDim>
constexpr int smem_bytes() {
  if constexpr (kWide<kHeadDim>) return wide::kSmemBytes;
  else return Layout<kHeadDim>::kSmemBytes;
}

// Keys a key-kernel CTA owns.
template <int kHeadDim>
constexpr int kKeysPerCta = kWide<kHeadDim> ? wide::kKeys : kOwnRows;

}  // namespace flashjax::cuda::hopper_bwd
