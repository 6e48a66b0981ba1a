// The key and query kernels' consumers (warpgroups 1 and 2, 64 owned rows
// each): their mainloops over the streamed tiles, the wgmma products these
// issue, and the stores of their gradients.
//
//  * key kernel: a CTA owns 128 keys of one kv head (64 per consumer
//    warpgroup); the producer streams (Q_j, dO_j) tiles of 64 queries for every
//    query head of the group, with those rows' lse and D. Per tile:
//    S^T = K Q_j^T and dP^T = V dO_j^T (both operands in shared memory), P^T
//    and dS^T in registers, then dV += P^T dO_j and dK += dS^T Q_j with the
//    left operand from registers. With kFusedDq (the default, non-deterministic
//    mode) it also stores dS^T in shared memory and computes this key block's
//    share of dQ_j = dS_j K, added to a float32 buffer by bulk reductions; a
//    last kernel converts that buffer to dq (5 products per tile pair in all).
//    At head dim 128, dQ_j is issued with tile j + 1's updates (kDqLagsTile).
//  * query kernel (deterministic mode): a CTA owns 128 query rows; the
//    producer streams (K_j, V_j) tiles of 64 keys. Per tile: S = Q K_j^T,
//    dP = dO V_j^T, dS in registers, dQ += dS K_j (7 products in all, no
//    atomics). It also writes each row's share of dsinks.
//
// A consumer's accumulators are declared, and its results stored, in its own
// function rather than in the kernel: declared in the kernel they compile to
// another register order, and ptxas then schedules differently.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/device.cuh"
#include "../common/epilogue.cuh"
#include "../common/exact_rows.cuh"
#include "../common/score_mod.cuh"
#include "../common/score_terms.cuh"
#include "../common/segments.cuh"
#include "../common/softmax.cuh"
#include "bwd_dq_writer.cuh"
#include "bwd_epilogue.cuh"
#include "bwd_gradients.cuh"
#include "bwd_scheduler.cuh"
#include "bwd_smem.cuh"
#include "bwd_tile_config.h"
#include "flashjax/params.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_bwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// C(64 x 64) = A(own rows, K-major) * B(streamed tile, K-major)^T over kHeadDim;
// a and b: k_major_desc of the tiles' k-step 0.
template <class T, int kHeadDim>
__device__ __forceinline__ void issue_abt(float (&c)[32], uint64_t a, uint64_t b) {
  using C = TileConfig<kHeadDim>;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk)
    wgmma_ss_n64<T>(c, k_major_step<C::kOwnRows>(a, kk), k_major_step<C::kStreamRows>(b, kk),
                    kk > 0);
}

// The N-major descriptor of a streamed tile (kStreamRows rows of keys or
// queries; the next 64 head dims kStreamRows * 128 B on, the next 8 rows 1024 B on).
template <int kStreamRows>
__device__ __forceinline__ uint64_t stream_n_major_desc(const unsigned char* tile) {
  return smem_desc(tile, kStreamRows * 128, 1024);
}

// acc(64 x kHeadDim) += A(64 x 64, registers) * B(streamed tile rows, N-major);
// tile: stream_n_major_desc of the tile.
template <class T, int kHeadDim>
__device__ __forceinline__ void issue_ab(float (&acc)[kHeadDim / 2], const uint32_t (&a)[4][4],
                                         uint64_t tile) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc = desc_advance(tile, kk * 16 * 128);
    if constexpr (kHeadDim == 64) wgmma_rs_n64<T>(acc, a[kk], desc, 1);
    else wgmma_rs_n128<T>(acc, a[kk], desc, 1);
  }
}

// The MN-major descriptor of a [rows][64] tile (dS^T, or 64 head dims of K).
__device__ __forceinline__ uint64_t mn_major_desc(const unsigned char* tile) {
  return smem_desc(tile, 1024, 1024);
}

