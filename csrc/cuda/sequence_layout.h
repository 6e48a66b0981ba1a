// Device-side support for the sequence layouts of seqlen.h, shared by the
// kernel paths: the segment-id range of each tile of rows, and the zero-fill
// of the packed tensors' rows that no sequence's slot covers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "flashjax/seqlen.h"

namespace flashjax::cuda {

// The segment-id range of every kRows-row tile of each sequence's used query
// rows and used keys (empty for a tile with none), computed on the device by
// compute_segment_tiles. A tiled kernel skips a (query tile, key tile) pair
// whose ranges do not meet, and compares ids per element only where their
// ids are not all equal; its tiles must be these kRows-row tiles.
struct SegmentTiles {
  static constexpr int64_t kRows = 64;
  IdRange* q = nullptr;  // [batch][q_tiles]; null: no segment ids
  IdRange* k = nullptr;  // [batch][k_tiles]
  int64_t q_tiles = 0, k_tiles = 0;

  static size_t workspace_bytes(const AttentionParams& p) {
    if (!p.has_segments()) return 0;
    return sizeof(IdRange) * static_cast<size_t>(p.batch * (tiles(p.seqlen_q) + tiles(p.seqlen_k)));
  }
  SegmentTiles() = default;
  // `workspace`: workspace_bytes(p) bytes (4-byte aligned), or null (no tiles).
  SegmentTiles(const AttentionParams& p, void* workspace) {
    if (!p.has_segments() || !workspace) return;
    q_tiles = tiles(p.seqlen_q);
    k_tiles = tiles(p.seqlen_k);
    q = static_cast<IdRange*>(workspace);
    k = q + p.batch * q_tiles;
  }
  explicit FJ_HOST_DEVICE operator bool() const { return q != nullptr; }

  // The ranges of sequence b's tiles holding query row i / key j (slot rows).
  FJ_HOST_DEVICE IdRange query_tile(int64_t b, int64_t i) const {
    return q[b * q_tiles + i / kRows];
  }
  FJ_HOST_DEVICE IdRange key_tile(int64_t b, int64_t j) const {
    return k[b * k_tiles + j / kRows];
  }

 private:
  static int64_t tiles(int64_t rows) { return (rows + kRows - 1) / kRows; }
};

// Fills `tiles` (segment ids present) from p's ids; stream-ordered.
cudaError_t compute_segment_tiles(const AttentionParams& p, const SegmentTiles& tiles,
                                  cudaStream_t stream);

// The layouts a kernel instantiation takes: uniform calls only (SeqlenInfo
// from the shapes, as dense kernels were), any seqused / packed layout, or
// those with segment ids too. Each call runs the narrowest that takes it, so
// that the generality costs registers only where it is used.
enum class Layouts { kUniform, kVarlen, kSegments };

inline Layouts layouts_of(const AttentionParams& p) {
  if (p.has_segments()) return Layouts::kSegments;
  return p.uniform() ? Layouts::kUniform : Layouts::kVarlen;
}

// Calls fn(std::integral_constant<Layouts, layouts_of(p)>{}).
template <class Fn>
cudaError_t with_layouts(const AttentionParams& p, Fn&& fn) {
  switch (layouts_of(p)) {
    case Layouts::kUniform: return fn(std::integral_constant<Layouts, Layouts::kUniform>{});
    case Layouts::kVarlen: return fn(std::integral_constant<Layouts, Layouts::kVarlen>{});
    default: return fn(std::integral_constant<Layouts, Layouts::kSegments>{});
  }
}

// Sequence b's SeqlenInfo in a kernel compiled for kLayouts.
template <Layouts kLayouts>
FJ_HOST_DEVICE SeqlenInfo sequence_info(const AttentionParams& p, int64_t b) {
  if constexpr (kLayouts == Layouts::kUniform) return SeqlenInfo::uniform(p, b);
  else return SeqlenInfo(p, b);
}

// The last sequence b in [0, batch) whose start(b) is at most `row` (0 when
// none): for starts non-decreasing in b (consistent cu_seqlens), the only
// sequence whose slot may hold packed row `row`; some b otherwise.
template <class StartOf>
__device__ int64_t last_sequence_starting_by(int64_t batch, int64_t row, StartOf&& start) {
  int64_t lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (start(mid) <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

enum class Pass { kForward, kBackward };

// Packed layout: writes the tensor rows that no sequence's slot covers (the
// forward's out = 0 and lse = -inf; the backward's dq, dk, dv = 0). Launch it
// before the attention kernels: exact for non-decreasing cu_seqlens; with
// other values a covered row may be zeroed (the attention kernels then write
// it) or an uncovered one left unwritten, but nothing out of bounds is touched.
cudaError_t fill_uncovered_rows(const AttentionParams& p, Pass pass, cudaStream_t stream);

}  // namespace flashjax::cuda
