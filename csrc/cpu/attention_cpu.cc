#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "element.h"
#include "thread_pool.h"
#include "tile_math.h"

namespace flashjax::cpu {
namespace {

constexpr int64_t kBlockQ = 64;  // query rows per tile (multiple of 4)
constexpr int64_t kBlockK = 64;  // keys per tile (multiple of 16)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A parallel task index as (batch, head, tile), tile fastest.
struct Task {
  int64_t b, h, tile;
  Task(int64_t task, int64_t tiles, int64_t heads)
      : b(task / (tiles * heads)), h((task / tiles) % heads), tile(task % tiles) {}
};

// Where one head's rows live inside a (batch, seqlen, heads, dim) tensor.
struct HeadView {
  int64_t offset;      // element offset of row 0
  int64_t row_stride;  // elements between consecutive rows
};
HeadView head_view(int64_t b, int64_t seqlen, int64_t h, int64_t heads, int64_t dim) {
  return {(b * seqlen * heads + h) * dim, heads * dim};
}

// Copies `rows` rows of `dim` elements into a float tile of `ld` columns and
// `pad_rows` rows; the padding is zero so that it contributes nothing.
template <class T>
void load_tile(float* tile, int64_t ld, int64_t pad_rows, const T* base, HeadView view,
               int64_t row0, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < pad_rows; ++r) {
    float* dst = tile + r * ld;
    int64_t filled = 0;
    if (r < rows) {
      const T* src = base + view.offset + (row0 + r) * view.row_stride;
      for (int64_t c = 0; c < dim; ++c) dst[c] = to_float(src[c]);
      filled = dim;
    }
    std::fill(dst + filled, dst + ld, 0.0f);
  }
}

template <class T>
void store_tile(T* base, HeadView view, int64_t row0, int64_t rows, int64_t dim,
                const float* tile, int64_t ld, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = base + view.offset + (row0 + r) * view.row_stride;
    for (int64_t c = 0; c < dim; ++c) dst[c] = from_float<T>(tile[r * ld + c] * scale);
  }
}

// Turns raw q.k products into scores: scale, softcap, then -inf outside the
// visible window and beyond the `cols` valid keys of the tile.
FJ_MULTIVERSION
void finish_scores(float* S, const AttentionParams& p, int64_t q0, int64_t rows, int64_t k0,
                   int64_t cols, bool needs_mask) {
  const float scale = p.softmax_scale, cap = p.softcap;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = S + r * kBlockK;
    if (cap > 0.0f) {
      for (int64_t j = 0; j < kBlockK; ++j) s[j] = cap * std::tanh(s[j] * scale / cap);
    } else {
      for (int64_t j = 0; j < kBlockK; ++j) s[j] *= scale;
    }
    int64_t lo = 0, hi = cols;  // visible columns [lo, hi)
    if (needs_mask) {
      lo = std::clamp<int64_t>(p.first_key(q0 + r) - k0, 0, cols);
      hi = std::clamp<int64_t>(p.last_key(q0 + r) + 1 - k0, lo, cols);
    }
    for (int64_t j = 0; j < lo; ++j) s[j] = kNegInf;
    for (int64_t j = hi; j < kBlockK; ++j) s[j] = kNegInf;
  }
}

