// Split-KV attention over a KV cache (see kvcache_attention.h). Decoding reads
// every cached key once per step and computes little with it, so what matters
// is how many bytes are in flight: the keys of one sequence are split over
// enough CTAs to fill the GPU, each keeping two 64-key K and V tiles in flight
// (a three-stage cp.async pipeline) while it computes on a third. Cache rows
// are found through SeqlenInfo::k_location (contiguous, leftpad, batch index or
// page table alike), row by row, so any page size works; a tile's rows are
// located one iteration before its loads are issued (split_kv_common.cuh).
// (Paged caches still decode 1.04-1.11x slower than contiguous ones;
// benchmarks/NOTES.md has what was measured and tried.) Caches of q's dtype
// run split_kv_kernel below (16 packed query rows a CTA, Q K^T); float8 caches
// split_kv_float8_kernel (split_kv_float8.cuh: 8 rows a CTA, keys as the mma's
// rows, the float8 stages widened on their way into the fragments).
#include "kvcache_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../common/dispatch.h"
#include "../common/nonfinite.cuh"
#include "../common/softmax.cuh"
#include "split_kv_common.cuh"
#include "split_kv_float8.cuh"

namespace flashjax::cuda {
namespace {

using namespace split_kv;

constexpr int kRows = 16;  // packed query rows per CTA: one mma row block
constexpr int kAppendThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int kCombineThreads = 256;  // a CTA per output row:
constexpr int kSplitGroups = 4;       // 4 groups of 64 threads (head_dim_v / 2 column pairs)
// combine_kernel's compiled splits per thread: up to 8, 32 and kMaxSplits splits.
constexpr int kCombineBuckets[] = {2, 8, kMaxSplits / kSplitGroups};

// Calls fn(C{}) with the cache element type of p (T: the cache holds q's dtype).
template <class T, class Fn>
cudaError_t with_cache_element(const AttentionParams& p, Fn&& fn) {
  switch (p.cache.element) {
    case CacheElement::kAsQuery: return fn(T{});
    case CacheElement::kFloat8E4M3: return fn(__nv_fp8_e4m3{});
    case CacheElement::kFloat8E5M2: return fn(__nv_fp8_e5m2{});
  }
  return cudaErrorInvalidValue;
}

// Shared memory: the query tile, then kStages (K, V) tiles. The warps' merge
// of their softmax states reuses everything past the query.
template <int kHeadDim>
struct SplitSmem {
  static constexpr int kQueryBytes = kRows * kHeadDim * 2;
  static constexpr int kBytes = kQueryBytes + kStages * 2 * kBlockN * kHeadDim * 2;
  static_assert(WarpStates<kHeadDim, kRows>::kBytes <= kBytes - kQueryBytes,
                "the merge must fit past the query");
};

// CTA (b, kv head, 16-row tile, split) over a cache of q's dtype T: attention
// of the tile's packed query rows over the split's share of the 64-key tiles
// the rows see.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    split_kv_kernel(const __grid_constant__ AttentionParams p, int splits,
                    const __grid_constant__ Partials partials) {
  using Smem = SplitSmem<kHeadDim>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* stages = reinterpret_cast<T*>(smem_raw + Smem::kQueryBytes);

  const SplitCta<kRows> cta(p, splits);
  const SeqlenInfo& seq = cta.seq;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  load_query<T, kHeadDim>(p, cta, sQ);  // (with the first tile's group)
  KeyStages<kHeadDim, T, kRows> pipeline(p, cta, stages);
  pipeline.start();

  constexpr int kDimTiles = kHeadDim / 8, kKeyTiles = kKeysPerWarp / 8;
  RowSoftmax softmax{cta.row0 + lane / 4, static_cast<int>(p.seqlen_q)};
  float o[kDimTiles * 4] = {};
  for (int tile = cta.tile_first; tile < cta.tile_end; ++tile) {
    pipeline.load(tile + kStages - 1);  // into the stage tile - 1 freed
    cp_async_wait<kStages - 1>();
    __syncthreads();  // tile landed for every thread
    const T* sK = pipeline.stage(tile) + warp * kKeysPerWarp * kHeadDim;
    const T* sV = sK + kBlockN * kHeadDim;
    const int64_t k0 = cta.tile_k0(tile) + warp * kKeysPerWarp;
    if (k0 < cta.keys.key_end && k0 + kKeysPerWarp > cta.keys.key_begin) {
      float s[kKeyTiles * 4];
      gemm_abt<T, kHeadDim, kKeysPerWarp>(s, sQ, 0, sK);
      const bool masked = RowSoftmax::tile_needs_mask(seq, cta.q_first, cta.q_last, k0,
                                                      kKeysPerWarp, cta.keys.key_begin,
                                                      cta.keys.key_end);
      softmax.scores<kKeyTiles>(s, p, seq, k0, masked);
      softmax.update<kKeyTiles, kDimTiles>(s, o);
      // A masked slice whose V holds NaN or inf takes the exact product
      // (common/nonfinite.cuh says why); the check costs masked slices only.
      if (masked && __any_sync(0xffffffffu, tile_has_nonfinite<T>(sV, kKeysPerWarp * kHeadDim,
                                                                  lane, 32))) {
        float hidden[kKeyTiles * 4] = {};
        softmax.mask<kKeyTiles>(hidden, seq, k0);
        gemm_ab_masked<T, kHeadDim, kKeysPerWarp>(o, s, hidden, SwizzledRows<T, kHeadDim>{sV});
      } else {
        gemm_ab<T, kHeadDim, kKeysPerWarp>(o, s, sV);
      }
    }
    __syncthreads();  // every warp is done with the stage before it is refilled
  }
  cp_async_wait<0>();
  allow_dependent_grid_launch();

  // The warps' softmax states through shared memory (past the query).
  const WarpStates<kHeadDim, kRows> states(stages);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r, slot = warp * kRows + row;
    float l = softmax.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
      states.m[slot] = softmax.m[r];
      states.l[slot] = l;
    }
#pragma unroll
    for (int n = 0; n < kDimTiles; ++n) {
      states.o[slot * kHeadDim + 8 * n + 2 * t] = o[4 * n + 2 * r];
      states.o[slot * kHeadDim + 8 * n + 2 * t + 1] = o[4 * n + 2 * r + 1];
    }
  }
  __syncthreads();
  states.template write<T>(p, cta, splits, partials, 1.0f);
}