// This key block's share of dQ_j (64 queries x 64 head dims) = dS_j K. At
// head dim 128 the consumers split the head dims and share all 128 keys (both
// dS^T halves, hence the 256-thread barrier); at 64 each consumer takes its own
// 64 keys and all head dims, and the reductions add the two halves.
// ds_tile / k_tile: mn_major_desc of the dS^T tile and of the owned K.
template <class T, int kHeadDim>
__device__ __forceinline__ void issue_dq(float (&dq)[32], uint64_t ds_tile, uint64_t k_tile,
                                         int consumer) {
  using C = TileConfig<kHeadDim>;
  constexpr bool kOwnKeys = C::kDqOfOwnKeys;
  const int key0 = kOwnKeys ? consumer * 64 : 0;
  const uint64_t k_cols = desc_advance(k_tile, kOwnKeys ? 0 : consumer * C::kOwnRows * 128);
  // The first product overwrites dq; zeroing it first tells the compiler that
  // the last tile's values are dead (they would stay live through the softmax).
#pragma unroll
  for (int i = 0; i < 32; ++i) dq[i] = 0.0f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < (kOwnKeys ? 4 : 8); ++kk) {
    const int row = key0 + 16 * kk;
    wgmma_ss_mn_n64<T>(dq, desc_advance(ds_tile, row * 128), desc_advance(k_cols, row * 128),
                       kk > 0);
  }
}

// A consumer's loop over `tiles` streamed tiles: products(it) issues the
// S-like products of tile it, gradients(it) turns their results into float
// register fragments, pack(it) rounds those into wgmma operands, updates(it)
// issues the accumulating products and release(it) frees tile it's stage.
// Without kOverlap (key kernel), gradients waits for the products itself, so
// that it may start before all of them are done.
// kOverlap: the updates of tile it-1 run on the tensor cores while
// gradients(it) runs on the CUDA cores; this keeps two tiles' fragments live,
// which the key kernel (dK and dV accumulators) has no registers for.
// Without kOverlap, products(it) may return false: no tile it (the producer's end
// mark, MaskedTiles), the loop ends there. Returns the tiles done.
template <bool kOverlap, class Products, class Gradients, class Pack, class Updates,
          class Release>
__device__ __forceinline__ int64_t pipeline(int64_t tiles, Products&& products,
                                            Gradients&& gradients, Pack&& pack,
                                            Updates&& updates, Release&& release) {
  if (tiles == 0) return 0;
  if constexpr (!kOverlap) {
    for (int64_t it = 0; it < tiles; ++it) {
      if constexpr (std::is_same_v<decltype(products(it)), bool>) {
        if (!products(it)) return it;
      } else {
        products(it);
      }
      gradients(it);
      pack(it);
      updates(it);
      wgmma_wait<0>();
      release(it);
    }
    return tiles;
  }
  products(0);
  wgmma_wait<0>();
  gradients(0);
  pack(0);
  for (int64_t it = 1; it < tiles; ++it) {
    products(it);
    updates(it - 1);
    wgmma_wait<1>();  // tile it's products are done; tile it-1's updates may run
    gradients(it);
    wgmma_wait<0>();  // the operands packed for tile it-1 are free again
    release(it - 1);
    pack(it);
  }
  updates(tiles - 1);
  wgmma_wait<0>();
  release(tiles - 1);
  return tiles;
}

// Zeros rows [first_row, kRows) of a pair of tiles (owned K and V, or Q and
// dO; streamed Q and dO, or K and V) that reach past a sequence's used rows
// (zero_tile_rows says why).
template <int kRows, int kHeadDim>
__device__ __forceinline__ void zero_rows_of_pair(unsigned char* a, unsigned char* b,
                                                  int first_row, int barrier) {
  zero_tile_rows<kRows, kHeadDim>(a, first_row, barrier);
  zero_tile_rows<kRows, kHeadDim>(b, first_row, barrier);
}

