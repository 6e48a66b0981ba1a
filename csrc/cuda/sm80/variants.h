// The compiled variants of the mma.sync kernels: a sequence layout class (Layouts,
// sequence_layout.h) and whether the scores take terms (bias, mask, ALiBi, dropout:
// common/score_terms.cuh). Terms are compiled only with the layouts that run any
// call (kVarlen, kSegments): a uniform call with terms runs the kVarlen kernels
// (SeqlenInfo(p, b) of a uniform call is SeqlenInfo::uniform's), so the terms
// cost the build one more instantiation per kernel and layout class, not two.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "../common/sequence_layout.h"
#include "flashjax/params.h"

namespace flashjax::cuda {

// Whether p's scores take terms (the kTerms kernels).
inline bool needs_score_terms(const AttentionParams& p) {
  return p.has_score_terms() || static_cast<bool>(p.dropout);
}

// Calls fn(std::bool_constant<kTerms>{}, std::integral_constant<Layouts, kLayouts>{})
// for the variant that runs p.
template <class Fn>
cudaError_t with_variant(const AttentionParams& p, Fn&& fn) {
  if (needs_score_terms(p)) {
    if (p.has_segments())
      return fn(std::true_type{}, std::integral_constant<Layouts, Layouts::kSegments>{});
    return fn(std::true_type{}, std::integral_constant<Layouts, Layouts::kVarlen>{});
  }
  return with_layouts(p, [&](auto layouts) { return fn(std::false_type{}, layouts); });
}

}  // namespace flashjax::cuda