// Reduces x over the CTA with op (a warp's shuffles, then the warps' results
// through shared memory); every thread gets the result.
template <int kThreadsPerCta, class Op>
__device__ float cta_reduce(float x, Op op, float (&warp_results)[kThreadsPerCta / 32]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    x = op(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if (threadIdx.x % 32 == 0) warp_results[threadIdx.x / 32] = x;
  __syncthreads();
  x = warp_results[0];
#pragma unroll
  for (int w = 1; w < kThreadsPerCta / 32; ++w) x = op(x, warp_results[w]);
  __syncthreads();  // warp_results may be reused
  return x;
}

// One CTA per output row: merges the splits' partial results. A thread per
// split reads its lse and the CTA reduces them to the keys' lse and each
// split's weight (no serial loop over the splits: the merge is
// latency-bound); kSplitGroups groups of threads each sum every
// kSplitGroups-th split of a pass's columns, and shared memory adds the
// groups up (partials just written are in L2). A thread's partials of the
// first pass are loaded with its lse, before the reductions, all at once (a
// fixed, predicated count): one L2 round trip for the whole merge, not one
// for the lse and one per few splits (b1 8k, 33 splits: 3 more; 64k float8,
// 66 splits: 5 more). kGroupSplits, a thread's splits at most, is compiled
// for a few split counts (kCombineBuckets): the registers of 32 (120) would
// leave room for 2 CTAs an SM where batch 16 has 512 rows of 2 splits.
template <class T, int kGroupSplits>
__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const __grid_constant__ AttentionParams p, int splits,
                   const __grid_constant__ Partials partials) {
  static_assert(kMaxSplits <= kCombineThreads, "a thread per split");
  constexpr int kGroupThreads = kCombineThreads / kSplitGroups;
  constexpr int kPassColumns = 2 * kGroupThreads;
  wait_for_prerequisite_grid();
  __shared__ float split_weight[kMaxSplits];
  __shared__ float warp_results[kCombineThreads / 32];
  __shared__ float2 group_sums[kSplitGroups][kGroupThreads];
  // (rows < 2^31: launch_split_kv checks)
  const int row = blockIdx.x, seqlen_q = static_cast<int>(p.seqlen_q);
  const int i = row % seqlen_q, h = row / seqlen_q % static_cast<int>(p.heads_q),
            b = row / (seqlen_q * static_cast<int>(p.heads_q));
  const int split = threadIdx.x;
  const int group = threadIdx.x / kGroupThreads, lane = threadIdx.x % kGroupThreads;
  const int64_t split_stride = partials.rows * p.head_dim_v;
  // Columns [col0, col0 + kPassColumns): this thread's 2 of every group split
  // (a running pointer: 64-bit products per load made the loads wait ~500
  // instructions).
  float2 x[kGroupSplits];
  const auto load_pass = [&](int col0) {
    const bool in_dim = col0 + 2 * lane < p.head_dim_v;
    const float* at = partials.out + group * split_stride + row * p.head_dim_v + col0 + 2 * lane;
#pragma unroll
    for (int k = 0; k < kGroupSplits; ++k, at += kSplitGroups * split_stride)
      x[k] = group + k * kSplitGroups < splits && in_dim
                 ? *reinterpret_cast<const float2*>(at)
                 : make_float2(0.0f, 0.0f);
  };
  const float lse2 = split < splits ? partials.lse2[split * partials.rows + row] : kNegInf;
  load_pass(0);
  const float m = cta_reduce<kCombineThreads>(lse2, [](float x, float y) { return fmaxf(x, y); },
                                              warp_results);
  // A split that saw no key wrote out 0 and lse -inf: weight 0.
  const float e = lse2 == kNegInf ? 0.0f : fast_exp2(lse2 - (m == kNegInf ? 0.0f : m));
  const float total = cta_reduce<kCombineThreads>(e, [](float x, float y) { return x + y; },
                                                  warp_results);
  // total == 0: no split saw a key; a NaN split (fmaxf dropped it from m) makes
  // total, the lse and every weight NaN, as that row's out and lse must be.
  const bool seen = total != 0.0f;
  const float keys_lse2 = seen ? m + __log2f(total) : kNegInf;
  if (split < kMaxSplits) split_weight[split] = split < splits && seen ? e / total : 0.0f;
  __syncthreads();
  for (int col0 = 0; col0 < p.head_dim_v; col0 += kPassColumns) {
    if (col0 > 0) load_pass(col0);
    float2 sum = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < kGroupSplits; ++k) {
      const float w = split_weight[group + k * kSplitGroups];  // (0 past splits; < kMaxSplits)
      sum.x += w * x[k].x;
      sum.y += w * x[k].y;
    }
    group_sums[group][lane] = sum;
    __syncthreads();
    const int col = col0 + 2 * lane;
    if (group == 0 && col < p.head_dim_v) {
#pragma unroll
      for (int g = 1; g < kSplitGroups; ++g) {
        sum.x += group_sums[g][lane].x;
        sum.y += group_sums[g][lane].y;
      }
      write_output<T>(p, b, i, h, col, keys_lse2, sum.x, sum.y);
    }
    __syncthreads();
  }
}

