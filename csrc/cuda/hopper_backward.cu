// Hopper (sm_90a) backward: TMA-fed, wgmma-based, warp-specialised like the
// forward.
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
//  * query kernel (deterministic mode): a CTA owns 128 query rows; the
//    producer streams (K_j, V_j) tiles of 64 keys. Per tile: S = Q K_j^T,
//    dP = dO V_j^T, dS in registers, dQ += dS K_j (7 products in all, no
//    atomics). It also writes each row's share of dsinks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <mutex>

#include "common.cuh"
#include "dispatch.h"
#include "fragment_softmax.cuh"
#include "hopper_backward.h"
#include "hopper_common.cuh"
#include "simt_attention.h"

namespace flashjax::cuda {
namespace {

constexpr int kOwnRows = 128;   // rows a CTA owns (keys or queries): 64 per consumer
constexpr int kStreamRows = 64; // rows of each streamed tile
constexpr int kThreads = 384;

// dQ is accumulated in float32 blocks of 64 rows x kCols head dims (64; 32 in
// the wide kernel, whose shared memory holds only 8 KB stages), contiguous so
// that one bulk reduction adds a block: block (bh, row tile, column block)
// starts at ((bh * row_tiles + tile) * kHeadDim / kCols + column block) * 64 *
// kCols floats, and element (r, c) sits at r * kCols + (c ^ 8 * (r % (kCols /
// 8))) in it (pairs of columns swizzled by row, so that staging it in shared
// memory spreads banks).
template <int kCols>
constexpr int kDqBlock = 64 * kCols;
template <int kCols>
constexpr int kDqBlockBytes = kDqBlock<kCols> * 4;

template <int kCols>
__host__ __device__ __forceinline__ int64_t dq_block_offset(int64_t row, int64_t col) {
  const int64_t r = row % 64;
  return r * kCols + ((col % kCols) ^ (8 * (r % (kCols / 8))));
}

// The float32 block (in floats from the buffer's start) of head bh's rows
// [64 * (row / 64), +64) and head dims [kCols * col_block, +kCols).
template <int kHeadDim, int kCols>
__host__ __device__ __forceinline__ int64_t dq_block_start(int64_t bh, int64_t row,
                                                           int64_t col_block,
                                                           int64_t rows_padded) {
  return ((bh * (rows_padded / 64) + row / 64) * (kHeadDim / kCols) + col_block) *
         kDqBlock<kCols>;
}

// Head dims above 128 take the wide key kernel (fused dQ only).
template <int kHeadDim>
constexpr bool kWide = kHeadDim > 128;
template <int kHeadDim>
constexpr int kDqCols = kWide<kHeadDim> ? 32 : 64;

template <int kHeadDim>
struct Layout {
  // Streamed tile stages (3: the next tile loads while one is computed and one
  // drains) and dQ stages per consumer (2: a reduction's reads need not finish
  // before the next tile stages dQ).
  static constexpr int kStages = 3;
  static constexpr int kDqStages = kHeadDim == 64 ? 2 : 1;
  static constexpr int kOwnBytes = kOwnRows * kHeadDim * 2;       // one owned tensor
  static constexpr int kStreamBytes = kStreamRows * kHeadDim * 2; // one streamed tile
  static constexpr int kDsBytes = kOwnRows * kStreamRows * 2;     // dS^T [keys][queries]
  static constexpr int kStatBytes = 2 * kStreamRows * 4;          // a tile's lse2 and D
  static constexpr int kDsOffset = 2 * kOwnBytes + 2 * kStages * kStreamBytes;
  static constexpr int kDqStageOffset = kDsOffset + 2 * kDsBytes;  // dS^T double-buffered
  static constexpr int kStatOffset = kDqStageOffset + 2 * kDqStages * kDqBlockBytes<64>;
  static constexpr int kBarrierOffset = kStatOffset + kStages * kStatBytes;
  static constexpr int kBarriers = 1 + 2 * kStages + 2 * 2 * kDqStages;
  static constexpr int kSmemBytes = kBarrierOffset + 8 * kBarriers + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
};

// Where the key kernel finds the streamed rows' statistics (padded rows).
struct RowStats {
  const float* lse2 = nullptr;  // null: not streamed (query kernel)
  const float* D = nullptr;
  int64_t rows_padded = 0;
};

struct BackwardMaps {
  CUtensorMap own_a, own_b, stream_a, stream_b;  // key kernel: K, V, Q, dO; query: Q, dO, K, V
};

// Per padded row: lse in log2 units and D for the key kernel's producer
// (+inf and 0 past seqlen_q, so those rows get P = dS = 0), and, when dQ is
// fused into the key kernel, each row's share of dsinks (as the query kernel
// writes it otherwise).
__global__ void stage_rows_kernel(const AttentionParams p, BackwardWorkspace ws, bool dsinks) {
  const int64_t n = p.batch * p.heads_q * ws.rows_padded;
  for (int64_t at = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; at < n;
       at += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bh = at / ws.rows_padded, i = at % ws.rows_padded;
    float lse2 = -kNegInf, D = 0.0f;
    if (i < p.seqlen_q) {  // (uniform layouts: lse, D, dsink_rows are dense (b, h, i))
      lse2 = lse_to_log2(static_cast<const float*>(p.lse.data)[bh * p.seqlen_q + i]);
      D = static_cast<const float*>(ws.D.data)[bh * p.seqlen_q + i];
      if (dsinks && p.sinks)
        static_cast<float*>(ws.dsink_rows.data)[bh * p.seqlen_q + i] =
            dsink_share(p.sinks[bh] * kLog2e, lse2, D);
    }
    ws.lse2_padded[at] = lse2;
    ws.D_padded[at] = D;
  }
}

// dq = scale * the float32 accumulation (rows of kHeadDim columns).
template <class T, int kHeadDim>
__global__ void convert_dq_kernel(const AttentionParams p, const float* dq_accum,
                                  int64_t rows_padded) {
  const int64_t n = p.batch * p.seqlen_q * p.heads_q * p.head_dim;
  for (int64_t at = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; at < n;
       at += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = at % p.head_dim, rest = at / p.head_dim;
    const int64_t h = rest % p.heads_q, bi = rest / p.heads_q;
    const int64_t b = bi / p.seqlen_q, i = bi % p.seqlen_q;
    constexpr int kCols = kDqCols<kHeadDim>;
    const float x = dq_accum[dq_block_start<kHeadDim, kCols>(b * p.heads_q + h, i, c / kCols,
                                                             rows_padded) +
                             dq_block_offset<kCols>(i, c)];
    static_cast<T*>(p.dq.data)[at] = from_float<T>(x * p.softmax_scale);  // (dense dq)
  }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Shared memory and barriers of both kernels: two owned [128][d] tensors, a
// ring of (a, b) streamed tile pairs (with their rows' lse2 and D) with one
// full/empty barrier pair each, and, for the fused key kernel, two dS^T
// buffers and each consumer's dQ stages with a full/empty barrier pair each.
template <int kHeadDim>
struct Smem {
  unsigned char *own_a, *own_b, *stream_a, *stream_b, *ds;
  float *dq_stage, *stats;
  uint64_t *owned, *full, *empty, *dq_full, *dq_empty;
  __device__ explicit Smem(unsigned char* raw) {
    using L = Layout<kHeadDim>;
    unsigned char* base = align_smem(raw);
    own_a = base;
    own_b = own_a + L::kOwnBytes;
    stream_a = own_b + L::kOwnBytes;
    stream_b = stream_a + L::kStages * L::kStreamBytes;
    ds = base + L::kDsOffset;
    dq_stage = reinterpret_cast<float*>(base + L::kDqStageOffset);
    stats = reinterpret_cast<float*>(base + L::kStatOffset);
    owned = reinterpret_cast<uint64_t*>(base + L::kBarrierOffset);
    full = owned + 1;
    empty = full + L::kStages;
    dq_full = empty + L::kStages;
    dq_empty = dq_full + 2 * L::kDqStages;
  }
  __device__ void init() {
    if (threadIdx.x == 0) {
      mbar_init(owned, 1);
      using L = Layout<kHeadDim>;
      for (int s = 0; s < L::kStages; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], 8);  // one arrival per consumer warp
      }
      for (int s = 0; s < 2 * L::kDqStages; ++s) {
        mbar_init(&dq_full[s], 128);  // every thread of the consumer
        mbar_init(&dq_empty[s], 1);   // the dQ writer
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
};

// Producer: owned tensors once, then `tiles` streamed pairs; tile i sits at
// row stream_row(i) of head stream_head(i). With stats.lse2, also those rows'
// lse2 and D.
template <int kHeadDim, class RowOf, class HeadOf>
__device__ void produce(Smem<kHeadDim>& sm, const BackwardMaps& maps, int own_row, int own_head,
                        int batch, int64_t tiles, RowOf&& stream_row, HeadOf&& stream_head,
                        const AttentionParams& p, const RowStats& stats) {
  using L = Layout<kHeadDim>;
  mbar_expect_tx(sm.owned, 2 * L::kOwnBytes);
  tma_tile<kHeadDim, kOwnRows>(sm.own_a, &maps.own_a, sm.owned, own_row, own_head, batch);
  tma_tile<kHeadDim, kOwnRows>(sm.own_b, &maps.own_b, sm.owned, own_row, own_head, batch);
  for (int64_t it = 0; it < tiles; ++it) {
    const int stage = it % L::kStages, phase = (it / L::kStages) & 1;
    mbar_wait(&sm.empty[stage], phase ^ 1);
    mbar_expect_tx(&sm.full[stage], 2 * L::kStreamBytes + (stats.lse2 ? L::kStatBytes : 0));
    const int row = static_cast<int>(stream_row(it)), head = static_cast<int>(stream_head(it));
    if (stats.lse2) {
      const int64_t at = (batch * p.heads_q + head) * stats.rows_padded + row;
      float* dst = sm.stats + stage * (L::kStatBytes / 4);
      bulk_load(dst, stats.lse2 + at, L::kStatBytes / 2, &sm.full[stage]);
      bulk_load(dst + kStreamRows, stats.D + at, L::kStatBytes / 2, &sm.full[stage]);
    }
    tma_tile<kHeadDim, kStreamRows>(sm.stream_a + stage * L::kStreamBytes, &maps.stream_a,
                                    &sm.full[stage], row, head, batch);
    tma_tile<kHeadDim, kStreamRows>(sm.stream_b + stage * L::kStreamBytes, &maps.stream_b,
                                    &sm.full[stage], row, head, batch);
  }
}

// C(64 x 64) = A(own rows, K-major) * B(streamed tile, K-major)^T over kHeadDim.
template <class T, int kHeadDim>
__device__ __forceinline__ void issue_abt(float (&c)[32], const unsigned char* own_rows,
                                          const unsigned char* tile) {
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk)
    wgmma_ss_n64<T>(c, k_major_desc<kOwnRows>(own_rows, kk),
                    k_major_desc<kStreamRows>(tile, kk), kk > 0);
}

// acc(64 x kHeadDim) += A(64 x 64, registers) * B(streamed tile rows, N-major).
template <class T, int kHeadDim>
__device__ __forceinline__ void issue_ab(float (&acc)[kHeadDim / 2], const uint32_t (&a)[4][4],
                                         const unsigned char* tile) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t desc = smem_desc(tile + kk * 16 * 128, kStreamRows * 128, 1024);
    if constexpr (kHeadDim == 64) wgmma_rs_n64<T>(acc, a[kk], desc, 1);
    else wgmma_rs_n128<T>(acc, a[kk], desc, 1);
  }
}

template <int kN>
__device__ __forceinline__ void fence_regs(float (&regs)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}

// P (in s, from log2 scores) and dS (in dp), in place; lse2/D per element.
template <int kN, class LseOf, class DOf>
__device__ __forceinline__ void probabilities_and_grad(float (&s)[kN], float (&dp)[kN],
                                                       const AttentionParams& p, LseOf&& lse2,
                                                       DOf&& d_of) {
  const float inv_cap_log2 = p.softcap > 0.0f ? 1.0f / (p.softcap * kLog2e) : 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const float prob = fast_exp2(s[i] - lse2(i));
    float ds = prob * (dp[i] - d_of(i));
    if (p.softcap > 0.0f) {
      const float t = prob > 0.0f ? s[i] * inv_cap_log2 : 0.0f;
      ds *= 1.0f - t * t;
    }
    s[i] = prob;
    dp[i] = ds;
  }
}