// One online-softmax step: S (scores) becomes P = exp(S - m_new), row maxima m
// and sums l are updated and O is rescaled by exp(m_old - m_new).
FJ_MULTIVERSION
void online_softmax(float* S, int64_t rows, float* m, float* l, float* O, int64_t ldo) {
  for (int64_t r = 0; r < kBlockQ; ++r) {
    float* s = S + r * kBlockK;
    if (r >= rows) {
      std::fill(s, s + kBlockK, 0.0f);
      continue;
    }
    const float m_new = std::max(m[r], row_max(s, kBlockK));
    if (m_new == kNegInf) {  // nothing visible yet in this row
      std::fill(s, s + kBlockK, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < kBlockK; ++j) s[j] = exp_approx(s[j] - m_new);
    const float sum = row_sum(s, kBlockK);
    const float alpha = exp_approx(m[r] - m_new);
    if (alpha != 1.0f) {
      float* o = O + r * ldo;
      for (int64_t c = 0; c < ldo; ++c) o[c] *= alpha;
    }
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
  }
}

// P = exp(S - lse) for the backward (0 where masked, in padding rows, or in rows
// that saw nothing).
FJ_MULTIVERSION
void probabilities(float* P, const float* S, int64_t rows, const float* lse) {
  for (int64_t r = 0; r < kBlockQ; ++r) {
    float* pr = P + r * kBlockK;
    const float* s = S + r * kBlockK;
    if (r >= rows || lse[r] == kNegInf) {
      std::fill(pr, pr + kBlockK, 0.0f);
      continue;
    }
    for (int64_t j = 0; j < kBlockK; ++j) pr[j] = exp_approx(s[j] - lse[r]);
  }
}

// dP becomes dS = dL/d(scaled q.k): P * (dP - D), times the softcap derivative.
FJ_MULTIVERSION
void score_gradient(float* dP, const float* P, const float* S, const float* D, float cap) {
  for (int64_t r = 0; r < kBlockQ; ++r) {
    float* g = dP + r * kBlockK;
    const float* pr = P + r * kBlockK;
    const float* s = S + r * kBlockK;
    for (int64_t j = 0; j < kBlockK; ++j) {
      float ds = pr[j] * (g[j] - D[r]);
      if (cap > 0.0f) {
        const float t = pr[j] > 0.0f ? s[j] / cap : 0.0f;
        ds *= 1.0f - t * t;
      }
      g[j] = ds;
    }
  }
}

// Per-call geometry shared by forward and backward.
struct Shape {
  int64_t dp, dvp;  // padded head dims
  int64_t q_tiles, k_tiles;
  explicit Shape(const AttentionParams& p)
      : dp(round_up(p.head_dim, kRowAlign)),
        dvp(round_up(p.head_dim_v, kRowAlign)),
        q_tiles(ceil_div(p.seqlen_q, kBlockQ)),
        k_tiles(ceil_div(p.seqlen_k, kBlockK)) {}
};

// Does every row of [q0, q0+rows) see every key of [k0, k0+cols)?
bool tile_needs_mask(const AttentionParams& p, int64_t q0, int64_t rows, int64_t k0,
                     int64_t cols) {
  return cols < kBlockK || k0 < p.first_key(q0 + rows - 1) || k0 + cols - 1 > p.last_key(q0);
}

float sink_logit(const AttentionParams& p, int64_t b, int64_t h) {
  return p.sinks ? p.sinks[b * p.heads_q + h] : kNegInf;
}

// ---------------------------------------------------------------- forward

template <class T>
void forward_tile(const AttentionParams& p, const Shape& shape, int64_t task) {
  const auto [b, h, qt] = Task(task, shape.q_tiles, p.heads_q);
  const int64_t hk = h / p.group_size();
  const int64_t q0 = qt * kBlockQ, rows = std::min(kBlockQ, p.seqlen_q - q0);
  const int64_t dp = shape.dp, dvp = shape.dvp;

  thread_local Scratch scratch;
  float* Q = scratch.get(kBlockQ * dp + 2 * dp * kBlockK + kBlockK * dvp +
                         kBlockQ * kBlockK + kBlockQ * dvp + 2 * kBlockQ);
  float* Kt = Q + kBlockQ * dp;
  float* Kr = Kt + dp * kBlockK;
  float* V = Kr + dp * kBlockK;
  float* S = V + kBlockK * dvp;
  float* O = S + kBlockQ * kBlockK;
  float* m = O + kBlockQ * dvp;
  float* l = m + kBlockQ;
  std::fill(O, O + kBlockQ * dvp, 0.0f);
  std::fill(m, m + kBlockQ, kNegInf);
  std::fill(l, l + kBlockQ, 0.0f);

  const auto* q = static_cast<const T*>(p.q);
  const auto* k = static_cast<const T*>(p.k);
  const auto* v = static_cast<const T*>(p.v);
  const HeadView qv = head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim);
  const HeadView kv = head_view(b, p.seqlen_k, hk, p.heads_kv, p.head_dim);
  const HeadView vv = head_view(b, p.seqlen_k, hk, p.heads_kv, p.head_dim_v);
  load_tile(Q, dp, kBlockQ, q, qv, q0, rows, p.head_dim);

  const int64_t key_begin = p.first_key(q0), key_end = p.last_key(q0 + rows - 1) + 1;
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, key_end - k0);
    load_tile(Kr, dp, kBlockK, k, kv, k0, cols, p.head_dim);
    transpose(Kt, kBlockK, Kr, dp, kBlockK, dp);
    load_tile(V, dvp, kBlockK, v, vv, k0, cols, p.head_dim_v);
    std::fill(S, S + kBlockQ * kBlockK, 0.0f);
    matmul_acc(S, kBlockK, Q, dp, Kt, kBlockK, kBlockQ, kBlockK, dp);
    finish_scores(S, p, q0, rows, k0, cols, tile_needs_mask(p, q0, rows, k0, cols));
    online_softmax(S, rows, m, l, O, dvp);
    matmul_acc(O, dvp, S, kBlockK, V, dvp, kBlockQ, dvp, kBlockK);
  }

  // Fold in the sink, normalise, and write out and lse.
  const float sink = sink_logit(p, b, h);
  float* lse = p.lse + (b * p.heads_q + h) * p.seqlen_q + q0;
  for (int64_t r = 0; r < rows; ++r) {
    const float m_final = std::max(m[r], sink);
    float* o = O + r * dvp;
    if (m_final == kNegInf) {  // the row saw no key and has no sink
      std::fill(o, o + dvp, 0.0f);
      lse[r] = kNegInf;
      continue;
    }
    const float keys_scale = std::exp(m[r] - m_final);
    const float total = l[r] * keys_scale + std::exp(sink - m_final);
    const float factor = keys_scale / total;
    for (int64_t c = 0; c < dvp; ++c) o[c] *= factor;
    lse[r] = m_final + std::log(total);
  }
  store_tile(static_cast<T*>(p.out), head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim_v), q0,
             rows, p.head_dim_v, O, dvp, 1.0f);
}

