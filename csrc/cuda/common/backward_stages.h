// The stages around the main backward kernels that every backward path runs
// (Hopper, mma.sync, SIMT). They are SIMT kernels, defined in
// simt/simt_attention.cu; declared here so that the tensor-core backwards
// include from common/ rather than from another target.
#pragma once

#include <cuda_runtime.h>

#include "backward_workspace.h"
#include "flashjax/params.h"

namespace flashjax::cuda {

// D of every used row (laid out like lse; also zeroes ws.nonfinite and
// ws.zeroed where there is one), and dsinks from the used rows' shares (laid
// out like lse).
cudaError_t backward_preprocess(const AttentionParams& p, const BackwardWorkspace& ws,
                                cudaStream_t stream);
// After a tensor-core backward: the gradient rows holding NaN or inf again,
// pair by pair, if one was flagged in ws.nonfinite (exact_rows.cuh says why).
cudaError_t recompute_nonfinite_gradients(const AttentionParams& p, const BackwardWorkspace& ws,
                                          cudaStream_t stream);
cudaError_t backward_dsinks(const AttentionParams& p, const TensorRef& dsink_rows,
                            cudaStream_t stream);
// dbias (when p.dbias is set; else nothing), every element of it written: a pass of
// its own that recomputes P and dP pair by pair, one warp per (bias entry, query
// row), summing the entry's sequences and heads in a fixed order (deterministic).
// D: ws.D as backward_preprocess leaves it. Reads q, k, v, dout, lse and the terms only.
cudaError_t simt_bias_gradient(const AttentionParams& p, const TensorRef& D,
                               cudaStream_t stream);

// A tensor-core backward (Hopper, mma.sync): the preprocess, its main kernels
// (`kernels(p)`), then the exact dbias pass, the non-finite rows and dsinks.
// The kernels add a dbias entry that several (sequence, head)s share
// atomically; deterministic mode leaves such an entry out of their p and sums
// it in a fixed order in the exact pass instead.
template <class Kernels>
cudaError_t run_backward_stages(const AttentionParams& call, const BackwardWorkspace& ws,
                                cudaStream_t stream, Kernels&& kernels) {
  if (cudaError_t e = backward_preprocess(call, ws, stream); e != cudaSuccess) return e;
  const bool exact_dbias = call.deterministic && call.dbias && call.dbias.broadcast();
  AttentionParams p = call;
  if (exact_dbias) p.dbias = ScoreArray{};
  if (cudaError_t e = kernels(static_cast<const AttentionParams&>(p)); e != cudaSuccess) return e;
  if (exact_dbias)
    if (cudaError_t e = simt_bias_gradient(call, ws.D, stream); e != cudaSuccess) return e;
  if (cudaError_t e = recompute_nonfinite_gradients(p, ws, stream); e != cudaSuccess) return e;
  return backward_dsinks(p, ws.dsink_rows, stream);
}

}  // namespace flashjax::cuda
