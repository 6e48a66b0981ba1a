// The Hopper forward's consumers: each warpgroup owns 64 query rows of a work
// item. Per key tile it issues S_j = Q K_j^T (both operands in shared memory)
// and O += P_{j-1} V_{j-1} (P straight from registers) back to back, waits for
// S_j only, runs the online softmax while the second product runs, then
// rescales O. The consumers take turns issuing (ping-pong), so that one
// warpgroup's softmax runs while another's products occupy the tensor cores.
// (The tile loop in a function of its own, here or as a lambda in the kernel,
// compiles a little differently from the loop written in the kernel body, as
// hopper_forward.cu had it: tools/compare_sass.py, 2026-11-25, d128: -8 / -72
// / -56 instructions uniform / varlen / segments, same registers and spills;
// d64 varlen: ptxas +16 B spill stores, +24 B loads.)
#pragma once

#include <cstdint>

#include "../common/fragment.cuh"
#include "../common/mask_tiles.h"
#include "../common/segments.cuh"
#include "../common/sequence_layout.h"
#include "../common/softmax.cuh"
#include "flashjax/params.h"
#include "fwd_smem.cuh"
#include "fwd_tile_config.h"
#include "hopper_common.cuh"

namespace flashjax::cuda::hopper_fwd {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Consumer warpgroup `consumer`'s main loop; kv (the K/V ring position) and
// q_loads (Q tiles taken) run on across its work items, as the producer's do.
template <class Cfg, Layouts kLayouts>
struct ForwardMainloop {
  using T = typename Cfg::Element;
  static constexpr int kHeadDim = Cfg::kHeadDim, kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  static constexpr int kConsumers = Cfg::kConsumers, kMmaK = Cfg::kMmaK;
  static constexpr int kKeyTiles = kBlockN / 8, kDimTiles = kHeadDim / 8;  // 8-column tiles
  static constexpr int kKeySteps = kBlockN / kMmaK;  // k-steps of P V

  const ForwardSmem<Cfg>& sm;
  const int consumer, lane;
  const unsigned char* q_rows;  // this warpgroup's rows of the Q tile
  int64_t kv = 0, q_loads = 0;

  __device__ ForwardMainloop(const ForwardSmem<Cfg>& smem, int consumer_index)
      : sm(smem),
        consumer(consumer_index),
        lane(threadIdx.x % 32),
        q_rows(smem.q + consumer_index * kConsumerRows * kSwizzleBytes) {}

  // Opens consumer 0's first turn, once per kernel: the turns then rotate across
  // work items (every consumer takes n_tiles turns an item), so that one
  // consumer starts its next item while the others finish theirs. (Restarting
  // the rotation at every item made consumer 0 wait for the last consumer's
  // epilogue before its next item's first product.)
  __device__ __forceinline__ void open_turns() const {
    if (consumer == kConsumers - 1) named_arrive(kTurnBarrier);
  }

  // P's A operand of key step kk (16-bit: 16 keys; float8: 32, p_fragment_f8's order).
  __device__ __forceinline__ static void pack_probabilities(uint32_t (&a)[4],
                                                            const float (&s)[kKeyTiles * 4],
                                                            int kk) {
    if constexpr (Cfg::kFloat8)
      p_fragment_f8<kKeyTiles>(a, s, kk);
    else
      p_fragment<T, kKeyTiles>(a, s, kk);
  }

