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
// A uniform call with a window (causal included): the dynamic schedule's tile
// counter and each tile's owner (TileSchedule, fwd_scheduler.cuh), for as many
// tiles as kMinTileRows-row tiles would make; zeroed as a whole before the launch.
// base may be null (sizes only).
struct ForwardWorkspace {
  static constexpr size_t kAlign = 256;
  static constexpr int64_t kMinTileRows = 128;  // (TileConfig's kBlockM: 128 or 192)
  VarlenWorkList list;
  SegmentTiles segments;
  MaskTiles masks;
  unsigned long long* tile_counter = nullptr;
  int* tile_owner = nullptr;
  size_t bytes = 0;
  static bool has_window(const AttentionParams& p) {
    return p.window_left >= 0 || p.window_right >= 0;
  }
  ForwardWorkspace(const AttentionParams& p, void* base) {
    if (layouts_of(p) == Layouts::kUniform) {
      if (!has_window(p)) return;
      const int64_t tiles = p.batch * p.heads_q * ((p.seqlen_q + kMinTileRows - 1) / kMinTileRows);
      if (base) {
        tile_counter = static_cast<unsigned long long*>(base);
        tile_owner = reinterpret_cast<int*>(static_cast<char*>(base) + kAlign);
      }
      bytes = kAlign + sizeof(int) * static_cast<size_t>(tiles);
      return;
    }
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
