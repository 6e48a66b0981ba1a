// The Hopper forward's shared memory: fwd_tile_config.h's layout carved into
// the Q tile, the K and V rings and their mbarriers, and the barriers'
// initialisation.
#pragma once

#include <cstdint>

#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Q has its own full/empty pair so that the next item's Q loads during the
// current item's last products; the K and V rings have one pair per stage.
template <class Cfg>
struct ForwardSmem {
  unsigned char *q, *k, *v;  // k, v: kStages tiles each
  unsigned char* out;        // Cfg::kStagesOut: each consumer's out rows
  uint64_t *q_full, *q_empty, *k_full, *k_empty, *v_full, *v_empty;
  // Per consumer warp: whether a row it wrote holds NaN or inf (in shared
  // memory: the main loop has no register to spare for it).
  int* nonfinite_warps;

  __device__ explicit ForwardSmem(unsigned char* raw) {
    unsigned char* base = align_smem(raw);
    q = base;
    k = q + Cfg::kQBytes;
    v = k + kStages * Cfg::kKVBytes;
    out = base + Cfg::kOutOffset;
    q_full = reinterpret_cast<uint64_t*>(base + Cfg::kBarrierOffset);
    q_empty = q_full + 1;
    k_full = q_empty + 1;
    k_empty = k_full + kStages;
    v_full = k_empty + kStages;
    v_empty = v_full + kStages;
    nonfinite_warps = reinterpret_cast<int*>(base + Cfg::kFlagOffset);
  }

  // (One thread, before the CTA's first __syncthreads.) The full barriers
  // complete on the producer's arrival and the TMA bytes, the empty ones on
  // one arrival per consumer warp.
  __device__ void init() const {
    constexpr int kConsumerWarps = kWarpsPerGroup * Cfg::kConsumers;
    mbar_init(q_full, 1);
    mbar_init(q_empty, kConsumerWarps);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&k_empty[s], kConsumerWarps);
      mbar_init(&v_empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    for (int w = 0; w < kConsumerWarps; ++w) nonfinite_warps[w] = 0;
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
