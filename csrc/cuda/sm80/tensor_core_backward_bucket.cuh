// Tensor-core backward (mma.sync m16n8k16, fp16/bf16, float32 accumulation),
// deterministic by construction: no atomics (but for a dbias entry that several
// (sequence, head)s share, which deterministic mode sums in the exact pass).
//
//  * key kernel: a CTA owns kBlock keys of one kv head (each warp 16 keys) and
//    walks every query tile of every query head of the group that can see
//    them, recomputing S^T = K Q^T and P^T, accumulating dV += P^T dO and
//    dK += dS^T Q in registers. At head dim 256 the registers hold only one
//    of dK, dV, so the kernel runs twice.
//  * query kernel: a CTA owns kBlock query rows and walks their key tiles,
//    accumulating dQ += dS K, and each row's share of dsinks.
//
// With P = exp(S - lse) and D = rowsum(dO * O) - dlse (preprocess kernel):
// dP = dO V^T, dS = P * (dP - D) (times the softcap derivative).
//
// kTerms kernels (score_terms.cuh): S takes the bias, mask and ALiBi terms after the
// masks (P from them); with dropout (keep factors Z: 0 or 1 / (1 - rate)), dP = Z *
// (dO V^T) and dV += (P Z)^T dO (D is unchanged: O = (P Z) V). The softcap derivative
// reads the capped scores before the terms; dbias (the query kernel's: each pair once
// per (sequence, head)) takes dS before it.
//
// One head-dim bucket's kernels and launches (tensor_core_backward_bucket.h),
// instantiated per compiled bucket in a unit of its own (cmake/cuda.cmake,
// launch_bucket.cu.in).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/backward_workspace.h"
#include "../common/block.cuh"
#include "../common/device.cuh"
#include "../common/dispatch.h"
#include "../common/epilogue.cuh"
#include "../common/exact_rows.cuh"
#include "../common/mask.cuh"
#include "../common/score_mod.cuh"
#include "../common/score_terms.cuh"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "mma_sm80.cuh"
#include "tensor_core_backward_bucket.h"

namespace flashjax::cuda::sm80_bwd {
namespace {


constexpr int kBlock = 64;  // rows of every tile (keys or queries)
constexpr int kThreads = 128;
constexpr int kTiles = kBlock / 8;  // 8-column tiles across a 64-wide S fragment

template <int kHeadDim>
constexpr int smem_bytes() {
  return 4 * kBlock * kHeadDim * 2 + 2 * kBlock * 4;
}

template <int kN>
__device__ __forceinline__ void zero(float (&x)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) x[i] = 0.0f;
}

static_assert(kBlock == SegmentTiles::kRows, "segment-id ranges are kept per tile");


// kLayouts (every kernel): the sequence layouts the instantiation takes
// (sequence_layout.h); kTerms: whether the scores take terms (without, `terms` is
// an empty struct and the code is the plain kernel's). D_rows is laid out like lse.
// (Struct parameters are __grid_constant__: helpers take them by reference, which
// otherwise copies them to local memory and costs the key kernel spills.)
template <class T, int kHeadDim, Layouts kLayouts, bool kTerms, bool kWantDK, bool kWantDV>
__global__ void __launch_bounds__(kThreads)
    key_kernel(AttentionParams p, const __grid_constant__ TensorRef D_rows,
               const __grid_constant__ SegmentTiles segment_tiles, int* nonfinite) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlock * kHeadDim;
  T* sQ = sV + kBlock * kHeadDim;
  T* sdO = sQ + kBlock * kHeadDim;
  float* s_lse = reinterpret_cast<float*>(sdO + kBlock * kHeadDim);  // log2 units
  float* s_D = s_lse + kBlock;

