// Hopper (sm_90a) forward: the host side's entry points (which calls it takes,
// its workspace, the dispatch to a head-dim bucket); each bucket's launches are
// fwd_launch_bucket.cuh's, the kernel and its parts fwd_kernel.cuh's.
#include <cuda_runtime.h>

#include "../common/dispatch.h"
#include "../common/sequence_layout.h"
#include "flashjax/params.h"
#include "fwd_launch_bucket.h"
#include "fwd_workspace.h"
#include "hopper_common.cuh"
#include "hopper_forward.h"

namespace flashjax::cuda {
namespace hopper_fwd {
namespace {

// Head-dim buckets of this kernel: it also has native 96 and 192 ones (the
// other kernels pad those to 128 / 256); FLASHJAX_HEAD_DIMS picks the compiled ones.
constexpr HeadDims<64, 96, 128, 192, 256> kBuckets{};
// The float8 kernels' (Float8BucketLaunch).
constexpr HeadDims<128, 256> kFloat8Buckets{};

}  // namespace
}  // namespace hopper_fwd

using hopper_fwd::ForwardWorkspace;
using hopper_fwd::kBuckets;

namespace {

// float8 q, k, v (Float8BucketLaunch's kernels): e4m3 or e5m2, bfloat16 or float16 out,
// V^T and the descales given, uniform layouts without score terms (softcap is fine:
// the descale goes on the products before the cap), head dims equal and one of
// kFloat8Buckets (their own bucket, compiled).
bool float8_supported(const AttentionParams& p) {
  const Float8Inputs& f = p.float8;
  const int64_t bucket = head_dim_bucket(hopper_fwd::kFloat8Buckets, p);
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && f.vt &&
         f.score_descale && f.v_descale && f.vt_keys >= p.seqlen_k &&
         f.vt_keys % kFloat8KeyBlock == 0 && p.uniform() && !p.has_pair_terms() &&
         p.head_dim == p.head_dim_v && bucket == p.head_dim &&
         head_dim_compiled(static_cast<int>(bucket));
}

}  // namespace

bool hopper_forward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  if (p.float8.active() && !float8_supported(p)) return false;
  // Layouts: see hopper_layouts_supported. TMA needs 16-byte row strides (head dims
  // % 8) and a 64-column box inside the tensor (head dims >= 64); int32 TMA
  // coordinates bound the sizes.
  // Score terms or dropout: not with segment ids (with_variant has the variants).
  // Bias and mask: their rows are slot rows (dense only).
  return hopper_layouts_supported(p) && !(p.has_pair_terms() && p.has_segments()) &&
         p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 &&
         p.head_dim_v % 8 == 0 && head_dim_bucket(kBuckets, p) != 0 && p.head_dim >= 64 &&
         p.head_dim_v >= 64 &&
         p.seqlen_q < (1 << 30) && p.seqlen_k < (1 << 30) && compute_capability() == 90 &&
         encode_fn() != nullptr;
#else
  (void)p;
  return false;
#endif
}

size_t hopper_forward_workspace_bytes(const AttentionParams& p) {
  return ForwardWorkspace(p, nullptr).bytes;
}

cudaError_t hopper_forward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  if (p.float8.active())
    return with_bucket(hopper_fwd::kFloat8Buckets, p, [&](auto dim) {
      return hopper_fwd::Float8BucketLaunch<decltype(dim)::value>::run(p, workspace, stream);
    });
  return with_bucket(kBuckets, p, [&](auto dim) {
    return hopper_fwd::BucketLaunch<decltype(dim)::value>::run(p, workspace, stream);
  });
}

}  // namespace flashjax::cuda