// The same with dP's product still running when it is called (S's done):
// without softcap, P's exponentials run first and overlap that product;
// wait_dp() then waits for it. With softcap, dS needs the capped scores that P
// overwrites, so it waits first.
template <int kN, class LseOf, class DOf, class WaitDp>
__device__ __forceinline__ void probabilities_then_grad(float (&s)[kN], float (&dp)[kN],
                                                        const AttentionParams& p, LseOf&& lse2,
                                                        DOf&& d_of, WaitDp&& wait_dp) {
  if (p.softcap > 0.0f) {
    wait_dp();
    probabilities_and_grad(s, dp, p, lse2, d_of);
    return;
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) s[i] = fast_exp2(s[i] - lse2(i));
  fence_regs(s);  // (the exponentials are issued before the wait)
  wait_dp();
#pragma unroll
  for (int i = 0; i < kN; ++i) dp[i] = s[i] * (dp[i] - d_of(i));
}

template <class T, int kK>
__device__ __forceinline__ void pack_fragments(uint32_t (&a)[kK][4], const float (&x)[kK * 8]) {
#pragma unroll
  for (int kk = 0; kk < kK; ++kk) p_fragment<T, 2 * kK>(a[kk], x, kk);
}

// Writes rows row0 + [0, 64) of a consumer's 64 x kHeadDim accumulator.
template <class T, int kHeadDim>
__device__ __forceinline__ void store_block(T* head_base, int64_t row_stride, int64_t rows,
                                            int64_t dim, int64_t row0,
                                            const float (&acc)[kHeadDim / 2], float scale) {
  store_rows<T, kHeadDim>(head_base, row_stride, rows, dim, row0 + ((threadIdx.x / 32) % 4) * 16,
                          acc, scale);
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
template <bool kOverlap, class Products, class Gradients, class Pack, class Updates,
          class Release>
__device__ __forceinline__ void pipeline(int64_t tiles, Products&& products,
                                         Gradients&& gradients, Pack&& pack, Updates&& updates,
                                         Release&& release) {
  if (tiles == 0) return;
  if constexpr (!kOverlap) {
    for (int64_t it = 0; it < tiles; ++it) {
      products(it);
      gradients(it);
      pack(it);
      updates(it);
      wgmma_wait<0>();
      release(it);
    }
    return;
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
}

// Stores a warpgroup's packed [64 keys][16 kK queries] fragment (P^T or dS^T)
// at key rows key0 + [0, 64) and query columns 8 chunk0 + [0, 16 kK) of a
// [keys][64 queries] tile, in the 128-byte-swizzled layout wgmma reads (as a
// K-major or an MN-major operand): key row r is 128 bytes, 16-byte chunk c at
// c ^ (r % 8).
template <int kK>
__device__ __forceinline__ void store_transposed(unsigned char* tile, int key0, int chunk0,
                                                 const uint32_t (&x)[kK][4]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int row0 = key0 + ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  const uint32_t base = smem_u32(tile) + 4 * t;
#pragma unroll
  for (int kk = 0; kk < kK; ++kk)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = row0 + 8 * (j & 1), chunk = chunk0 + 2 * kk + j / 2;
      st_shared(base + row * 128 + ((chunk ^ (row % 8)) << 4), x[kk][j]);
    }
}

// This key block's share of dQ_j (64 queries x 64 head dims) = dS_j K. At
// head dim 128 the consumers split the head dims and share all 128 keys (both
// dS^T halves, hence the 256-thread barrier); at 64 each consumer takes its own
// 64 keys and all head dims, and the reductions add the two halves.
template <class T, int kHeadDim>
__device__ __forceinline__ void issue_dq(float (&dq)[32], const unsigned char* ds_tile,
                                         const unsigned char* k_tile, int consumer) {
  constexpr bool kOwnKeys = kHeadDim == 64;
  const int key0 = kOwnKeys ? consumer * 64 : 0;
  const unsigned char* k_cols = k_tile + (kOwnKeys ? 0 : consumer * kOwnRows * 128);
  // The first product overwrites dq; zeroing it first tells the compiler that
  // the last tile's values are dead (they would stay live through the softmax).
#pragma unroll
  for (int i = 0; i < 32; ++i) dq[i] = 0.0f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < (kOwnKeys ? 4 : 8); ++kk) {
    const int row = key0 + 16 * kk;
    wgmma_ss_mn_n64<T>(dq, smem_desc(ds_tile + row * 128, 1024, 1024),
                       smem_desc(k_cols + row * 128, 1024, 1024), kk > 0);
  }
}

