// See mask_tiles.h.
#include "mask_tiles.h"

namespace flashjax::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// One warp per (mask entry, row tile, column tile): lanes take column pairs of
// each row, then the warp ORs their findings.
__global__ void mask_tiles_kernel(const AttentionParams p, const MaskTiles tiles) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t per_entry = tiles.row_tiles * tiles.col_tiles;
  const int64_t entry = warp / per_entry;
  if (entry >= MaskTiles::entries(p)) return;
  const int64_t rt = warp % per_entry / tiles.col_tiles, ct = warp % tiles.col_tiles;
  const int64_t eb = entry / tiles.head_entries, eh = entry % tiles.head_entries;
  const bool* base = p.mask.at<const bool>(eb * p.mask.batch_div, eh * p.mask.head_div);
  uint32_t found = 0;
  const int64_t r0 = rt * MaskTiles::kRows, c0 = ct * MaskTiles::kRows;
  for (int64_t r = r0; r < r0 + MaskTiles::kRows && r < p.seqlen_q; ++r)
    for (int64_t c = c0 + lane; c < c0 + MaskTiles::kRows && c < p.seqlen_k; c += 32)
      found |= base[r * p.mask.row_stride + c] ? MaskTiles::kAnyAllowed : MaskTiles::kAnyHidden;
  found = __reduce_or_sync(0xffffffffu, found);
  if (lane == 0) tiles.bits[warp] = static_cast<uint8_t>(found);
}

}  // namespace

cudaError_t compute_mask_tiles(const AttentionParams& p, const MaskTiles& tiles,
                               cudaStream_t stream) {
  if (!tiles) return cudaSuccess;
  const int64_t warps = MaskTiles::entries(p) * tiles.row_tiles * tiles.col_tiles;
  if (warps == 0) return cudaSuccess;
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  mask_tiles_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream>>>(p, tiles);
  return cudaGetLastError();
}

}  // namespace flashjax::cuda