  // O (unnormalised, in o: zeros on entry) and the softmax statistics of the
  // consumer's rows of work item w.
  // keys: the item's ItemKeys; terms: a FragmentTerms (score_terms.cuh) of the
  // item's rows (kernels with a mask: keys is PublishedKeys, the tiles as the
  // producer publishes them).
  template <class Item, class Keys, class Terms>
  __device__ __forceinline__ void compute(const AttentionParams& p, const Item& w,
                                          const Keys& keys,
                                          const FragmentSegments<kLayouts>& segments,
                                          const Terms& terms,
                                          RowSoftmax& softmax, float (&o)[kDimTiles * 4]) {
    int64_t n_tiles = keys.count;  // (Keys::kMasked: published with Q, read after its wait)
    // S_j = Q K_j^T for ring slot kv + j; the caller waits for it.
    auto issue_scores = [&](float (&s)[kKeyTiles * 4], int64_t it) {
      const int64_t g = kv + it;
      const unsigned char* k_tile = sm.k + (g % kStages) * Cfg::kKBytes;
      mbar_wait(&sm.k_full[g % kStages], (g / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / kMmaK; ++kk)
        wgmma_ss<T, kBlockN>(s, k_major_desc<kBlockM>(q_rows, kk),
                             k_major_desc<kBlockN>(k_tile, kk), kk > 0);
      wgmma_commit();
    };
    // O += P_j V_j; the caller waits for it.
    auto issue_values = [&](const uint32_t (&pa)[kKeySteps][4], int64_t it) {
      const int64_t g = kv + it;
      const unsigned char* v_tile = sm.v + (g % kStages) * Cfg::kVBytes;
      mbar_wait(&sm.v_full[g % kStages], (g / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) {
        if constexpr (Cfg::kFloat8) {  // V^T: K-major, column blocks [head dims][128 keys]
          wgmma_rs<T, kHeadDim>(o, pa[kk], k_major_desc<kHeadDim>(v_tile, kk));
        } else {
          // V is N-major: a k-step's keys are groups of 8 rows (1024 B apart);
          // column blocks of head dims are kBlockN swizzle rows apart.
          wgmma_rs<T, kHeadDim>(o, pa[kk],
                                smem_desc(v_tile + kk * kMmaK * kSwizzleBytes,
                                          kBlockN * kSwizzleBytes, 8 * kSwizzleBytes));
        }
      }
      wgmma_commit();
    };
    // S_j has been read: free K_j, and Q after the item's last S.
    auto scores_done = [&](int64_t it) {
      if (lane != 0) return;
      mbar_arrive(&sm.k_empty[(kv + it) % kStages]);
      if (it == n_tiles - 1) mbar_arrive(sm.q_empty);
    };
    // Key tile it's first key, whether the mask hides some of its pairs from this
    // consumer's rows (then it is read per element) and whether positions, windows or
    // the sequence's end hide some (`ranged`): kernels with a mask (Keys::kMasked)
    // take them as the producer published them with the K tile (read once it is in,
    // before the wait for S_it); the others compute them in softmax_step.
    struct TileKeys {
      int64_t k0;
      bool mask_mixed, ranged;
    };
    TileKeys prefetched{0, false, false};
    auto prefetch_keys = [&](int64_t it) {
      if constexpr (Keys::kMasked) {
        const PublishedTile tile = PublishedTile::read(&sm.tiles[(kv + it) % kStages]);
        prefetched = {tile.k0, ((tile.mixed >> consumer) & 1u) != 0, tile.ranged};
      }
    };
    // (the others: tile_needs_mask as the range of its false answers, found once an
    // item: two 32-bit compares a tile instead of ~30 instructions of 64-bit ones)
    int32_t unranged_lo = 0, unranged_hi = -1;
    if constexpr (!Keys::kMasked)
      RowSoftmax::unmasked_tiles(w.seq, w.q0, w.last_row, kBlockN, w.keys.key_begin,
                                 w.keys.key_end, unranged_lo, unranged_hi);
    auto tile_keys = [&](int64_t it) {
      if constexpr (Keys::kMasked) {
        return prefetched;
      } else {
        const int64_t k0 = keys.k0(it);
        const int32_t k0_32 = static_cast<int32_t>(k0);  // (keys are < 2^31)
        return TileKeys{k0, false, k0_32 < unranged_lo || k0_32 > unranged_hi};
      }
    };
    // kVarlen: V rows of key tile it past the sequence's used keys are zeroed
    // before the P V that sums over them (zero_tile_rows says why); only an
    // item's last tile can cross the end.
    auto clear_values_past_end = [&](int64_t it) {
      const int64_t k0 = tile_keys(it).k0;  // (kMasked: the last tile's, prefetched)
      if (k0 + kBlockN <= w.seq.seqlen_k) return;
      const int64_t g = kv + it;
      mbar_wait(&sm.v_full[g % kStages], (g / kStages) & 1);
      zero_tile_rows<kBlockN, Cfg::kPaddedDim, Cfg::kElementBytes>(
          sm.v + (g % kStages) * Cfg::kVBytes,
          static_cast<int>(w.seq.seqlen_k > k0 ? w.seq.seqlen_k - k0 : 0),
          kClearBarrier + consumer);
    };
    auto values_done = [&](int64_t it) {
      if (lane == 0) mbar_arrive(&sm.v_empty[(kv + it) % kStages]);
    };
    // A bias's rows of the tile `ahead` tiles after tile it into L2 (kBiasAheadTiles):
    // the walk's next tiles, but where a mask skips some (lines then unused).
    auto prefetch_bias = [&](int64_t it, int ahead) {
      terms.template prefetch_bias<kBlockN>(tile_keys(it).k0 + ahead * kBlockN);
    };
    // Without score terms (which add in log2 units) the scale rides in the exponent's
    // FFMA (FA3's order: one instruction a score instead of a multiply and a subtraction).
    // float8: the item's descale of q.k too (>= 0: Float8Inputs); P carries
    // 2^kFloat8ExponentOffset.
    constexpr bool kFoldScale = !Terms::kActive;
    static_assert(!Cfg::kFloat8 || (kFoldScale && kLayouts == Layouts::kUniform),
                  "float8: uniform layouts without score terms");
    constexpr int kOffset = Cfg::kFloat8 ? kFloat8ExponentOffset : 0;
    float scale = kFoldScale ? exponent_scale(p) : 1.0f;
    if constexpr (Cfg::kFloat8) scale *= p.float8.score_factor(w.b, w.hk, p.heads_kv);
    // float8 with softcap (or a scale <= 0): the raw products become scores before the
    // exponent (scale is then the descale alone), so the descale goes on them there,
    // before the cap's tanh, which is not linear.
    const bool descale_first = Cfg::kFloat8 && scores_prescaled(p);
    auto softmax_step = [&](float (&s)[kKeyTiles * 4], int64_t it, float (&alpha)[2]) {
      const TileKeys tile = tile_keys(it);
      const int64_t k0 = tile.k0;
      softmax.scores<kKeyTiles, kFoldScale>(s, p, w.seq, k0, tile.ranged,
                                            descale_first ? scale : 1.0f);
      segments.template mask<kKeyTiles>(s, k0);
      if constexpr (Terms::kActive) terms.template add<kKeyTiles>(s, k0, tile.mask_mixed);
      softmax.exponentiate<kKeyTiles, kOffset>(s, alpha, descale_first ? 1.0f : scale);
      terms.template drop<kKeyTiles>(s, k0);  // (after the row sums: lse is undropped)
    };

    // Ping-pong: named barrier kTurnBarrier + c is consumer c's turn (open_turns
    // starts the rotation); each turn ends by passing it on.
    const auto wait_turn = [&] { named_sync(kTurnBarrier + consumer); };
    const auto pass_turn = [&] { named_arrive(kTurnBarrier + (consumer + 1) % kConsumers); };

    mbar_wait(sm.q_full, q_loads++ & 1);
    if constexpr (Keys::kMasked)
      n_tiles = static_cast<int64_t>(ld_shared_u64(smem_u32(sm.item_tiles)));
    if (n_tiles > 0) {
      // Software pipeline across tiles: while the softmax of S_j runs on the
      // CUDA cores, the tensor cores compute O += P_{j-1} V_{j-1}.
      float s[kKeyTiles * 4];
      uint32_t pa[kKeySteps][4];
      float alpha[2];
      wait_turn();
      issue_scores(s, 0);
      pass_turn();
      prefetch_keys(0);
#pragma unroll
      for (int ahead = 1; ahead <= kBiasAheadTiles; ++ahead) prefetch_bias(0, ahead);
      wgmma_wait<0>();
      fence_operands(s);
      scores_done(0);
      softmax_step(s, 0, alpha);
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) pack_probabilities(pa[kk], s, kk);
      for (int64_t it = 1; it < n_tiles; ++it) {
        wait_turn();
        issue_scores(s, it);
        issue_values(pa, it - 1);
        pass_turn();
        prefetch_keys(it);
        prefetch_bias(it, kBiasAheadTiles);
        wgmma_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
        fence_operands(s);
        scores_done(it);
        softmax_step(s, it, alpha);
        wgmma_wait<0>();
        fence_operands(o);
        values_done(it - 1);
        RowSoftmax::rescale<kDimTiles>(o, alpha);
#pragma unroll
        for (int kk = 0; kk < kKeySteps; ++kk) pack_probabilities(pa[kk], s, kk);
      }
      if constexpr (kLayouts != Layouts::kUniform) clear_values_past_end(n_tiles - 1);
      // (without a turn, as FlashAttention 3 does: the item's last product goes in
      // right after its softmax, so that this consumer reaches its epilogue and next
      // item sooner)
      issue_values(pa, n_tiles - 1);
      wgmma_wait<0>();
      fence_operands(o);
      values_done(n_tiles - 1);
    } else if (lane == 0) {
      mbar_arrive(sm.q_empty);
    }
    if constexpr (kFoldScale) softmax.log2_units<kOffset>(descale_first ? 1.0f : scale);
    if constexpr (Cfg::kFloat8) {  // (O = P V^T of the raw float8 values)
      const float v_descale = p.float8.value_factor(w.b, w.hk, p.heads_kv);
#pragma unroll
      for (int i = 0; i < kDimTiles * 4; ++i) o[i] *= v_descale;
    }
    kv += n_tiles;
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace flashjax::cuda::hopper_fwd
