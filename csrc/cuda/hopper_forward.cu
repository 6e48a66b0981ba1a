// Hopper (sm_90a) forward: warp-specialised, TMA-fed, wgmma-based.
//
// Persistent: one CTA per SM walks a static schedule of query tiles
// (TileSchedule). Warpgroup 0 is the producer: one thread issues TMA loads of
// each tile's Q and of K and V tiles into a kStages-deep ring of shared-memory
// buffers, each guarded by a "full" and an "empty" mbarrier; the next tile's Q
// and first K/V tiles load while the consumers finish the current one. The
// other warpgroups (two, or three at head dim 64) are consumers, each owning
// 64 query rows of the tile: S = Q K^T with both operands in shared memory,
// the online softmax in registers, then O += P V with P taken straight from
// registers. TMA writes the 128-byte swizzled layout that wgmma reads, so no
// thread touches the tiles.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <mutex>

#include "common.cuh"
#include "dispatch.h"
#include "fragment_softmax.cuh"
#include "hopper_common.cuh"
#include "hopper_forward.h"

namespace flashjax::cuda {
namespace {

constexpr int kStages = 2;
// GQA packing is compiled for head dims up to 128 (at 256 its row arithmetic
// makes the kernel spill).
template <int kHeadDim>
constexpr bool kPacksGroups = kHeadDim <= 128;

template <int kHeadDim>
struct Tiles {
  // Consumer warpgroups, 64 query rows each: three at head dim 64, where the
  // products are short and the softmax needs more warps to hide behind them.
  static constexpr int kConsumers = kHeadDim == 64 ? 3 : 2;
  static constexpr int kBlockM = 64 * kConsumers;  // query rows per tile
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Registers per thread: the producer gives its share to the consumers.
  static constexpr int kProducerRegs = kConsumers == 3 ? 24 : 40;
  static constexpr int kConsumerRegs = kConsumers == 3 ? 160 : 232;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;  // keys per tile
  // Tiles are whole 64-column swizzle blocks (96 -> 128 columns, zero-filled).
  static constexpr int kPaddedDim = (kHeadDim + kSwizzleCols - 1) / kSwizzleCols * kSwizzleCols;
  static constexpr int kQBytes = kBlockM * kPaddedDim * 2;
  static constexpr int kKVBytes = kBlockN * kPaddedDim * 2;
  static constexpr int kBarrierOffset = kQBytes + 2 * kStages * kKVBytes;
  // Q, K ring, V ring, then barriers; +1024 to align the base for the swizzle.
  static constexpr int kSmemBytes = kBarrierOffset + 8 * (2 + 4 * kStages) + 1024;
};

struct TensorMaps {
  CUtensorMap q, k, v;
};

// Persistent static schedule. A work item is a pair of query tiles of one
// head, tile j and tile q_tiles - 1 - j, done one after the other: under a
// causal mask their costs add up to the same total for every j, so items cost
// alike under any mask. gridDim.x CTAs (one per SM) take the items in rounds
// of gridDim.x, one head's items consecutive so that the CTAs running together
// read the same K and V from L2; odd rounds go in mirrored order (zig-zag) to
// even out what remains.
//
// GQA packing: when a group's heads times seqlen_q fit in one tile
// (packed_rows = seqlen_q, e.g. decoding), a tile holds every query of a kv
// head's group of query heads, so K and V are read once for the group; the
// "heads" of the schedule are then the kv heads.
struct TileSchedule {
  int64_t q_tiles, pairs_per_head, total_pairs;
  int64_t packed_rows;  // 0: one query head per tile
  enum Step { kTile, kSkip, kEnd };
  // The k-th tile of this CTA (kSkip: the missing half of a middle pair).
  __device__ Step tile(int64_t k, QueryTile& out) const {
    const int64_t g = gridDim.x, round = k / 2;
    const int64_t item = round * g + ((round & 1) ? g - 1 - blockIdx.x : blockIdx.x);
    if (item >= total_pairs) return kEnd;
    const int64_t j = item % pairs_per_head, heavy = q_tiles - 1 - j;
    if (k % 2 == 1 && j == heavy) return kSkip;
    out = {k % 2 == 0 ? heavy : j, item / pairs_per_head};
    return kTile;
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// One work item of a CTA: a tile of kBlockM query rows of one head.
// (Packed: bh indexes batch * heads_kv, h is the group's first query head.)
template <int kBlockM, int kBlockN>
struct WorkItem {
  int64_t b, h, hk, q0, last_row;
  SeqlenInfo seq;  // (uniform calls only)
  KeyRange keys;
  int64_t n_tiles;
  __device__ WorkItem(const AttentionParams& p, QueryTile t, bool packed)
      : b(t.bh / (packed ? p.heads_kv : p.heads_q)),
        h(packed ? t.bh % p.heads_kv * p.group_size() : t.bh % p.heads_q),
        hk(h / p.group_size()),
        q0(t.tile * kBlockM),
        last_row(min(q0 + kBlockM, p.seqlen_q) - 1),
        seq(SeqlenInfo::uniform(p, b)),
        keys(seq, q0, last_row, kBlockN),
        n_tiles(keys.tiles(kBlockN)) {}
};

template <class T, int kHeadDim>
__global__ void __launch_bounds__(Tiles<kHeadDim>::kThreads, 1)
    hopper_forward_kernel(const AttentionParams p, const __grid_constant__ TensorMaps maps,
                          const TileSchedule schedule) {
  using Cfg = Tiles<kHeadDim>;
  constexpr int kBlockN = Cfg::kBlockN, kBlockM = Cfg::kBlockM, kConsumers = Cfg::kConsumers;
  constexpr bool kPacks = kPacksGroups<kHeadDim>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = align_smem(smem_raw);
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + Cfg::kQBytes;              // kStages tiles
  unsigned char* sV = sK + kStages * Cfg::kKVBytes;   // kStages tiles
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarrierOffset);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* k_empty = k_full + kStages;
  uint64_t* v_full = k_empty + kStages;
  uint64_t* v_empty = v_full + kStages;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    mbar_init(q_empty, 4 * kConsumers);  // one arrival per consumer warp
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&k_empty[s], 4 * kConsumers);
      mbar_init(&v_empty[s], 4 * kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const bool packed = kPacks && schedule.packed_rows > 0;
  const int q_bytes = packed ? static_cast<int>(schedule.packed_rows * p.group_size()) *
                                   Cfg::kPaddedDim * 2
                             : Cfg::kQBytes;
  // Both roles walk the same items; the K/V ring position (kv) and the
  // count of Q loads (local) run on across items.
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Cfg::kProducerRegs));
    if (threadIdx.x != 0) return;
    int64_t kv = 0, local = 0;
    QueryTile tile;
    for (int64_t k = 0;; ++k) {
      const auto step = schedule.tile(k, tile);
      if (step == TileSchedule::kEnd) break;
      if (step == TileSchedule::kSkip) continue;
      const WorkItem<kBlockM, kBlockN> w(p, tile, packed);
      mbar_wait(q_empty, (local++ & 1) ^ 1);
      mbar_expect_tx(q_full, q_bytes);
      tma_tile<kHeadDim, kBlockM>(sQ, &maps.q, q_full, w.q0, w.h, w.b);
      for (int64_t it = 0; it < w.n_tiles; ++it, ++kv) {
        const int stage = kv % kStages, phase = (kv / kStages) & 1;
        const int k0 = static_cast<int>(w.keys.tile_begin + it * kBlockN);
        mbar_wait(&k_empty[stage], phase ^ 1);
        mbar_expect_tx(&k_full[stage], Cfg::kKVBytes);
        tma_tile<kHeadDim, kBlockN>(sK + stage * Cfg::kKVBytes, &maps.k, &k_full[stage], k0,
                                    w.hk, w.b);
        mbar_wait(&v_empty[stage], phase ^ 1);
        mbar_expect_tx(&v_full[stage], Cfg::kKVBytes);
        tma_tile<kHeadDim, kBlockN>(sV + stage * Cfg::kKVBytes, &maps.v, &v_full[stage], k0,
                                    w.hk, w.b);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Cfg::kConsumerRegs));
  const int consumer = warpgroup - 1;
  const int warp_in_group = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  constexpr int kKeyTiles = kBlockN / 8, kDimTiles = kHeadDim / 8;
  const unsigned char* q_rows = sQ + consumer * 64 * 128;  // this warpgroup's 64 rows
  int64_t kv = 0, local = 0;
  QueryTile tile;
  for (int64_t k = 0;; ++k) {
    const auto step = schedule.tile(k, tile);
    if (step == TileSchedule::kEnd) break;
    if (step == TileSchedule::kSkip) continue;
    const WorkItem<kBlockM, kBlockN> w(p, tile, packed);
    const int64_t n_tiles = w.n_tiles;
    float o[kDimTiles * 4] = {};
    RowSoftmax softmax{w.q0 + consumer * 64 + warp_in_group * 16 + lane / 4,
                       kPacks ? static_cast<int>(schedule.packed_rows) : 0};

    // S_j = Q K_j^T for ring slot kv + j; the caller waits for it.
    auto issue_scores = [&](float (&s)[kKeyTiles * 4], int64_t it) {
      const int64_t g = kv + it;
      const unsigned char* k_tile = sK + (g % kStages) * Cfg::kKVBytes;
      mbar_wait(&k_full[g % kStages], (g / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk)
        wgmma_ss<T, kBlockN>(s, k_major_desc<kBlockM>(q_rows, kk),
                             k_major_desc<kBlockN>(k_tile, kk), kk > 0);
      wgmma_commit();
    };
    // O += P_j V_j; the caller waits for it.
    auto issue_values = [&](const uint32_t (&pa)[kBlockN / 16][4], int64_t it) {
      const int64_t g = kv + it;
      const unsigned char* v_tile = sV + (g % kStages) * Cfg::kKVBytes;
      mbar_wait(&v_full[g % kStages], (g / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        // V is N-major: 16 keys = 2 groups of 8 rows (1024 B apart); column
        // blocks of 64 head dims are kBlockN * 128 B apart.
        wgmma_rs<T, kHeadDim>(o, pa[kk], smem_desc(v_tile + kk * 16 * 128, kBlockN * 128, 1024));
      }
      wgmma_commit();
    };
    // S_j has been read: free K_j, and Q after the item's last S.
    auto scores_done = [&](int64_t it) {
      if (lane != 0) return;
      mbar_arrive(&k_empty[(kv + it) % kStages]);
      if (it == n_tiles - 1) mbar_arrive(q_empty);
    };
    auto values_done = [&](int64_t it) {
      if (lane == 0) mbar_arrive(&v_empty[(kv + it) % kStages]);
    };
    auto softmax_step = [&](float (&s)[kKeyTiles * 4], int64_t it, float (&alpha)[2]) {
      const int64_t k0 = w.keys.tile_begin + it * kBlockN;
      softmax.scores<kKeyTiles>(s, p, w.seq, k0,
                                RowSoftmax::tile_needs_mask(w.seq, w.q0, w.last_row, k0, kBlockN,
                                                            w.keys.key_begin, w.keys.key_end));
      softmax.exponentiate<kKeyTiles>(s, alpha);
    };

    // Ping-pong: the consumers take turns (round robin) to issue their matrix
    // products, so that one warpgroup's softmax runs while another's products
    // occupy the tensor cores. Named barrier 1 + c is consumer c's turn; the
    // last consumer opens the first turn, and each turn ends by passing it on.
    const auto wait_turn = [&] { named_sync(1 + consumer); };
    const auto pass_turn = [&] { named_arrive(1 + (consumer + 1) % kConsumers); };

    mbar_wait(q_full, local++ & 1);
    if (n_tiles > 0) {
      // Software pipeline across tiles: while the softmax of S_j runs on the
      // CUDA cores, the tensor cores compute O += P_{j-1} V_{j-1}.
      float s[kKeyTiles * 4];
      uint32_t pa[kBlockN / 16][4];
      float alpha[2];
      if (consumer == kConsumers - 1) named_arrive(1);
      wait_turn();
      issue_scores(s, 0);
      pass_turn();
      wgmma_wait<0>();
      fence_operands(s);
      scores_done(0);
      softmax_step(s, 0, alpha);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) p_fragment<T, kKeyTiles>(pa[kk], s, kk);
      for (int64_t it = 1; it < n_tiles; ++it) {
        wait_turn();
        issue_scores(s, it);
        issue_values(pa, it - 1);
        pass_turn();
        wgmma_wait<1>();  // S_j is ready; P_{j-1} V_{j-1} may still run
        fence_operands(s);
        scores_done(it);
        softmax_step(s, it, alpha);
        wgmma_wait<0>();
        fence_operands(o);
        values_done(it - 1);
        RowSoftmax::rescale<kDimTiles>(o, alpha);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) p_fragment<T, kKeyTiles>(pa[kk], s, kk);
      }
      wait_turn();
      issue_values(pa, n_tiles - 1);
      if (consumer != kConsumers - 1) pass_turn();  // balanced arrivals at the item's end
      wgmma_wait<0>();
      fence_operands(o);
      values_done(n_tiles - 1);
    } else if (lane == 0) {
      mbar_arrive(q_empty);
    }
    kv += n_tiles;
    softmax.write<T, kDimTiles>(p, w.seq, o, w.b, w.h);
  }
}

#else  // not compiled for sm_90a: never launched (hopper_forward_supports says no)

template <class T, int kHeadDim>
__global__ void hopper_forward_kernel(const AttentionParams, const __grid_constant__ TensorMaps,
                                      const TileSchedule) {}

#endif

template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, cudaStream_t stream) {
  using Cfg = Tiles<kHeadDim>;
  static std::once_flag configured;
  static cudaError_t config_status = cudaSuccess;
  std::call_once(configured, [] {
    config_status = cudaFuncSetAttribute(hopper_forward_kernel<T, kHeadDim>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Cfg::kSmemBytes);
  });
  if (config_status != cudaSuccess) return config_status;
  TensorMaps maps;
  constexpr int kBlockM = Cfg::kBlockM;
  const bool packed =
      kPacksGroups<kHeadDim> && p.group_size() > 1 && p.seqlen_q * p.group_size() <= kBlockM;
  if (!make_map(&maps.q, p.q, p.dtype, p.batch, p.seqlen_q, p.heads_q, p.head_dim,
                packed ? static_cast<int>(p.seqlen_q) : kBlockM,
                packed ? static_cast<int>(p.group_size()) : 1) ||
      !make_map(&maps.k, p.k, p.dtype, p.batch, p.seqlen_k, p.heads_kv, p.head_dim,
                Cfg::kBlockN) ||
      !make_map(&maps.v, p.v, p.dtype, p.batch, p.seqlen_k, p.heads_kv, p.head_dim_v,
                Cfg::kBlockN))
    return cudaErrorInvalidValue;
  TileSchedule schedule;
  schedule.packed_rows = packed ? p.seqlen_q : 0;
  schedule.q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
  schedule.pairs_per_head = (schedule.q_tiles + 1) / 2;
  schedule.total_pairs = schedule.pairs_per_head * p.batch * (packed ? p.heads_kv : p.heads_q);
  const int64_t blocks = std::min<int64_t>(schedule.total_pairs, multiprocessor_count());
  hopper_forward_kernel<T, kHeadDim>
      <<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps,
                                                                                 schedule);
  return cudaGetLastError();
}

