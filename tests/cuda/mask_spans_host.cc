// MaskTiles::Entry::span / col_span (csrc/cuda/common/mask_tiles.h, host and device)
// against brute force on random, causal-like and banded tile summaries, with the spans
// made as mask_spans_kernel makes them, and MaskTiles::on_grid (a span onto a kernel's
// tile grid: the Hopper forward's items, the backward's key and query blocks) against
// the grid tiles that meet the span, and the summaries' layout ([batch entries][head
// entries][row tiles][col tiles]) through entry() and row_bits(); compiled and run on
// the host by tests/test_mask_tiles.py. Prints "ok" when every case agrees.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "cuda/common/mask_tiles.h"

using flashjax::cuda::MaskTiles;

// The RowSpan of n tiles' summary bytes, stride apart (mask_spans_kernel's rule).
static MaskTiles::RowSpan span_of(const uint8_t* bits, int n, int stride) {
  int first = n, last = -1, allowed = 0;
  for (int t = 0; t < n; ++t)
    if (bits[t * stride] & MaskTiles::kAnyAllowed) first = std::min(first, t), last = t, ++allowed;
  return {first, last + 1, allowed == last + 1 - first ? 1 : 0, 0};
}

int main() {
  std::mt19937 rng(1);
  int bad = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int rt = 1 + rng() % 6, ct = 1 + rng() % 9, kind = rng() % 3;
    std::vector<uint8_t> bits(rt * ct);
    for (int r = 0; r < rt; ++r)
      for (int c = 0; c < ct; ++c) {
        const bool allowed = kind == 0   ? rng() % 3 != 0
                             : kind == 1 ? c <= r + static_cast<int>(rng() % 2)  // causal-like
                                         : c >= r - 1 && c <= r + 1 && rng() % 8 != 0;
        bits[r * ct + c] = allowed ? MaskTiles::kAnyAllowed : MaskTiles::kAnyHidden;
      }
    std::vector<MaskTiles::RowSpan> rows(rt), cols(ct);
    for (int r = 0; r < rt; ++r) rows[r] = span_of(&bits[r * ct], ct, 1);
    for (int c = 0; c < ct; ++c) cols[c] = span_of(&bits[c], rt, ct);
    const MaskTiles::Entry entry{bits.data(), rows.data(), cols.data(), rt, ct};
    // Rows [r0, r0 + n) (or keys, by_cols) against the union of their tiles.
    const bool by_cols = rng() % 2;
    const int tiles = by_cols ? ct : rt, t0 = rng() % tiles;
    const int64_t x0 = t0 * MaskTiles::kRows + rng() % MaskTiles::kRows;
    const int64_t n = 1 + rng() % (tiles * MaskTiles::kRows - x0);
    const MaskTiles::RowSpan u = by_cols ? entry.col_span(x0, n) : entry.span(x0, n);
    const int t_end = static_cast<int>(std::min<int64_t>((x0 + n + 63) / 64, tiles));
    const int others = by_cols ? rt : ct;
    std::vector<int> seen(others, 0);
    int first = others, last = -1;
    for (int t = t0; t < t_end; ++t)
      for (int o = 0; o < others; ++o)
        if (bits[by_cols ? o * ct + t : t * ct + o] & MaskTiles::kAnyAllowed)
          seen[o] = 1, first = std::min(first, o), last = std::max(last, o);
    if (last < 0) {
      bad += u.first < u.end;
      continue;
    }
    bad += u.first != first || u.end != last + 1;
    if (u.dense)
      for (int o = first; o <= last; ++o) bad += !seen[o];
  }
  for (int trial = 0; trial < 20000; ++trial) {
    // A span of tiles of kRows (maybe empty) onto a grid of `count` tiles of n from begin.
    const int64_t n = (rng() % 3 == 0 ? 176 : 64 * (1 + rng() % 2)), count = rng() % 6,
                  begin = rng() % 4 == 0 ? 0 : rng() % 700, end = begin + count * n;
    const int32_t first = rng() % 16, last = first + static_cast<int32_t>(rng() % 8) - 2;
    const MaskTiles::RowSpan s{first, last, 1, 0};
    const MaskTiles::Range r = MaskTiles::on_grid(s, begin, end, n);
    int64_t lo = end, hi = begin;  // the grid tiles that meet the span's rows
    for (int64_t t = begin; t < end; t += n)
      if (t < s.end * MaskTiles::kRows && t + n > s.first * MaskTiles::kRows && s.first < s.end)
        lo = std::min(lo, t), hi = std::max(hi, t + n);
    if (hi <= lo) lo = hi = begin;
    bad += r.begin != lo || r.end != hi;
  }
  for (int trial = 0; trial < 200; ++trial) {
    // Every (sequence b, head h, row tile r, column tile c) of a mask broadcast over
    // batch_div sequences and head_div heads reads its byte of the layout.
    MaskTiles m;
    const int batch = 1 + rng() % 4, heads = 1 + rng() % 6;
    m.batch_div = rng() % 2 ? batch : 1;
    m.head_div = heads % 2 == 0 && rng() % 2 ? 2 : 1;
    m.head_entries = heads / m.head_div;
    m.row_tiles = 1 + rng() % 5;
    m.col_tiles = 1 + rng() % 7;
    const int64_t entries = batch / m.batch_div * m.head_entries;
    std::vector<uint8_t> bits(entries * m.row_tiles * m.col_tiles);
    for (auto& b : bits) b = static_cast<uint8_t>(rng());
    m.bits = bits.data();
    for (int b = 0; b < batch; ++b)
      for (int h = 0; h < heads; ++h)
        for (int64_t r = 0; r < m.row_tiles; ++r)
          for (int64_t c = 0; c < m.col_tiles; ++c) {
            const int64_t e = b / m.batch_div * m.head_entries + h / m.head_div;
            const uint8_t want = bits[(e * m.row_tiles + r) * m.col_tiles + c];
            bad += m.entry(b, h).of(r * MaskTiles::kRows, MaskTiles::kRows,
                                    c * MaskTiles::kRows, MaskTiles::kRows) != want;
            bad += m.row_bits(m.batch_entry(b) + m.head_entry(h), r)[c] != want;
          }
  }
  if (bad) std::printf("%d mismatches\n", bad);
  else std::printf("ok\n");
  return bad != 0;
}