// ---------------------------------------------------------------- backward

// Tiles one backward task works on: Q/dO rows and K/V columns as floats.
struct BackwardTiles {
  float *Q, *dO, *Kr, *Kt, *Vr, *Vt, *S, *P, *dS, *T;  // T: transposed P or dS
  float *lse, *D;
  BackwardTiles(Scratch& scratch, const Shape& s) {
    const int64_t tile = kBlockQ * kBlockK;
    Q = scratch.get(kBlockQ * s.dp + kBlockQ * s.dvp + 2 * kBlockK * s.dp +
                    2 * s.dvp * kBlockK + 4 * tile + 2 * kBlockQ);
    dO = Q + kBlockQ * s.dp;
    Kr = dO + kBlockQ * s.dvp;
    Kt = Kr + kBlockK * s.dp;
    Vr = Kt + kBlockK * s.dp;
    Vt = Vr + kBlockK * s.dvp;
    S = Vt + s.dvp * kBlockK;
    P = S + tile;
    dS = P + tile;
    T = dS + tile;
    lse = T + tile;
    D = lse + kBlockQ;
  }
};

// Everything about a (batch, query head) pair that the backward tiles read.
template <class T>
struct BackwardHead {
  const AttentionParams& p;
  const Shape& shape;
  const float* D_all;  // rowsum(dO * O) - dlse, [batch, heads_q, seqlen_q]
  int64_t b, h;