// Stores columns [kCols * part, +kCols) of a consumer's dQ fragment (64 rows x
// 64 columns) in a float32 block's layout in shared memory, from where one
// bulk reduction adds it to the dQ buffer (per-thread atomics cost more than a
// third of the kernel's time).
template <int kCols>
__device__ __forceinline__ void stage_dq(float* stage, const float (&dq)[32], int part) {
  const int lane = threadIdx.x % 32;
  const int row0 = ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  // dq_block_offset's swizzle (rows row0 and row0 + 8 share it).
  const int swizzle = row0 % (kCols / 8);
  const uint32_t base = smem_u32(stage) + 4 * (row0 * kCols + 2 * (lane % 4));
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      const int i = 4 * (n + part * kCols / 8) + 2 * r;
      const uint32_t at = base + 4 * (8 * r * kCols + 8 * (n ^ swizzle));
      st_shared(at, dq[i], dq[i + 1]);
    }
}

// The keys [k0, last_key] of kv head hk a key-kernel CTA owns (kRows of them),
// and the streamed query tiles that see them: tile it is rows [row(it),
// +kStreamRows) of query head head(it).
template <int kRows>
struct KeyBlock {
  int64_t b, hk, k0, last_key, row_begin, q_tiles, tiles;
  __device__ explicit KeyBlock(const AttentionParams& p) {
    const int64_t k_tiles = (p.seqlen_k + kRows - 1) / kRows;
    const int64_t k_tile = blockIdx.x % k_tiles, bhk = blockIdx.x / k_tiles;
    b = bhk / p.heads_kv;
    hk = bhk % p.heads_kv;
    k0 = k_tile * kRows;
    last_key = min(k0 + kRows, p.seqlen_k) - 1;
    const SeqlenInfo seq = SeqlenInfo::uniform(p, b);
    row_begin = seq.first_query(k0) / kStreamRows * kStreamRows;
    const int64_t row_end = seq.last_query(last_key) + 1;
    q_tiles = row_end > row_begin ? (row_end - row_begin + kStreamRows - 1) / kStreamRows : 0;
    tiles = q_tiles * p.group_size();
  }
  __device__ int64_t row(int64_t it) const { return row_begin + (it % q_tiles) * kStreamRows; }
  __device__ int64_t head(const AttentionParams& p, int64_t it) const {
    return hk * p.group_size() + it / q_tiles;
  }

