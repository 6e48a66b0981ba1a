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
// rows and used keys (empty for a tile with none), and each tile's span of the
// other side's tiles whose ranges meet it, computed on the device by
// compute_segment_tiles. A tiled kernel narrows a block's loop to the span
// (documents packed in order: only the tiles of its own documents), skips a
// (query tile, key tile) pair whose ranges do not meet, and compares ids per
// element only where their ids are not all equal. Its tiles must be whole
// kRows-row tiles.
struct SegmentTiles {
  static constexpr int64_t kRows = 64;
  struct Span {  // tiles [first, last] of the other side; first > last: none
    int32_t first, last;
  };
  IdRange* q = nullptr;  // [batch][q_tiles]; null: no segment ids
  IdRange* k = nullptr;  // [batch][k_tiles]
  Span* q_span = nullptr;  // [batch][q_tiles]: key tiles meeting each query tile
  Span* k_span = nullptr;  // [batch][k_tiles]: query tiles meeting each key tile
  int64_t q_tiles = 0, k_tiles = 0;

  static size_t workspace_bytes(const AttentionParams& p) {
    if (!p.has_segments()) return 0;
    return (sizeof(IdRange) + sizeof(Span)) *
           static_cast<size_t>(p.batch * (tiles(p.seqlen_q) + tiles(p.seqlen_k)));
  }
  SegmentTiles() = default;
  // `workspace`: workspace_bytes(p) bytes (4-byte aligned), or null (no tiles).
  SegmentTiles(const AttentionParams& p, void* workspace) {
    if (!p.has_segments() || !workspace) return;
    q_tiles = tiles(p.seqlen_q);
    k_tiles = tiles(p.seqlen_k);
    q = static_cast<IdRange*>(workspace);
    k = q + p.batch * q_tiles;
    q_span = reinterpret_cast<Span*>(k + p.batch * k_tiles);
    k_span = q_span + p.batch * q_tiles;
  }
  explicit FJ_HOST_DEVICE operator bool() const { return q != nullptr; }

  // The ranges of sequence b's tiles holding query row i / key j (slot rows).
  FJ_HOST_DEVICE IdRange query_tile(int64_t b, int64_t i) const {
    return q[b * q_tiles + i / kRows];
  }
  FJ_HOST_DEVICE IdRange key_tile(int64_t b, int64_t j) const {
    return k[b * k_tiles + j / kRows];
  }
  // The keys [begin, end) (whole tiles) whose ids may meet those of sequence
  // b's query rows [row0, row0 + rows) (row0 a multiple of kRows); begin >= end: none.
  FJ_HOST_DEVICE void key_span(int64_t b, int64_t row0, int64_t rows, int64_t& begin,
                               int64_t& end) const {
    merged_span(q_span + b * q_tiles, q_tiles, row0, rows, begin, end);
  }
  // The query rows whose ids may meet those of sequence b's keys [k0, k0 + rows).
  FJ_HOST_DEVICE void query_span(int64_t b, int64_t k0, int64_t rows, int64_t& begin,
                                 int64_t& end) const {
    merged_span(k_span + b * k_tiles, k_tiles, k0, rows, begin, end);
  }

 private:
  static int64_t tiles(int64_t rows) { return (rows + kRows - 1) / kRows; }
  FJ_HOST_DEVICE static void merged_span(const Span* spans, int64_t count, int64_t row0,
                                         int64_t rows, int64_t& begin, int64_t& end) {
    int64_t first = INT64_MAX, last = -1;
    for (int64_t t = row0 / kRows; t < count && t * kRows < row0 + rows; ++t) {
      if (spans[t].first > spans[t].last) continue;
      first = spans[t].first < first ? spans[t].first : first;
      last = spans[t].last > last ? spans[t].last : last;
    }
    begin = last < 0 ? 0 : first * kRows;
    end = (last + 1) * kRows;
  }
};

// Fills `tiles` (segment ids present) from p's ids, ranges then spans; stream-ordered.
cudaError_t compute_segment_tiles(const AttentionParams& p, const SegmentTiles& tiles,
                                  cudaStream_t stream);

// The layouts a kernel instantiation takes: uniform calls only (SeqlenInfo
// from the shapes, as dense kernels were), any seqused / packed layout, or
// those with segment ids too. Each call runs the narrowest that takes it, so
// that the generality costs registers only where it is used.
enum class Layouts { kUniform, kVarlen, kSegments };

inline Layouts layouts_of(const AttentionParams& p) {
  if (p.has_segments()) return Layouts::kSegments;
  // (Score terms or dropout, p.has_pair_terms(): the tensor-core kernels compile them
  // into a variant of their own, kTerms, with the general layouts only: a uniform call
  // with terms runs as kVarlen.)
  return p.uniform() && !p.has_pair_terms() ? Layouts::kUniform : Layouts::kVarlen;
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

// The score terms a tensor-core kernel variant is compiled with (its kTerms):
// none; ALiBi alone (a slope and a distance per row: the general variant's
// bias, mask, dropout and dbias state made the Hopper backward spill inside its
// tile loop, ~5x slower); a mask or dropout or both, with or without ALiBi (no
// bias); or any of bias, mask, ALiBi and dropout.
enum class TermSet { kNone, kAlibi, kMask, kAny };
constexpr bool has_terms(TermSet set) { return set != TermSet::kNone; }
// Whether the variant reads a mask (and its tile summaries, MaskTiles).
constexpr bool has_mask(TermSet set) { return set == TermSet::kMask || set == TermSet::kAny; }

// Calls fn(std::integral_constant<TermSet, ...>{}, std::integral_constant<Layouts, ...>{}):
// the kernel variant that runs p. Terms are compiled only with the layouts that run
// any call (kVarlen, kSegments), so they cost the build one more instantiation per
// kernel and layout class, not two; kernels with the lean variants (kLeanTerms)
// compile kAlibi and kMask for uniform calls only (one more instantiation each), and
// with kUniformBias the general set with the kUniform layouts for uniform calls with
// a bias that are not deterministic (the Hopper backward: 0.79x the kVarlen
// instantiation's fwd+bwd time, benchmarks/NOTES.md "Eighteenth session"; only its
// fused key kernel is compiled so); the other calls with terms run the general one.
template <bool kLeanTerms = false, bool kUniformBias = false, class Fn>
cudaError_t with_variant(const AttentionParams& p, Fn&& fn) {
  using Any = std::integral_constant<TermSet, TermSet::kAny>;
  if (p.has_pair_terms()) {
    if (p.has_segments())
      return fn(Any{}, std::integral_constant<Layouts, Layouts::kSegments>{});
    if constexpr (kLeanTerms) {
      using Uniform = std::integral_constant<Layouts, Layouts::kUniform>;
      if (p.uniform() && !p.bias)
        return p.mask || p.dropout
                   ? fn(std::integral_constant<TermSet, TermSet::kMask>{}, Uniform{})
                   : fn(std::integral_constant<TermSet, TermSet::kAlibi>{}, Uniform{});
      if constexpr (kUniformBias)
        if (p.uniform() && !p.deterministic) return fn(Any{}, Uniform{});
    }
    return fn(Any{}, std::integral_constant<Layouts, Layouts::kVarlen>{});
  }
  return with_layouts(p, [&](auto layouts) {
    return fn(std::integral_constant<TermSet, TermSet::kNone>{}, layouts);
  });
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