  void load_rows(BackwardTiles& t, int64_t q0, int64_t rows) const {
    load_tile(t.Q, shape.dp, kBlockQ, static_cast<const T*>(p.q),
              head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim), q0, rows, p.head_dim);
    load_tile(t.dO, shape.dvp, kBlockQ, static_cast<const T*>(p.dout),
              head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim_v), q0, rows, p.head_dim_v);
    load_stats(t, q0, rows);
  }

  // The rows' lse and D (-inf and 0 past `rows`).
  void load_stats(BackwardTiles& t, int64_t q0, int64_t rows) const {
    const int64_t row_base = (b * p.heads_q + h) * p.seqlen_q + q0;
    for (int64_t r = 0; r < kBlockQ; ++r) {
      t.lse[r] = r < rows ? p.lse[row_base + r] : kNegInf;
      t.D[r] = r < rows ? D_all[row_base + r] : 0.0f;
    }
  }

  void load_keys(BackwardTiles& t, int64_t k0, int64_t cols) const {
    const int64_t hk = h / p.group_size();
    load_tile(t.Kr, shape.dp, kBlockK, static_cast<const T*>(p.k),
              head_view(b, p.seqlen_k, hk, p.heads_kv, p.head_dim), k0, cols, p.head_dim);
    transpose(t.Kt, kBlockK, t.Kr, shape.dp, kBlockK, shape.dp);
    load_tile(t.Vr, shape.dvp, kBlockK, static_cast<const T*>(p.v),
              head_view(b, p.seqlen_k, hk, p.heads_kv, p.head_dim_v), k0, cols, p.head_dim_v);
    transpose(t.Vt, kBlockK, t.Vr, shape.dvp, kBlockK, shape.dvp);
  }

  // Recomputes S and P for the loaded tiles and leaves dS in t.dS.
  void gradients(BackwardTiles& t, int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    std::fill(t.S, t.S + kBlockQ * kBlockK, 0.0f);
    matmul_acc(t.S, kBlockK, t.Q, shape.dp, t.Kt, kBlockK, kBlockQ, kBlockK, shape.dp);
    finish_scores(t.S, p, q0, rows, k0, cols, tile_needs_mask(p, q0, rows, k0, cols));
    probabilities(t.P, t.S, rows, t.lse);
    std::fill(t.dS, t.dS + kBlockQ * kBlockK, 0.0f);
    matmul_acc(t.dS, kBlockK, t.dO, shape.dvp, t.Vt, kBlockK, kBlockQ, kBlockK, shape.dvp);
    score_gradient(t.dS, t.P, t.S, t.D, p.softcap);
  }
};

// A query tile's share of dsinks[b, h]: d lse_i / d sink = p_sink_i and
// dL / d lse_i = -D_i.
float dsink_share(const AttentionParams& p, int64_t b, int64_t h, const float* lse,
                  const float* D, int64_t rows) {
  const float sink = sink_logit(p, b, h);
  float part = 0.0f;
  for (int64_t r = 0; r < rows; ++r)
    if (lse[r] != kNegInf) part -= std::exp(sink - lse[r]) * D[r];
  return part;
}

// D = rowsum(dO * O) - dlse for one (batch, head, q-tile).
template <class T>
void backward_preprocess(const AttentionParams& p, const Shape& shape, int64_t task,
                         float* D_all) {
  const auto [b, h, qt] = Task(task, shape.q_tiles, p.heads_q);
  const int64_t bh = b * p.heads_q + h;
  const int64_t q0 = qt * kBlockQ, rows = std::min(kBlockQ, p.seqlen_q - q0);
  const HeadView view = head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim_v);
  const auto* out = static_cast<const T*>(p.out);
  const auto* dout = static_cast<const T*>(p.dout);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = view.offset + (q0 + r) * view.row_stride;
    float sum = 0.0f;
    for (int64_t c = 0; c < p.head_dim_v; ++c) sum += to_float(out[at + c]) * to_float(dout[at + c]);
    const int64_t row = bh * p.seqlen_q + q0 + r;
    D_all[row] = sum - (p.dlse ? p.dlse[row] : 0.0f);
  }
}

// dK and dV of key tile [k0, k0 + cols) of kv head hk, summed over its
// query-head group, stored to p.dk / p.dv; with dQ (the group's heads, each
// rows_padded rows of shape.dp), also adds each query row's share of dQ.
template <class T>
void key_tile_gradients(const AttentionParams& p, const Shape& shape, const float* D_all,
                        BackwardTiles& t, float* dK, int64_t b, int64_t hk, int64_t k0,
                        int64_t cols, float* dQ, int64_t rows_padded) {
  float* dV = dK + kBlockK * shape.dp;
  std::fill(dK, dK + kBlockK * (shape.dp + shape.dvp), 0.0f);
  const int64_t row_begin = p.first_query(k0), row_end = p.last_query(k0 + cols - 1) + 1;
  const int64_t first_head = hk * p.group_size();
  BackwardHead<T>{p, shape, D_all, b, first_head}.load_keys(t, k0, cols);
  for (int64_t h = first_head; h < first_head + p.group_size(); ++h) {
    const BackwardHead<T> head{p, shape, D_all, b, h};
    for (int64_t q0 = row_begin; q0 < row_end; q0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, row_end - q0);
      head.load_rows(t, q0, rows);
      head.gradients(t, q0, rows, k0, cols);
      transpose(t.T, kBlockQ, t.P, kBlockK, kBlockQ, kBlockK);
      matmul_acc(dV, shape.dvp, t.T, kBlockQ, t.dO, shape.dvp, kBlockK, shape.dvp, kBlockQ);
      transpose(t.T, kBlockQ, t.dS, kBlockK, kBlockQ, kBlockK);
      matmul_acc(dK, shape.dp, t.T, kBlockQ, t.Q, shape.dp, kBlockK, shape.dp, kBlockQ);
      if (dQ)
        matmul_acc(dQ + ((h - first_head) * rows_padded + q0) * shape.dp, shape.dp, t.dS, kBlockK,
                   t.Kr, shape.dp, kBlockQ, shape.dp, kBlockK);
    }
  }
  store_tile(static_cast<T*>(p.dk), head_view(b, p.seqlen_k, hk, p.heads_kv, p.head_dim), k0,
             cols, p.head_dim, dK, shape.dp, p.softmax_scale);
  store_tile(static_cast<T*>(p.dv), head_view(b, p.seqlen_k, hk, p.heads_kv, p.head_dim_v), k0,
             cols, p.head_dim_v, dV, shape.dvp, 1.0f);
}