  // Masks a thread's S^T fragment (keys key, key + 8; queries col0 + [0, 8 kTiles))
  // where some of the block's (key, query) pairs are invisible.
  template <int kTiles>
  __device__ void mask(float (&st)[kTiles * 4], const AttentionParams& p, int64_t key,
                       int64_t col0) const {
    constexpr int kCols = kTiles * 8;
    const SeqlenInfo seq = SeqlenInfo::uniform(p, b);
    if (col0 >= seq.first_query(last_key) && col0 + kCols - 1 <= seq.last_query(k0) &&
        col0 + kCols <= p.seqlen_q && last_key - k0 + 1 == kRows)
      return;
    int lo[2], hi[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t k = key + 8 * r;
      visible_columns(seq.first_query(k), min(seq.last_query(k), p.seqlen_q - 1), col0, kCols,
                      lo[r], hi[r]);
      if (k >= p.seqlen_k) hi[r] = -1;
    }
    mask_columns<kTiles>(st, lo, hi);
  }
};

// The fused key kernel's dQ writer, one thread of the producer warpgroup: it
// sends each consumer's staged dQ block (tile it, stage it % kDqStages) as a
// bulk reduction once all 128 of its threads have arrived on dq_full, and
// frees a stage (dq_empty) once the reduction has read it, so that consumers
// only wait when they are a whole ring ahead.
template <int kHeadDim>
__device__ void write_dq(Smem<kHeadDim>& sm, const KeyBlock<kOwnRows>& kb,
                         const AttentionParams& p, const RowStats& stats, float* dq_accum) {
  using L = Layout<kHeadDim>;
  constexpr int kLag = L::kDqStages - 1;  // tiles whose reductions may still read
  for (int64_t it = 0; it < kb.tiles; ++it) {
    const int s = it % L::kDqStages;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      mbar_wait(&sm.dq_full[c * L::kDqStages + s], (it / L::kDqStages) & 1);
      // At head dim 64 both consumers add to the same block (their own keys).
      const int64_t block = dq_block_start<kHeadDim, 64>(
          kb.b * p.heads_q + kb.head(p, it), kb.row(it), kHeadDim == 64 ? 0 : c,
          stats.rows_padded);
      bulk_reduce_add(dq_accum + block, sm.dq_stage + (c * L::kDqStages + s) * kDqBlock<64>,
                      kDqBlockBytes<64>);
    }
    bulk_wait_reads<2 * kLag>();
    if (it >= kLag) {
      const int freed = (it - kLag) % L::kDqStages;
      mbar_arrive(&sm.dq_empty[freed]);
      mbar_arrive(&sm.dq_empty[L::kDqStages + freed]);
    }
  }
  bulk_wait_all();
}

template <class T, int kHeadDim, bool kFusedDq>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_key_kernel(const AttentionParams p, const __grid_constant__ BackwardMaps maps,
                      const RowStats stats, float* dq_accum) {
  extern __shared__ unsigned char smem_raw[];
  Smem<kHeadDim> sm(smem_raw);
  using L = Layout<kHeadDim>;
  const KeyBlock<kOwnRows> kb(p);
  const int64_t b = kb.b, hk = kb.hk, k0 = kb.k0, tiles = kb.tiles;
  const auto tile_row = [&](int64_t it) { return kb.row(it); };
  const auto tile_head = [&](int64_t it) { return kb.head(p, it); };
  sm.init();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 0)
      produce(sm, maps, static_cast<int>(k0), static_cast<int>(hk), static_cast<int>(b), tiles,
              tile_row, tile_head, p, stats);
    else if (kFusedDq && threadIdx.x == 32)
      write_dq(sm, kb, p, stats, dq_accum);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int consumer = warpgroup - 1, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t my_key = k0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  const unsigned char* k_rows = sm.own_a + consumer * 64 * 128;
  const unsigned char* v_rows = sm.own_b + consumer * 64 * 128;
  float dk[kHeadDim / 2] = {}, dv[kHeadDim / 2] = {};

  const auto q_tile = [&](int64_t it) { return sm.stream_a + (it % L::kStages) * L::kStreamBytes; };
  const auto do_tile = [&](int64_t it) { return sm.stream_b + (it % L::kStages) * L::kStreamBytes; };
  const auto tile_stats = [&](int64_t it) { return sm.stats + (it % L::kStages) * (L::kStatBytes / 4); };
  float st[32], dpt[32];
  uint32_t pa[4][4], dsa[4][4];
  float dq[32];
  mbar_wait(sm.owned, 0);
  pipeline<false>(
      tiles,
      [&](int64_t it) {  // S^T = K Q_j^T, dP^T = V dO_j^T
        mbar_wait(&sm.full[it % L::kStages], (it / L::kStages) & 1);
        wgmma_fence();
        issue_abt<T, kHeadDim>(st, k_rows, q_tile(it));
        wgmma_commit();
        issue_abt<T, kHeadDim>(dpt, v_rows, do_tile(it));
        wgmma_commit();
      },
      [&](int64_t it) {  // P^T, dS^T
        wgmma_wait<1>();
        fence_regs(st);
        // (q0 before scores_log2: the other order compiled to a layout 6% slower at d64.)
        const int64_t q0 = tile_row(it);
        scores_log2(st, p);
        kb.mask<8>(st, p, my_key, q0);
        // Rows past seqlen_q have lse2 = +inf and D = 0 (padded), so P = dS = 0.
        const float* lse2 = tile_stats(it);
        const float* D = lse2 + kStreamRows;
        const auto column = [&](int i) { return (i / 4) * 8 + 2 * t + (i & 1); };
        probabilities_then_grad(st, dpt, p, [&](int i) { return lse2[column(i)]; },
                                [&](int i) { return D[column(i)]; }, [&] {
                                  wgmma_wait<0>();
                                  fence_regs(dpt);
                                });
      },
      [&](int64_t it) {
        pack_fragments<T, 4>(pa, st);
        pack_fragments<T, 4>(dsa, dpt);
        if constexpr (kFusedDq) {
          store_transposed(sm.ds + (it % 2) * L::kDsBytes, consumer * 64, 0, dsa);
          fence_proxy_async();
        }
      },
      [&](int64_t it) {  // dV += P^T dO_j, (dQ_j = dS_j K,) dK += dS^T Q_j
        wgmma_fence();
        issue_ab<T, kHeadDim>(dv, pa, do_tile(it));
        if constexpr (kFusedDq) {
          // Both halves of dS^T (or this consumer's, at head dim 64) are stored.
          if constexpr (kHeadDim == 64) named_sync(3 + consumer, 128);
          else named_sync(3);
          issue_dq<T, kHeadDim>(dq, sm.ds + (it % 2) * L::kDsBytes, sm.own_a, consumer);
          wgmma_commit();
          issue_ab<T, kHeadDim>(dk, dsa, q_tile(it));
          wgmma_commit();
          // dQ is staged for the writer while dK's product runs.
          wgmma_wait<1>();
          fence_regs(dq);
          const int slot = consumer * L::kDqStages + it % L::kDqStages;
          mbar_wait(&sm.dq_empty[slot], ((it / L::kDqStages) & 1) ^ 1);
          stage_dq<64>(sm.dq_stage + slot * kDqBlock<64>, dq, 0);
          fence_proxy_async();
          mbar_arrive(&sm.dq_full[slot]);
        } else {
          issue_ab<T, kHeadDim>(dk, dsa, q_tile(it));
          wgmma_commit();
        }
      },
      [&](int64_t it) {
        fence_regs(dv);
        fence_regs(dk);
        if (lane == 0) mbar_arrive(&sm.empty[it % L::kStages]);
      });
  const int64_t row0 = k0 + consumer * 64;
  store_block<T, kHeadDim>(p.dk.at<T>(b, 0, hk), p.dk.row_stride, p.seqlen_k, p.head_dim, row0,
                           dk, p.softmax_scale);
  store_block<T, kHeadDim>(p.dv.at<T>(b, 0, hk), p.dv.row_stride, p.seqlen_k, p.head_dim_v, row0,
                           dv, 1.0f);
}

