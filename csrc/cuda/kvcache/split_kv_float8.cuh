// The split-KV kernel of float8 caches: keys as the mma's rows. Decoding has
// few query rows a kv head (GQA 4, one token: 4), so the 16-bit kernel's
// 16-row Q K^T wastes most of each product; here a CTA takes 8 packed query
// rows, the mma's n8, and each warp computes S^T = K Q^T (its 16 keys as the
// m16 rows) and O^T += V^T P^T (16 dims at a time as the rows):
// - K's A fragments come straight from the float8 stage: an ldmatrix of byte
//   pairs gives a lane bytes 4t..4t+3 of a key's 16-dim chunk, widened to
//   halves as the k indices 2t, 2t + 1 (low pair) and 2t + 8, 2t + 9 (high
//   pair); the query's B fragments, kept in registers for the whole loop,
//   take their dims in that order;
// - V^T's A fragments: an ldmatrix.trans of byte pairs gives a lane the dims
//   2g, 2g + 1 of keys 2t, 2t + 1; one byte permute and two conversions make
//   the halves of (keys 2t, 2t + 1) at dim 2g (row g of the product) and at
//   dim 2g + 1 (row g + 8): output row r of dim chunk c is dim 16c + 2(r % 8) + r / 8;
// - P^T, an accumulator fragment (keys as rows), becomes the B operand by one
//   movmatrix.trans per 8 keys.
// Every e4m3 and e5m2 value is a half: the products are in half, bfloat16
// queries rescaled per row by a power of two once per CTA (query_to_half),
// and the descales scale the scores and the output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "../common/nonfinite.cuh"
#include "../common/score_mod.cuh"
#include "../common/softmax.cuh"
#include "split_kv_common.cuh"

namespace flashjax::cuda::split_kv {

constexpr int kFloat8Rows = 8;  // packed query rows per CTA: the mma's n8

// Shared memory: the 16-bit query tile, kStages (K, V) stages of float8 rows
// (float8_swizzled), the query rows' float32 score scales. The warps' merge
// reuses everything past the query.
template <int kHeadDim>
struct Float8Smem {
  static constexpr int kQueryBytes = kFloat8Rows * kHeadDim * 2;
  static constexpr int kRowScaleOffset = kQueryBytes + kStages * 2 * kBlockN * kHeadDim;
  static constexpr int kBytes = kRowScaleOffset + kFloat8Rows * int{sizeof(float)};
  static_assert(WarpStates<kHeadDim, kFloat8Rows>::kBytes <= kBytes - kQueryBytes,
                "the merge must fit past the query");
};

// 4 CTAs an SM at d <= 128 (shared memory allows 4 at d128; kvcache.py's
// split count assumes as many), as shared memory allows at d256 (2).
template <int kHeadDim>
inline constexpr int kFloat8MinCtasPerSm = kHeadDim <= 128 ? 4 : 2;

// Two float8 values (the low and high byte of `pair`) as a pair of halves, in
// one instruction and exactly.
template <class C>
__device__ __forceinline__ uint32_t widen_pair(uint16_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, kFloat8Format<C>);
  return static_cast<uint32_t>(h.x) | static_cast<uint32_t>(h.y) << 16;
}
template <class C>
__device__ __forceinline__ float float8_value(uint8_t x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x, kFloat8Format<C>)));
}

// The 8x8 16-bit matrix of a warp's fragment (row lane / 4, columns
// 2 (lane % 4) and + 1 in x), transposed.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Whether one of the four float8 values of x is NaN or inf (e4m3: NaN only).
template <class C>
__device__ __forceinline__ bool nonfinite_float8x4(uint32_t x) {
  constexpr uint32_t kExp = std::is_same_v<C, __nv_fp8_e4m3> ? 0x7f7f7f7fu : 0x7c7c7c7cu;
  return __vcmpeq4(x & kExp, kExp) != 0;
}

