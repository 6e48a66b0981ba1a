// The Hopper backward's elementwise pre-kernel (after backward_preprocess has
// computed D): per-row statistics padded to whole tiles, which the key
// kernels' producers bulk-copy. (Internal linkage, as the other kernels of
// bwd_launch.cu, the one translation unit that includes this header: there
// it compiles to the same code and resources as before the split.)
#pragma once

#include <cstdint>

#include "../backward_workspace.h"
#include "../common.cuh"
#include "../fragment_softmax.cuh"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_bwd {

// Per padded row: lse in log2 units and D for the key kernel's producer
// (+inf and 0 past seqlen_q, so those rows get P = dS = 0), and, when dQ is
// fused into the key kernel, each row's share of dsinks (as the query kernel
// writes it otherwise).
static __global__ void stage_rows_kernel(const AttentionParams p, BackwardWorkspace ws,
                                         bool dsinks) {
  const int64_t n = p.batch * p.heads_q * ws.rows_padded;
  for (int64_t at = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; at < n;
       at += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bh = at / ws.rows_padded, i = at % ws.rows_padded;
    float lse2 = -kNegInf, D = 0.0f;
    if (i < p.seqlen_q) {  // (uniform layouts: lse, D, dsink_rows are dense (b, h, i))
      lse2 = lse_to_log2(static_cast<const float*>(p.lse.data)[bh * p.seqlen_q + i]);
      D = static_cast<const float*>(ws.D.data)[bh * p.seqlen_q + i];
      if (dsinks && p.sinks)
        static_cast<float*>(ws.dsink_rows.data)[bh * p.seqlen_q + i] =
            dsink_share(p.sinks[bh] * kLog2e, lse2, D);
    }
    ws.lse2_padded[at] = lse2;
    ws.D_padded[at] = D;
  }
}

}  // namespace flashjax::cuda::hopper_bwd