// Two-pass backward, pass 1: one key tile of one kv head.
template <class T>
void backward_key_tile(const AttentionParams& p, const Shape& shape, const float* D_all,
                       int64_t task) {
  const auto [b, hk, kt] = Task(task, shape.k_tiles, p.heads_kv);
  thread_local Scratch scratch, accum;
  BackwardTiles t(scratch, shape);
  float* dK = accum.get(kBlockK * (shape.dp + shape.dvp));
  const int64_t k0 = kt * kBlockK;
  key_tile_gradients<T>(p, shape, D_all, t, dK, b, hk, k0, std::min(kBlockK, p.seqlen_k - k0),
                        nullptr, 0);
}

// dQ of one query tile, and this tile's share of dsinks.
template <class T>
void backward_query_tile(const AttentionParams& p, const Shape& shape, const float* D_all,
                         int64_t task, float* dsink_parts) {
  const auto [b, h, qt] = Task(task, shape.q_tiles, p.heads_q);
  const int64_t q0 = qt * kBlockQ, rows = std::min(kBlockQ, p.seqlen_q - q0);

  thread_local Scratch scratch, accum;
  BackwardTiles t(scratch, shape);
  float* dQ = accum.get(kBlockQ * shape.dp);
  std::fill(dQ, dQ + kBlockQ * shape.dp, 0.0f);

  const BackwardHead<T> head{p, shape, D_all, b, h};
  head.load_rows(t, q0, rows);
  const int64_t key_begin = p.first_key(q0), key_end = p.last_key(q0 + rows - 1) + 1;
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, key_end - k0);
    head.load_keys(t, k0, cols);
    head.gradients(t, q0, rows, k0, cols);
    matmul_acc(dQ, shape.dp, t.dS, kBlockK, t.Kr, shape.dp, kBlockQ, shape.dp, kBlockK);
  }
  store_tile(static_cast<T*>(p.dq), head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim), q0, rows,
             p.head_dim, dQ, shape.dp, p.softmax_scale);

  if (p.sinks) dsink_parts[task] = dsink_share(p, b, h, t.lse, t.D, rows);
}

