// Bias, mask, ALiBi and dropout on accumulator fragments (fragment.cuh's layout),
// for the tensor-core kernels compiled with kTerms (a compile-time variant beside
// the sequence layouts: kernels without it keep their code). The terms themselves
// are flashjax/score_terms.h's and dropout's keep bits dropout.h's, so every path
// computes the same scores and the same mask.
//
// A thread holds fragment rows row and row + 8 and, per 8-column tile n, columns
// c0 + 8n + 2t and + 1 (t = lane % 4). kQueries: rows are queries and columns keys
// (forward, dQ); kKeys: rows are keys and columns queries (dK, dV: S^T).
#pragma once

#include <cstdint>

#include "device.cuh"
#include "flashjax/dropout.h"
#include "flashjax/params.h"
#include "flashjax/score_terms.h"
#include "flashjax/seqlen.h"
#include "segments.cuh"
#include "sequence_layout.h"

// Tiles ahead of their use that the Hopper kernels prefetch a bias's lines into L2
// (FragmentTerms::prefetch_bias; an A/B knob, 0: none).
#ifndef FLASHJAX_BIAS_AHEAD_TILES
#define FLASHJAX_BIAS_AHEAD_TILES 2
#endif

namespace flashjax::cuda {

constexpr int kBiasAheadTiles = FLASHJAX_BIAS_AHEAD_TILES;

template <TermSet kSet, FragmentRows kRows>
struct FragmentTerms;

// Scores must be in log2 units before terms are added (kTerms kernels scale first:
// score_mod.cuh's scores_prescaled).
template <FragmentRows kRows>
struct FragmentTerms<TermSet::kNone, kRows> {
  static constexpr bool kActive = false;
  __device__ FragmentTerms(const AttentionParams&, const SeqlenInfo&, int64_t) {}
  __device__ void head(const AttentionParams&, const SeqlenInfo&, int64_t, int64_t) {}
  __device__ float term_log2_at(int, int64_t) const { return 0.0f; }
  template <int kTiles>
  __device__ void add(float (&)[kTiles * 4], int64_t, bool = true) const {}
  template <int kTiles>
  __device__ void terms_of(float (&)[kTiles * 4], int64_t) const {}
  template <int kTiles>
  __device__ static void add_terms(float (&)[kTiles * 4], const float (&)[kTiles * 4]) {}
  template <int kTiles>
  __device__ void drop(float (&)[kTiles * 4], int64_t) const {}
  template <int kTiles>
  __device__ uint32_t keep_bits(int64_t) const { return ~0u; }
  template <int kTiles>
  __device__ void apply_keep(float (&)[kTiles * 4], uint32_t) const {}
  __device__ bool dropping() const { return false; }
  template <int kCols>
  __device__ void prefetch_bias(int64_t) const {}
  __device__ void add_bias_gradient_at(int, int64_t, float) const {}
  template <int kTiles>
  __device__ void add_bias_gradient(const float (&)[kTiles * 4], int64_t) const {}
};

// kSet kAlibi: only the ALiBi term; kMask: a mask and dropout, ALiBi or not (the
// terms a set leaves out, their code and state, are compiled out).
template <TermSet kSet, FragmentRows kRows>
struct FragmentTerms {
  static constexpr bool kActive = true;
  static constexpr bool kAlibiOnly = kSet == TermSet::kAlibi;
  static constexpr bool kAll = kSet == TermSet::kAny;  // (bias, dbias)
  static constexpr bool kDrops = kAll || kSet == TermSet::kMask;
  static constexpr bool kQueryRows = kRows == FragmentRows::kQueries;
  // Lane l ^ kPartnerLanes holds fragment row row ^ 1 (lane / 4 + a multiple of 8).
  static constexpr int kPartnerLanes = 4;
  int64_t row;                // the thread's first fragment row (the other is row + 8)
  int64_t rows_used, cols_used;  // used queries / keys as rows and columns
  ScoreTerms terms;
  float slope_log2 = 0.0f;    // the ALiBi slope in log2 units
  bool slope_finite = true;   // (its terms are finite: they need not spare hidden scores)
  Dropout::Head dropout;
  bool drops = false;
  float keep_scale = 1.0f;
  float* dbias = nullptr;     // this (sequence, head)'s dbias entry (null: none)
  int64_t dbias_ld = 0;
  bool dbias_shared = false;  // the entry also serves other (sequence, head)s: add atomically

  __device__ FragmentTerms(const AttentionParams& p, const SeqlenInfo& seq, int64_t fragment_row)
      : row(fragment_row),
        rows_used(kQueryRows ? seq.seqlen_q : seq.seqlen_k),
        cols_used(kQueryRows ? seq.seqlen_k : seq.seqlen_q),
        drops(kDrops && static_cast<bool>(p.dropout)),
        keep_scale(p.dropout.scale) {}