// A key-kernel consumer: dK and dV of its 64 keys over the block's query
// tiles (with kFusedDq also each tile's share of dQ, staged for the writer),
// then its rows of dk and dv. `consumer` must be warp-uniform as the compiler
// sees it (bwd_kernel.cuh), so that descriptors live in uniform registers.
// kTerms: bias, mask, ALiBi, dropout and dbias, or ALiBi alone (score_terms.cuh);
// the variants with a mask take each tile as the producer publishes it
// (MaskedTiles: it skips the tiles the mask hides).
template <class T, int kHeadDim, bool kFusedDq, Layouts kLayouts, TermSet kTerms>
__device__ __forceinline__ void key_consumer(Smem<kHeadDim>& sm,
                                             const KeyBlock<TileConfig<kHeadDim>, kLayouts>& kb,
                                             const AttentionParams& p, const BackwardMaps& maps,
                                             const SegmentTiles& segment_tiles, int consumer,
                                             int* nonfinite) {
  using C = TileConfig<kHeadDim>;
  constexpr int kOwnRows = C::kOwnRows, kStreamRows = C::kStreamRows;
  constexpr bool kDqLags = kFusedDq && C::kDqLagsTile;
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int64_t my_key = kb.k0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  // Descriptors, built once: the owned rows', and each ring's stage 0 (a
  // stage is an offset from it).
  const uint64_t k_rows = k_major_desc<kOwnRows>(sm.own_a + consumer * 64 * 128, 0);
  const uint64_t v_rows = k_major_desc<kOwnRows>(sm.own_b + consumer * 64 * 128, 0);
  const uint64_t q_k_major = k_major_desc<kStreamRows>(sm.stream_a, 0);
  const uint64_t do_k_major = k_major_desc<kStreamRows>(sm.stream_b, 0);
  const uint64_t q_n_major = stream_n_major_desc<kStreamRows>(sm.stream_a);
  const uint64_t do_n_major = stream_n_major_desc<kStreamRows>(sm.stream_b);
  const uint64_t ds_mn_major = mn_major_desc(sm.ds), k_mn_major = mn_major_desc(sm.own_a);
  // This thread's columns of a tile's lse2 and D: 8 n + 2 t and the next, n < 8.
  const uint32_t my_stats = smem_u32(sm.stats) + 4 * 2 * t;
  float dk[kHeadDim / 2] = {}, dv[kHeadDim / 2] = {};

  float st[32], dpt[32];
  uint32_t pa[4][4], dsa[4][4];
  float dq[32];
  // The current tile: its slot in the Q/dO ring, its first query row, its
  // dS^T buffer and dQ stage (stepped in release: no division per tile).
  RingSlot<C::kStages> tile;
  RingSlot<C::kDqStages> dq_stage;
  int ds_buffer = 0;
  int64_t q0 = kb.row_begin + kb.first_tile * kStreamRows;  // (the walk's first tile)
  const auto stream_offset = [&] { return static_cast<uint32_t>(tile.stage * C::kStreamBytes); };
  const int zeroed = barrier_id(NamedBarrier::kTileZeroed, consumer);
  // (kSegments: this consumer's 64 keys are one segment-id tile.)
  const FragmentSegments<kLayouts> segments(p, segment_tiles, kb.seq, kb.b, FragmentRows::kKeys,
                                            kb.k0 + consumer * 64, my_key);
  FragmentTerms<kTerms, FragmentRows::kKeys> terms(p, kb.sequence(p), my_key);
  int64_t tile_head = kb.hk * p.group_size();  // (kTerms: the current tile's query head)
  int64_t terms_head = -1;                      // (the head terms.head set up last)
  // Hands this consumer's share of a tile's dQ (in dq) to the dQ writer.
  // (real = false: staged only, into a stage not yet handed over.)
  const auto send_dq = [&](bool real = true) {
    const int slot = consumer * C::kDqStages + dq_stage.stage;
    mbar_wait(&sm.dq_empty[slot], dq_stage.phase ^ 1);
    stage_dq<C::kDqCols>(sm.dq_stage + slot * kDqBlock<C::kDqCols>, dq, 0);
    fence_proxy_async();
    if (!real) return;
    // (a warp's lanes after __syncwarp, as ds_full: 128 arrivals a tile on one mbarrier
    // cost ~5% of the d128 2k causal key kernel's stall samples; ncu, twenty-eighth session)
    warp_arrive(&sm.dq_full[slot]);
    dq_stage.next();
  };
  // kDqLagsTile: issues (and commits) dQ of tile j from dS^T buffer `buffer`
  // once both consumers' halves are stored.
  // (Tile 0 issues one too, from a buffer not yet written, and drops it: a
  // product issued only from tile 1 on makes ptxas spill.)
  const auto issue_lagging_dq = [&](int64_t j, int buffer) {
    if (j >= 0) mbar_wait(&sm.ds_full[buffer], (j >> 1) & 1);
    issue_dq<T, kHeadDim>(dq, desc_advance(ds_mn_major, buffer * C::kDsBytes), k_mn_major,
                          consumer);
    wgmma_commit();
  };
  mbar_wait(sm.owned, 0);
  if (kb.owned_crosses_end())
    zero_rows_of_pair<kOwnRows, kHeadDim>(sm.own_a, sm.own_b, kb.first_unused_owned_row(), zeroed);
  [[maybe_unused]] const int64_t tiles_done = pipeline<false>(
      kb.tiles,
      [&](int64_t) {  // S^T = K Q_j^T, dP^T = V dO_j^T
        mbar_wait(&sm.full[tile.stage], tile.phase);
        // (the tile the producer found, MaskedTiles; none: the block's tiles end)
        if constexpr (has_mask(kTerms)) {
          q0 = read_published(&sm.streamed[tile.stage]).row;
          if (q0 == StreamedTile::kEndRow) return false;
        }
        if (kb.tile_crosses_end(q0))
          zero_rows_of_pair<kStreamRows, kHeadDim>(sm.stream_a + stream_offset(),
                                                   sm.stream_b + stream_offset(),
                                                   kb.first_unused_row(q0), zeroed);
        wgmma_fence();
        issue_abt<T, kHeadDim>(st, k_rows, desc_advance(q_k_major, stream_offset()));
        wgmma_commit();
        issue_abt<T, kHeadDim>(dpt, v_rows, desc_advance(do_k_major, stream_offset()));
        wgmma_commit();
        // (a bias's rows of a later tile into L2: the walk's next tiles, of this head
        // but where a mask skips some or the head changes: lines then unused)
        terms.template prefetch_bias<kStreamRows>(q0 + kBiasAheadTiles * kStreamRows);
        return true;
      },
      [&](int64_t it) {  // P^T, dS^T
        // The tile's query head (MaskedTiles), and whether the mask hides some of its
        // pairs (then read per element).
        bool mask_mixed = false;
        if constexpr (has_mask(kTerms)) {
          const StreamedTile found = read_published(&sm.streamed[tile.stage]);
          tile_head = found.head;
          mask_mixed = (found.mixed >> consumer) & 1u;
        }
        // The tile's lse2 and D (loaded before the waits: their latency hides there;
        // the variants with a mask read them where they are used: 32 registers fewer
        // while the terms are added, which spilled inside the loop: d128 kMask fused
        // loop 50 -> 4 local loads a tile, fwd+bwd 0.92x. The ALiBi variant keeps them
        // early: on demand, its fused kernel spilled more, 176 -> 320 B).
        constexpr bool kStatsOnDemand = has_mask(kTerms);
        float lse2[16] = {}, D[16] = {};  // (D: loaded in the wait below)
        const uint32_t stats = my_stats + tile.stage * C::kStatBytes;
        if constexpr (!kStatsOnDemand) {
#pragma unroll
          for (int n = 0; n < 8; ++n) ld_shared(stats + 4 * 8 * n, lse2[2 * n], lse2[2 * n + 1]);
        }
        wgmma_wait<1>();
        fence_operands(st);
        // (else the scale rides in the exponent; terms are added to log2 scores)
        if (has_terms(kTerms) || scores_prescaled(p)) scores_log2(st, p);
        kb.template mask<8>(st, p, my_key, q0);
        segments.template mask<8>(st, q0);
        // Rows past seqlen_q have lse2 = +inf and D = 0 (padded), so P = dS = 0.
        const auto column = [](int i) { return 2 * (i / 4) + (i & 1); };
        const auto wait_dp = [&] {
#pragma unroll
          for (int n = 0; n < 8; ++n)
            ld_shared(stats + 4 * (kStreamRows + 8 * n), D[2 * n], D[2 * n + 1]);
          wgmma_wait<0>();
          fence_operands(dpt);
        };
        // element i's column: 8 (i / 4) + 2 t + (i & 1)
        const auto stat_at = [&](int i, int offset) {
          return ld_shared(stats + 4 * (offset + 8 * (i / 4) + (i & 1)));
        };
        const auto lse2_of = [&](int i) {
          return kStatsOnDemand ? stat_at(i, 0) : lse2[column(i)];
        };
        const auto d_of = [&](int i) {
          return kStatsOnDemand ? stat_at(i, kStreamRows) : D[column(i)];
        };
        if constexpr (has_terms(kTerms)) {
          // (a mask variant: only where the tile's head changes; a CTA's tiles run
          // through one head's, then the next's)
          if (!has_mask(kTerms) || tile_head != terms_head)
            terms.head(p, kb.sequence(p), kb.b, tile_head);
          terms_head = tile_head;
          terms.template add<8>(st, q0, mask_mixed);
          if (kTerms != TermSet::kAny && !terms.dropping() && !(p.softcap > 0.0f)) {
            // ALiBi or a mask, no dropout or softcap: P's exponentials overlap dP's
            // product, as without terms (the scores are in log2 units already).
            probabilities_then_grad(st, dpt, p, 1.0f, lse2_of, d_of, wait_dp);
          } else {
            wgmma_wait<0>();
            fence_operands(dpt);
            terms_probabilities_and_grad<true, 8>(st, dpt, p, terms, q0, lse2_of, d_of);
          }
        } else {
          probabilities_then_grad(st, dpt, p, exponent_scale(p), lse2_of, d_of, wait_dp);
        }
      },
      [&](int64_t it) {
        pack_fragments<T, 4>(pa, st);
        pack_fragments<T, 4>(dsa, dpt);
        if constexpr (kFusedDq) {
          // (kDqLagsTile: the buffer's last tile's dQ products are done)
          if constexpr (kDqLags) mbar_wait(&sm.ds_empty[ds_buffer], ((it >> 1) & 1) ^ 1);
          store_fragment(sm.ds + ds_buffer * C::kDsBytes, consumer * 64, 0, dsa);
          fence_proxy_async();
          if constexpr (kDqLags) warp_arrive(&sm.ds_full[ds_buffer]);
        }
      },
      [&](int64_t it) {  // dV += P^T dO_j, (dQ_j = dS_j K,) dK += dS^T Q_j
        if constexpr (kDqLags) {
          // dQ_{j-1} (both halves of its dS^T stored a tile ago), then dV_j and
          // dK_j; dQ_{j-1} is staged while those run.
          issue_lagging_dq(it - 1, ds_buffer ^ 1);
          wgmma_fence();
          issue_ab<T, kHeadDim>(dv, pa, desc_advance(do_n_major, stream_offset()));
          issue_ab<T, kHeadDim>(dk, dsa, desc_advance(q_n_major, stream_offset()));
          wgmma_commit();
          wgmma_wait<1>();
          fence_operands(dq);
          if (it > 0) warp_arrive(&sm.ds_empty[ds_buffer ^ 1]);
          send_dq(it > 0);
          return;
        }
        wgmma_fence();
        issue_ab<T, kHeadDim>(dv, pa, desc_advance(do_n_major, stream_offset()));
        if constexpr (kFusedDq) {
          // This consumer's dS^T is stored (kDqOfOwnKeys: the others lag).
          named_sync(barrier_id(NamedBarrier::kDsStored, consumer), 128);
          issue_dq<T, kHeadDim>(dq, desc_advance(ds_mn_major, ds_buffer * C::kDsBytes),
                                k_mn_major, consumer);
          wgmma_commit();
          issue_ab<T, kHeadDim>(dk, dsa, desc_advance(q_n_major, stream_offset()));
          wgmma_commit();
          // dQ is staged for the writer while dK's product runs.
          wgmma_wait<1>();
          fence_operands(dq);
          send_dq();
        } else {
          issue_ab<T, kHeadDim>(dk, dsa, desc_advance(q_n_major, stream_offset()));
          wgmma_commit();
        }
      },
      [&](int64_t) {
        fence_operands(dv);
        fence_operands(dk);
        if (lane == 0) mbar_arrive(&sm.empty[tile.stage]);
        tile.next();
        ds_buffer ^= 1;
        if constexpr (!has_mask(kTerms)) {  // (else published with the next tile)
          q0 = kb.next_row(q0);
          if (has_terms(kTerms) && q0 == kb.row_begin) ++tile_head;  // (the next head's tiles)
        }
      });
  if constexpr (kDqLags) {  // the last tile's dQ
    if (tiles_done > 0) {
      issue_lagging_dq(tiles_done - 1, ds_buffer ^ 1);
      wgmma_wait<0>();
      fence_operands(dq);
      send_dq();
    }
  }
  store_key_gradients<T, kHeadDim, kLayouts>(sm, maps, kb, p, dk, dv, consumer);
  flag_nonfinite(nonfinite, dk, dv);  // rows a tile product may have got wrong (exact_rows.cuh)
}

