// Hopper (sm_90a) forward: warp-specialised, TMA-fed, wgmma-based.
//
// Persistent: one CTA per SM walks a schedule of query tiles (TileSchedule;
// VarlenTileSchedule for packed / seqused layouts, sm90/fwd_scheduler.cuh).
// Warpgroup 0 is the producer: one thread issues TMA loads of
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
#include <type_traits>

#include "common.cuh"
#include "dispatch.h"
#include "fragment_softmax.cuh"
#include "hopper_common.cuh"
#include "hopper_forward.h"
#include "sequence_layout.h"
#include "sm90/fwd_scheduler.cuh"

namespace flashjax::cuda {
namespace {

constexpr int kStages = 2;
// Named barriers: 1 + c is consumer c's turn to issue; kClearBarrier + c
// orders consumer c's zeroing of a V tile before its product (kVarlen);
// kRowsDoneBarrier: every consumer has written its last rows.
constexpr int kMaxConsumers = 3;
constexpr int kClearBarrier = 1 + kMaxConsumers;
constexpr int kRowsDoneBarrier = kClearBarrier + kMaxConsumers;
// The producer warpgroup's warp that recomputes rows a tile product got wrong.
constexpr int kRecomputeWarp = 1;
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
  // Q, K ring, V ring, then barriers and a flag per consumer warp; +1024 to
  // align the base for the swizzle.
  static constexpr int kFlagOffset = kBarrierOffset + 8 * (2 + 4 * kStages);
  static constexpr int kSmemBytes = kFlagOffset + 4 * 4 * kConsumers + 1024;
};

struct TensorMaps {
  CUtensorMap q, k, v;
};

// The schedule type of a layout (TileSchedule's GQA packing: uniform only).
template <Layouts kLayouts>
using ScheduleOf =
    std::conditional_t<kLayouts == Layouts::kUniform, TileSchedule, VarlenTileSchedule>;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// One work item of a CTA: a tile of kBlockM query rows (slot rows from q0)
// of one head of sequence b, whose rows seq locates.
// (GQA packing: bh indexes batch * heads_kv, h is the group's first query head.)
template <Layouts kLayouts, int kBlockM, int kBlockN>
struct WorkItem {
  int64_t b, h, hk, q0;
  SeqlenInfo seq;
  int64_t last_row;  // the tile's last used row (< q0: none, the tile only writes zeros)
  KeyRange keys;
  int64_t n_tiles;
  __device__ WorkItem(const AttentionParams& p, QueryTile t, bool packed,
                      const SegmentTiles& segment_tiles)
      : b(t.bh / (packed ? p.heads_kv : p.heads_q)),
        h(packed ? t.bh % p.heads_kv * p.group_size() : t.bh % p.heads_q),
        hk(h / p.group_size()),
        q0(t.tile * kBlockM),
        seq(sequence_info<kLayouts>(p, b)),
        last_row(min(q0 + kBlockM, seq.seqlen_q) - 1),
        keys(seq, q0, last_row, kBlockN) {
    narrow_to_segments<kLayouts>(keys, segment_tiles, b, q0, kBlockM, kBlockN);
    n_tiles = keys.tiles(kBlockN);
  }