// Float8 caches under bfloat16 queries compute in half: each query row of the
// tile (in place, swizzled) is multiplied by the power of two 2^shift that
// brings its largest magnitude into [2^14, 2^15), exactly (a bfloat16's 8
// significant bits fit a half's 11 wherever a value is within 2^-28 of its
// row's largest; smaller ones round at 2^-39 of it), and unscale[row] =
// 2^-shift. kLanesPerRow threads share a row (whole warps: the others wait).
// (A row with inf keeps inf, and its scores are inf or NaN as in bfloat16; a
// NaN stays NaN.)
template <int kHeadDim, int kRows>
__device__ void query_to_half(void* tile, float* unscale) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kLanesPerRow = kThreads / kRows < kChunks ? kThreads / kRows : kChunks;
  constexpr int kPerLane = kChunks / kLanesPerRow;
  constexpr int kTopShift = 141, kMaxShift = 126;  // 2^(141 - 127 - e): [2^14, 2^15)
  static_assert(kChunks % kLanesPerRow == 0 && 32 % kLanesPerRow == 0 &&
                    kRows * kLanesPerRow % 32 == 0, "a row's lanes, whole warps");
  if (threadIdx.x >= kRows * kLanesPerRow) return;
  const int row = threadIdx.x / kLanesPerRow, first = threadIdx.x % kLanesPerRow;
  uint4* chunks = static_cast<uint4*>(tile);
  uint4 x[kPerLane];
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = chunks[swizzled<kHeadDim>(row, first + kLanesPerRow * i) / 8];
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&x[i]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      largest = fmaxf(largest, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int offset = 1; offset < kLanesPerRow; offset <<= 1)
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  const int exponent = static_cast<int>(__float_as_uint(largest) >> 23);  // (largest >= 0)
  const int shift = min(kMaxShift, kTopShift - exponent);
  const float scale = __uint_as_float(static_cast<uint32_t>(127 + shift) << 23);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&x[i]);
    uint4 y;
    __half2* halves = reinterpret_cast<__half2*>(&y);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(pairs[j]);
      halves[j] = __floats2half2_rn(f.x * scale, f.y * scale);
    }
    chunks[swizzled<kHeadDim>(row, first + kLanesPerRow * i) / 8] = y;
  }
  if (first == 0) unscale[row] = __uint_as_float(static_cast<uint32_t>(127 - shift) << 23);
}

// The online softmax of a thread's two query columns 2t, 2t + 1 (S^T: the
// queries are the fragment's columns, a warp's keys its rows g and g + 8):
// running max and sum per column (log2 units; the sum is this thread's
// keys', summed over the column's 8 lanes at the end), and the keys each
// column's query sees.
struct QueryColumns {
  float m[2] = {kNegInf, kNegInf};
  float l[2] = {0.0f, 0.0f};
  int first_key[2], last_key[2];  // (32-bit: the keys are rows of a pool of < 2^31 rows)

  template <int kCtaRows>
  __device__ explicit QueryColumns(const SplitCta<kCtaRows>& cta) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = cta.row0 + 2 * t + j;
      const bool used = row < cta.rows.count;  // (an unused row sees nothing)
      first_key[j] = used ? static_cast<int>(cta.seq.first_key(cta.rows.query(row))) : 0;
      last_key[j] = used ? static_cast<int>(cta.seq.last_key(cta.rows.query(row))) : -1;
    }
  }
  // s (S^T fragment: e = 2 * (key half) + column) -inf where the column's query
  // does not see key k0 + g (+ 8); hidden says where.
  __device__ void mask(float (&s)[4], bool (&hidden)[4], int k0) const {
    const int g = threadIdx.x % 32 / 4;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = k0 + g + 8 * (e / 2);
      hidden[e] = key < first_key[e % 2] || key > last_key[e % 2];
      if (hidden[e]) s[e] = kNegInf;
    }
  }
  // s becomes exp2(s - m_new); alpha = exp2(m_old - m_new) per column.
  __device__ void exponentiate(float (&s)[4], float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float mx = fmaxf(m[j], fmaxf(s[j], s[j + 2]));
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, offset));
      const float base = mx == kNegInf ? 0.0f : mx;  // nothing visible yet: keep zeros
      alpha[j] = fast_exp2(m[j] - base);
      s[j] = fast_exp2(s[j] - base);
      s[j + 2] = fast_exp2(s[j + 2] - base);
      l[j] = l[j] * alpha[j] + (s[j] + s[j + 2]);
      m[j] = mx;
    }
  }
  // l summed over the column's lanes.
  __device__ void reduce_sums() {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1)
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], offset);
  }
};

// o (O^T fragments, kHeadDim / 16 dim chunks) += V^T P^T over the warp's 16
// keys, summing only the pairs not hidden, each p * v as IEEE arithmetic
// does (nonfinite.cuh's gemm_ab_masked, for this layout): for the rare masked
// slices whose V holds NaN or inf. p: S^T probabilities (rounded to half
// here, as the mma takes them); stage_v: the warp's float8 V rows.
template <class C, int kHeadDim>
__device__ void key_major_masked_product(float (&o)[kHeadDim / 4], const float (&p)[4],
                                         const bool (&hidden)[4], const C* stage_v) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const uint8_t* v = reinterpret_cast<const uint8_t*>(stage_v);
