// The Hopper backward kernels' shared memory: the layouts of
// bwd_tile_config.h carved into tiles and mbarriers, and the barriers'
// initialisation.
#pragma once

#include <cstdint>

#include "bwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared memory and barriers of the key and query kernels: two owned [128][d]
// tensors, a ring of (a, b) streamed tile pairs (with their rows' lse2 and D)
// with one full/empty barrier pair each, and, for the fused key kernel, two
// dS^T buffers and each consumer's dQ stages with a full/empty barrier pair
// each.
template <int kHeadDim>
struct Smem {
  unsigned char *own_a, *own_b, *stream_a, *stream_b, *ds;
  float *dq_stage, *stats;
  uint64_t *owned, *full, *empty, *dq_full, *dq_empty;
  __device__ explicit Smem(unsigned char* raw) {
    using L = Layout<kHeadDim>;
    unsigned char* base = align_smem(raw);
    own_a = base;
    own_b = own_a + L::kOwnBytes;
    stream_a = own_b + L::kOwnBytes;
    stream_b = stream_a + L::kStages * L::kStreamBytes;
    ds = base + L::kDsOffset;
    dq_stage = reinterpret_cast<float*>(base + L::kDqStageOffset);
    stats = reinterpret_cast<float*>(base + L::kStatOffset);
    owned = reinterpret_cast<uint64_t*>(base + L::kBarrierOffset);
    full = owned + 1;
    empty = full + L::kStages;
    dq_full = empty + L::kStages;
    dq_empty = dq_full + 2 * L::kDqStages;
  }
  __device__ void init() {
    if (threadIdx.x == 0) {
      mbar_init(owned, 1);
      using L = Layout<kHeadDim>;
      for (int s = 0; s < L::kStages; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], 8);  // one arrival per consumer warp
      }
      for (int s = 0; s < 2 * L::kDqStages; ++s) {
        mbar_init(&dq_full[s], 128);  // every thread of the consumer
        mbar_init(&dq_empty[s], 1);   // the dQ writer
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
};

// The wide key kernel's: K, V, a ring of Q tiles (with their rows' lse2) and
// one dO tile (with D), each with a full/empty barrier pair, P^T/dS^T pairs
// and each consumer's two dQ stages. Constructed by every thread (it
// initialises the barriers).
struct WideSmem {
  unsigned char *k, *v, *q, *dout, *grads;
  float *dq_stage, *lse2, *D;
  uint64_t *owned, *q_full, *q_empty, *do_full, *do_empty;
  __device__ explicit WideSmem(unsigned char* raw) {
    using namespace wide;
    unsigned char* base = align_smem(raw);
    k = base;
    v = base + kTileBytes;
    q = base + kQOffset;
    dout = base + kDoOffset;
    grads = base + kGradOffset;
    dq_stage = reinterpret_cast<float*>(base + kDqStageOffset);
    lse2 = reinterpret_cast<float*>(base + kStatOffset);
    D = lse2 + kQStages * kStreamRows;
    owned = reinterpret_cast<uint64_t*>(base + kBarrierOffset);
    q_full = owned + 1;
    q_empty = q_full + kQStages;
    do_full = q_empty + kQStages;
    do_empty = do_full + 1;
    if (threadIdx.x == 0) {
      mbar_init(owned, 1);
      for (int s = 0; s < kQStages; ++s) {
        mbar_init(&q_full[s], 1);
        mbar_init(&q_empty[s], 8);  // one arrival per consumer warp
      }
      mbar_init(do_full, 1);
      mbar_init(do_empty, 8);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  // Tile it's P^T and dS^T (double-buffered: the other consumer may still
  // read tile it - 1's while this one writes tile it's).
  __device__ unsigned char* pt(int64_t it) const { return grads + (it % 2) * 2 * wide::kGradBytes; }
  __device__ unsigned char* dst(int64_t it) const { return pt(it) + wide::kGradBytes; }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