  // TMA coordinates (int32: the tensors' rows are < 2^30): the tensor rows of
  // the tile's first query and of slot key k0, and the batch entry. A tile
  // that crosses the end of its sequence's used rows loads the rows that
  // follow (padding, or the next sequence's: TMA only zero-fills past the
  // tensor). Such queries only reach their own rows, cleared before the write
  // (clear_unused_rows); such keys are masked to P = 0 and their V rows zeroed
  // (clear_values_past_end), so a non-finite value there (NaN, inf: e.g.
  // uninitialised padding of a seqused KV cache) does not reach this sequence.
  __device__ int q_row() const { return static_cast<int>(seq.q_row(q0)); }
  __device__ int k_row(int64_t k0) const { return static_cast<int>(seq.k_row(k0)); }
  __device__ int batch() const { return static_cast<int>(seq.batch); }
};

// The rows of work item w that warp `warp_in_group` of consumer warpgroup
// `consumer` holds (as lane threadIdx.x % 32); kPacks: GQA packing compiled in.
template <bool kPacks, int kBlockM, int kBlockN, Layouts kLayouts>
__device__ __forceinline__ RowSoftmax item_rows(const WorkItem<kLayouts, kBlockM, kBlockN>& w,
                                                const ScheduleOf<kLayouts>& schedule,
                                                int consumer, int warp_in_group) {
  return RowSoftmax{w.q0 + consumer * 64 + warp_in_group * 16 + (threadIdx.x % 32) / 4,
                    kPacks ? static_cast<int>(schedule.packed_rows) : 0};
}

// Rare: a row holding NaN or inf may be one a tile product got wrong
// (exact_rows.cuh). Once every consumer has written its rows, the producer's
// kRecomputeWarp walks the CTA's items again and recomputes, pair by pair,
// such rows of the consumer warps that flagged one (flags[4 * consumer +
// warp]). Done here, not in the consumers, whose main loop would otherwise
// keep registers for it (the kernel spills).
template <class T, bool kPacks, Layouts kLayouts, int kBlockM, int kBlockN, int kConsumers>
__device__ __forceinline__ void recompute_flagged_rows(const AttentionParams& p,
                                                       const ScheduleOf<kLayouts>& schedule,
                                                       const SegmentTiles& segment_tiles,
                                                       const int* flags) {
  named_sync(kRowsDoneBarrier, 32 + 128 * kConsumers);
  bool any = false;
  for (int f = 0; f < 4 * kConsumers; ++f) any |= flags[f] != 0;
  if (!any) return;
  const bool packed = kPacks && schedule.packed_rows > 0;
  QueryTile tile;
  for (int64_t k = 0;; ++k) {
    const auto step = schedule.tile(k, tile);
    if (step == ScheduleStep::kEnd) break;
    if (step == ScheduleStep::kSkip) continue;
    const WorkItem<kLayouts, kBlockM, kBlockN> w(p, tile, packed, segment_tiles);
    for (int f = 0; f < 4 * kConsumers; ++f)
      if (flags[f])
        item_rows<kPacks>(w, schedule, f / 4, f % 4)
            .template recompute_nonfinite_rows<T>(p, w.seq, w.b, w.h);
  }
}

// kLayouts: any (sequence_layout.h); kSegments narrows each tile's keys to
// its segment-id span and masks ids per element where a tile's are not all equal.
template <class T, int kHeadDim, Layouts kLayouts>
__global__ void __launch_bounds__(Tiles<kHeadDim>::kThreads, 1)
    hopper_forward_kernel(const __grid_constant__ AttentionParams p, const __grid_constant__ TensorMaps maps,
                          const __grid_constant__ ScheduleOf<kLayouts> schedule,
                          const __grid_constant__ SegmentTiles segment_tiles) {
  using Cfg = Tiles<kHeadDim>;
  constexpr int kBlockN = Cfg::kBlockN, kBlockM = Cfg::kBlockM, kConsumers = Cfg::kConsumers;
  constexpr bool kPacks = kPacksGroups<kHeadDim> && kLayouts == Layouts::kUniform;
  using Item = WorkItem<kLayouts, kBlockM, kBlockN>;
  static_assert(kConsumers <= kMaxConsumers, "named barrier ids overlap");
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
  // Per consumer warp: whether a row it wrote holds NaN or inf (in shared
  // memory: the main loop has no register to spare for it).
  int* nonfinite_warps = reinterpret_cast<int*>(smem + Cfg::kFlagOffset);

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
    for (int w = 0; w < 4 * kConsumers; ++w) nonfinite_warps[w] = 0;
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
    if (threadIdx.x / 32 == kRecomputeWarp)
      recompute_flagged_rows<T, kPacks, kLayouts, kBlockM, kBlockN, kConsumers>(
          p, schedule, segment_tiles, nonfinite_warps);
    if (threadIdx.x != 0) return;
    int64_t kv = 0, local = 0;
    QueryTile tile;
    for (int64_t k = 0;; ++k) {
      const auto step = schedule.tile(k, tile);
      if (step == ScheduleStep::kEnd) break;
      if (step == ScheduleStep::kSkip) continue;
      const Item w(p, tile, packed, segment_tiles);
      mbar_wait(q_empty, (local++ & 1) ^ 1);
      mbar_expect_tx(q_full, q_bytes);
      tma_tile<kHeadDim, kBlockM>(sQ, &maps.q, q_full, w.q_row(), w.h, w.batch());
      for (int64_t it = 0; it < w.n_tiles; ++it, ++kv) {
        const int stage = kv % kStages, phase = (kv / kStages) & 1;
        const int k0 = static_cast<int>(w.keys.tile_begin + it * kBlockN);
        mbar_wait(&k_empty[stage], phase ^ 1);
        mbar_expect_tx(&k_full[stage], Cfg::kKVBytes);
        tma_tile<kHeadDim, kBlockN>(sK + stage * Cfg::kKVBytes, &maps.k, &k_full[stage],
                                    w.k_row(k0), w.hk, w.batch());
        mbar_wait(&v_empty[stage], phase ^ 1);
        mbar_expect_tx(&v_full[stage], Cfg::kKVBytes);
        tma_tile<kHeadDim, kBlockN>(sV + stage * Cfg::kKVBytes, &maps.v, &v_full[stage],
                                    w.k_row(k0), w.hk, w.batch());
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
    if (step == ScheduleStep::kEnd) break;
    if (step == ScheduleStep::kSkip) continue;
    const Item w(p, tile, packed, segment_tiles);
    const int64_t n_tiles = w.n_tiles;
    float o[kDimTiles * 4] = {};
    RowSoftmax softmax = item_rows<kPacks>(w, schedule, consumer, warp_in_group);
    // (kSegments: this consumer's 64 rows are one segment-id tile.)
    const FragmentSegments<kLayouts> segments(p, segment_tiles, w.seq, w.b, FragmentRows::kQueries,
                                              w.q0 + consumer * 64, softmax.row);

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
    // kVarlen: V rows of key tile it past the sequence's used keys are zeroed
    // before the P V that sums over them (zero_tile_rows says why); only an
    // item's last tile can cross the end.
    auto clear_values_past_end = [&](int64_t it) {
      const int64_t k0 = w.keys.tile_begin + it * kBlockN;
      if (k0 + kBlockN <= w.seq.seqlen_k) return;
      const int64_t g = kv + it;
      mbar_wait(&v_full[g % kStages], (g / kStages) & 1);
      zero_tile_rows<kBlockN, Cfg::kPaddedDim>(
          sV + (g % kStages) * Cfg::kKVBytes,
          static_cast<int>(w.seq.seqlen_k > k0 ? w.seq.seqlen_k - k0 : 0),
          kClearBarrier + consumer);
    };
    auto values_done = [&](int64_t it) {
      if (lane == 0) mbar_arrive(&v_empty[(kv + it) % kStages]);
    };
    auto softmax_step = [&](float (&s)[kKeyTiles * 4], int64_t it, float (&alpha)[2]) {
      const int64_t k0 = w.keys.tile_begin + it * kBlockN;
      softmax.scores<kKeyTiles>(s, p, w.seq, k0,
                                RowSoftmax::tile_needs_mask(w.seq, w.q0, w.last_row, k0, kBlockN,
                                                            w.keys.key_begin, w.keys.key_end));
      segments.template mask<kKeyTiles>(s, k0);
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
      if constexpr (kLayouts != Layouts::kUniform) clear_values_past_end(n_tiles - 1);
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
    if constexpr (kLayouts != Layouts::kUniform) softmax.clear_unused_rows<kDimTiles>(o, w.seq);
    const bool nonfinite = softmax.write<T, kDimTiles>(p, w.seq, o, w.b, w.h);
    if (__any_sync(0xffffffffu, nonfinite) && lane == 0)
      nonfinite_warps[consumer * 4 + warp_in_group] = 1;
  }
  named_arrive(kRowsDoneBarrier, 32 + 128 * kConsumers);  // (recompute_flagged_rows)
}

#else  // not compiled for sm_90a: never launched (hopper_forward_supports says no)

template <class T, int kHeadDim, Layouts kLayouts>
__global__ void hopper_forward_kernel(const __grid_constant__ AttentionParams, const __grid_constant__ TensorMaps,
                                      const __grid_constant__ ScheduleOf<kLayouts>,
                                      const SegmentTiles) {}

#endif


// gqa_packed: a tile holds a whole query-head group (TileSchedule).
template <int kHeadDim>
bool make_maps(const AttentionParams& p, bool gqa_packed, TensorMaps& maps) {
  using Cfg = Tiles<kHeadDim>;
  const MapExtent qe = query_extent(p), ke = key_extent(p);
  return make_map(&maps.q, p.q, p.dtype, qe.batch, qe.rows, p.heads_q, p.head_dim,
                  gqa_packed ? static_cast<int>(p.seqlen_q) : Cfg::kBlockM,
                  gqa_packed ? static_cast<int>(p.group_size()) : 1) &&
         make_map(&maps.k, p.k, p.dtype, ke.batch, ke.rows, p.heads_kv, p.head_dim,
                  Cfg::kBlockN) &&
         make_map(&maps.v, p.v, p.dtype, ke.batch, ke.rows, p.heads_kv, p.head_dim_v,
                  Cfg::kBlockN);
}

// The workspace of a non-uniform call: the work list, then (segment ids) the
// id ranges and spans of the segment-id tiles. base may be null (sizes only).
struct ForwardWorkspace {
  static constexpr size_t kAlign = 256;
  VarlenWorkList list;
  SegmentTiles segments;
  size_t bytes = 0;
  ForwardWorkspace(const AttentionParams& p, void* base) {
    if (p.uniform()) return;
    const size_t list_bytes = (VarlenWorkList::workspace_bytes(p) + kAlign - 1) / kAlign * kAlign;
    if (base) {
      list = VarlenWorkList(p, base);
      segments = SegmentTiles(p, static_cast<char*>(base) + list_bytes);
    }
    bytes = list_bytes + SegmentTiles::workspace_bytes(p);
  }
};

// `workspace`: hopper_forward_workspace_bytes(p) bytes (ForwardWorkspace).
template <class T, int kHeadDim, Layouts kLayouts>
cudaError_t launch_layouts(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  using Cfg = Tiles<kHeadDim>;
  constexpr int kBlockM = Cfg::kBlockM;
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        return cudaFuncSetAttribute(hopper_forward_kernel<T, kHeadDim, kLayouts>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      });
      e != cudaSuccess)
    return e;
  ScheduleOf<kLayouts> schedule;
  int64_t items;  // (an upper bound for kVarlen: the device knows the count)
  const bool gqa_packed = kLayouts == Layouts::kUniform && kPacksGroups<kHeadDim> &&
                          p.group_size() > 1 && p.seqlen_q * p.group_size() <= kBlockM;
  if constexpr (kLayouts == Layouts::kUniform) {
    schedule.packed_rows = gqa_packed ? p.seqlen_q : 0;
    schedule.q_tiles = (p.seqlen_q + kBlockM - 1) / kBlockM;
    schedule.pairs_per_head = (schedule.q_tiles + 1) / 2;
    schedule.total_pairs =
        schedule.pairs_per_head * p.batch * (gqa_packed ? p.heads_kv : p.heads_q);
    items = schedule.total_pairs;
  }
  const ForwardWorkspace ws(p, workspace);
  if constexpr (kLayouts != Layouts::kUniform) {
    if (!workspace) return cudaErrorInvalidValue;
    items = p.batch * p.heads_q * (((p.seqlen_q + kBlockM - 1) / kBlockM + 1) / 2);
    if (items == 0) return cudaSuccess;
    if constexpr (kLayouts == Layouts::kSegments)
      if (cudaError_t e = compute_segment_tiles(p, ws.segments, stream); e != cudaSuccess)
        return e;
    schedule.list = ws.list;
    schedule.heads = p.heads_q;
    WorkShape shape;
    shape.tile_rows = kBlockM;
    shape.heads = p.heads_q;
    shape.pairs = true;
    if (cudaError_t e = build_work_list(p, shape, schedule.list, stream); e != cudaSuccess)
      return e;
  }
  TensorMaps maps;
  if (!make_maps<kHeadDim>(p, gqa_packed, maps)) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>(items, multiprocessor_count());
  hopper_forward_kernel<T, kHeadDim, kLayouts>
      <<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
          p, maps, schedule, ws.segments);
  return cudaGetLastError();
}