// dQ, dK and dV of one kv head's whole query-head group in one task: each tile
// pair costs 5 tile products instead of the two-pass 7 (dQ accumulates in a
// per-task buffer instead of being recomputed per query tile). Deterministic:
// one thread, fixed order.
template <class T>
void backward_group(const AttentionParams& p, const Shape& shape, const float* D_all,
                    int64_t task, float* dsink_parts) {
  const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
  const int64_t group = p.group_size(), first_head = hk * group;
  const int64_t rows_padded = p.seqlen_q + kBlockQ;  // a tile may overrun the last row

  thread_local Scratch scratch, accum;
  BackwardTiles t(scratch, shape);
  float* dK = accum.get(kBlockK * (shape.dp + shape.dvp));
  // Not thread_local: up to a few tens of MB per task, freed with the task.
  std::vector<float> dQ_buffer(group * rows_padded * shape.dp, 0.0f);
  float* dQ = dQ_buffer.data();
  for (int64_t kt = 0; kt < shape.k_tiles; ++kt) {
    const int64_t k0 = kt * kBlockK;
    key_tile_gradients<T>(p, shape, D_all, t, dK, b, hk, k0,
                          std::min(kBlockK, p.seqlen_k - k0), dQ, rows_padded);
  }
  for (int64_t h = first_head; h < first_head + group; ++h) {
    const float* dQ_head = dQ + (h - first_head) * rows_padded * shape.dp;
    store_tile(static_cast<T*>(p.dq), head_view(b, p.seqlen_q, h, p.heads_q, p.head_dim), 0,
               p.seqlen_q, p.head_dim, dQ_head, shape.dp, p.softmax_scale);
    if (!p.sinks) continue;
    const BackwardHead<T> head{p, shape, D_all, b, h};
    for (int64_t qt = 0; qt < shape.q_tiles; ++qt) {  // the same shares as the two-pass path
      const int64_t q0 = qt * kBlockQ, rows = std::min(kBlockQ, p.seqlen_q - q0);
      head.load_stats(t, q0, rows);
      dsink_parts[(b * p.heads_q + h) * shape.q_tiles + qt] =
          dsink_share(p, b, h, t.lse, t.D, rows);
    }
  }
}

// One pass (backward_group) when there are enough (batch, kv head) pairs to
// keep every thread busy and their dQ buffers are small (64 MB a task, 1 GB
// for all running at once); else two passes.
// FLASHJAX_CPU_BACKWARD=one-pass|two-pass forces a choice (tests run both).
bool use_one_pass(const AttentionParams& p, const Shape& shape) {
  const char* env = std::getenv("FLASHJAX_CPU_BACKWARD");
  if (env && std::strcmp(env, "one-pass") == 0) return true;
  if (env && std::strcmp(env, "two-pass") == 0) return false;
  constexpr int64_t kMaxTaskBytes = int64_t{64} << 20, kMaxTotalBytes = int64_t{1} << 30;
  const int64_t buffer = p.group_size() * (p.seqlen_q + kBlockQ) * shape.dp * 4;
  const int64_t tasks = p.batch * p.heads_kv;
  return tasks >= 2 * num_threads() && buffer <= kMaxTaskBytes &&
         buffer * std::min<int64_t>(tasks, num_threads()) <= kMaxTotalBytes;
}

template <class T>
void backward_impl(const AttentionParams& p) {
  const Shape shape(p);
  const int64_t bh_q = p.batch * p.heads_q;
  std::vector<float> D_all(bh_q * p.seqlen_q);
  parallel_for(bh_q * shape.q_tiles,
               [&](int64_t task) { backward_preprocess<T>(p, shape, task, D_all.data()); });
  std::vector<float> dsink_parts(p.sinks ? bh_q * shape.q_tiles : 0);
  if (use_one_pass(p, shape)) {
    parallel_for(p.batch * p.heads_kv, [&](int64_t task) {
      backward_group<T>(p, shape, D_all.data(), task, dsink_parts.data());
    });
  } else {
    parallel_for(p.batch * p.heads_kv * shape.k_tiles, [&](int64_t task) {
      backward_key_tile<T>(p, shape, D_all.data(), task);
    });
    parallel_for(bh_q * shape.q_tiles, [&](int64_t task) {
      backward_query_tile<T>(p, shape, D_all.data(), task, dsink_parts.data());
    });
  }
  if (p.sinks && p.dsinks) {  // fixed-order sum: deterministic
    for (int64_t bh = 0; bh < bh_q; ++bh) {
      float total = 0.0f;
      for (int64_t qt = 0; qt < shape.q_tiles; ++qt) total += dsink_parts[bh * shape.q_tiles + qt];
      p.dsinks[bh] = total;
    }
  } else if (p.dsinks) {
    std::fill(p.dsinks, p.dsinks + bh_q, 0.0f);
  }
}

}  // namespace

void attention_forward(const AttentionParams& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Shape shape(p);
    parallel_for(p.batch * p.heads_q * shape.q_tiles,
                 [&](int64_t task) { forward_tile<T>(p, shape, task); });
  });
}

void attention_backward(const AttentionParams& p) {
  dispatch_dtype(p.dtype, [&](auto tag) { backward_impl<decltype(tag)>(p); });
}

}  // namespace flashjax::cpu
