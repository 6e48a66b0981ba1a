// The Hopper backward kernels' shared memory: the plans of bwd_tile_config.h
// (TileConfig::kSmem, WideTileConfig::kSmem) carved into tiles and mbarriers,
// and the barriers' initialisation.
#pragma once

#include <cstdint>

#include "bwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The region at byte `offset` of the aligned shared-memory base, as T.
template <class T>
__device__ __forceinline__ T* smem_region(unsigned char* base, int offset) {
  return reinterpret_cast<T*>(base + offset);
}

// A stage's StreamedTile (bwd_tile_config.h), between the producer and the
// consumers: written before the stage's loads, read after its full wait.
__device__ __forceinline__ void publish(StreamedTile* slot, const StreamedTile& tile) {
  st_shared_u64(smem_u32(&slot->row), static_cast<uint64_t>(tile.row));
  st_shared_u64(smem_u32(&slot->head), tile.head | static_cast<uint64_t>(tile.mixed) << 32);
}
// (Plain loads: the full wait before them orders them, and a volatile load with a
// memory clobber here made the key kernel reload its block from local memory.)
__device__ __forceinline__ StreamedTile read_published(const StreamedTile* slot) {
  return *slot;
}

// Shared memory and barriers of the key and query kernels: two owned [128][d]
// tensors, a ring of (a, b) streamed tile pairs (with their rows' lse2 and D)
// with one full/empty barrier pair each, and, for the fused key kernel, two
// dS^T buffers and each consumer's dQ stages with a full/empty barrier pair
// each.
template <int kHeadDim>
struct Smem {
  unsigned char *own_a, *own_b, *stream_a, *stream_b, *ds;
  float *dq_stage, *stats;
  StreamedTile* streamed;
  uint64_t *owned, *full, *empty, *dq_full, *dq_empty, *ds_full, *ds_empty;
  __device__ explicit Smem(unsigned char* raw) {
    constexpr auto at = TileConfig<kHeadDim>::kSmem;
    unsigned char* base = align_smem(raw);
    own_a = base + at.own_a;
    own_b = base + at.own_b;
    stream_a = base + at.stream_a;
    stream_b = base + at.stream_b;
    ds = base + at.ds;
    dq_stage = smem_region<float>(base, at.dq_stage);
    stats = smem_region<float>(base, at.stats);
    streamed = smem_region<StreamedTile>(base, at.streamed);
    owned = smem_region<uint64_t>(base, at.owned);
    full = smem_region<uint64_t>(base, at.full);
    empty = smem_region<uint64_t>(base, at.empty);
    dq_full = smem_region<uint64_t>(base, at.dq_full);
    dq_empty = smem_region<uint64_t>(base, at.dq_empty);
    ds_full = smem_region<uint64_t>(base, at.ds_full);
    ds_empty = smem_region<uint64_t>(base, at.ds_empty);
  }
  __device__ void init() {
    if (threadIdx.x == 0) {
      mbar_init(owned, 1);
      using Config = TileConfig<kHeadDim>;
      for (int s = 0; s < Config::kStages; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], 8);  // one arrival per consumer warp
      }
      for (int s = 0; s < Config::kConsumers * Config::kDqStages; ++s) {
        mbar_init(&dq_full[s], 4);   // one arrival per warp of the consumer
        mbar_init(&dq_empty[s], 1);  // the dQ writer
      }
      for (int b = 0; b < 2; ++b) {  // (per dS^T buffer: one arrival per consumer warp)
        mbar_init(&ds_full[b], 4 * Config::kConsumers);
        mbar_init(&ds_empty[b], 4 * Config::kConsumers);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
};

// The wide key kernel's: K, V, a ring of Q tiles (with their rows' lse2) and
// one dO tile (with D), each with a full/empty barrier pair, P^T/dS^T pairs
// and each consumer's two dQ stages, with a full/empty barrier pair each.
// Constructed by every thread (it initialises the barriers).
struct WideSmem {
  unsigned char *k, *v, *q, *dout, *grads;
  float *dq_stage, *lse2, *D;
  uint64_t *owned, *q_full, *q_empty, *do_full, *do_empty, *dq_full, *dq_empty;
  __device__ explicit WideSmem(unsigned char* raw) {
    constexpr auto at = WideTileConfig::kSmem;
    unsigned char* base = align_smem(raw);
    k = base + at.k;
    v = base + at.v;
    q = base + at.q;
    dout = base + at.dout;
    grads = base + at.grads;
    dq_stage = smem_region<float>(base, at.dq_stage);
    lse2 = smem_region<float>(base, at.lse2);
    D = smem_region<float>(base, at.D);
    owned = smem_region<uint64_t>(base, at.owned);
    q_full = smem_region<uint64_t>(base, at.q_full);
    q_empty = smem_region<uint64_t>(base, at.q_empty);
    do_full = smem_region<uint64_t>(base, at.do_full);
    do_empty = smem_region<uint64_t>(base, at.do_empty);
    dq_full = smem_region<uint64_t>(base, at.dq_full);
    dq_empty = smem_region<uint64_t>(base, at.dq_empty);
    if (threadIdx.x == 0) {
      mbar_init(owned, 1);
      for (int s = 0; s < WideTileConfig::kQStages; ++s) {
        mbar_init(&q_full[s], 1);
        mbar_init(&q_empty[s], 8);  // one arrival per consumer warp
      }
      mbar_init(do_full, 1);
      mbar_init(do_empty, 8);
      for (int s = 0; s < WideTileConfig::kConsumers * WideTileConfig::kDqStagesPerConsumer; ++s) {
        mbar_init(&dq_full[s], 4);   // one arrival per warp of the consumer
        mbar_init(&dq_empty[s], 1);  // its dQ writer
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  // Tile it's P^T and dS^T (WideTileConfig::kGradBuffers).
  __device__ unsigned char* pt(int64_t it) const {
    return grads + (it % WideTileConfig::kGradBuffers) * WideTileConfig::kGradPairBytes;
  }
  __device__ unsigned char* dst(int64_t it) const { return pt(it) + WideTileConfig::kGradBytes; }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