template <class T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_query_kernel(const AttentionParams p, const __grid_constant__ BackwardMaps maps,
                        const __grid_constant__ TensorRef D_all,
                        const __grid_constant__ TensorRef dsink_rows) {
  extern __shared__ unsigned char smem_raw[];
  Smem<kHeadDim> sm(smem_raw);
  using L = Layout<kHeadDim>;
  const int64_t q_tiles = (p.seqlen_q + kOwnRows - 1) / kOwnRows;
  const auto [q_tile, bh] = query_tile(q_tiles);
  const int64_t b = bh / p.heads_q, h = bh % p.heads_q, hk = h / p.group_size();
  const int64_t q0 = q_tile * kOwnRows, last_row = min(q0 + kOwnRows, p.seqlen_q) - 1;
  const SeqlenInfo seq = SeqlenInfo::uniform(p, b);
  const KeyRange keys(seq, q0, last_row, kStreamRows);
  const int64_t tiles = keys.tiles(kStreamRows);
  sm.init();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 0)
      produce(sm, maps, static_cast<int>(q0), static_cast<int>(h), static_cast<int>(b), tiles,
              [&](int64_t it) { return keys.tile_begin + it * kStreamRows; },
              [&](int64_t) { return hk; }, p, RowStats{});
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int consumer = warpgroup - 1, lane = threadIdx.x % 32;
  RowSoftmax rows{q0 + consumer * 64 + ((threadIdx.x / 32) % 4) * 16 + lane / 4};
  const unsigned char* q_rows = sm.own_a + consumer * 64 * 128;
  const unsigned char* do_rows = sm.own_b + consumer * 64 * 128;
  float lse2[2], D[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = rows.row + 8 * r;
    lse2[r] = i < p.seqlen_q ? lse_to_log2(*p.lse.at<const float>(b, i, h)) : -kNegInf;
    D[r] = i < p.seqlen_q ? *D_all.at<const float>(b, i, h) : 0.0f;
  }
  float dq[kHeadDim / 2] = {};

  const auto k_tile = [&](int64_t it) { return sm.stream_a + (it % L::kStages) * L::kStreamBytes; };
  const auto v_tile = [&](int64_t it) { return sm.stream_b + (it % L::kStages) * L::kStreamBytes; };
  float s[32], dp[32];
  uint32_t dsa[4][4];
  mbar_wait(sm.owned, 0);
  pipeline<true>(
      tiles,
      [&](int64_t it) {  // S = Q K_j^T, dP = dO V_j^T
        mbar_wait(&sm.full[it % L::kStages], (it / L::kStages) & 1);
        wgmma_fence();
        issue_abt<T, kHeadDim>(s, q_rows, k_tile(it));
        issue_abt<T, kHeadDim>(dp, do_rows, v_tile(it));
        wgmma_commit();
      },
      [&](int64_t it) {  // dS
        fence_regs(s);
        fence_regs(dp);
        const int64_t k0 = keys.tile_begin + it * kStreamRows;
        rows.scores<8>(s, p, seq, k0,
                       RowSoftmax::tile_needs_mask(seq, q0, last_row, k0, kStreamRows,
                                                   keys.key_begin, keys.key_end));
        probabilities_and_grad(s, dp, p, [&](int i) { return lse2[(i % 4) / 2]; },
                               [&](int i) { return D[(i % 4) / 2]; });
      },
      [&](int64_t) { pack_fragments<T, 4>(dsa, dp); },
      [&](int64_t it) {  // dQ += dS K_j
        wgmma_fence();
        issue_ab<T, kHeadDim>(dq, dsa, k_tile(it));
        wgmma_commit();
      },
      [&](int64_t it) {
        fence_regs(dq);
        if (lane == 0) mbar_arrive(&sm.empty[it % L::kStages]);
      });
  store_block<T, kHeadDim>(p.dq.at<T>(b, 0, h), p.dq.row_stride, p.seqlen_q, p.head_dim,
                           q0 + consumer * 64, dq, p.softmax_scale);
  write_dsink_rows(p, seq, b, h, rows.row, lse2, D, dsink_rows);
}

#else  // not compiled for sm_90a: never launched (hopper_backward_supports says no)

template <class T, int kHeadDim, bool kFusedDq>
__global__ void hopper_key_kernel(const AttentionParams, const __grid_constant__ BackwardMaps,
                                  const RowStats, float*) {}
template <class T, int kHeadDim>
__global__ void hopper_query_kernel(const AttentionParams, const __grid_constant__ BackwardMaps,
                                    const __grid_constant__ TensorRef,
                                    const __grid_constant__ TensorRef) {}

#endif

