// What the Hopper backward kernels take besides AttentionParams (built by
// bwd_launch.cu): the TMA tensor maps and the padded row statistics.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "bwd_workspace.h"


namespace flashjax::cuda::hopper_bwd {

// Where the key kernel finds the streamed rows' statistics (and its dQ
// buffer's rows): PaddedRows' layout.
struct RowStats {
  const float* lse2 = nullptr;  // null: not streamed (query kernel)
  const float* D = nullptr;
  PaddedRows padded;
  int* nonfinite = nullptr;  // BackwardWorkspace::nonfinite (flag_nonfinite)
};

struct BackwardMaps {
  CUtensorMap own_a, own_b, stream_a, stream_b;  // key kernel: K, V, Q, dO; query: Q, dO, K, V
  // Key kernel, uniform layouts: dK and dV, stored by TMA from shared memory
  // (bwd_epilogue.cuh) when `store_own` (their maps could be made).
  CUtensorMap grad_a, grad_b;
  bool store_own = false;
};

}  // namespace flashjax::cuda::hopper_bwd