// A query-kernel consumer: dQ of its 64 rows over the block's key tiles, then
// its rows of dq and their shares of dsinks. kTerms: as the key consumer's
// (dbias is the key kernel's).
template <class T, int kHeadDim, Layouts kLayouts, TermSet kTerms>
__device__ __forceinline__ void query_consumer(Smem<kHeadDim>& sm,
                                               const QueryBlock<TileConfig<kHeadDim>, kLayouts>& qb,
                                               const AttentionParams& p,
                                               const SegmentTiles& segment_tiles,
                                               const MaskTiles& mask_tiles, int consumer,
                                               const TensorRef& D_all,
                                               const TensorRef& dsink_rows, int* nonfinite) {
  using C = TileConfig<kHeadDim>;
  constexpr int kOwnRows = C::kOwnRows, kStreamRows = C::kStreamRows;
  const int lane = threadIdx.x % 32;
  RowSoftmax rows{qb.q0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16 + lane / 4};
  const FragmentSegments<kLayouts> segments(p, segment_tiles, qb.seq, qb.b,
                                            FragmentRows::kQueries, qb.q0 + consumer * 64, rows.row);
  FragmentTerms<kTerms, FragmentRows::kQueries> terms(p, qb.seq, rows.row);
  terms.head(p, qb.seq, qb.b, qb.h);
  const unsigned char* q_rows = sm.own_a + consumer * 64 * 128;
  const unsigned char* do_rows = sm.own_b + consumer * 64 * 128;
  float lse2[2], D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = rows.row + 8 * r;
    const bool used = i < qb.seq.seqlen_q;
    lse2[r] = used ? lse_to_log2(*qb.seq.template q_at<const float>(p.lse, i, qb.h)) : -kNegInf;
    D[r] = used ? *qb.seq.template q_at<const float>(D_all, i, qb.h) : 0.0f;
  }
  float dq[kHeadDim / 2] = {};

  const auto k_tile = [&](int64_t it) { return sm.stream_a + (it % C::kStages) * C::kStreamBytes; };
  const auto v_tile = [&](int64_t it) { return sm.stream_b + (it % C::kStages) * C::kStreamBytes; };
  float s[32], dp[32];
  uint32_t dsa[4][4];
  const int zeroed = barrier_id(NamedBarrier::kTileZeroed, consumer);
  mbar_wait(sm.owned, 0);
  if (qb.owned_crosses_end())
    zero_rows_of_pair<kOwnRows, kHeadDim>(sm.own_a, sm.own_b, qb.first_unused_owned_row(), zeroed);
  pipeline<true>(
      qb.tiles,
      [&](int64_t it) {  // S = Q K_j^T, dP = dO V_j^T
        mbar_wait(&sm.full[it % C::kStages], (it / C::kStages) & 1);
        if (qb.tile_crosses_end(it))
          zero_rows_of_pair<kStreamRows, kHeadDim>(k_tile(it), v_tile(it),
                                                   qb.first_unused_row(it), zeroed);
        wgmma_fence();
        issue_abt<T, kHeadDim>(s, k_major_desc<kOwnRows>(q_rows, 0),
                               k_major_desc<kStreamRows>(k_tile(it), 0));
        issue_abt<T, kHeadDim>(dp, k_major_desc<kOwnRows>(do_rows, 0),
                               k_major_desc<kStreamRows>(v_tile(it), 0));
        wgmma_commit();
      },
      [&](int64_t it) {  // dS
        fence_operands(s);
        fence_operands(dp);
        const int64_t k0 = qb.key_tile(it);
        rows.scores<8>(s, p, qb.seq, k0,
                       RowSoftmax::tile_needs_mask(qb.seq, qb.q0, qb.last_row, k0, kStreamRows,
                                                   qb.keys.key_begin, qb.keys.key_end));
        segments.template mask<8>(s, k0);
        const auto lse2_of = [&](int i) { return lse2[(i % 4) / 2]; };
        const auto d_of = [&](int i) { return D[(i % 4) / 2]; };
        if constexpr (has_terms(kTerms)) {
          bool mask_mixed = false;  // (the mask per element only where it hides some pairs)
          if constexpr (has_mask(kTerms))
            mask_mixed = !mask_tiles || (mask_tiles.of(qb.b, qb.h, qb.q0 + consumer * 64, 64, k0,
                                                       kStreamRows) &
                                         MaskTiles::kAnyHidden);
          terms.template add<8>(s, k0, mask_mixed);
          terms_probabilities_and_grad<false, 8>(s, dp, p, terms, k0, lse2_of, d_of);
        } else {
          probabilities_and_grad(s, dp, p, 1.0f, lse2_of, d_of);
        }
      },
      [&](int64_t) { pack_fragments<T, 4>(dsa, dp); },
      [&](int64_t it) {  // dQ += dS K_j
        wgmma_fence();
        issue_ab<T, kHeadDim>(dq, dsa, stream_n_major_desc<kStreamRows>(k_tile(it)));
        wgmma_commit();
      },
      [&](int64_t it) {
        fence_operands(dq);
        if (lane == 0) mbar_arrive(&sm.empty[it % C::kStages]);
      });
  store_block<T, kHeadDim>(qb.seq.template q_at<T>(p.dq, 0, qb.h), p.dq.row_stride,
                           qb.seq.q_slot, p.head_dim, qb.q0 + consumer * 64, dq, p.softmax_scale);
  write_dsink_rows(p, qb.seq, qb.b, qb.h, rows.row, lse2, D, dsink_rows);
  flag_nonfinite(nonfinite, dq);  // rows a tile product may have got wrong (exact_rows.cuh)
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_bwd