  // The (sequence b, query head h) the next tiles belong to.
  __device__ void head(const AttentionParams& p, const SeqlenInfo& seq, int64_t b, int64_t h) {
    if constexpr (kAll) {
      terms = ScoreTerms(p, seq, b, h);
    } else {
      terms.alibi = kAlibiOnly || p.alibi_slopes;
      if (terms.alibi) terms.slope = p.alibi_slopes[b * p.heads_q + h];
      terms.diagonal = seq.diagonal_offset();
      if constexpr (has_mask(kSet))
        terms.mask = p.mask.at<const bool>(b, h), terms.mask_ld = p.mask.row_stride;
    }
    slope_log2 = terms.slope * kLog2e;
    slope_finite = isfinite(slope_log2);
    if (drops) dropout = p.dropout.head(b, h, p.heads_q);
    if (kAll && p.dbias) {
      dbias = p.dbias.at<float>(b, h);
      dbias_ld = p.dbias.row_stride;
      dbias_shared = p.dbias.broadcast();
    }
  }

  // The terms present (those the set leaves out as compile-time constants).
  __device__ const float* bias_ptr() const { return kAll ? terms.bias : nullptr; }
  __device__ const bool* mask_ptr() const { return has_mask(kSet) ? terms.mask : nullptr; }
  __device__ bool alibi_on() const { return kAlibiOnly || terms.alibi; }

  // (query, key) of fragment element (row half r, column c).
  __device__ void pair(int r, int64_t c, int64_t& i, int64_t& j) const {
    if constexpr (kQueryRows) i = row + 8 * r, j = c;
    else i = c, j = row + 8 * r;
  }
  __device__ bool used(int r, int64_t c) const { return row + 8 * r < rows_used && c < cols_used; }
  // (query, key) of fragment element `index` of the tile from column c0; false past
  // the used pairs.
  __device__ bool pair_at(int index, int64_t c0, int64_t& i, int64_t& j) const {
    const int r = (index % 4) / 2;
    const int64_t c = c0 + (index / 4) * 8 + 2 * (threadIdx.x % 4) + (index & 1);
    pair(r, c, i, j);
    return used(r, c);
  }

  // The bias of the tile from column c0 (kCols columns) into L2, for add() tiles
  // later (kBiasAheadTiles; none at 0; the one place that decides, so callers call it
  // unconditionally): without it add()'s loads, issued once S is in, waited for DRAM
  // every tile (ncu: 59% of the bias forward's stalls, "long_sb", sixteenth session).
  // Query rows (the forward): a row's four threads take its 128-byte lines in turn.
  // Key rows (the backward's key kernel): a warp's 16 keys are 64 bytes of each query
  // row, its lanes take the tile's query rows in turn.
  template <int kCols>
  __device__ void prefetch_bias(int64_t c0) const {
    if constexpr (kAll && kBiasAheadTiles > 0) {
      if (!terms.bias || c0 >= cols_used) return;
      if constexpr (kQueryRows) {
        constexpr int kLineFloats = 128 / sizeof(float);
#pragma unroll
        for (int line = threadIdx.x % 4; line * kLineFloats < kCols; line += 4) {
          const int64_t c = c0 + line * kLineFloats;
          if (c >= cols_used) break;
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (row + 8 * r < rows_used) prefetch_l2(terms.bias + (row + 8 * r) * terms.bias_ld + c);
        }
      } else {
        const int lane = threadIdx.x % 32;
        const int64_t key0 = row - lane / kPartnerLanes;  // (the warp's first key)
        if (key0 >= rows_used) return;
#pragma unroll
        for (int i = lane; i < kCols; i += 32) {
          if (c0 + i >= cols_used) break;
          prefetch_l2(terms.bias + (c0 + i) * terms.bias_ld + key0);
        }
      }
    }
  }

  // The bias and ALiBi terms (log2 units) of fragment element `index` of the tile
  // from column c0 (0 for pairs past the used ones). One element: for the backward's
  // softcap slope, which needs the capped score without the terms.
  __device__ float term_log2_at(int index, int64_t c0) const {
    int64_t i, j;
    if (!pair_at(index, c0, i, j)) return 0.0f;
    float x = bias_ptr() ? kLog2e * __ldg(bias_ptr() + i * terms.bias_ld + j) : 0.0f;
    if (alibi_on()) {
      const int64_t d = i + terms.diagonal - j;
      x -= slope_log2 * static_cast<float>(d < 0 ? -d : d);
    }
    return x;
  }