  const int64_t k_tiles = (p.seqlen_k + kBlock - 1) / kBlock;
  const int64_t k_tile = blockIdx.x % k_tiles;
  const int64_t bhk = blockIdx.x / k_tiles;
  const int64_t b = bhk / p.heads_kv, hk = bhk % p.heads_kv;
  const SeqlenInfo seq = sequence_info<kLayouts>(p, b);
  const int64_t k0 = k_tile * kBlock;
  if (k0 >= seq.k_slot) return;  // past this sequence's slot
  const int64_t last_key = min(k0 + kBlock, seq.seqlen_k) - 1;  // last used key (< k0: none)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t my_key = k0 + warp * 16 + lane / 4;  // fragment rows my_key, my_key + 8

  // Only used keys and rows are read (the rest of a tile is zero), so keys
  // past the used ones get dK = dV = 0.
  load_tile<T, kHeadDim, kBlock>(sK, seq.k_at<const T>(p.k, 0, hk), p.k.row_stride, k0,
                                 seq.seqlen_k, p.head_dim);
  load_tile<T, kHeadDim, kBlock>(sV, seq.k_at<const T>(p.v, 0, hk), p.v.row_stride, k0,
                                 seq.seqlen_k, p.head_dim_v);
  cp_async_commit();

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
  zero(dk);
  zero(dv);
  QueryRange queries(seq, k0, last_key, kBlock);
  narrow_to_segments<kLayouts>(queries, segment_tiles, b, k0, kBlock, kBlock);
  const FragmentSegments<kLayouts> segments(p, segment_tiles, seq, b, FragmentRows::kKeys, k0,
                                            my_key);
  FragmentTerms<kTerms ? TermSet::kAny : TermSet::kNone, FragmentRows::kKeys> terms(p, seq, my_key);
  for (int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    terms.head(p, seq, b, h);
    const T* q_head = seq.q_at<const T>(p.q, 0, h);
    const T* do_head = seq.q_at<const T>(p.dout, 0, h);
    for (int64_t q0 = segments.next_tile(queries.tile_begin, queries.row_end, kBlock);
         q0 < queries.row_end; q0 = segments.next_tile(q0 + kBlock, queries.row_end, kBlock)) {
      __syncthreads();  // the previous tile's Q, dO, lse, D are no longer read
      load_tile<T, kHeadDim, kBlock>(sQ, q_head, p.q.row_stride, q0, seq.seqlen_q, p.head_dim);
      load_tile<T, kHeadDim, kBlock>(sdO, do_head, p.dout.row_stride, q0, seq.seqlen_q,
                                     p.head_dim_v);
      cp_async_commit();
      if (threadIdx.x < kBlock) {  // rows past the used ones: P = dS = 0
        const int64_t i = q0 + threadIdx.x;
        const bool used = i < seq.seqlen_q;
        s_lse[threadIdx.x] = used ? lse_to_log2(*seq.q_at<const float>(p.lse, i, h)) : -kNegInf;
        s_D[threadIdx.x] = used ? *seq.q_at<const float>(D_rows, i, h) : 0.0f;
      }
      // kTerms: the tile's terms and dropout bits while Q and dO load (and before the
      // fragments of the products are live).
      float term[kTiles * 4];
      [[maybe_unused]] uint32_t keep = ~0u;
      if constexpr (kTerms) {
        terms.template terms_of<kTiles>(term, q0);
        if (terms.dropping()) keep = terms.template keep_bits<kTiles>(q0);
      }
      cp_async_wait_all();
      __syncthreads();

      // kTerms: dP^T = V dO^T before S^T, so that from S^T on everything up to the
      // products is elementwise (P^T is not a third fragment beside S^T and dP^T).
      float dpt[kTiles * 4];
      if constexpr (kTerms && kWantDK) gemm_abt<T, kHeadDim, kBlock>(dpt, sV, warp * 16, sdO);

      // S^T: rows are this warp's keys, columns the tile's queries.
      float st[kTiles * 4];
      gemm_abt<T, kHeadDim, kBlock>(st, sK, warp * 16, sQ);
      scores_log2(st, p);
      const bool needs_mask = q0 < seq.first_query(last_key) ||
                              q0 + kBlock - 1 > seq.last_query(k0) ||
                              q0 + kBlock > seq.seqlen_q || last_key - k0 + 1 < kBlock;
      if (needs_mask) {
        int lo[2], hi[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // (keys past the used ones see no query)
          const int64_t key = my_key + 8 * r;
          visible_columns(seq.first_query(key), seq.last_query(key), q0, kBlock, lo[r], hi[r]);
        }
        mask_columns<kTiles>(st, lo, hi);
      }
      segments.template mask<kTiles>(st, q0);
      const auto column_of = [&](int i) { return (i / 4) * 8 + 2 * t + (i & 1); };
      float pt[kTiles * 4];
#pragma unroll
      for (int i = 0; i < kTiles * 4; ++i) pt[i] = st[i];
      // kTerms: P^T from the scores with terms; st keeps the capped scores without
      // them, which the softcap derivative reads.
      if constexpr (kTerms) terms.template add_terms<kTiles>(pt, term);
      probabilities(pt, [&](int i) { return s_lse[column_of(i)]; });
      if constexpr (kTerms) {
        if constexpr (kWantDK) {  // dS^T from P^T and dP^T Z
          if (terms.dropping()) terms.template apply_keep<kTiles>(dpt, keep);
          score_gradient(dpt, pt, st, p, [&](int i) { return s_D[column_of(i)]; });
        }
        if constexpr (kWantDV) {  // dV += (P^T Z) dO
          if (terms.dropping()) terms.template apply_keep<kTiles>(pt, keep);
          gemm_ab<T, kHeadDim, kBlock>(dv, pt, sdO);
        }
        if constexpr (kWantDK) gemm_ab<T, kHeadDim, kBlock>(dk, dpt, sQ);
      } else {
        if constexpr (kWantDV) gemm_ab<T, kHeadDim, kBlock>(dv, pt, sdO);
        if constexpr (kWantDK) {
          gemm_abt<T, kHeadDim, kBlock>(dpt, sV, warp * 16, sdO);
          score_gradient(dpt, pt, st, p, [&](int i) { return s_D[column_of(i)]; });
          gemm_ab<T, kHeadDim, kBlock>(dk, dpt, sQ);
        }
      }
    }
  }
  if constexpr (kWantDK)
    store_rows<T, kHeadDim>(seq.k_at<T>(p.dk, 0, hk), p.dk.row_stride, seq.k_slot, p.head_dim,
                            k0 + warp * 16, dk, p.softmax_scale);
  if constexpr (kWantDV)
    store_rows<T, kHeadDim>(seq.k_at<T>(p.dv, 0, hk), p.dv.row_stride, seq.k_slot, p.head_dim_v,
                            k0 + warp * 16, dv, 1.0f);
  if constexpr (kWantDK) flag_nonfinite(nonfinite, dk);  // (exact_rows.cuh)
  if constexpr (kWantDV) flag_nonfinite(nonfinite, dv);
}

