// The Hopper backward's elementwise pre-kernel (after backward_preprocess has
// computed D): per-row statistics padded to whole tiles, which the key
// kernels' producers bulk-copy. (Internal linkage, as the other kernels of
// bwd_launch.cu, the one translation unit that includes this header: there
// it compiles to the same code and resources as before the split.)
#pragma once

#include <cstdint>

#include "../common/device.cuh"
#include "../common/epilogue.cuh"
#include "../common/softmax.cuh"
#include "bwd_workspace.h"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_bwd {

// Per padded row (PaddedRows): lse in log2 units and D for the key kernel's
// producer (+inf and 0 past the used rows, so those rows get P = dS = 0), and,
// when dQ is fused into the key kernel, each used row's share of dsinks (as
// the query kernel writes it otherwise).
static __global__ void stage_rows_kernel(const AttentionParams p, HopperBackwardWorkspace ws,
                                         bool dsinks) {
  start_after_prerequisite_grid();  // (launch_early, after backward_preprocess)
  const int64_t n = ws.padded.total();
  for (int64_t at = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; at < n;
       at += int64_t(gridDim.x) * blockDim.x) {
    const PaddedRows::Row r = ws.padded.locate(p, at);
    float lse2 = -kNegInf, D = 0.0f;
    if (r.i >= 0 && r.i < r.seq.seqlen_q) {
      lse2 = lse_to_log2(*r.seq.q_at<const float>(p.lse, r.i, r.h));
      D = *r.seq.q_at<const float>(ws.D, r.i, r.h);
      if (dsinks && p.sinks)
        *r.seq.q_at<float>(ws.dsink_rows, r.i, r.h) =
            dsink_share(p.sinks[r.b * p.heads_q + r.h] * kLog2e, lse2, D);
    }
    ws.lse2_padded[at] = lse2;
    ws.D_padded[at] = D;
  }
}

}  // namespace flashjax::cuda::hopper_bwd
