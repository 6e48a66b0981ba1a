// The backward's device workspace (XLA scratch, declared by the FFI handler),
// carved into arrays in order. BackwardWorkspace holds what every backward path
// uses: D and dsink_rows (laid out like lse, so that kernels index them as they
// index lse), the non-finite flag and, with segment ids or a mask, their row
// tiles' ranges. A path that needs more carves its own arrays after these
// (the Hopper path: sm90/bwd_workspace.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashjax/params.h"
#include "mask_tiles.h"
#include "sequence_layout.h"

namespace flashjax::cuda {

// Hands out a workspace's arrays one after another, each kArrayAlign-aligned;
// base may be null to size the workspace only.
class WorkspaceCarver {
 public:
  static constexpr size_t kArrayAlign = 256;
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}
  void* take(size_t array_bytes) {
    void* array = base_ ? base_ + bytes_ : nullptr;
    bytes_ += (array_bytes + kArrayAlign - 1) / kArrayAlign * kArrayAlign;
    return array;
  }
  float* take_floats(size_t floats) { return static_cast<float*>(take(floats * sizeof(float))); }
  size_t bytes() const { return bytes_; }

 private:
  char* base_;
  size_t bytes_ = 0;
};

struct BackwardWorkspace {
  TensorRef D;             // float32 like lse: rowsum(dO * O) - dlse (used rows only)
  TensorRef dsink_rows;    // float32 like lse: each used row's share of dsinks
  // Set by a tensor-core kernel that stored a NaN or inf gradient (zeroed by
  // backward_preprocess; read by recompute_nonfinite_gradients).
  int* nonfinite = nullptr;
  SegmentTiles segments;   // with segment ids only
  MaskTiles masks;         // with a mask only (the Hopper kernels narrow their blocks by it)
  // A path's float32 accumulation region that backward_preprocess zeroes too
  // (kArrayAlign-aligned, whole float4s), or none.
  float* zeroed = nullptr;
  int64_t zeroed_float4s = 0;
  size_t bytes = 0;

  // The common arrays only (base null: sizing only).
  BackwardWorkspace(const AttentionParams& p, void* base) {
    WorkspaceCarver carver(base);
    carve(p, carver);
  }

  // Floats spanned by an array with lse's strides over every row of the
  // query-side tensors (one batch entry of total_q rows when packed).
  static size_t floats_like_lse(const AttentionParams& p) {
    const int64_t batches = p.packed() ? 1 : p.batch;
    const int64_t rows = p.packed() ? p.total_q : p.seqlen_q;
    if (batches <= 0 || rows <= 0 || p.heads_q <= 0) return 0;
    return static_cast<size_t>((batches - 1) * p.lse.batch_stride +
                               (rows - 1) * p.lse.row_stride +
                               (p.heads_q - 1) * p.lse.head_stride + 1);
  }

 protected:
  BackwardWorkspace() = default;
  // Takes the common arrays from `carver` (a path's own follow).
  void carve(const AttentionParams& p, WorkspaceCarver& carver) {
    const auto like_lse = [&](void* data) {
      return TensorRef{data, p.lse.batch_stride, p.lse.row_stride, p.lse.head_stride};
    };
    D = like_lse(carver.take_floats(floats_like_lse(p)));
    dsink_rows = like_lse(carver.take_floats(floats_like_lse(p)));
    nonfinite = static_cast<int*>(carver.take(sizeof(int)));
    segments = SegmentTiles(p, carver.take(SegmentTiles::workspace_bytes(p)));
    masks = MaskTiles(p, carver.take(MaskTiles::workspace_bytes(p)));
    bytes = carver.bytes();
  }
};

}  // namespace flashjax::cuda