// kTerms: dS = g * softcap'(S) with g = P * (dP - D) (dP dropped); dbias += g (a
// store where this (sequence, head) owns the entry, atomic where it is shared), from
// the capped scores without terms `s_log2`.
template <int kN, class Terms, class DOf>
__device__ __forceinline__ void score_gradient_with_terms(float (&dp)[kN], const float (&prob)[kN],
                                                          const float (&s_log2)[kN],
                                                          const AttentionParams& p,
                                                          const Terms& terms, int64_t c0,
                                                          DOf&& d_of) {
#pragma unroll
  for (int i = 0; i < kN; ++i) dp[i] = prob[i] * (dp[i] - d_of(i));
  terms.template add_bias_gradient<kN / 4>(dp, c0);
  if (p.softcap > 0.0f) {
    const float inv_cap_log2 = 1.0f / (p.softcap * kLog2e);
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float t = prob[i] > 0.0f ? s_log2[i] * inv_cap_log2 : 0.0f;
      dp[i] *= softcap_slope(t);
    }
  }
}

template <class T, int kHeadDim, Layouts kLayouts, bool kTerms>
__global__ void __launch_bounds__(kThreads)
    query_kernel(AttentionParams p, const __grid_constant__ TensorRef D_rows,
                 const __grid_constant__ TensorRef dsink_rows,
                 const __grid_constant__ SegmentTiles segment_tiles, int* nonfinite) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlock * kHeadDim;
  T* sK = sdO + kBlock * kHeadDim;
  T* sV = sK + kBlock * kHeadDim;

  const int64_t q_tiles = (p.seqlen_q + kBlock - 1) / kBlock;
  const auto [q_tile, bh] = query_tile(q_tiles);
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group_size();
  const SeqlenInfo seq = sequence_info<kLayouts>(p, b);
  const int64_t q0 = q_tile * kBlock;
  if (q0 >= seq.q_slot) return;  // past this sequence's slot
  const int64_t last_row = min(q0 + kBlock, seq.seqlen_q) - 1;  // last used row (< q0: none)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  RowSoftmax rows{q0 + warp * 16 + lane / 4};  // used for its row and masking

  // Only used rows and keys are read (the rest of a tile is zero).
  load_tile<T, kHeadDim, kBlock>(sQ, seq.q_at<const T>(p.q, 0, h), p.q.row_stride, q0,
                                 seq.seqlen_q, p.head_dim);
  load_tile<T, kHeadDim, kBlock>(sdO, seq.q_at<const T>(p.dout, 0, h), p.dout.row_stride, q0,
                                 seq.seqlen_q, p.head_dim_v);
  cp_async_commit();
  float lse2[2], D[2];  // rows past the used ones: P = dS = 0, so dQ = 0
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = rows.row + 8 * r;
    const bool used = i < seq.seqlen_q;
    lse2[r] = used ? lse_to_log2(*seq.q_at<const float>(p.lse, i, h)) : -kNegInf;
    D[r] = used ? *seq.q_at<const float>(D_rows, i, h) : 0.0f;
  }

  float dq[kHeadDim / 2];
  zero(dq);
  KeyRange keys(seq, q0, last_row, kBlock);
  narrow_to_segments<kLayouts>(keys, segment_tiles, b, q0, kBlock, kBlock);
  const FragmentSegments<kLayouts> segments(p, segment_tiles, seq, b, FragmentRows::kQueries, q0,
                                            rows.row);
  FragmentTerms<kTerms ? TermSet::kAny : TermSet::kNone, FragmentRows::kQueries> terms(
      p, seq, rows.row);
  terms.head(p, seq, b, h);
  const T* k_head = seq.k_at<const T>(p.k, 0, hk);
  const T* v_head = seq.k_at<const T>(p.v, 0, hk);
  for (int64_t k0 = segments.next_tile(keys.tile_begin, keys.key_end, kBlock); k0 < keys.key_end;
       k0 = segments.next_tile(k0 + kBlock, keys.key_end, kBlock)) {
    __syncthreads();  // the previous K, V tiles are no longer read
    load_tile<T, kHeadDim, kBlock>(sK, k_head, p.k.row_stride, k0, seq.seqlen_k, p.head_dim);
    load_tile<T, kHeadDim, kBlock>(sV, v_head, p.v.row_stride, k0, seq.seqlen_k, p.head_dim_v);
    cp_async_commit();
    // kTerms: the tile's terms and dropout bits while K and V load.
    float term[kTiles * 4];
    [[maybe_unused]] uint32_t keep = ~0u;
    if constexpr (kTerms) {
      terms.template terms_of<kTiles>(term, k0);
      if (terms.dropping()) keep = terms.template keep_bits<kTiles>(k0);
    }
    cp_async_wait_all();
    __syncthreads();

    float s[kTiles * 4];
    gemm_abt<T, kHeadDim, kBlock>(s, sQ, warp * 16, sK);
    rows.scores<kTiles>(s, p, seq, k0,
                        RowSoftmax::tile_needs_mask(seq, q0, last_row, k0, kBlock, keys.key_begin,
                                                    keys.key_end));
    segments.template mask<kTiles>(s, k0);
    float prob[kTiles * 4];
#pragma unroll
    for (int i = 0; i < kTiles * 4; ++i) prob[i] = s[i];
    // kTerms: P from the scores with terms; s keeps the capped scores without them.
    if constexpr (kTerms) terms.template add_terms<kTiles>(prob, term);
    probabilities(prob, [&](int i) { return lse2[(i % 4) / 2]; });
    float dp[kTiles * 4];
    gemm_abt<T, kHeadDim, kBlock>(dp, sdO, warp * 16, sV);
    if constexpr (kTerms) {
      if (terms.dropping()) terms.template apply_keep<kTiles>(dp, keep);  // dP Z
      score_gradient_with_terms(dp, prob, s, p, terms, k0, [&](int i) { return D[(i % 4) / 2]; });
    } else {
      score_gradient(dp, prob, s, p, [&](int i) { return D[(i % 4) / 2]; });
    }
    gemm_ab<T, kHeadDim, kBlock>(dq, dp, sK);
  }
  store_rows<T, kHeadDim>(seq.q_at<T>(p.dq, 0, h), p.dq.row_stride, seq.q_slot, p.head_dim,
                          q0 + warp * 16, dq, p.softmax_scale);
  flag_nonfinite(nonfinite, dq);  // rows a tile product got wrong (exact_rows.cuh)
  write_dsink_rows(p, seq, b, h, rows.row, lse2, D, dsink_rows);
}