// Head dims 129-256 ("wide"): dK and dV of 128 keys do not fit in registers,
// so a CTA owns 64 keys and its two consumers split the work of each
// streamed tile of 64 queries two ways:
//  * consumer c computes S^T and dP^T for queries [32c, +32) (all 64 keys),
//    and stores P^T and dS^T (16-bit) to shared memory;
//  * after a 256-thread barrier, consumer c accumulates dV and dK for head
//    dims [128c, +128) from the whole P^T and dS^T tiles (operands from
//    shared memory), and computes those head dims of dQ_j = dS_j K as two
//    64-column products, added to the float32 buffer by 32-column bulk
//    reductions.
// Registers: dK, dV 64 each, dQ 2 x 32; S^T, dP^T 16 each (dead by then).
// Shared memory: K, V, two Q stages and one dO stage (dO is released after
// dV, the first update; a second stage measured no faster), two P^T/dS^T
// pairs and two 8 KB dQ stages per consumer: 224 KB.
namespace wide {
constexpr int kKeys = 64;
constexpr int kHeadDim = 256;
constexpr int kQStages = 2;
constexpr int kTileBytes = 64 * kHeadDim * 2;  // K, V, a Q or a dO tile
constexpr int kGradBytes = kKeys * kStreamRows * 2;  // one P^T or dS^T tile
constexpr int kColBlock = 64 * 128;  // one 64-column block of a 64-row tile
constexpr int kDqStageFloats = kDqBlock<kDqCols<kHeadDim>>;
constexpr int kQOffset = 2 * kTileBytes;
constexpr int kDoOffset = kQOffset + kQStages * kTileBytes;
constexpr int kGradOffset = kDoOffset + kTileBytes;
constexpr int kDqStageOffset = kGradOffset + 2 * 2 * kGradBytes;
constexpr int kStatOffset = kDqStageOffset + 2 * 2 * kDqStageFloats * 4;
constexpr int kStatBytes = kStreamRows * 4;  // a tile's lse2 (with Q) or D (with dO)
constexpr int kBarrierOffset = kStatOffset + (kQStages + 1) * kStatBytes;
constexpr int kSmemBytes = kBarrierOffset + 8 * (1 + 2 * kQStages + 2) + 1024;
static_assert(kSmemBytes <= 227 * 1024, "exceeds the opt-in shared memory of sm_90");
}  // namespace wide

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

