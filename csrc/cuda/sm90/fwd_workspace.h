// The Hopper forward's workspace (non-uniform calls and calls with a mask).
#pragma once

#include <cstddef>

#include "../common/mask_tiles.h"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/work_list.h"
#include "flashjax/params.h"

namespace flashjax::cuda::hopper_fwd {

// The workspace of a non-uniform call: the work list, then (segment ids) the
// id ranges and spans of the segment-id tiles, then (a mask) its tile summaries.
// base may be null (sizes only).
struct ForwardWorkspace {
  static constexpr size_t kAlign = 256;
  VarlenWorkList list;
  SegmentTiles segments;
  MaskTiles masks;
  size_t bytes = 0;
  ForwardWorkspace(const AttentionParams& p, void* base) {
    if (layouts_of(p) == Layouts::kUniform) return;
    const auto aligned = [](size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    const size_t list_bytes = aligned(VarlenWorkList::workspace_bytes(p));
    const size_t segment_bytes = aligned(SegmentTiles::workspace_bytes(p));
    if (base) {
      list = VarlenWorkList(p, base);
      segments = SegmentTiles(p, static_cast<char*>(base) + list_bytes);
      masks = MaskTiles(p, static_cast<char*>(base) + list_bytes + segment_bytes);
    }
    bytes = list_bytes + segment_bytes + MaskTiles::workspace_bytes(p);
  }
};


}  // namespace flashjax::cuda::hopper_fwd