template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <class T, int kHeadDim, Layouts kLayouts, bool kTerms>
cudaError_t launch(const AttentionParams& p, const BackwardWorkspace& ws, cudaStream_t stream) {
  constexpr int kSmem = smem_bytes<kHeadDim>();
  constexpr bool kOnePass = kHeadDim <= 128;  // dK and dV fit in registers together
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        cudaError_t status = allow_smem(query_kernel<T, kHeadDim, kLayouts, kTerms>, kSmem);
        if (status == cudaSuccess)
          status = allow_smem(key_kernel<T, kHeadDim, kLayouts, kTerms, true, kOnePass>, kSmem);
        if constexpr (!kOnePass)  // (constexpr: no dV-only kernel is compiled where unused)
          if (status == cudaSuccess)
            status = allow_smem(key_kernel<T, kHeadDim, kLayouts, kTerms, false, true>, kSmem);
        return status;
      });
      e != cudaSuccess)
    return e;
  const int64_t key_blocks = (p.seqlen_k + kBlock - 1) / kBlock * p.batch * p.heads_kv;
  const int64_t query_blocks = (p.seqlen_q + kBlock - 1) / kBlock * p.batch * p.heads_q;
  if (key_blocks > 0x7fffffff || query_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  if (key_blocks > 0) {
    key_kernel<T, kHeadDim, kLayouts, kTerms, true, kOnePass>
        <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(p, ws.D, ws.segments,
                                                                          ws.nonfinite);
    if constexpr (!kOnePass)
      key_kernel<T, kHeadDim, kLayouts, kTerms, false, true>
          <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(p, ws.D, ws.segments,
                                                                          ws.nonfinite);
  }
  if (query_blocks > 0)
    query_kernel<T, kHeadDim, kLayouts, kTerms>
        <<<static_cast<unsigned>(query_blocks), kThreads, kSmem, stream>>>(
            p, ws.D, ws.dsink_rows, ws.segments, ws.nonfinite);
  return cudaGetLastError();
}

}  // namespace

template <int kHeadDim>
cudaError_t BucketLaunch<kHeadDim>::run(const AttentionParams& p, const BackwardWorkspace& ws,
                                        cudaStream_t stream) {
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    return with_variant(p, [&](auto terms, auto layouts) {
      return launch<decltype(tag), kHeadDim, decltype(layouts)::value,
                    has_terms(decltype(terms)::value)>(p, ws, stream);
    });
  });
}

}  // namespace flashjax::cuda::sm80_bwd