// Head-dim buckets of this kernel: those of FLASHJAX_HEAD_DIMS, which for this
// kernel may also list 96 and 192 (the other kernels pad those to 128 / 256).
int hopper_forward_bucket(const AttentionParams& p) {
  const int64_t d = std::max(p.head_dim, p.head_dim_v);
  for (int bucket : {
#ifdef FLASHJAX_TC_HEAD_DIM_64
           64,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_96
           96,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
           128,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_192
           192,
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
           256,
#endif
           0})
    if (bucket == 0 || d <= bucket) return bucket;
  return 0;
}

template <class T>
cudaError_t launch_bucket(const AttentionParams& p, cudaStream_t stream) {
  switch (hopper_forward_bucket(p)) {
#ifdef FLASHJAX_TC_HEAD_DIM_64
    case 64: return launch<T, 64>(p, stream);
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_96
    case 96: return launch<T, 96>(p, stream);
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_128
    case 128: return launch<T, 128>(p, stream);
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_192
    case 192: return launch<T, 192>(p, stream);
#endif
#ifdef FLASHJAX_TC_HEAD_DIM_256
    case 256: return launch<T, 256>(p, stream);
#endif
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool hopper_forward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  // Uniform layouts only (for now). TMA needs 16-byte row strides (head dims
  // % 8) and a 64-column box inside the tensor (head dims >= 64); int32 TMA
  // coordinates bound the sizes.
  return p.uniform() && p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 &&
         p.head_dim_v % 8 == 0 && hopper_forward_bucket(p) != 0 && p.head_dim >= 64 &&
         p.head_dim_v >= 64 &&
         p.seqlen_q < (1 << 30) && p.seqlen_k < (1 << 30) && compute_capability() == 90 &&
         encode_fn() != nullptr;
#else
  (void)p;
  return false;
#endif
}

cudaError_t hopper_forward(const AttentionParams& p, cudaStream_t stream) {
  return with_half_type(p.dtype,
                        [&](auto tag) { return launch_bucket<decltype(tag)>(p, stream); });
}

}  // namespace flashjax::cuda
