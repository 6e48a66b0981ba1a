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

namespace flashjax::cuda {

// Scores must be in log2 units before terms are added (kTerms kernels scale first:
// score_mod.cuh's scores_prescaled).
template <bool kTerms, FragmentRows kRows>
struct FragmentTerms {
  static constexpr bool kActive = false;
  __device__ FragmentTerms(const AttentionParams&, const SeqlenInfo&, int64_t) {}
  __device__ void head(const AttentionParams&, const SeqlenInfo&, int64_t, int64_t) {}
  __device__ float term_log2_at(int, int64_t, bool* = nullptr) const { return 0.0f; }
  template <int kTiles>
  __device__ void add(float (&)[kTiles * 4], int64_t, bool = true) const {}
  template <int kTiles>
  __device__ void drop(float (&)[kTiles * 4], int64_t) const {}
  __device__ bool dropping() const { return false; }
  __device__ bool bias_gradient() const { return false; }
  __device__ void add_bias_gradient_at(int, int64_t, float) const {}
  template <int kTiles>
  __device__ void add_bias_gradient(const float (&)[kTiles * 4], int64_t) const {}
};

template <FragmentRows kRows>
struct FragmentTerms<true, kRows> {
  static constexpr bool kActive = true;
  static constexpr bool kQueryRows = kRows == FragmentRows::kQueries;
  int64_t row;                // the thread's first fragment row (the other is row + 8)
  int64_t rows_used, cols_used;  // used queries / keys as rows and columns
  ScoreTerms terms;
  float slope_log2 = 0.0f;    // the ALiBi slope in log2 units
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
        drops(static_cast<bool>(p.dropout)),
        keep_scale(p.dropout.scale) {}

  // The (sequence b, query head h) the next tiles belong to.
  __device__ void head(const AttentionParams& p, const SeqlenInfo& seq, int64_t b, int64_t h) {
    terms = ScoreTerms(p, seq, b, h);
    slope_log2 = terms.slope * kLog2e;
    if (drops) dropout = p.dropout.head(b, h, p.heads_q);
    if (p.dbias) {
      dbias = p.dbias.at<float>(b, h);
      dbias_ld = p.dbias.row_stride;
      dbias_shared = p.dbias.broadcast();
    }
  }

  // (query, key) of fragment element (row half r, column c).
  __device__ void pair(int r, int64_t c, int64_t& i, int64_t& j) const {
    if constexpr (kQueryRows) i = row + 8 * r, j = c;
    else i = c, j = row + 8 * r;
  }
  __device__ bool used(int r, int64_t c) const { return row + 8 * r < rows_used && c < cols_used; }

  // The bias and ALiBi terms (log2 units) of fragment element `index` of the tile
  // from column c0 (0 for pairs past the used ones); *allowed: the mask's verdict
  // (not read when allowed is null).
  __device__ float term_log2_at(int index, int64_t c0, bool* allowed = nullptr) const {
    const int r = (index % 4) / 2;
    const int64_t c = c0 + (index / 4) * 8 + 2 * (threadIdx.x % 4) + (index & 1);
    if (allowed) *allowed = true;
    if (!used(r, c)) return 0.0f;
    int64_t i, j;
    pair(r, c, i, j);
    float x = terms.bias ? kLog2e * __ldg(terms.bias + i * terms.bias_ld + j) : 0.0f;
    if (terms.alibi) {
      const int64_t d = i + terms.diagonal - j;
      x -= slope_log2 * static_cast<float>(d < 0 ? -d : d);
    }
    if (allowed && terms.mask)
      *allowed = __ldg(reinterpret_cast<const unsigned char*>(terms.mask) + i * terms.mask_ld + j);
    return x;
  }

  // s (log2 units) += the bias and ALiBi terms; -inf where the mask hides the pair
  // (mask_mixed false: the tile summaries say it hides none of these). Hidden scores
  // stay hidden (a +inf bias must not revive them).
  template <int kTiles>
  __device__ void add(float (&s)[kTiles * 4], int64_t c0, bool mask_mixed = true) const {
#pragma unroll
    for (int index = 0; index < kTiles * 4; ++index) {
      bool allowed = true;
      const float x = s[index] + term_log2_at(index, c0, mask_mixed ? &allowed : nullptr);
      if (s[index] != kNegInf) s[index] = allowed ? x : kNegInf;
    }
  }

  __device__ bool dropping() const { return drops; }
  __device__ bool bias_gradient() const { return dbias != nullptr; }

  // x *= 1 / (1 - rate) where dropout keeps the pair, 0 where it drops it
  // (dropout.h: one Philox call per 8 elements of a 16 x 16 block).
  template <int kTiles>
  __device__ void drop(float (&x)[kTiles * 4], int64_t c0) const {
    if (!drops) return;
    static_assert(kTiles % 2 == 0, "dropout groups span 16 columns");
    const int t = threadIdx.x % 4;
    if constexpr (kQueryRows) {
      // Rows row, row + 8 (row % 16 < 8) and columns c, c + 1, c + 8, c + 9 of a
      // 16-column block: one group, slot r * 4 + (n % 2) * 2 + e.
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
            float& v = x[4 * (2 * m + half) + e];
            v = (bits >> slot) & 1u ? v * keep_scale : 0.0f;
          }
      }
    } else {
      // Rows are keys j, j + 8 (one group's key columns), columns queries: query
      // columns c + e and c + e + 8 (c = c0 + 16 m + 2 t) share a group (x1 of c + e).
      const uint32_t x0 = dropout::column_counter(static_cast<uint32_t>(row));
      const int key_slot = static_cast<int>(row % 2);
#pragma unroll
      for (int m = 0; m < kTiles / 2; ++m)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t bits = dropout.group_keep_bits(
              dropout::row_counter(static_cast<uint32_t>(c0 + 16 * m + 2 * t + e)), x0);
#pragma unroll
          for (int half = 0; half < 2; ++half)    // query + 8 half
#pragma unroll
            for (int r = 0; r < 2; ++r) {         // key + 8 half
              const int slot = half * 4 + r * 2 + key_slot;
              float& v = x[4 * (2 * m + half) + 2 * r + e];
              v = (bits >> slot) & 1u ? v * keep_scale : 0.0f;
            }
        }
    }
  }

  // dbias += g (the gradient of the score after softcap, natural units) at fragment
  // element `index` of the tile from column c0, if it is a used pair: a store where
  // this (sequence, head) owns the entry (every pair is visited once; launch zeroes
  // dbias first), an atomic add where the entry is shared.
  __device__ void add_bias_gradient_at(int index, int64_t c0, float g) const {
    if (!dbias) return;
    const int r = (index % 4) / 2;
    const int64_t c = c0 + (index / 4) * 8 + 2 * (threadIdx.x % 4) + (index & 1);
    if (!used(r, c)) return;
    int64_t i, j;
    pair(r, c, i, j);
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