  // s (log2 units) += the bias and ALiBi terms; -inf where the mask hides the pair
  // (mask_mixed false: the mask's tile summaries say it hides none of these pairs).
  // Hidden scores stay hidden (a +inf bias must not revive them). Per row half, the
  // addresses and the ALiBi distance are set up once; per element, a predicated load
  // (bias and mask pairs of adjacent keys in one load where aligned: query rows) and
  // a float distance (exact below 2^24). Pairs past the used ones are left alone
  // (their scores are hidden already; the loads would leave the arrays).
  template <int kTiles>
  __device__ void add(float (&s)[kTiles * 4], int64_t c0, bool mask_mixed = true) const {
    constexpr int kCols = kTiles * 8;
    const int t = threadIdx.x % 4;
    // Tile-relative columns [0, col_end) are used; this thread's are 8 n + 2 t + e.
    const int col_end = static_cast<int>(clamp_to(cols_used - c0, 0, kCols)) - 2 * t;
    const bool read_mask = mask_ptr() && mask_mixed;
    if (!bias_ptr() && !alibi_on() && !read_mask) return;  // (no set-up per row)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t fr = row + 8 * r;
      if (fr >= rows_used) continue;
      // Element (n, e) is pair (i, j) = (fr, c0 + 2t + 8n + e) (query rows) or
      // (c0 + 2t + 8n + e, fr) (key rows): its offset from the row's first is
      // (8n + e) * step in the arrays.
      const int64_t i0 = kQueryRows ? fr : c0 + 2 * t, j0 = kQueryRows ? c0 + 2 * t : fr;
      const float* bias_at = bias_ptr() ? bias_ptr() + i0 * terms.bias_ld + j0 : nullptr;
      const unsigned char* mask_at =
          read_mask ? reinterpret_cast<const unsigned char*>(mask_ptr()) + i0 * terms.mask_ld + j0
                    : nullptr;
      const int64_t bias_step = kQueryRows ? 1 : terms.bias_ld;
      const int64_t mask_step = kQueryRows ? 1 : terms.mask_ld;
      // |i + diagonal - j| = |distance0 -/+ (8n + e)|
      const float distance0 = static_cast<float>(i0 + terms.diagonal - j0);
      // (pairs: 8-byte aligned bias pairs, 2-byte aligned mask pairs)
      const bool pairs = kQueryRows && ((reinterpret_cast<uintptr_t>(bias_ptr()) |
                                         static_cast<uintptr_t>(terms.bias_ld * 4)) % 8 == 0) &&
                         ((reinterpret_cast<uintptr_t>(mask_ptr()) |
                           static_cast<uintptr_t>(terms.mask_ld)) % 2 == 0);
      if ((pairs || !kQueryRows) && cols_used - c0 >= kCols) {
        add_full_row<kTiles>(s, r, bias_at, mask_at, distance0);
        continue;
      }
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        float add[2] = {0.0f, 0.0f};
        bool hidden[2] = {false, false};
        const int o = 8 * n;
        const bool both = o + 1 < col_end, first = o < col_end;
        if (bias_at) {
          if (pairs && both) {
            const float2 b2 = __ldg(reinterpret_cast<const float2*>(bias_at + o));
            add[0] = b2.x, add[1] = b2.y;
          } else {
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (o + e < col_end) add[e] = __ldg(bias_at + (o + e) * bias_step);
          }
#pragma unroll
          for (int e = 0; e < 2; ++e) add[e] *= kLog2e;
        }
        if (alibi_on()) {
#pragma unroll
          for (int e = 0; e < 2; ++e)
            add[e] -= slope_log2 * fabsf(kQueryRows ? distance0 - static_cast<float>(o + e)
                                                    : distance0 + static_cast<float>(o + e));
        }
        if (mask_at) {
          if (pairs && both) {
            const unsigned short m2 = __ldg(reinterpret_cast<const unsigned short*>(mask_at + o));
            hidden[0] = (m2 & 0xffu) == 0, hidden[1] = (m2 >> 8) == 0;
          } else {
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (o + e < col_end) hidden[e] = __ldg(mask_at + (o + e) * mask_step) == 0;
          }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * n + 2 * r + e];
          const bool on = (e == 0 ? first : both) && x != kNegInf;
          x = on ? (hidden[e] ? kNegInf : x + add[e]) : x;
        }
      }
    }
  }

  // add()'s common case, without a branch per element: a tile whose columns are all
  // used (query rows: aligned pairs, one load each; key rows: a load per element, a
  // row of the arrays apart). One pass per term, so that each pass's loads are
  // independent.
  template <int kTiles>
  __device__ void add_full_row(float (&s)[kTiles * 4], int r, const float* bias_at,
                               const unsigned char* mask_at, float distance0) const {
    const auto add_to = [](float& x, float v) { x = x != kNegInf ? x + v : x; };
    if (bias_at) {
      float2 b2[kTiles];
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        if constexpr (kQueryRows) {
          b2[n] = __ldg(reinterpret_cast<const float2*>(bias_at + 8 * n));
        } else {
          b2[n].x = __ldg(bias_at + 8 * n * terms.bias_ld);
          b2[n].y = __ldg(bias_at + (8 * n + 1) * terms.bias_ld);
        }
      }
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        add_to(s[4 * n + 2 * r], kLog2e * b2[n].x);
        add_to(s[4 * n + 2 * r + 1], kLog2e * b2[n].y);
      }
    }
    if (alibi_on()) {
      // |i + diagonal - j| = |distance0 -/+ (8n + e)| (query / key rows)
      const float sign = kQueryRows ? -1.0f : 1.0f;
      if (slope_finite) {
        // A finite term leaves hidden (-inf) and NaN scores as they are: no test, two
        // instructions an element (an FADD, and an FFMA taking |.| as an operand).
        const float minus_slope = -slope_log2;
#pragma unroll
        for (int n = 0; n < kTiles; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[4 * n + 2 * r + e];
            x = fmaf(minus_slope, fabsf(distance0 + sign * static_cast<float>(8 * n + e)), x);
          }
      } else {
#pragma unroll
        for (int n = 0; n < kTiles; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            add_to(s[4 * n + 2 * r + e],
                   -slope_log2 * fabsf(fmaf(sign, static_cast<float>(8 * n + e), distance0)));
      }
    }
    if (mask_at) {
      unsigned short m2[kTiles];
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        if constexpr (kQueryRows) {
          m2[n] = __ldg(reinterpret_cast<const unsigned short*>(mask_at + 8 * n));
        } else {
          m2[n] = static_cast<unsigned short>(__ldg(mask_at + 8 * n * terms.mask_ld) |
                                              (__ldg(mask_at + (8 * n + 1) * terms.mask_ld) << 8));
        }
      }
#pragma unroll
      for (int n = 0; n < kTiles; ++n) {
        if ((m2[n] & 0xffu) == 0) s[4 * n + 2 * r] = kNegInf;
        if ((m2[n] >> 8) == 0) s[4 * n + 2 * r + 1] = kNegInf;
      }
    }
  }

  // add() in two steps, for a kernel that reads the terms before its scores are live
  // (fewer registers while the loads are in flight, and their latency hidden behind
  // the product): terms_of(term, c0) makes the tile's terms (add() on zeros: bias +
  // ALiBi, -inf where the mask hides the pair, 0 past the used pairs), add_terms(s,
  // term) adds them to the scores (hidden ones stay hidden). The same scores as add()
  // up to rounding (s + (bias - ALiBi) for (s + bias) - ALiBi).
  template <int kTiles>
  __device__ void terms_of(float (&term)[kTiles * 4], int64_t c0) const {
#pragma unroll
    for (int k = 0; k < kTiles * 4; ++k) term[k] = 0.0f;
    add<kTiles>(term, c0);
  }
  template <int kTiles>
  __device__ static void add_terms(float (&s)[kTiles * 4], const float (&term)[kTiles * 4]) {
#pragma unroll
    for (int k = 0; k < kTiles * 4; ++k)
      if (s[k] != kNegInf) s[k] += term[k];
  }

  __device__ bool dropping() const { return kDrops && drops; }

  // Dropout's keep bits of a tile of kTiles column tiles, one word per chunk of up to
  // 8 (keep_bits): taken once for the backward's dP and P.
  template <int kTiles>
  struct KeepWords {
    static constexpr int kChunk = kTiles < 8 ? kTiles : 8;
    static_assert(kTiles % kChunk == 0, "whole chunks of 8 column tiles");
    uint32_t word[kTiles / kChunk];
  };
  template <int kTiles>
  __device__ KeepWords<kTiles> keep_words(int64_t c0) const {
    constexpr int kChunk = KeepWords<kTiles>::kChunk;
    KeepWords<kTiles> keep{};
    if (!dropping()) return keep;
#pragma unroll
    for (int n0 = 0; n0 < kTiles; n0 += kChunk)
      keep.word[n0 / kChunk] = keep_bits<kChunk>(c0 + n0 * 8);
    return keep;
  }

  // x *= 1 / (1 - rate) where dropout keeps the pair, 0 where it drops it
  // (dropout.h: one Philox call per 8 elements of a 16 x 16 block).
  template <int kTiles>
  __device__ void drop(float (&x)[kTiles * 4], const KeepWords<kTiles>& keep) const {
    if (!dropping()) return;
    constexpr int kChunk = KeepWords<kTiles>::kChunk;
#pragma unroll
    for (int n0 = 0; n0 < kTiles; n0 += kChunk)
#pragma unroll
      for (int i = 0; i < kChunk * 4; ++i)
        x[4 * n0 + i] = (keep.word[n0 / kChunk] >> i) & 1u ? x[4 * n0 + i] * keep_scale : 0.0f;
  }
  template <int kTiles>
  __device__ void drop(float (&x)[kTiles * 4], int64_t c0) const {
    if (dropping()) drop<kTiles>(x, keep_words<kTiles>(c0));
  }

  // Dropout's keep bits of the tile from column c0 (c0 % 16 == 0, fragment row % 16 <
  // 8), for drop() and for a kernel that applies them to several fragments (the
  // backward's P for dV and dP) or takes them early (fewer live registers): bit 4n + e
  // is element 4n + e's (kTiles <= 8: one 32-bit word); apply_keep(x, bits) multiplies.
  // Only when dropping() (the bits of no dropout are not all ones).
  template <int kTiles>
  __device__ uint32_t keep_bits(int64_t c0) const {
    static_assert(kTiles % 2 == 0, "dropout groups span 16 columns");
    static_assert(kTiles * 4 <= 32, "one bit per element of a 32-bit word");
    const int t = threadIdx.x % 4;
    uint32_t keep = 0;
    if constexpr (kQueryRows) {
      const uint32_t x1 = dropout::row_counter(static_cast<uint32_t>(row));
#pragma unroll
      for (int m = 0; m < kTiles / 2; ++m) {
        const uint32_t bits = dropout.group_keep_bits(
            x1, dropout::column_counter(static_cast<uint32_t>(c0 + 16 * m + 2 * t)));
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int slot = (e / 2) * 4 + half * 2 + (e & 1);
            keep |= ((bits >> slot) & 1u) << (4 * (2 * m + half) + e);
          }
      }
    } else {
      // Keys as rows (S^T): a group holds keys {k, k + 1, k + 8, k + 9} of query rows
      // {q, q + 8}; this thread uses keys {row, row + 8} of the groups of queries
      // c and c + 1, and the thread 4 lanes away (fragment row row ^ 1, fragment.cuh's
      // layout) the other keys of the same two groups: each generates one, and they
      // swap (every lane of the warp takes part).
      const uint32_t x0 = dropout::column_counter(static_cast<uint32_t>(row));
      const int key_slot = static_cast<int>(row % 2);
#pragma unroll
      for (int m = 0; m < kTiles / 2; ++m) {
        const uint32_t mine = dropout.group_keep_bits(
            dropout::row_counter(static_cast<uint32_t>(c0 + 16 * m + 2 * t + key_slot)), x0);
        const uint32_t theirs = __shfl_xor_sync(0xFFFFFFFFu, mine, kPartnerLanes);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t bits = e == key_slot ? mine : theirs;
#pragma unroll
          for (int half = 0; half < 2; ++half)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int slot = half * 4 + r * 2 + key_slot;
              keep |= ((bits >> slot) & 1u) << (4 * (2 * m + half) + 2 * r + e);
            }
        }
      }
    }
    return keep;
  }
  template <int kTiles>
  __device__ void apply_keep(float (&x)[kTiles * 4], uint32_t keep) const {
#pragma unroll
    for (int i = 0; i < kTiles * 4; ++i) x[i] = (keep >> i) & 1u ? x[i] * keep_scale : 0.0f;
  }

  // dbias += g (the gradient of the score after softcap, natural units) at fragment
  // element `index` of the tile from column c0, if it is a used pair: a store where
  // this (sequence, head) owns the entry (every pair is visited once; launch zeroes
  // dbias first), an atomic add where the entry is shared.
  __device__ void add_bias_gradient_at(int index, int64_t c0, float g) const {
    int64_t i, j;
    if (!kAll || !dbias || !pair_at(index, c0, i, j)) return;
    float* at = dbias + i * dbias_ld + j;
    if (dbias_shared) atomicAdd(at, g);
    else *at = g;
  }
  template <int kTiles>
  __device__ void add_bias_gradient(const float (&g)[kTiles * 4], int64_t c0) const {
#pragma unroll
    for (int index = 0; index < kTiles * 4; ++index) add_bias_gradient_at(index, c0, g[index]);
  }
};

}  // namespace flashjax::cuda
