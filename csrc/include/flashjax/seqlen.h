// Where one sequence's queries and keys live and which of them see which: the
// one place that knows about dense, padded (seqused), packed (cu_seqlens) and
// segment-id layouts. Built once per work tile, on host and device alike.
//
// A sequence owns a *slot* of rows in each tensor (the dense seqlen, or its
// cu_seqlens range); the kernels write every row of the slot. Its first
// *used* rows (seqused, else the whole slot) take part; the rest of the slot
// gets output 0, lse -inf and zero gradients.
//
// Inconsistent metadata is data, so it is clamped rather than trusted:
// cu_seqlens entries to [0, total], each slot's end to at least its start
// (a non-monotonic pair gives an empty slot), a slot to max_seqlen rows
// (seqlen_q/seqlen_k of the params), seqused to [0, slot]. Rows no slot
// covers are zero-filled (out, lse = -inf, dq, dk, dv) by fill_uncovered_rows.
#pragma once

#include "flashjax/params.h"

namespace flashjax {

struct SeqlenInfo {
  int64_t batch = 0;             // index into the query-side tensors' batch dimension
  int64_t k_batch = 0;           // and the key side's (a KV cache's entry)
  PageRow pages;                 // set when the keys are a paged cache's
  int64_t q_start = 0, k_start = 0;  // first row of the slot
  int64_t q_slot = 0, k_slot = 0;    // rows of the slot
  int64_t seqlen_q = 0, seqlen_k = 0;  // used rows
  int64_t window_left = -1, window_right = -1;
  int64_t diagonal = 0;  // query row i's diagonal is key i + diagonal

  SeqlenInfo() = default;
  FJ_HOST_DEVICE SeqlenInfo(const AttentionParams& p, int64_t b)
      : window_left(p.window_left), window_right(p.window_right) {
    if (p.packed()) {
      q_start = clamp_to(p.cu_seqlens_q[b], 0, p.total_q);
      k_start = clamp_to(p.cu_seqlens_k[b], 0, p.total_k);
      // At most max_seqlen rows, and none past the tensor's end.
      q_slot = clamp_to(p.cu_seqlens_q[b + 1] - q_start, 0,
                        p.seqlen_q < p.total_q - q_start ? p.seqlen_q : p.total_q - q_start);
      k_slot = clamp_to(p.cu_seqlens_k[b + 1] - k_start, 0,
                        p.seqlen_k < p.total_k - k_start ? p.seqlen_k : p.total_k - k_start);
    } else {
      batch = k_batch = b;
      q_slot = p.seqlen_q;
      k_slot = p.seqlen_k;
    }
    seqlen_q = p.seqused_q ? clamp_to(p.seqused_q[b], 0, q_slot) : q_slot;
    seqlen_k = p.seqused_k ? clamp_to(p.seqused_k[b], 0, k_slot) : k_slot;
    if (p.cache.active()) set_cache_keys(p.cache, b);
    diagonal = p.diagonal_offset ? p.diagonal_offset[b] : seqlen_k - seqlen_q;
  }

  // SeqlenInfo(p, b) of a p.uniform() call, from the shapes alone (no
  // metadata reads): kernels compiled for uniform calls only keep their
  // constant-folded dense arithmetic.
  FJ_HOST_DEVICE static SeqlenInfo uniform(const AttentionParams& p, int64_t b) {
    SeqlenInfo s;
    s.batch = s.k_batch = b;
    s.q_slot = s.seqlen_q = p.seqlen_q;
    s.k_slot = s.seqlen_k = p.seqlen_k;
    s.window_left = p.window_left;
    s.window_right = p.window_right;
    s.diagonal = p.seqlen_k - p.seqlen_q;
    return s;
  }

  // Row i's diagonal is key i + offset: the call's position offset, else
  // bottom-right alignment on the used lengths.
  FJ_HOST_DEVICE int64_t diagonal_offset() const { return diagonal; }

