// See mask_tiles.h.
#include "mask_tiles.h"

namespace flashjax::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// Whether any byte of x is zero (a hidden pair among 4 bools).
__device__ __forceinline__ bool has_zero_byte(uint32_t x) {
  return ((x - 0x01010101u) & ~x & 0x80808080u) != 0;
}

// One warp per (mask entry, row tile, column tile), then the warp ORs its lanes'
// findings. Whole tiles of 16-byte aligned rows (the mask's rows a multiple of 16
// bools) are read 16 bytes a lane (8 loads a lane); the others a byte at a time.
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
  constexpr int kVector = 16, kVectorsPerRow = MaskTiles::kRows / kVector;
  const bool whole = r0 + MaskTiles::kRows <= p.seqlen_q && c0 + MaskTiles::kRows <= p.seqlen_k &&
                     p.mask.row_stride % kVector == 0 &&
                     reinterpret_cast<uintptr_t>(base) % kVector == 0;
  if (whole) {
#pragma unroll
    for (int v = lane; v < MaskTiles::kRows * kVectorsPerRow; v += 32) {
      const uint4 x = *reinterpret_cast<const uint4*>(
          base + (r0 + v / kVectorsPerRow) * p.mask.row_stride + c0 + v % kVectorsPerRow * kVector);
      if (x.x | x.y | x.z | x.w) found |= MaskTiles::kAnyAllowed;
      if (has_zero_byte(x.x) || has_zero_byte(x.y) || has_zero_byte(x.z) || has_zero_byte(x.w))
        found |= MaskTiles::kAnyHidden;
    }
  } else {
    for (int64_t r = r0; r < r0 + MaskTiles::kRows && r < p.seqlen_q; ++r)
      for (int64_t c = c0 + lane; c < c0 + MaskTiles::kRows && c < p.seqlen_k; c += 32)
        found |= base[r * p.mask.row_stride + c] ? MaskTiles::kAnyAllowed : MaskTiles::kAnyHidden;
  }
  found = __reduce_or_sync(0xffffffffu, found);
  if (lane == 0) tiles.bits[warp] = static_cast<uint8_t>(found);
}

// One warp per (mask entry, row tile), then per (mask entry, column tile): its
// RowSpan from the summaries of the tile's row (column).
__global__ void mask_spans_kernel(const AttentionParams p, const MaskTiles tiles) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t rows_spans = MaskTiles::entries(p) * tiles.row_tiles;
  const bool of_rows = warp < rows_spans;
  const int64_t index = of_rows ? warp : warp - rows_spans;  // (entry, tile) of its kind
  if (!of_rows && index >= MaskTiles::entries(p) * tiles.col_tiles) return;
  const int64_t per_entry = tiles.row_tiles * tiles.col_tiles;
  const int64_t n = of_rows ? tiles.row_tiles : tiles.col_tiles;
  const uint8_t* first_bits = tiles.bits + index / n * per_entry +
                              (of_rows ? index % n * tiles.col_tiles : index % n);
  const int64_t stride = of_rows ? 1 : tiles.col_tiles;
  const auto count = static_cast<int32_t>(of_rows ? tiles.col_tiles : tiles.row_tiles);
  int32_t first = count, last = -1, allowed = 0;
  for (int32_t t = lane; t < count; t += 32)
    if (first_bits[t * stride] & MaskTiles::kAnyAllowed) {
      first = t < first ? t : first;
      last = t;
      ++allowed;
    }
  first = __reduce_min_sync(0xffffffffu, first);
  last = __reduce_max_sync(0xffffffffu, last);
  allowed = __reduce_add_sync(0xffffffffu, allowed);
  if (lane == 0)
    (of_rows ? tiles.spans : tiles.col_spans)[index] = {
        first, last + 1, allowed == last + 1 - first ? 1 : 0, 0};
}

}  // namespace

cudaError_t compute_mask_tiles(const AttentionParams& p, const MaskTiles& tiles,
                               cudaStream_t stream) {
  if (!tiles) return cudaSuccess;
  const int64_t warps = MaskTiles::entries(p) * tiles.row_tiles * tiles.col_tiles;
  if (warps == 0) return cudaSuccess;
  const int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  mask_tiles_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream>>>(p, tiles);
  const int64_t span_warps = MaskTiles::entries(p) * (tiles.row_tiles + tiles.col_tiles);
  const int64_t span_blocks = (span_warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  mask_spans_kernel<<<static_cast<unsigned>(span_blocks), 32 * kWarpsPerBlock, 0, stream>>>(
      p, tiles);
  return cudaGetLastError();
}

}  // namespace flashjax::cuda