// New element x (of q's dtype T) as a cache of elements C stores it: as it is,
// or x * (1 / descales[at]) rounded to the nearest float8 (out of range: e4m3's
// NaN, e5m2's inf; as jnp.asarray(x * (1 / descale), float8 dtype)).
template <class C, class T>
__device__ __forceinline__ C cache_element(T x, const float* descales, int64_t at) {
  if constexpr (kFloat8<C>) {
    C y;
    y.__x = __nv_cvt_float_to_fp8(static_cast<float>(x) * (1.0f / descales[at]), __NV_NOSAT,
                                  kFloat8Format<C>);
    return y;
  } else {
    return x;
  }
}

// A CTA row (blockIdx.y, striding) per new row (b, j); threads over its kv
// heads' elements, k's then v's (32-bit index arithmetic within a row).
template <class T, class C>
__global__ void append_kernel(const __grid_constant__ AttentionParams p) {
  const KvCache& c = p.cache;
  const int per_head = static_cast<int>(p.head_dim + p.head_dim_v);
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= per_head * p.heads_kv) return;
  const int hk = e / per_head, element = e % per_head;
  for (int64_t new_row = blockIdx.y; new_row < p.batch * c.new_rows; new_row += gridDim.y) {
    const int64_t b = new_row / c.new_rows, j = new_row % c.new_rows;
    int64_t slot, row;
    if (!c.append_location(b, j, slot, row)) continue;
    const int64_t at = b * p.heads_kv + hk;  // (descales: float8 caches only)
    if (element < p.head_dim)
      p.k.at<C>(slot, row, hk)[element] =
          cache_element<C>(c.k_new.at<const T>(b, j, hk)[element], c.k_descale, at);
    else
      p.v.at<C>(slot, row, hk)[element - p.head_dim] = cache_element<C>(
          c.v_new.at<const T>(b, j, hk)[element - p.head_dim], c.v_descale, at);
  }
}