  // Visible keys [first_key(i), last_key(i)] of query row i (slot-relative;
  // empty, first > last, for rows past the used ones).
  FJ_HOST_DEVICE int64_t first_key(int64_t i) const {
    const int64_t lo = window_left < 0 ? 0 : i + diagonal_offset() - window_left;
    return lo < 0 ? 0 : lo;
  }
  FJ_HOST_DEVICE int64_t last_key(int64_t i) const {
    if (i >= seqlen_q) return -1;
    const int64_t hi = window_right < 0 ? seqlen_k - 1 : i + diagonal_offset() + window_right;
    return hi > seqlen_k - 1 ? seqlen_k - 1 : hi;
  }
  // Query rows that see key j: [first_query(j), last_query(j)] (may be empty).
  FJ_HOST_DEVICE int64_t first_query(int64_t j) const {
    const int64_t lo = window_right < 0 ? 0 : j - diagonal_offset() - window_right;
    return lo < 0 ? 0 : lo;
  }
  FJ_HOST_DEVICE int64_t last_query(int64_t j) const {
    if (j >= seqlen_k) return -1;
    const int64_t hi = window_left < 0 ? seqlen_q - 1 : j - diagonal_offset() + window_left;
    return hi > seqlen_q - 1 ? seqlen_q - 1 : hi;
  }

  // Tensor rows of slot rows (for TensorRef::at with `batch`, `k_batch`; not
  // for a paged cache's keys, which k_at finds).
  FJ_HOST_DEVICE int64_t q_row(int64_t i) const { return q_start + i; }
  FJ_HOST_DEVICE int64_t k_row(int64_t j) const { return k_start + j; }
  // Element 0 of slot row i, head h of a query-side tensor (q, out, dout, dq,
  // lse, dlse) or slot row j of a key-side one (k, v, dk, dv); T may be const.
  template <class T>
  FJ_HOST_DEVICE T* q_at(const TensorRef& t, int64_t i, int64_t h) const {
    return t.at<T>(batch, q_row(i), h);
  }
  template <class T>
  FJ_HOST_DEVICE T* k_at(const TensorRef& t, int64_t j, int64_t h) const {
    int64_t batch_index, row;
    k_location(j, batch_index, row);
    return t.at<T>(batch_index, row, h);
  }
  // The (batch index, row) of slot row j of a key-side tensor; a page outside
  // the pool reads page 0 (in bounds, unspecified).
  FJ_HOST_DEVICE void k_location(int64_t j, int64_t& batch_index, int64_t& row) const {
    if (pages.pages) {
      pages.locate(k_row(j), batch_index, row);
    } else {
      batch_index = k_batch;
      row = k_row(j);
    }
  }

 private:
  // Keys are cache rows [leftpad, seqlens + new_rows) of the sequence's entry
  // or pages, clamped to the capacity; an entry outside the cache has none.
  FJ_HOST_DEVICE void set_cache_keys(const KvCache& c, int64_t b) {
    const int64_t capacity = c.capacity();
    k_start = c.leftpad ? clamp_to(c.leftpad[b], 0, capacity) : 0;
    // (KvCache::cached_rows(b), spelled out: calling it here changed the code of
    // every kernel that builds a SeqlenInfo, for no run-time difference.)
    const int64_t end = clamp_to(clamp_to(c.seqlens[b], 0, capacity) + c.new_rows, 0, capacity);
    k_slot = capacity - k_start;
    seqlen_k = end > k_start ? end - k_start : 0;
    pages = c.page_row(b);
    int64_t row;
    if (!c.paged() && !c.locate(b, 0, k_batch, row)) seqlen_k = 0;
  }
};

// Segment ids (dense layout only): query i of sequence b sees key j only when
// their ids are equal, on top of the SeqlenInfo ranges. null ids: no segments.
struct SegmentIds {
  const int32_t* q = nullptr;  // this sequence's row of q_segment_ids
  const int32_t* k = nullptr;
  SegmentIds() = default;
  FJ_HOST_DEVICE SegmentIds(const AttentionParams& p, int64_t b) {
    if (p.has_segments()) {
      q = p.q_segment_ids + b * p.seqlen_q;
      k = p.kv_segment_ids + b * p.seqlen_k;
    }
  }
  explicit FJ_HOST_DEVICE operator bool() const { return q != nullptr; }
  FJ_HOST_DEVICE bool visible(int64_t i, int64_t j) const { return !q || q[i] == k[j]; }
};

// An inclusive range of segment ids (a tile's); empty when lo > hi.
struct IdRange {
  int32_t lo = 2147483647, hi = -2147483647 - 1;
  FJ_HOST_DEVICE void add(int32_t id) {
    lo = id < lo ? id : lo;
    hi = id > hi ? id : hi;
  }
  FJ_HOST_DEVICE bool meets(const IdRange& o) const { return lo <= o.hi && o.lo <= hi; }
  // Every id here equals every id of o (one id each, the same): every pair is
  // visible, so no per-element comparison is needed.
  FJ_HOST_DEVICE bool all_equal(const IdRange& o) const {
    return lo == hi && o.lo == o.hi && lo == o.lo;
  }
};

}  // namespace flashjax
