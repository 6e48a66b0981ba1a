// One description of an attention call, shared by the CPU path and the CUDA
// kernels. The FFI layer fills it from XLA buffers and attributes; kernels
// only read it. Every tensor is a TensorRef (explicit strides); where a
// sequence's rows are is SeqlenInfo's business (seqlen.h), so that dense,
// padded (seqused), packed (cu_seqlens) and later paged layouts differ in one
// place only.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FJ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FJ_HOST_DEVICE inline
#endif

#include "flashjax/dropout.h"

namespace flashjax {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The elements of a KV cache: q's dtype, or float8 (KvCache's descales).
enum class CacheElement : int32_t { kAsQuery = 0, kFloat8E4M3 = 1, kFloat8E5M2 = 2 };

// The GPU kernels a call may use: the fastest the device and call allow (kAny),
// at most the mma.sync tensor-core kernels, or the SIMT kernels only. Python's
// implementation="cuda:mma" / "cuda:simt" (a static option of the call); the CPU
// path ignores it.
enum class KernelCap : int32_t { kAny = 0, kMma = 1, kSimt = 2 };

inline constexpr int64_t kMaxHeadDim = 256;

FJ_HOST_DEVICE int64_t clamp_to(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// A tensor of (batch, rows, heads, [dim]) elements, the last dim contiguous.
// Packed (varlen) tensors have one batch entry of total_rows rows and
// batch_stride 0; per-row statistics (lse, D) are (batch, heads, rows) with
// row_stride 1.
struct TensorRef {
  void* data = nullptr;
  int64_t batch_stride = 0;  // elements
  int64_t row_stride = 0;
  int64_t head_stride = 0;

  FJ_HOST_DEVICE int64_t offset(int64_t batch, int64_t row, int64_t head) const {
    return batch * batch_stride + row * row_stride + head * head_stride;
  }
  // Element 0 of (batch, row, head); T may be const.
  template <class T>
  FJ_HOST_DEVICE T* at(int64_t batch, int64_t row, int64_t head) const {
    return static_cast<T*>(data) + offset(batch, row, head);
  }
  explicit FJ_HOST_DEVICE operator bool() const { return data != nullptr; }

  // A contiguous (batch, rows, heads, dim) tensor.
  static TensorRef rows_heads_dim(void* data, int64_t rows, int64_t heads, int64_t dim) {
    return {data, rows * heads * dim, heads * dim, dim};
  }
  // A contiguous (batch, heads, rows) array of per-row float32 statistics.
  static TensorRef heads_rows(void* data, int64_t rows, int64_t heads) {
    return {data, heads * rows, 1, rows};
  }
};

// One sequence's row of a page table: logical row r lies in row r % page_rows
// of page pages[r / page_rows].
struct PageRow {
  const int32_t* pages = nullptr;  // null: not paged
  int64_t page_rows = 0, num_pages = 0;
  // false (page clamped to 0, in bounds) when the page is outside the pool.
  // (32-bit division where it fits: the hot loop of paged decoding.)
  FJ_HOST_DEVICE bool locate(int64_t r, int64_t& page, int64_t& row) const {
    const bool narrow = r <= 0x7fffffff && page_rows <= 0x7fffffff;
    const int64_t index = narrow ? static_cast<uint32_t>(r) / static_cast<uint32_t>(page_rows)
                                 : r / page_rows;
    page = pages[index];
    row = r - index * page_rows;
    const bool inside = page >= 0 && page < num_pages;
    page = inside ? page : 0;
    return inside;
  }
};

// A KV cache the keys and values are read from (flash_attention_with_kvcache):
// sequence b's keys are its logical cache rows [leftpad, seqlens + new_rows)
// (clamped to the capacity), where logical row r lies in row r of cache entry
// batch_idx[b] (contiguous), or in row r % slot_rows of page
// page_table[b][r / slot_rows] (paged). k and v of AttentionParams are then the
// caches: (slots, slot_rows, heads_kv, dim). The new rows (k_new, v_new) are
// written at logical rows seqlens.. before the attention reads them.
struct KvCache {
  const int32_t* seqlens = nullptr;     // [batch] rows before the new ones; set = cache layout
  const int32_t* leftpad = nullptr;     // [batch] first valid row (null: 0)
  const int32_t* batch_idx = nullptr;   // [batch] cache entry (contiguous; null: b)
  const int32_t* page_table = nullptr;  // [batch, max_pages] (null: contiguous)
  int64_t max_pages = 0;
  int64_t slots = 0;      // cache entries, or pages
  int64_t slot_rows = 0;  // rows of an entry (seqlen_cache), or page_size
  int64_t new_rows = 0;   // seqlen_new (0: nothing appended)
  TensorRef k_new, v_new; // [batch, new_rows, heads_kv, dim]
  // Float8 caches (q and the new rows in q's dtype): element x of sequence b, kv
  // head h stands for x * descale[b * heads_kv + h]; a new row x is stored as
  // x * (1 / descale) rounded to the cache's float8 type.
  CacheElement element = CacheElement::kAsQuery;
  const float* k_descale = nullptr;  // [batch, heads_kv]
  const float* v_descale = nullptr;

  FJ_HOST_DEVICE bool active() const { return seqlens != nullptr; }
  FJ_HOST_DEVICE bool paged() const { return page_table != nullptr; }
  FJ_HOST_DEVICE bool float8() const { return element != CacheElement::kAsQuery; }
  // Logical rows a sequence can hold.
  FJ_HOST_DEVICE int64_t capacity() const { return paged() ? max_pages * slot_rows : slot_rows; }
  FJ_HOST_DEVICE PageRow page_row(int64_t b) const {
    return paged() ? PageRow{page_table + b * max_pages, slot_rows, slots} : PageRow{};
  }
  // Sequence b's rows before the new ones (cache_seqlens, clamped to the capacity).
  FJ_HOST_DEVICE int64_t cached_rows(int64_t b) const {
    return clamp_to(seqlens[b], 0, capacity());
  }
  // Where new row j of sequence b is written: false (nothing written) past the
  // capacity or in an entry or page outside the cache.
  FJ_HOST_DEVICE bool append_location(int64_t b, int64_t j, int64_t& slot, int64_t& row) const {
    const int64_t r = cached_rows(b) + j;
    return r < capacity() && locate(b, r, slot, row);
  }
  // Where logical row r (in [0, capacity)) of sequence b lies: (slot, row of
  // the slot); false (slot clamped to 0) when the page or entry is outside
  // the cache.
  FJ_HOST_DEVICE bool locate(int64_t b, int64_t r, int64_t& slot, int64_t& row) const {
    if (paged()) return page_row(b).locate(r, slot, row);
    slot = batch_idx ? batch_idx[b] : b;
    row = r;
    const bool inside = slot >= 0 && slot < slots;
    slot = inside ? slot : 0;
    return inside;
  }
};

// float8 q, k, v (flash_attention's fp8 forward, the Hopper kernel; the other paths
// dequantise in Python): for sequence b, kv head h (q's heads by their kv head), q.k
// stands for q.k * score_descale[b * heads_kv + h] (q_descale * k_descale, made >= 0 by
// flipping q's sign in Python, so that the kernels' row maxima stay maxima) and V's
// element x for x * v_descale[..]. `vt` is V transposed to (batch, heads_kv,
// head_dim_v, vt_keys) with each kFloat8KeyBlock keys permuted into the order in which
// a thread's accumulators pack into the 8-bit wgmma A operand (permuted_key;
// docs/architecture.md, "float8 inputs"); AttentionParams::v stays V (the exact
// recompute of non-finite rows reads it). AttentionParams::dtype is out's then.
inline constexpr int64_t kFloat8KeyBlock = 32;
struct Float8Inputs {
  CacheElement element = CacheElement::kAsQuery;  // kAsQuery: not float8
  const float* score_descale = nullptr;           // [batch, heads_kv]
  const float* v_descale = nullptr;               // [batch, heads_kv]
  TensorRef vt;         // row_stride: vt_keys; "rows" are head dims
  int64_t vt_keys = 0;  // seqlen_k rounded up to kFloat8KeyBlock

  FJ_HOST_DEVICE bool active() const { return element != CacheElement::kAsQuery; }
  // Slot k of a kFloat8KeyBlock-key block of vt holds key permuted_key(k) of the block:
  // slots 4 t .. 4 t + 3 of each 16 hold keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9.
  FJ_HOST_DEVICE static int permuted_key(int k) {
    const int half = k / 16, t = (k % 16) / 4, j = k % 4;
    return 16 * half + 2 * t + (j & 1) + 8 * (j >> 1);
  }
  // The factors of q.k and of V for sequence b, kv head hk (1 when not float8).
  FJ_HOST_DEVICE float score_factor(int64_t b, int64_t hk, int64_t heads_kv) const {
    return active() ? score_descale[b * heads_kv + hk] : 1.0f;
  }
  FJ_HOST_DEVICE float value_factor(int64_t b, int64_t hk, int64_t heads_kv) const {
    return active() ? v_descale[b * heads_kv + hk] : 1.0f;
  }
};

// A (batch.., heads, seqlen_q, seqlen_k) array of per-score values (bias: float32,
// mask: bool) whose batch and heads may broadcast: sequence b, query head h read
// entry (b / batch_div, h / head_div) (batch entries 1 or batch: batch_div = batch
// or 1, also after vmap folds its axis into batch; heads 1, heads_kv or heads_q:
// head_div = heads_q, group or 1); row i (a slot row: dense layout only), key j at
// i * row_stride + j. dbias has its bias's shape and strides.
struct ScoreArray {
  void* data = nullptr;
  int64_t batch_div = 1, head_div = 1;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;  // elements

  // Element (0, 0) of sequence b, query head h; T may be const.
  template <class T>
  FJ_HOST_DEVICE T* at(int64_t b, int64_t h) const {
    // (no division where nothing broadcasts: kernels look entries up per tile)
    const int64_t eb = batch_div == 1 ? b : b / batch_div, eh = head_div == 1 ? h : h / head_div;
    return static_cast<T*>(data) + eb * batch_stride + eh * head_stride;
  }
  explicit FJ_HOST_DEVICE operator bool() const { return data != nullptr; }
  // Several (sequence, head)s read each entry (a dbias entry sums them).
  FJ_HOST_DEVICE bool broadcast() const { return batch_div > 1 || head_div > 1; }
};

// Attention dropout (dropout.h): `words` [batch, heads_q, 4] uint32 holds, per
// (sequence, query head), the key (k0, k1) and the mask indices (b, h) its elements
// use (a vmapped axis folded into batch, or a batch- or head-shard, keeps each
// instance's key and its unbatched call's indices); probabilities are multiplied by
// `scale` = 1 / (1 - rate) where the mask keeps them and by 0 where it drops them.
// The lse is the undropped one.
struct Dropout {
  const uint32_t* words = nullptr;  // null: no dropout
  uint32_t threshold = 0;           // dropout::threshold(rate)
  float scale = 1.0f;

  explicit FJ_HOST_DEVICE operator bool() const { return words != nullptr; }
  // The generator and mask indices of sequence b, query head h.
  struct Head {
    dropout::Generator generator;
    uint32_t b = 0, h = 0;
    // Keep bits of the 8 elements of group (x1, x0) (Generator::group_keep_bits).
    FJ_HOST_DEVICE uint32_t group_keep_bits(uint32_t x1, uint32_t x0) const {
      return generator.group_keep_bits(b, h, x1, x0);
    }
  };
  FJ_HOST_DEVICE Head head(int64_t b, int64_t h, int64_t heads_q) const {
    const uint32_t* w = words + (b * heads_q + h) * 4;
    return Head{dropout::Generator{w[0], w[1], threshold}, w[2], w[3]};
  }
};

struct AttentionParams {
  // Shapes. `batch` is the number of sequences: the dense batch (every leading
  // dimension folded in: vmap adds them) or, packed, len(cu_seqlens) - 1.
  // seqlen_q / seqlen_k are the rows of one sequence's slot: the padded length
  // when dense, max_seqlen when packed (lengths are clamped to it).
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  DType dtype = DType::kFloat32;

  // Semantics. Causal is folded into window_right = 0 by the caller.
  float softmax_scale = 1.0f;
  float softcap = 0.0f;          // 0 = off
  int64_t window_left = -1;      // -1 = unbounded
  int64_t window_right = -1;     // -1 = unbounded

  // Sequence layout (int32 device arrays, all optional; see seqlen.h).
  const int32_t* cu_seqlens_q = nullptr;   // [batch + 1]: set = packed layout
  const int32_t* cu_seqlens_k = nullptr;   // [batch + 1] (set together with _q)
  int64_t total_q = 0, total_k = 0;        // rows of the packed tensors
  const int32_t* seqused_q = nullptr;      // [batch]: rows of each sequence taking part
  const int32_t* seqused_k = nullptr;      // [batch]
  const int32_t* q_segment_ids = nullptr;  // [batch, seqlen_q] (dense only)
  const int32_t* kv_segment_ids = nullptr; // [batch, seqlen_k]: q sees k iff ids equal
  // [batch]: query row i's diagonal is key i + diagonal_offset[b] (the query's
  // position minus the first key's: a query/key position offset, e.g. a shard of
  // a longer sequence). null: bottom-right alignment, used seqlen_k - seqlen_q.
  const int32_t* diagonal_offset = nullptr;
  KvCache cache;                           // keys from a KV cache (seqlen_k = its capacity)
  Float8Inputs float8;                     // float8 q, k, v (dense, Hopper)

  // Score terms (dense layout only for bias and mask): the score of query i, key j is
  // softcap(scale * q.k) + bias - slope * |i + diagonal - j| (SeqlenInfo's diagonal),
  // and -inf where mask is false (on top of windows and segment ids).
  ScoreArray bias;                         // float32 [batch|1, heads_q|heads_kv|1, seqlen_q, seqlen_k]
  ScoreArray mask;                         // bool, the same shapes as bias
  const float* alibi_slopes = nullptr;     // [batch, heads_q] ALiBi slopes
  Dropout dropout;                         // attention dropout (null words: none)

  // Forward tensors.
  TensorRef q;                   // [batch, seqlen_q, heads_q, head_dim]
  TensorRef k;                   // [batch, seqlen_k, heads_kv, head_dim]
  TensorRef v;                   // [batch, seqlen_k, heads_kv, head_dim_v]
  const float* sinks = nullptr;  // [batch, heads_q], nullptr = no sinks
  TensorRef out;                 // like q, head_dim_v
  TensorRef lse;                 // float32 [batch, heads_q, seqlen_q]

  // Backward tensors (unused by the forward).
  TensorRef dout;                // like out
  TensorRef dlse;                // like lse: cotangent of the returned lse (may be null)
  TensorRef dq;                  // like q
  TensorRef dk;                  // like k
  TensorRef dv;                  // like v
  float* dsinks = nullptr;       // [batch, heads_q]
  ScoreArray dbias;              // float32, bias's shape: summed over what bias broadcasts
                                 // (null: not wanted, Options::bias_gradient false)
  bool deterministic = false;    // GPU: bitwise-repeatable dq accumulation
  KernelCap kernel_cap = KernelCap::kAny;

  FJ_HOST_DEVICE int64_t group_size() const { return heads_q / heads_kv; }
  FJ_HOST_DEVICE bool packed() const { return cu_seqlens_q != nullptr; }
  FJ_HOST_DEVICE bool has_segments() const { return q_segment_ids != nullptr; }
  // Every sequence fills its whole slot: the kernels' original, fastest case.
  FJ_HOST_DEVICE bool uniform() const {
    return !packed() && !seqused_q && !seqused_k && !has_segments() && !cache.active() &&
           !diagonal_offset;
  }
  // Bias, mask or ALiBi terms in the scores.
  FJ_HOST_DEVICE bool has_score_terms() const {
    return static_cast<bool>(bias) || static_cast<bool>(mask) || alibi_slopes != nullptr;
  }
  // Score terms or dropout: what the CUDA kernels' terms variants (kTerms) read.
  FJ_HOST_DEVICE bool has_pair_terms() const {
    return has_score_terms() || static_cast<bool>(dropout);
  }
};

}  // namespace flashjax