#pragma unroll 1
  for (int key = 0; key < kKeysPerWarp; ++key) {
    // Key `key` is row key % 8 of lane (key % 8) * 4 + t's fragment, half key / 8.
    const bool upper = key >= 8;
    const int src = (key % 8) * 4 + t;
    float pk[2];
    bool hid[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      pk[j] = __half2float(__float2half_rn(__shfl_sync(0xffffffffu, upper ? p[2 + j] : p[j], src)));
      hid[j] = __shfl_sync(0xffffffffu, static_cast<int>(upper ? hidden[2 + j] : hidden[j]), src);
    }
#pragma unroll
    for (int c = 0; c < kHeadDim / 16; ++c)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float x = float8_value<C>(v[float8_swizzled<kHeadDim>(key, c) + 2 * g + r]);
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (!hid[j]) o[4 * c + 2 * r + j] += pk[j] * x;
      }
  }
}

// CTA (b, kv head, 8-row tile, split): attention of the tile's packed query
// rows over the split's share of the 64-key tiles the rows see.
template <class T, class C, int kHeadDim>
__global__ void __launch_bounds__(kThreads, kFloat8MinCtasPerSm<kHeadDim>)
    split_kv_float8_kernel(const __grid_constant__ AttentionParams p, int splits,
                           const __grid_constant__ Partials partials) {
  static_assert(kFloat8<C>, "float8 caches");
  using Smem = Float8Smem<kHeadDim>;
  constexpr int kDimChunks = kHeadDim / 16;  // k-steps of S^T, row blocks of O^T
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  C* stages = reinterpret_cast<C*>(smem_raw + Smem::kQueryBytes);

  const SplitCta<kFloat8Rows> cta(p, splits);
  const Descales<C> descales(p.cache, cta.b, cta.hk, p.heads_kv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  load_query<T, kHeadDim>(p, cta, sQ);
  cp_async_commit();  // (its own group: converted first)
  KeyStages<kHeadDim, C, kFloat8Rows> pipeline(p, cta, stages);
  pipeline.start();

  // The query's B fragments (Q^T) of every k-step, in K's dim order: dims
  // 16 kk + 4t .. + 3 of query row g. The scores' scale per column: k_descale
  // and the inverse of query_to_half's rescaling.
  float score_scale[2] = {descales.k, descales.k};
  cp_async_wait<kStages - 1>();  // the query's group
  __syncthreads();
  if constexpr (!std::is_same_v<T, __half>) {
    float* unscale = reinterpret_cast<float*>(smem_raw + Smem::kRowScaleOffset);
    query_to_half<kHeadDim, kFloat8Rows>(sQ, unscale);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2; ++j) score_scale[j] *= unscale[2 * t + j];
  }
  uint2 query[kDimChunks];
#pragma unroll
  for (int kk = 0; kk < kDimChunks; ++kk)
    query[kk] = *reinterpret_cast<const uint2*>(
        reinterpret_cast<const __half*>(sQ) + swizzled<kHeadDim>(g, 2 * kk + t / 2) + 4 * (t % 2));

  // A lane's ldmatrix row: key lane % 16 of the warp's, dim chunk lane / 16 of each pair.
  const int ld_row = warp * kKeysPerWarp + lane % 16, ld_chunk = lane / 16;
  QueryColumns columns(cta);
  // A warp's keys [k0, k0 + 16) need no mask exactly for lo <= k0 <= hi.
  int32_t unmasked_lo, unmasked_hi;
  RowSoftmax::unmasked_tiles(cta.seq, cta.q_first, cta.q_last, kKeysPerWarp, cta.keys.key_begin,
                             cta.keys.key_end, unmasked_lo, unmasked_hi);
  float o[kDimChunks * 4] = {};
  for (int tile = cta.tile_first; tile < cta.tile_end; ++tile) {
    pipeline.load(tile + kStages - 1);  // into the stage tile - 1 freed
    cp_async_wait<kStages - 1>();
    __syncthreads();  // tile landed for every thread
    const C* stage_k = pipeline.stage(tile);
    const C* stage_v = stage_k + kBlockN * kHeadDim;
    const int k0 = static_cast<int>(cta.tile_k0(tile)) + warp * kKeysPerWarp;
    if (k0 < cta.keys.key_end && k0 + kKeysPerWarp > cta.keys.key_begin) {
      // S^T = K Q^T: per pair of dim chunks, 4 8x8 matrices of byte pairs
      // (keys 0-7, 8-15 of chunk 2i, then of chunk 2i + 1).
      float s[4] = {};
#pragma unroll
      for (int i = 0; i < kDimChunks / 2; ++i) {
        uint32_t r[4];
        ldmatrix_x4(r, stage_k + float8_swizzled<kHeadDim>(ld_row, 2 * i + ld_chunk));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a[4] = {
              widen_pair<C>(r[2 * h] & 0xffffu), widen_pair<C>(r[2 * h + 1] & 0xffffu),
              widen_pair<C>(r[2 * h] >> 16), widen_pair<C>(r[2 * h + 1] >> 16)};
          mma<__half>(s, a, query[2 * i + h].x, query[2 * i + h].y);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[e] *= score_scale[e % 2];
      scores_log2(s, p);
      const bool masked = k0 < unmasked_lo || k0 > unmasked_hi;
      bool hidden[4] = {};
      if (masked) columns.mask(s, hidden, k0);
      float alpha[2];
      columns.exponentiate(s, alpha);
#pragma unroll
      for (int c = 0; c < kDimChunks; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[4 * c + e] *= alpha[e % 2];
      // A masked slice whose V holds NaN or inf takes the exact product
      // (common/nonfinite.cuh says why); the check costs masked slices only.
      const C* warp_v = stage_v + warp * kKeysPerWarp * kHeadDim;
      const uint4* v_chunks = reinterpret_cast<const uint4*>(warp_v);
      bool nonfinite = false;
      if (masked) {
        for (int i = lane; i < kKeysPerWarp * kHeadDim / 16; i += 32) {
          const uint4 x = v_chunks[i];
          nonfinite |= nonfinite_float8x4<C>(x.x) | nonfinite_float8x4<C>(x.y) |
                       nonfinite_float8x4<C>(x.z) | nonfinite_float8x4<C>(x.w);
        }
      }
      if (masked && __any_sync(0xffffffffu, nonfinite)) {
        key_major_masked_product<C, kHeadDim>(o, s, hidden, warp_v);
      } else {
        // O^T += V^T P^T: P^T's B fragment by movmatrix (keys 2t, 2t + 1 and
        // + 8 of column g); per pair of dim chunks, 4 transposed matrices.
        const uint32_t b0 = movmatrix_trans(pack2<__half>(s[0], s[1]));
        const uint32_t b1 = movmatrix_trans(pack2<__half>(s[2], s[3]));
#pragma unroll
        for (int i = 0; i < kDimChunks / 2; ++i) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, stage_v + float8_swizzled<kHeadDim>(ld_row, 2 * i + ld_chunk));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // dims 2g, 2g + 1 of keys 2t, 2t + 1 -> (keys 2t, 2t + 1) at each dim
            const uint32_t lo = __byte_perm(r[2 * h], 0, 0x3120);
            const uint32_t hi = __byte_perm(r[2 * h + 1], 0, 0x3120);
            const uint32_t a[4] = {widen_pair<C>(lo & 0xffffu), widen_pair<C>(lo >> 16),
                                   widen_pair<C>(hi & 0xffffu), widen_pair<C>(hi >> 16)};
            mma<__half>(tile4(o, 2 * i + h), a, b0, b1);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with the stage before it is refilled
  }
  cp_async_wait<0>();
  allow_dependent_grid_launch();

  // The warps' states through shared memory (past the query): dim 16c + 2g + r
  // of column 2t + j is o[4c + 2r + j].
  const WarpStates<kHeadDim, kFloat8Rows> states(stages);
  columns.reduce_sums();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int slot = warp * kFloat8Rows + 2 * t + j;
    if (g == 0) {
      states.m[slot] = columns.m[j];
      states.l[slot] = columns.l[j];
    }
#pragma unroll
    for (int c = 0; c < kDimChunks; ++c)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        states.o[slot * kHeadDim + 16 * c + 2 * g + r] = o[4 * c + 2 * r + j];
  }
  __syncthreads();
  states.template write<T>(p, cta, splits, partials, descales.v);
}

}  // namespace flashjax::cuda::split_kv