struct WideSmem {
  unsigned char *k, *v, *q, *dout, *grads;
  float *dq_stage, *lse2, *D;
  uint64_t *owned, *q_full, *q_empty, *do_full, *do_empty;
  __device__ explicit WideSmem(unsigned char* raw) {
    using namespace wide;
    unsigned char* base = align_smem(raw);
    k = base;
    v = base + kTileBytes;
    q = base + kQOffset;
    dout = base + kDoOffset;
    grads = base + kGradOffset;
    dq_stage = reinterpret_cast<float*>(base + kDqStageOffset);
    lse2 = reinterpret_cast<float*>(base + kStatOffset);
    D = lse2 + kQStages * kStreamRows;
    owned = reinterpret_cast<uint64_t*>(base + kBarrierOffset);
    q_full = owned + 1;
    q_empty = q_full + kQStages;
    do_full = q_empty + kQStages;
    do_empty = do_full + 1;
    if (threadIdx.x == 0) {
      mbar_init(owned, 1);
      for (int s = 0; s < kQStages; ++s) {
        mbar_init(&q_full[s], 1);
        mbar_init(&q_empty[s], 8);  // one arrival per consumer warp
      }
      mbar_init(do_full, 1);
      mbar_init(do_empty, 8);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  // Tile it's P^T and dS^T (double-buffered: the other consumer may still
  // read tile it - 1's while this one writes tile it's).
  __device__ unsigned char* pt(int64_t it) const { return grads + (it % 2) * 2 * wide::kGradBytes; }
  __device__ unsigned char* dst(int64_t it) const { return pt(it) + wide::kGradBytes; }
};

// Producer: K and V once, then per tile Q (with its rows' lse2) and dO (with
// D), each in its own ring: Q is released after dK, dO after dV.
__device__ void produce_wide(WideSmem& sm, const BackwardMaps& maps, const KeyBlock<wide::kKeys>& kb,
                             const AttentionParams& p, const RowStats& stats) {
  using namespace wide;
  const int batch = static_cast<int>(kb.b), k0 = static_cast<int>(kb.k0);
  mbar_expect_tx(sm.owned, 2 * kTileBytes);
  tma_tile<kHeadDim, kKeys>(sm.k, &maps.own_a, sm.owned, k0, static_cast<int>(kb.hk), batch);
  tma_tile<kHeadDim, kKeys>(sm.v, &maps.own_b, sm.owned, k0, static_cast<int>(kb.hk), batch);
  for (int64_t it = 0; it < kb.tiles; ++it) {
    const int row = static_cast<int>(kb.row(it)), head = static_cast<int>(kb.head(p, it));
    const int64_t at = (kb.b * p.heads_q + head) * stats.rows_padded + row;
    const int s = it % kQStages, phase = ((it / kQStages) & 1) ^ 1;
    mbar_wait(&sm.q_empty[s], phase);
    mbar_expect_tx(&sm.q_full[s], kTileBytes + kStatBytes);
    bulk_load(sm.lse2 + s * kStreamRows, stats.lse2 + at, kStatBytes, &sm.q_full[s]);
    tma_tile<kHeadDim, kStreamRows>(sm.q + s * kTileBytes, &maps.stream_a, &sm.q_full[s], row,
                                    head, batch);
    mbar_wait(sm.do_empty, (it & 1) ^ 1);
    mbar_expect_tx(sm.do_full, kTileBytes + kStatBytes);
    bulk_load(sm.D, stats.D + at, kStatBytes, sm.do_full);
    tma_tile<kHeadDim, kStreamRows>(sm.dout, &maps.stream_b, sm.do_full, row, head, batch);
  }
}

// Adds a consumer's two 32-column halves of one 64-column dQ product, each
// staged in its own stage and sent by the consumer's thread 0 (so that one is
// written while the other's reduction may still be reading): before staging, it
// waits until at most one later reduction may still read a stage.
__device__ __forceinline__ void add_dq_wide(float* dq_accum, float* stages, int consumer,
                                            const float (&dq)[32], int64_t bh, int64_t row,
                                            int col_block64, int64_t rows_padded) {
  constexpr int kCols = kDqCols<wide::kHeadDim>;
#pragma unroll
  for (int part = 0; part < 2; ++part) {
    float* block = dq_accum + dq_block_start<wide::kHeadDim, kCols>(
                                  bh, row, 2 * col_block64 + part, rows_padded);
    float* stage = stages + part * wide::kDqStageFloats;
    if (threadIdx.x % 128 == 0) bulk_wait_reads<1>();
    named_sync(5 + consumer, 128);
    stage_dq<kCols>(stage, dq, part);
    fence_proxy_async();
    named_sync(5 + consumer, 128);
    if (threadIdx.x % 128 == 0) bulk_reduce_add(block, stage, kDqBlockBytes<kCols>);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_wide_key_kernel(const AttentionParams p, const __grid_constant__ BackwardMaps maps,
                           const RowStats stats, float* dq_accum) {
  using namespace wide;
  extern __shared__ unsigned char smem_raw[];
  WideSmem sm(smem_raw);
  const KeyBlock<kKeys> kb(p);
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 0) produce_wide(sm, maps, kb, p, stats);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int c = warpgroup - 1, lane = threadIdx.x % 32, t = lane % 4;
  const int key_row = ((threadIdx.x / 32) % 4) * 16 + lane / 4;
  float* stages = sm.dq_stage + 2 * c * kDqStageFloats;
  float dk[64] = {}, dv[64] = {};
  mbar_wait(sm.owned, 0);
  for (int64_t it = 0; it < kb.tiles; ++it) {
    const int s = it % kQStages, phase = (it / kQStages) & 1;
    const unsigned char* q_tile = sm.q + s * kTileBytes;
    const unsigned char* do_tile = sm.dout;
    mbar_wait(&sm.q_full[s], phase);
    mbar_wait(sm.do_full, it & 1);
    // S^T = K Q^T and dP^T = V dO^T for this consumer's 32 queries.
    float st[16], dpt[16];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      wgmma_ss_n32<T>(st, k_major_desc<kKeys>(sm.k, kk),
                      k_major_desc<kStreamRows>(q_tile + c * 32 * 128, kk), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
      wgmma_ss_n32<T>(dpt, k_major_desc<kKeys>(sm.v, kk),
                      k_major_desc<kStreamRows>(do_tile + c * 32 * 128, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(st);
    const int64_t col0 = kb.row(it) + 32 * c;
    scores_log2(st, p);
    kb.mask<4>(st, p, kb.k0 + key_row, col0);
    // Rows past seqlen_q have lse2 = +inf and D = 0 (padded), so P = dS = 0.
    const float* lse2 = sm.lse2 + s * kStreamRows + 32 * c;
    const float* D = sm.D + 32 * c;
    const auto column = [&](int i) { return (i / 4) * 8 + 2 * t + (i & 1); };
    probabilities_then_grad(st, dpt, p, [&](int i) { return lse2[column(i)]; },
                            [&](int i) { return D[column(i)]; }, [&] {
                              wgmma_wait<0>();
                              fence_regs(dpt);
                            });
    uint32_t frag[2][2][4];
    pack_fragments<T, 2>(frag[0], st);
    pack_fragments<T, 2>(frag[1], dpt);
    store_transposed(sm.pt(it), 0, 4 * c, frag[0]);
    store_transposed(sm.dst(it), 0, 4 * c, frag[1]);
    fence_proxy_async();
    named_sync(3);  // both consumers' halves of P^T and dS^T are stored

    // dV += P^T dO, dQ_j = dS K (two 64-column products), dK += dS^T Q for
    // head dims [128c, +128); four commit groups, retired in order.
    float dq0[32], dq1[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dq0[i] = dq1[i] = 0.0f;
    // acc += A^T B: A = P^T or dS^T [keys][queries], B = column block pair of
    // this consumer's head dims of dO or Q.
    const auto accumulate = [&](float (&acc)[64], const unsigned char* a, const unsigned char* b) {
#pragma unroll
      for (int kk = 0; kk < kStreamRows / 16; ++kk)
        wgmma_ss_bmn_n128<T>(acc, k_major_desc<kKeys>(a, kk),
                             smem_desc(b + 2 * c * kColBlock + kk * 16 * 128, kColBlock, 1024), 1);
      wgmma_commit();
    };
    // dq = dS K for column block `block` of K.
    const auto dq_block = [&](float (&dq)[32], int block) {
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        wgmma_ss_mn_n64<T>(dq, smem_desc(sm.dst(it) + kk * 16 * 128, 1024, 1024),
                           smem_desc(sm.k + block * kColBlock + kk * 16 * 128, 1024, 1024), kk > 0);
      wgmma_commit();
    };
    wgmma_fence();
    accumulate(dv, sm.pt(it), do_tile);
    dq_block(dq0, 2 * c);
    dq_block(dq1, 2 * c + 1);
    accumulate(dk, sm.dst(it), q_tile);
    wgmma_wait<3>();
    fence_regs(dv);
    if (lane == 0) mbar_arrive(sm.do_empty);
    const int64_t bh = kb.b * p.heads_q + kb.head(p, it);
    wgmma_wait<2>();
    fence_regs(dq0);
    add_dq_wide(dq_accum, stages, c, dq0, bh, kb.row(it), 2 * c, stats.rows_padded);
    wgmma_wait<1>();
    fence_regs(dq1);
    add_dq_wide(dq_accum, stages, c, dq1, bh, kb.row(it), 2 * c + 1, stats.rows_padded);
    wgmma_wait<0>();
    fence_regs(dk);
    if (lane == 0) mbar_arrive(&sm.q_empty[s]);
  }
  if (threadIdx.x % 128 == 0) bulk_wait_all();
  const int64_t row0 = kb.k0 + ((threadIdx.x / 32) % 4) * 16;
  store_rows<T, 128>(p.dk.at<T>(kb.b, 0, kb.hk), p.dk.row_stride, p.seqlen_k, p.head_dim, row0,
                     dk, p.softmax_scale, 128 * c);
  store_rows<T, 128>(p.dv.at<T>(kb.b, 0, kb.hk), p.dv.row_stride, p.seqlen_k, p.head_dim_v, row0,
                     dv, 1.0f, 128 * c);
}

#else

template <class T>
__global__ void hopper_wide_key_kernel(const AttentionParams, const __grid_constant__ BackwardMaps,
                                       const RowStats, float*) {}

#endif

// Kernel attributes are set once per instantiation.
template <class Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <int kHeadDim>
constexpr int smem_bytes() {
  if constexpr (kWide<kHeadDim>) return wide::kSmemBytes;
  else return Layout<kHeadDim>::kSmemBytes;
}

template <class T, int kHeadDim>
cudaError_t configure_kernels() {
  constexpr int kSmem = smem_bytes<kHeadDim>();
  static std::once_flag configured;
  static cudaError_t config_status = cudaSuccess;
  std::call_once(configured, [] {
    if constexpr (kWide<kHeadDim>) {
      config_status = allow_smem(hopper_wide_key_kernel<T>, kSmem);
    } else {
      for (cudaError_t e : {allow_smem(hopper_key_kernel<T, kHeadDim, true>, kSmem),
                            allow_smem(hopper_key_kernel<T, kHeadDim, false>, kSmem),
                            allow_smem(hopper_query_kernel<T, kHeadDim>, kSmem)})
        if (e != cudaSuccess && config_status == cudaSuccess) config_status = e;
    }
  });
  return config_status;
}

template <class T, int kHeadDim>
cudaError_t launch(const AttentionParams& p, const BackwardWorkspace& ws, cudaStream_t stream) {
  constexpr int kSmem = smem_bytes<kHeadDim>();
  constexpr int kKeysPerBlock = kWide<kHeadDim> ? wide::kKeys : kOwnRows;
  const bool fused = ws.dq_accum != nullptr;
  if (cudaError_t e = configure_kernels<T, kHeadDim>(); e != cudaSuccess) return e;
  const auto map = [&](CUtensorMap* m, const TensorRef& t, int64_t seqlen, int64_t heads,
                       int64_t dim, int rows) {
    return make_map(m, t, p.dtype, p.batch, seqlen, heads, dim, rows);
  };
  BackwardMaps key_maps, query_maps;
  if (!map(&key_maps.own_a, p.k, p.seqlen_k, p.heads_kv, p.head_dim, kKeysPerBlock) ||
      !map(&key_maps.own_b, p.v, p.seqlen_k, p.heads_kv, p.head_dim_v, kKeysPerBlock) ||
      !map(&key_maps.stream_a, p.q, p.seqlen_q, p.heads_q, p.head_dim, kStreamRows) ||
      !map(&key_maps.stream_b, p.dout, p.seqlen_q, p.heads_q, p.head_dim_v, kStreamRows) ||
      !map(&query_maps.own_a, p.q, p.seqlen_q, p.heads_q, p.head_dim, kOwnRows) ||
      !map(&query_maps.own_b, p.dout, p.seqlen_q, p.heads_q, p.head_dim_v, kOwnRows) ||
      !map(&query_maps.stream_a, p.k, p.seqlen_k, p.heads_kv, p.head_dim, kStreamRows) ||
      !map(&query_maps.stream_b, p.v, p.seqlen_k, p.heads_kv, p.head_dim_v, kStreamRows))
    return cudaErrorInvalidValue;
  const int64_t key_blocks =
      (p.seqlen_k + kKeysPerBlock - 1) / kKeysPerBlock * p.batch * p.heads_kv;
  const int64_t query_blocks = (p.seqlen_q + kOwnRows - 1) / kOwnRows * p.batch * p.heads_q;
  if (key_blocks > 0x7fffffff || query_blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const RowStats stats{ws.lse2_padded, ws.D_padded, ws.rows_padded};
  const unsigned elementwise_blocks = 8 * multiprocessor_count();  // grid-stride kernels
  stage_rows_kernel<<<elementwise_blocks, 256, 0, stream>>>(p, ws, fused);
  if (!fused) {  // deterministic: key kernel without dQ, then the query kernel
    if constexpr (kWide<kHeadDim>) {
      return cudaErrorNotSupported;  // hopper_backward_supports says no
    } else {
      hopper_key_kernel<T, kHeadDim, false>
          <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(p, key_maps, stats,
                                                                            nullptr);
      hopper_query_kernel<T, kHeadDim>
          <<<static_cast<unsigned>(query_blocks), kThreads, kSmem, stream>>>(p, query_maps, ws.D,
                                                                              ws.dsink_rows);
      return cudaGetLastError();
    }
  }
  const size_t accum_bytes =
      sizeof(float) * static_cast<size_t>(p.batch * p.heads_q * ws.rows_padded * ws.dq_cols);
  if (cudaError_t e = cudaMemsetAsync(ws.dq_accum, 0, accum_bytes, stream); e != cudaSuccess)
    return e;
  if constexpr (kWide<kHeadDim>)
    hopper_wide_key_kernel<T><<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(
        p, key_maps, stats, ws.dq_accum);
  else
    hopper_key_kernel<T, kHeadDim, true>
        <<<static_cast<unsigned>(key_blocks), kThreads, kSmem, stream>>>(p, key_maps, stats,
                                                                          ws.dq_accum);
  convert_dq_kernel<T, kHeadDim><<<elementwise_blocks, 256, 0, stream>>>(p, ws.dq_accum,
                                                                         ws.rows_padded);
  return cudaGetLastError();
}

}  // namespace

bool hopper_backward_supports(const AttentionParams& p) {
#ifdef FLASHJAX_HOPPER
  // As the forward (uniform layouts only, for now). Above head dim 128 only
  // the fused (non-deterministic) kernel exists; deterministic mode takes the
  // mma.sync path there.
  return p.uniform() && tensor_core_shapes(p) && (head_dim_bucket(p) <= 128 || !p.deterministic) &&
         p.head_dim >= 64 &&
         p.head_dim_v >= 64 && p.seqlen_q < (1 << 30) && p.seqlen_k < (1 << 30) &&
         compute_capability() == 90 && encode_fn() != nullptr;
#else
  (void)p;
  return false;
#endif
}

BackwardWorkspace hopper_backward_workspace(const AttentionParams& p, void* base) {
  // Deterministic mode computes dQ in its own kernel, without the float32 buffer.
  return BackwardWorkspace(p, base, true, p.deterministic ? 0 : head_dim_bucket(p));
}

cudaError_t hopper_backward(const AttentionParams& p, void* workspace, cudaStream_t stream) {
  const BackwardWorkspace ws = hopper_backward_workspace(p, workspace);
  if (cudaError_t e = backward_preprocess(p, ws.D, stream); e != cudaSuccess) return e;
  cudaError_t status = with_half_type(p.dtype, [&](auto tag) {
    if (head_dim_bucket(p) == 64) return launch<decltype(tag), 64>(p, ws, stream);
#ifdef FLASHJAX_TC_HEAD_DIM_256
    if (head_dim_bucket(p) == 256) return launch<decltype(tag), 256>(p, ws, stream);
#endif
    return launch<decltype(tag), 128>(p, ws, stream);
  });
  if (status != cudaSuccess) return status;
  return backward_dsinks(p, ws.dsink_rows, stream);
}

}  // namespace flashjax::cuda