template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  return with_layouts(p, [&](auto layouts) {
    return launch_layouts<T, kHeadDim, decltype(layouts)::value>(p, workspace, stream);
  });
}

// Head-dim buckets of this kernel: it also has native 96 and 192 ones (the
// other kernels pad those to 128 / 256); FLASHJAX_HEAD_DIMS picks the compiled ones.
constexpr HeadDims<64, 96, 128, 192, 256> kBuckets{};

}  // namespace

bool hopper_forward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  // Layouts: see hopper_layouts_supported. TMA needs 16-byte row strides (head dims
  // % 8) and a 64-column box inside the tensor (head dims >= 64); int32 TMA
  // coordinates bound the sizes.
  return hopper_layouts_supported(p) && p.dtype != DType::kFloat32 && p.head_dim % 8 == 0 &&
         p.head_dim_v % 8 == 0 && head_dim_bucket(kBuckets, p) != 0 && p.head_dim >= 64 &&
         p.head_dim_v >= 64 &&
         p.seqlen_q < (1 << 30) && p.seqlen_k < (1 << 30) && compute_capability() == 90 &&
         encode_fn() != nullptr;
#else
  (void)p;
  return false;
#endif
}

size_t hopper_forward_workspace_bytes(const AttentionParams& p) {
  return ForwardWorkspace(p, nullptr).bytes;
}

cudaError_t hopper_forward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    return with_bucket(kBuckets, p, [&](auto dim) {
      return launch<decltype(tag), decltype(dim)::value>(p, workspace, stream);
    });
  });
}

}  // namespace flashjax::cuda