// The split kernel of cache element C, its CTA rows and shared memory bytes.
template <class T, class C, int kHeadDim>
struct SplitKernel {
  static constexpr bool kKeyMajor = kFloat8<C>;
  static constexpr int kCtaRows = kKeyMajor ? kFloat8Rows : kRows;
  static constexpr int kSmemBytes =
      kKeyMajor ? Float8Smem<kHeadDim>::kBytes : SplitSmem<kHeadDim>::kBytes;
  static constexpr auto kernel() {
    if constexpr (kKeyMajor) return split_kv_float8_kernel<T, C, kHeadDim>;
    else return split_kv_kernel<T, kHeadDim>;
  }
};

template <class T, class C, int kHeadDim>
cudaError_t launch_split_kv(const AttentionParams& p, int splits, void* workspace,
                            cudaStream_t stream) {
  using Split = SplitKernel<T, C, kHeadDim>;
  static DeviceOnce configured;
  if (cudaError_t e = configured([] {
        return cudaFuncSetAttribute(Split::kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Split::kSmemBytes);
      });
      e != cudaSuccess)
    return e;
  const Partials partials(p, splits, workspace);
  if (splits > 1 && !partials.out) return cudaErrorInvalidValue;  // no workspace
  const int64_t blocks = split_kv_ctas<Split::kCtaRows>(p, splits);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  Split::kernel()<<<static_cast<unsigned>(blocks), kThreads, Split::kSmemBytes, stream>>>(
      p, splits, partials);
  if (splits == 1) return cudaGetLastError();
  if (partials.rows > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const auto combine = [&](auto kernel) {
    return launch_early(kernel, dim3(static_cast<unsigned>(partials.rows)), dim3(kCombineThreads),
                        0, stream, p, splits, partials);
  };
  const int group_splits = (splits + kSplitGroups - 1) / kSplitGroups;
  if (group_splits <= kCombineBuckets[0]) return combine(combine_kernel<T, kCombineBuckets[0]>);
  if (group_splits <= kCombineBuckets[1]) return combine(combine_kernel<T, kCombineBuckets[1]>);
  return combine(combine_kernel<T, kCombineBuckets[2]>);
}

}  // namespace

cudaError_t append_to_cache(const AttentionParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.cache.new_rows;
  const int64_t per_row = p.heads_kv * (p.head_dim + p.head_dim_v);
  if (rows == 0) return cudaSuccess;
  if (per_row > 0x7fffffff) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>((per_row + kAppendThreads - 1) / kAppendThreads),
                  static_cast<unsigned>(rows < kMaxGridY ? rows : kMaxGridY));  // y strides
  return with_dtype(kAllTypes, p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_cache_element<T>(p, [&](auto cache_tag) {
      append_kernel<T, decltype(cache_tag)><<<grid, kAppendThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

// KeyTileRows addresses a cache row by its 32-bit index in the pool of dense
// (slots, slot_rows, heads_kv, dim) caches.
bool pool_rows_fit_32_bits(const AttentionParams& p) {
  const KvCache& c = p.cache;
  const auto dense = [&](const TensorRef& t) {
    return t.batch_stride == c.slot_rows * t.row_stride && t.row_stride <= INT32_MAX / 2;
  };
  return c.slots * c.slot_rows <= INT32_MAX && dense(p.k) && dense(p.v);
}

bool split_kv_supports(const AttentionParams& p) {
  // (float8 rows load in 16-byte chunks of 16 elements)
  const bool whole_chunks = !p.cache.float8() || (p.head_dim % 16 == 0 && p.head_dim_v % 16 == 0);
  return p.cache.active() && tensor_core_shapes(p) && whole_chunks && pool_rows_fit_32_bits(p) &&
         p.seqlen_q * p.group_size() <= INT32_MAX && compute_capability() >= 80;
}

size_t split_kv_workspace_bytes(const AttentionParams& p, int splits) {
  return Partials::bytes(p, splits);
}

cudaError_t split_kv_forward(const AttentionParams& p, int splits, void* workspace,
                             cudaStream_t stream) {
  if (splits < 1 || splits > kMaxSplits || !p.cache.active()) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // (an append only)
  return with_dtype(kHalfTypes, p.dtype, [&](auto tag) {
    using T = decltype(tag);
    return with_cache_element<T>(p, [&](auto cache_tag) {
      return with_bucket(kTensorCoreBuckets, p, [&](auto dim) {
        return launch_split_kv<T, decltype(cache_tag), decltype(dim)::value>(p, splits,
                                                                            workspace, stream);
      });
    });
  });
}

}  // namespace flashjax::cuda
