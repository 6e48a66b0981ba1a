#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "element.h"
#include "float8.h"
#include "flashjax/score_terms.h"
#include "flashjax/seqlen.h"
#include "thread_pool.h"
#include "tile_math.h"

namespace flashjax::cpu {
namespace {

// Tile sizes: a 128 x 128 score tile (64 KB) and the Q / K / V / O tiles of
// head_dim 64 (32 KB each) stay in L2.
constexpr int64_t kBlockQ = 128;  // query rows per tile (multiple of 4)
// The forward's query tiles are taller: each K / V tile loaded and K transposed
// then serves 256 rows (the backward reuses its key tiles over all query tiles).
constexpr int64_t kForwardBlockQ = 256;
constexpr int64_t kBlockK = 128;  // keys per tile (multiple of kRowAlign)
// A masked forward tile (the causal diagonal, a sequence's end) computes its
// products in chunks of rows, each only up to the last key its rows see.
constexpr int64_t kRaggedChunkRows = 32;
constexpr float kNegInf = kNegInfinity;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A parallel task index as (sequence, head, tile), tile fastest.
struct Task {
  int64_t b, h, tile;
  Task(int64_t task, int64_t tiles, int64_t heads)
      : b(task / (tiles * heads)), h((task / tiles) % heads), tile(task % tiles) {}
};

// One head of a query-side or key-side tensor as a sequence sees it: slot
// row i is where SeqlenInfo puts it (q_at / k_at: the one place that knows).
struct HeadRows {
  const TensorRef& ref;
  const SeqlenInfo& seq;
  int64_t head;
  bool keys;
  template <class T>
  T* row(int64_t i) const { return keys ? seq.k_at<T>(ref, i, head) : seq.q_at<T>(ref, i, head); }
};
HeadRows query_rows(const TensorRef& ref, const SeqlenInfo& seq, int64_t h) {
  return {ref, seq, h, false};
}
HeadRows key_rows(const TensorRef& ref, const SeqlenInfo& seq, int64_t h) {
  return {ref, seq, h, true};
}

// Copies `rows` rows of `dim` elements, times `scale`, into a float tile of
// `ld` columns and `pad_rows` rows; the padding is zero so that it contributes
// nothing.
template <class T>
void load_tile(float* tile, int64_t ld, int64_t pad_rows, HeadRows src_rows, int64_t row0,
               int64_t rows, int64_t dim, float scale = 1.0f) {
  for (int64_t r = 0; r < pad_rows; ++r) {
    float* dst = tile + r * ld;
    int64_t filled = 0;
    if (r < rows) {
      const T* src = src_rows.row<const T>(row0 + r);
      for (int64_t c = 0; c < dim; ++c) dst[c] = to_float(src[c]) * scale;
      filled = dim;
    }
    std::fill(dst + filled, dst + ld, 0.0f);
  }
}

template <class T>
void store_tile(HeadRows dst_rows, int64_t row0, int64_t rows, int64_t dim, const float* tile,
                int64_t ld, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = dst_rows.row<T>(row0 + r);
    for (int64_t c = 0; c < dim; ++c) dst[c] = from_float<T>(tile[r * ld + c] * scale);
  }
}

// The segment ids of a tile pair (ranges read once): whether they can meet at
// all, and whether every pair shares one id (then no per-element check).
class TileSegments {
 public:
  TileSegments(const SegmentIds& ids, int64_t q0, int64_t rows, int64_t k0, int64_t cols)
      : present_(static_cast<bool>(ids)) {
    if (!present_) return;
    for (int64_t i = 0; i < rows; ++i) q_.add(ids.q[q0 + i]);
    for (int64_t j = 0; j < cols; ++j) k_.add(ids.k[k0 + j]);
  }
  bool meet() const { return !present_ || q_.meets(k_); }
  bool uniform() const { return !present_ || q_.all_equal(k_); }

 private:
  bool present_;
  IdRange q_, k_;
};

// Attention dropout of one (sequence, query head) (params.h Dropout, dropout.h's
// mask) over a tile pair: a Philox call per 8 elements. Inactive (no dropout): the
// tile code skips it, one branch per tile.
struct TileDropout {
  bool active = false;
  Dropout::Head head;

  TileDropout() = default;
  TileDropout(const AttentionParams& p, int64_t b, int64_t h)
      : active(static_cast<bool>(p.dropout)),
        head(active ? p.dropout.head(b, h, p.heads_q) : Dropout::Head{}) {}

  // f(r, j, kept) for the elements (q0 + r, k0 + j), r < rows, j < cols, by the
  // 16x16 blocks that cover them and their groups (rows {i, i + 8} x keys {c, c + 1,
  // c + 8, c + 9}).
  template <class F>
  void each(int64_t q0, int64_t rows, int64_t k0, int64_t cols, F&& f) const {
    using namespace dropout;
    for (int64_t i16 = q0 / 16 * 16; i16 < q0 + rows; i16 += 16)
      for (int64_t i = i16; i < i16 + 8; ++i) {
        const uint32_t x1 = row_counter(static_cast<uint32_t>(i));
        for (int64_t j16 = k0 / 16 * 16; j16 < k0 + cols; j16 += 16)
          for (int64_t c = j16; c < j16 + 8; c += 2) {
            const uint32_t bits = head.group_keep_bits(x1, column_counter(static_cast<uint32_t>(c)));
            for (int s = 0; s < kGroupSize; ++s) {
              const int64_t r = i + slot_row_offset(s) - q0, j = c + slot_column_offset(s) - k0;
              if (r >= 0 && r < rows && j >= 0 && j < cols) f(r, j, (bits >> s) & 1u);
            }
          }
      }
  }
  // Zeroes the dropped elements of S (rows of kBlockK floats).
  void drop(float* S, int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    each(q0, rows, k0, cols, [&](int64_t r, int64_t j, bool kept) {
      if (!kept) S[r * kBlockK + j] = 0.0f;
    });
  }
  // Z = the factors the probabilities are multiplied by: `scale` where kept, else 0.
  void factors(float* Z, float scale, int64_t q0, int64_t rows, int64_t k0, int64_t cols) const {
    each(q0, rows, k0, cols,
         [&](int64_t r, int64_t j, bool kept) { Z[r * kBlockK + j] = kept ? scale : 0.0f; });
  }
};

// X *= Z elementwise over rows < rows, keys < cols (tiles of kBlockK columns).
void multiply(float* X, const float* Z, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) X[r * kBlockK + j] *= Z[r * kBlockK + j];
}

// Which (row, key) pairs of a tile pair are visible: inside the row's key
// window, among the tile's `cols` valid keys and, with segment ids, in the
// row's segment. The one definition both the score mask and the careful
// products below use.
struct TileMask {
  const SeqlenInfo& seq;
  const SegmentIds& segments;
  int64_t q0, rows, k0, cols;
  bool needs_mask, needs_segment_mask;
  const ScoreTerms* terms = nullptr;  // bias, mask, ALiBi (null or inactive: none)

  // Visible columns [lo, hi) of row r before segment ids.
  void window(int64_t r, int64_t& lo, int64_t& hi) const {
    lo = 0, hi = cols;
    if (!needs_mask) return;
    lo = std::clamp<int64_t>(seq.first_key(q0 + r) - k0, 0, cols);
    hi = std::clamp<int64_t>(seq.last_key(q0 + r) + 1 - k0, lo, cols);
  }
  bool visible(int64_t r, int64_t j) const {
    if (r >= rows) return false;
    int64_t lo, hi;
    window(r, lo, hi);
    return lo <= j && j < hi && (!needs_segment_mask || segments.visible(q0 + r, k0 + j)) &&
           (!terms || terms->allows(q0 + r, k0 + j));
  }
};

// mask_scores with score terms: after the softcap (kept in `capped` when given: the
// backward's softcap derivative needs it), the bias and ALiBi terms, then the window,
// segment ids and the mask.
void mask_scores_with_terms(float* S, float softcap, const TileMask& mask, bool* seen,
                            float* capped) {
  const ScoreTerms& terms = *mask.terms;
  for (int64_t r = 0; r < mask.rows; ++r) {
    float* s = S + r * kBlockK;
    if (softcap > 0.0f)
      for (int64_t j = 0; j < kBlockK; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
    if (capped) std::copy(s, s + kBlockK, capped + r * kBlockK);
    int64_t lo, hi;
    mask.window(r, lo, hi);
    std::fill(s, s + lo, kNegInf);
    std::fill(s + hi, s + kBlockK, kNegInf);
    const int64_t i = mask.q0 + r;
    terms.add(s, i, mask.k0, lo, hi);
    bool any = false;
    for (int64_t j = lo; j < hi; ++j) {
      const int64_t key = mask.k0 + j;
      if (terms.allows(i, key) &&
          (!mask.needs_segment_mask || mask.segments.visible(i, key)))
        any = true;
      else
        s[j] = kNegInf;
    }
    if (seen && any) seen[r] = true;
  }
}

// Turns q.k products (q pre-scaled) into scores: softcap, then -inf where the
// mask hides a pair. seen[r] (when given) is set for rows that see a key here.
void mask_scores(float* S, float softcap, const TileMask& mask, bool* seen) {
  if (mask.terms && mask.terms->active()) return mask_scores_with_terms(S, softcap, mask, seen, nullptr);
  for (int64_t r = 0; r < mask.rows; ++r) {
    float* s = S + r * kBlockK;
    if (softcap > 0.0f)
      for (int64_t j = 0; j < kBlockK; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
    int64_t lo, hi;
    mask.window(r, lo, hi);
    std::fill(s, s + lo, kNegInf);
    std::fill(s + hi, s + kBlockK, kNegInf);
    bool any = lo < hi;
    if (mask.needs_segment_mask) {
      any = false;
      for (int64_t j = lo; j < hi; ++j) {
        if (mask.segments.visible(mask.q0 + r, mask.k0 + j))
          any = true;
        else
          s[j] = kNegInf;
      }
    }
    if (seen && any) seen[r] = true;
  }
}

// C[M][N] += A B over the pairs visible(i, k) only (A given as A[i][k], or as
// A[k][i] with trans_a): the exact IEEE sum when B holds inf or NaN, so that a
// hidden pair adds nothing (not 0 * NaN). Rare, so plain loops.
template <class Visible>
void visible_product(float* C, int64_t ldc, const float* A, int64_t lda, bool trans_a,
                     const float* B, int64_t ldb, int64_t M, int64_t N, int64_t K,
                     Visible visible) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      if (!visible(i, k)) continue;
      const float a = trans_a ? A[k * lda + i] : A[i * lda + k];
      for (int64_t n = 0; n < N; ++n) C[i * ldc + n] += a * B[k * ldb + n];
    }
}

// Per-call geometry shared by forward and backward.
struct Shape {
  int64_t dp, dvp;  // padded head dims
  int64_t q_tiles, k_tiles, forward_q_tiles;
  explicit Shape(const AttentionParams& p)
      : dp(round_up(p.head_dim, kRowAlign)),
        dvp(round_up(p.head_dim_v, kRowAlign)),
        q_tiles(ceil_div(p.seqlen_q, kBlockQ)),
        k_tiles(ceil_div(p.seqlen_k, kBlockK)),
        forward_q_tiles(ceil_div(p.seqlen_q, kForwardBlockQ)) {}
};

// Does every row of [q0, q0+rows) see every key of [k0, k0+cols)?
bool tile_needs_mask(const SeqlenInfo& seq, int64_t q0, int64_t rows, int64_t k0,
                     int64_t cols) {
  return cols < kBlockK || k0 < seq.first_key(q0 + rows - 1) || k0 + cols - 1 > seq.last_key(q0);
}

// Columns [0, n) of tile keys [k0, k0 + cols) that rows [r0, r0 + rows) of a
// tile from q0 may see (before windows' left edges and segment ids), n a
// multiple of kRowAlign: the rest of their scores are masked anyway.
int64_t ragged_columns(const SeqlenInfo& seq, int64_t q0, int64_t r0, int64_t rows, int64_t k0,
                       int64_t cols) {
  if (rows <= 0) return 0;
  const int64_t last = seq.last_key(q0 + r0 + rows - 1) + 1 - k0;
  return round_up(std::clamp<int64_t>(last, 0, cols), kRowAlign);
}

// Rows of [first, first + n) that take part (the rest of a slot only gets zeros).
int64_t used_rows(int64_t used, int64_t first, int64_t n) {
  return std::clamp<int64_t>(used - first, 0, n);
}

// Visible keys [begin, end) of query rows [q0, q0 + rows) (all used rows).
struct KeySpan {
  int64_t begin, end;
  KeySpan(const SeqlenInfo& seq, int64_t q0, int64_t rows)
      : begin(seq.first_key(q0)), end(rows > 0 ? seq.last_key(q0 + rows - 1) + 1 : 0) {}
};

// Query rows [begin, end) that see keys [k0, k0 + cols) (all used keys).
struct QuerySpan {
  int64_t begin, end;
  QuerySpan(const SeqlenInfo& seq, int64_t k0, int64_t cols)
      : begin(seq.first_query(k0)), end(cols > 0 ? seq.last_query(k0 + cols - 1) + 1 : 0) {}
};

float sink_logit(const AttentionParams& p, int64_t b, int64_t h) {
  return p.sinks ? p.sinks[b * p.heads_q + h] : kNegInf;
}

// ---------------------------------------------------------------- forward

// K^T and V of every (sequence, kv head) in float, converted once per call (else
// each query tile of a head, and each head of a GQA group, converts them again: at
// short causal lengths a tenth of the forward) when they fit kMaxConvertedKeyBytes;
// larger calls convert each key tile where it is used.
// FLASHJAX_CPU_FORWARD_KEYS=converted|per-tile forces a choice (tests run both).
constexpr int64_t kMaxConvertedKeyBytes = int64_t{64} << 20;

bool convert_keys_once(int64_t bytes) {
  const char* env = std::getenv("FLASHJAX_CPU_FORWARD_KEYS");
  if (env && std::strcmp(env, "converted") == 0) return true;
  if (env && std::strcmp(env, "per-tile") == 0) return false;
  return bytes <= kMaxConvertedKeyBytes;
}

struct ConvertedKeys {
  const float* data = nullptr;  // per (sequence, kv head): K^T (dp x keys), V (keys x dvp)
  int64_t keys = 0;             // columns of K^T, rows of V (kBlockK-padded, + one line)
  int64_t head_floats = 0;
  const float* kt(int64_t entry) const { return data + entry * head_floats; }
  const float* v(int64_t entry, int64_t dp) const { return kt(entry) + dp * keys; }
};

template <class T>
ConvertedKeys convert_keys(const AttentionParams& p, const Shape& shape, Scratch& storage) {
  ConvertedKeys c;
  // (one more line of floats: a power-of-two row stride would map K^T's rows to the
  // same cache sets)
  const int64_t tiled_keys = round_up(p.seqlen_k, kBlockK);  // (the tiles written below)
  c.keys = tiled_keys + kRowAlign;
  c.head_floats = (shape.dp + shape.dvp) * c.keys;
  const int64_t entries = p.batch * p.heads_kv;
  if (!convert_keys_once(entries * c.head_floats * int64_t{sizeof(float)})) return {};
  float* data = storage.get(entries * c.head_floats);
  parallel_for(entries, [&](int64_t entry) {
    const int64_t b = entry / p.heads_kv, hk = entry % p.heads_kv;
    const SeqlenInfo seq(p, b);
    thread_local Scratch scratch;
    float* Kr = scratch.get(kBlockK * shape.dp);
    float* kt = data + entry * c.head_floats;
    float* v = kt + shape.dp * c.keys;
    for (int64_t k0 = 0; k0 < tiled_keys; k0 += kBlockK) {
      const int64_t cols = std::clamp<int64_t>(seq.seqlen_k - k0, 0, kBlockK);
      load_tile<T>(Kr, shape.dp, kBlockK, key_rows(p.k, seq, hk), k0, cols, p.head_dim);
      transpose(kt + k0, c.keys, Kr, shape.dp, kBlockK, shape.dp);
      load_tile<T>(v + k0 * shape.dvp, shape.dvp, kBlockK, key_rows(p.v, seq, hk), k0, cols,
                   p.head_dim_v);
    }
  });
  c.data = data;
  return c;
}

template <class T>
void forward_tile(const AttentionParams& p, const Shape& shape, const ConvertedKeys& converted,
                  int64_t task) {
  const auto [b, h, qt] = Task(task, shape.forward_q_tiles, p.heads_q);
  const SeqlenInfo seq(p, b);
  const int64_t q0 = qt * kForwardBlockQ;
  if (q0 >= seq.q_slot) return;
  const int64_t rows = std::min(kForwardBlockQ, seq.q_slot - q0);
  const int64_t used = used_rows(seq.seqlen_q, q0, rows);
  const int64_t hk = h / p.group_size();
  const int64_t dp = shape.dp, dvp = shape.dvp;
  const SegmentIds segments(p, b);

  const TileKernels& kernels = tile_kernels();
  thread_local Scratch scratch;
  float* Q = scratch.get(kForwardBlockQ * dp + 2 * dp * kBlockK + kBlockK * dvp +
                         kForwardBlockQ * kBlockK + kForwardBlockQ * dvp + 3 * kForwardBlockQ);
  float* Kt = Q + kForwardBlockQ * dp;
  float* Kr = Kt + dp * kBlockK;
  float* V = Kr + dp * kBlockK;
  float* S = V + kBlockK * dvp;
  float* O = S + kForwardBlockQ * kBlockK;
  float* m = O + kForwardBlockQ * dvp;
  float* l = m + kForwardBlockQ;
  bool* seen = reinterpret_cast<bool*>(l + kForwardBlockQ);  // the row saw a key
  std::fill(O, O + kForwardBlockQ * dvp, 0.0f);
  std::fill(m, m + kForwardBlockQ, kNegInf);
  std::fill(l, l + kForwardBlockQ, 0.0f);
  std::fill(seen, seen + kForwardBlockQ, false);

  const HeadRows k_rows = key_rows(p.k, seq, hk), v_rows = key_rows(p.v, seq, hk);
  load_tile<T>(Q, dp, kForwardBlockQ, query_rows(p.q, seq, h), q0, used, p.head_dim,
               p.softmax_scale);
  const ScoreTerms terms = p.has_score_terms() ? ScoreTerms(p, seq, b, h) : ScoreTerms();
  const TileDropout dropout(p, b, h);

  const KeySpan keys(seq, q0, used);
  for (int64_t k0 = keys.begin; k0 < keys.end; k0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, keys.end - k0);
    const TileSegments tile_segments(segments, q0, used, k0, cols);
    if (!tile_segments.meet()) continue;
    // K^T and V of this key tile: columns / rows [k0, k0 + cols), zeros after them
    // (the converted ones: the following keys', which the masks and the ragged
    // products leave out)
    const float* kt = Kt;
    const float* v = V;
    int64_t ld_kt = kBlockK;
    if (converted.data) {
      const int64_t entry = b * p.heads_kv + hk;
      kt = converted.kt(entry) + k0, v = converted.v(entry, dp) + k0 * dvp;
      ld_kt = converted.keys;
    } else {
      load_tile<T>(Kr, dp, kBlockK, k_rows, k0, cols, p.head_dim);
      transpose(Kt, kBlockK, Kr, dp, kBlockK, dp);
      load_tile<T>(V, dvp, kBlockK, v_rows, k0, cols, p.head_dim_v);
    }
    const TileMask mask{seq,   segments, q0, used, k0, cols,
                        tile_needs_mask(seq, q0, used, k0, cols), !tile_segments.uniform(),
                        &terms};
    // Masked tiles: ragged, chunks of rows up to their last visible key (the
    // scores past it are masked, their P exactly 0); others: one chunk of the used
    // rows (a short query block, e.g. a KV cache's prefill, computed 256).
    const int64_t chunk =
        mask.needs_mask ? kRaggedChunkRows : round_up(std::max<int64_t>(used, 1), 4);
    const auto for_each_chunk = [&](auto&& body) {  // body(first row, columns)
      for (int64_t r0 = 0; r0 < used; r0 += chunk) {
        const int64_t n = mask.needs_mask
                              ? ragged_columns(seq, q0, r0, std::min(chunk, used - r0), k0, cols)
                              : kBlockK;
        if (n > 0) body(r0, n);
      }
    };
    for_each_chunk([&](int64_t r0, int64_t n) {
      kernels.gemm(S + r0 * kBlockK, kBlockK, Q + r0 * dp, dp, false, kt, ld_kt, chunk, n, dp,
                   false);
    });
    mask_scores(S, p.softcap, mask, seen);
    for_each_chunk([&](int64_t r0, int64_t n) {
      kernels.softmax_step(S + r0 * kBlockK, kBlockK, std::min(chunk, used - r0), chunk, n,
                           m + r0, l + r0, O + r0 * dvp, dvp);
    });
    // (l holds the undropped sums: the lse is the one before dropout; the kept
    // probabilities' 1 / (1 - rate) is applied with the normalisation)
    if (dropout.active) dropout.drop(S, q0, used, k0, cols);
    if (kernels.all_finite(v, round_up(cols, kRowAlign) * dvp)) {
      for_each_chunk([&](int64_t r0, int64_t n) {
        kernels.gemm(O + r0 * dvp, dvp, S + r0 * kBlockK, kBlockK, false, v, dvp, chunk, dvp, n,
                     true);
      });
    } else {  // inf / NaN in V: only visible pairs may add (0 * NaN is NaN)
      visible_product(O, dvp, S, kBlockK, false, v, dvp, kForwardBlockQ, dvp, kBlockK,
                      [&](int64_t r, int64_t j) { return mask.visible(r, j); });
    }
  }

  // Fold in the sink, normalise, and write out and lse. The slot's unused rows
  // and rows that saw no key (without a sink) get 0 and -inf; a row whose
  // visible scores are all -inf gets NaN, as exp(-inf - -inf) does.
  const float sink = sink_logit(p, b, h);
  float* lse = p.lse.at<float>(seq.batch, seq.q_row(q0), h);
  for (int64_t r = 0; r < rows; ++r) {
    float* o = O + r * dvp;
    if (r >= used || (!seen[r] && sink == kNegInf)) {
      std::fill(o, o + dvp, 0.0f);
      lse[r] = kNegInf;
      continue;
    }
    const float m_final = nan_max(m[r], sink);
    const float keys_scale = std::exp(m[r] - m_final);
    const float total = l[r] * keys_scale + std::exp(sink - m_final);
    const float factor = keys_scale / total * (dropout.active ? p.dropout.scale : 1.0f);
    for (int64_t c = 0; c < dvp; ++c) o[c] *= factor;
    lse[r] = m_final + std::log(total);
  }
  store_tile<T>(query_rows(p.out, seq, h), q0, rows, p.head_dim_v, O, dvp, 1.0f);
}

// ---------------------------------------------------------------- backward

// Tiles one backward task works on: Q/dO rows and K/V columns as floats.
// Q is pre-scaled by softmax_scale, as in the forward. The *_finite flags say
// whether the loaded rows hold no inf / NaN (else the products that sum over
// masked pairs take the careful path).
struct BackwardTiles {
  float *Q, *dO, *Kr, *Kt, *Vr, *Vt, *S, *P, *dS, *C;  // C: softcapped scores (score terms)
  float* Z;  // dropout's factors (TileDropout::factors)
  float *lse, *D;
  bool rows_finite = true, keys_finite = true;
  int64_t rows = 0;  // used rows of the loaded Q / dO tile (the rest is padding)
  BackwardTiles(Scratch& scratch, const Shape& s) {
    const int64_t tile = kBlockQ * kBlockK;
    Q = scratch.get(kBlockQ * s.dp + kBlockQ * s.dvp + 2 * kBlockK * s.dp +
                    2 * s.dvp * kBlockK + 5 * tile + 2 * kBlockQ);
    dO = Q + kBlockQ * s.dp;
    Kr = dO + kBlockQ * s.dvp;
    Kt = Kr + kBlockK * s.dp;
    Vr = Kt + kBlockK * s.dp;
    Vt = Vr + kBlockK * s.dvp;
    S = Vt + s.dvp * kBlockK;
    P = S + tile;
    dS = P + tile;
    lse = dS + tile;
    D = lse + kBlockQ;
    C = D + kBlockQ;
    Z = C + tile;
  }
};

// Everything about a (sequence, query head) pair that the backward tiles read.
template <class T>
struct BackwardHead {
  const AttentionParams& p;
  const Shape& shape;
  const TensorRef& D_all;  // rowsum(dO * O) - dlse, laid out like lse
  const SeqlenInfo& seq;
  const SegmentIds& segments;
  int64_t b, h;

  // Loads used query rows [q0, q0 + rows).
  void load_rows(BackwardTiles& t, int64_t q0, int64_t rows) const {
    load_tile<T>(t.Q, shape.dp, kBlockQ, query_rows(p.q, seq, h), q0, rows, p.head_dim,
                 p.softmax_scale);
    load_tile<T>(t.dO, shape.dvp, kBlockQ, query_rows(p.dout, seq, h), q0, rows, p.head_dim_v);
    t.rows = rows;
    const TileKernels& kernels = tile_kernels();
    t.rows_finite = kernels.all_finite(t.Q, kBlockQ * shape.dp) &&
                    kernels.all_finite(t.dO, kBlockQ * shape.dvp);
    load_stats(t, q0, rows);
  }

  // The rows' lse and D (-inf and 0 past `rows`).
  void load_stats(BackwardTiles& t, int64_t q0, int64_t rows) const {
    const float* lse = p.lse.at<const float>(seq.batch, seq.q_row(q0), h);
    const float* D = D_all.at<const float>(seq.batch, seq.q_row(q0), h);
    for (int64_t r = 0; r < kBlockQ; ++r) {
      t.lse[r] = r < rows ? lse[r] : kNegInf;
      t.D[r] = r < rows ? D[r] : 0.0f;
    }
  }

  void load_keys(BackwardTiles& t, int64_t k0, int64_t cols) const {
    const int64_t hk = h / p.group_size();
    load_tile<T>(t.Kr, shape.dp, kBlockK, key_rows(p.k, seq, hk), k0, cols, p.head_dim);
    t.keys_finite = tile_kernels().all_finite(t.Kr, kBlockK * shape.dp);
    transpose(t.Kt, kBlockK, t.Kr, shape.dp, kBlockK, shape.dp);
    load_tile<T>(t.Vr, shape.dvp, kBlockK, key_rows(p.v, seq, hk), k0, cols, p.head_dim_v);
    transpose(t.Vt, kBlockK, t.Vr, shape.dvp, kBlockK, shape.dvp);
  }

  // Recomputes S and P for the loaded tiles and leaves dS in t.dS; false (and
  // nothing computed) when segment ids rule the whole tile pair out. With dbias
  // (rows of `ld` floats from key k0's column), adds the tile's gradient of the
  // score terms to it: dS before the softcap derivative.
  bool gradients(BackwardTiles& t, int64_t q0, int64_t rows, int64_t k0, int64_t cols,
                 float* dbias = nullptr, int64_t ld = 0) const {
    const TileSegments tile_segments(segments, q0, rows, k0, cols);
    if (!tile_segments.meet()) return false;
    const TileKernels& kernels = tile_kernels();
    const ScoreTerms terms = p.has_score_terms() ? ScoreTerms(p, seq, b, h) : ScoreTerms();
    const TileMask mask{seq,   segments, q0, rows, k0, cols,
                        tile_needs_mask(seq, q0, rows, k0, cols), !tile_segments.uniform(),
                        &terms};
    const TileDropout dropout(p, b, h);
    kernels.gemm(t.S, kBlockK, t.Q, shape.dp, false, t.Kt, kBlockK, kBlockQ, kBlockK, shape.dp,
                 false);
    // P and dS from S (masked) and dP: with dropout, out = (P Z) V (Z: 0 or 1 / (1 - rate)),
    // so dP = Z (dO V^T) and dV's P is P Z; D = rowsum(dO O) is still sum_j P_ij dP_ij, so
    // dS = P (dP - D) as without.
    const auto scores_and_gradients = [&](float cap) {
      kernels.gemm(t.dS, kBlockK, t.dO, shape.dvp, false, t.Vt, kBlockK, kBlockQ, kBlockK,
                   shape.dvp, false);
      if (dropout.active) {
        dropout.factors(t.Z, p.dropout.scale, q0, rows, k0, cols);
        multiply(t.dS, t.Z, rows, cols);
      }
      kernels.backward_scores(t.S, t.P, t.dS, kBlockK, rows, kBlockQ, kBlockK, t.lse, t.D, cap);
      if (dropout.active) multiply(t.P, t.Z, rows, cols);
    };
    if (!terms.active()) {
      mask_scores(t.S, p.softcap, mask, nullptr);
      scores_and_gradients(p.softcap);
      return true;
    }
    // The softcap derivative reads the capped scores before the terms were added.
    const bool capped = p.softcap > 0.0f;
    mask_scores_with_terms(t.S, p.softcap, mask, nullptr, capped ? t.C : nullptr);
    scores_and_gradients(0.0f);
    for (int64_t r = 0; dbias && r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) dbias[r * ld + j] += t.dS[r * kBlockK + j];
    for (int64_t r = 0; capped && r < rows; ++r)
      for (int64_t j = 0; j < kBlockK; ++j) {
        const float c = t.C[r * kBlockK + j] / p.softcap;
        t.dS[r * kBlockK + j] *= 1.0f - c * c;
      }
    return true;
  }

  // Loads query rows [q0, q0 + rows) and walks the key tiles they see: loads each,
  // recomputes its gradients (adding to dbias's rows when given) and calls body() on
  // the tile pairs that segment ids do not rule out.
  template <class Body>
  void each_key_tile(BackwardTiles& t, int64_t q0, int64_t rows, float* dbias, int64_t ld,
                     Body&& body) const {
    load_rows(t, q0, rows);
    const KeySpan keys(seq, q0, rows);
    for (int64_t k0 = keys.begin; k0 < keys.end; k0 += kBlockK) {
      const int64_t cols = std::min(kBlockK, keys.end - k0);
      load_keys(t, k0, cols);
      if (gradients(t, q0, rows, k0, cols, dbias ? dbias + k0 : nullptr, ld)) body();
    }
  }
};

// C += A B for one of the products that sum over tile pairs (P^T dO, dS^T Q,
// dS K). With inf / NaN in B only pairs the mask lets through add (masked
// pairs have S = -inf; padding rows are not pairs: their S is not masked), so
// nothing leaks into rows / keys that never see it.
// A is P or dS, laid out like S (queries x keys), read transposed with trans_a.
void pair_product(const BackwardTiles& t, bool b_finite, float* C, int64_t ldc, const float* A,
                  bool trans_a, const float* B, int64_t ldb, int64_t M, int64_t N, int64_t K) {
  if (b_finite) {
    tile_kernels().gemm(C, ldc, A, kBlockK, trans_a, B, ldb, M, N, K, true);
    return;
  }
  visible_product(C, ldc, A, kBlockK, trans_a, B, ldb, M, N, K, [&](int64_t i, int64_t k) {
    const int64_t row = trans_a ? k : i, key = trans_a ? i : k;
    return row < t.rows && t.S[row * kBlockK + key] != kNegInf;
  });
}

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

// D = rowsum(dO * O) - dlse for the used rows of one (sequence, head, q-tile).
template <class T>
void backward_preprocess(const AttentionParams& p, const Shape& shape, int64_t task,
                         const TensorRef& D_all) {
  const auto [b, h, qt] = Task(task, shape.q_tiles, p.heads_q);
  const SeqlenInfo seq(p, b);
  const int64_t q0 = qt * kBlockQ;
  const int64_t rows = used_rows(seq.seqlen_q, q0, kBlockQ);
  const HeadRows out = query_rows(p.out, seq, h), dout = query_rows(p.dout, seq, h);
  float* D = D_all.at<float>(seq.batch, seq.q_row(q0), h);
  const float* dlse = p.dlse ? p.dlse.at<const float>(seq.batch, seq.q_row(q0), h) : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const T* o = out.row<const T>(q0 + r);
    const T* d_o = dout.row<const T>(q0 + r);
    float sum = 0.0f;
    for (int64_t c = 0; c < p.head_dim_v; ++c) sum += to_float(o[c]) * to_float(d_o[c]);
    D[r] = sum - (dlse ? dlse[r] : 0.0f);
  }
}

// dK and dV of key tile [k0, k0 + cols) of kv head hk, summed over its
// query-head group, stored to p.dk / p.dv (zeros for the slot's unused keys);
// with dQ (the group's heads, each rows_padded rows of shape.dp), also adds
// each query row's share of dQ.
template <class T>
void key_tile_gradients(const AttentionParams& p, const Shape& shape, const TensorRef& D_all,
                        const SeqlenInfo& seq, BackwardTiles& t, float* dK, int64_t b,
                        int64_t hk, int64_t k0, int64_t cols, float* dQ, int64_t rows_padded) {
  float* dV = dK + kBlockK * shape.dp;
  std::fill(dK, dK + kBlockK * (shape.dp + shape.dvp), 0.0f);
  const int64_t used_cols = used_rows(seq.seqlen_k, k0, cols);
  const QuerySpan queries(seq, k0, used_cols);
  const int64_t first_head = hk * p.group_size();
  const SegmentIds segments(p, b);
  if (used_cols > 0)
    BackwardHead<T>{p, shape, D_all, seq, segments, b, first_head}.load_keys(t, k0, used_cols);
  for (int64_t h = first_head; used_cols > 0 && h < first_head + p.group_size(); ++h) {
    const BackwardHead<T> head{p, shape, D_all, seq, segments, b, h};
    for (int64_t q0 = queries.begin; q0 < queries.end; q0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, queries.end - q0);
      head.load_rows(t, q0, rows);
      if (!head.gradients(t, q0, rows, k0, used_cols)) continue;
      pair_product(t, t.rows_finite, dV, shape.dvp, t.P, true, t.dO, shape.dvp, kBlockK,
                   shape.dvp, kBlockQ);
      pair_product(t, t.rows_finite, dK, shape.dp, t.dS, true, t.Q, shape.dp, kBlockK, shape.dp,
                   kBlockQ);
      if (dQ)
        pair_product(t, t.keys_finite, dQ + ((h - first_head) * rows_padded + q0) * shape.dp,
                     shape.dp, t.dS, false, t.Kr, shape.dp, kBlockQ, shape.dp, kBlockK);
    }
  }
  // (Q was pre-scaled: dK carries softmax_scale already.)
  store_tile<T>(key_rows(p.dk, seq, hk), k0, cols, p.head_dim, dK, shape.dp, 1.0f);
  store_tile<T>(key_rows(p.dv, seq, hk), k0, cols, p.head_dim_v, dV, shape.dvp, 1.0f);
}

// Two-pass backward, pass 1: one key tile of one kv head.
template <class T>
void backward_key_tile(const AttentionParams& p, const Shape& shape, const TensorRef& D_all,
                       int64_t task) {
  const auto [b, hk, kt] = Task(task, shape.k_tiles, p.heads_kv);
  const SeqlenInfo seq(p, b);
  const int64_t k0 = kt * kBlockK;
  if (k0 >= seq.k_slot) return;
  thread_local Scratch scratch, accum;
  BackwardTiles t(scratch, shape);
  float* dK = accum.get(kBlockK * (shape.dp + shape.dvp));
  key_tile_gradients<T>(p, shape, D_all, seq, t, dK, b, hk, k0,
                        std::min(kBlockK, seq.k_slot - k0), nullptr, 0);
}

// dQ of one query tile (zeros for the slot's unused rows), and this tile's
// share of dsinks.
template <class T>
void backward_query_tile(const AttentionParams& p, const Shape& shape, const TensorRef& D_all,
                         int64_t task, float* dsink_parts) {
  const auto [b, h, qt] = Task(task, shape.q_tiles, p.heads_q);
  const SeqlenInfo seq(p, b);
  const SegmentIds segments(p, b);
  const int64_t q0 = qt * kBlockQ;
  if (q0 >= seq.q_slot) return;
  const int64_t rows = std::min(kBlockQ, seq.q_slot - q0);
  const int64_t used = used_rows(seq.seqlen_q, q0, rows);

  thread_local Scratch scratch, accum;
  BackwardTiles t(scratch, shape);
  float* dQ = accum.get(kBlockQ * shape.dp);
  std::fill(dQ, dQ + kBlockQ * shape.dp, 0.0f);

  const BackwardHead<T> head{p, shape, D_all, seq, segments, b, h};
  head.each_key_tile(t, q0, used, nullptr, 0, [&] {
    pair_product(t, t.keys_finite, dQ, shape.dp, t.dS, false, t.Kr, shape.dp, kBlockQ, shape.dp,
                 kBlockK);
  });
  store_tile<T>(query_rows(p.dq, seq, h), q0, rows, p.head_dim, dQ, shape.dp, p.softmax_scale);

  if (p.sinks) dsink_parts[task] = dsink_share(p, b, h, t.lse, t.D, used);
}

// dQ, dK and dV of one kv head's whole query-head group in one task: each tile
// pair costs 5 tile products instead of the two-pass 7 (dQ accumulates in a
// per-task buffer instead of being recomputed per query tile). Deterministic:
// one thread, fixed order.
template <class T>
void backward_group(const AttentionParams& p, const Shape& shape, const TensorRef& D_all,
                    int64_t task, float* dsink_parts) {
  const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
  const SeqlenInfo seq(p, b);
  const SegmentIds segments(p, b);
  const int64_t group = p.group_size(), first_head = hk * group;
  const int64_t rows_padded = seq.q_slot + kBlockQ;  // a tile may overrun the last row

  thread_local Scratch scratch, accum;
  BackwardTiles t(scratch, shape);
  float* dK = accum.get(kBlockK * (shape.dp + shape.dvp));
  // Not thread_local: up to a few tens of MB per task, freed with the task.
  std::vector<float> dQ_buffer(group * rows_padded * shape.dp, 0.0f);
  float* dQ = dQ_buffer.data();
  for (int64_t k0 = 0; k0 < seq.k_slot; k0 += kBlockK)
    key_tile_gradients<T>(p, shape, D_all, seq, t, dK, b, hk, k0,
                          std::min(kBlockK, seq.k_slot - k0), dQ, rows_padded);
  for (int64_t h = first_head; h < first_head + group; ++h) {
    const float* dQ_head = dQ + (h - first_head) * rows_padded * shape.dp;
    store_tile<T>(query_rows(p.dq, seq, h), 0, seq.q_slot, p.head_dim, dQ_head, shape.dp,
                  p.softmax_scale);
    if (!p.sinks) continue;
    const BackwardHead<T> head{p, shape, D_all, seq, segments, b, h};
    for (int64_t qt = 0; qt < shape.q_tiles; ++qt) {  // the same shares as the two-pass path
      const int64_t q0 = qt * kBlockQ, used = used_rows(seq.seqlen_q, q0, kBlockQ);
      head.load_stats(t, q0, used);
      dsink_parts[(b * p.heads_q + h) * shape.q_tiles + qt] =
          dsink_share(p, b, h, t.lse, t.D, used);
    }
  }
}

// dbias rows [q0, q0 + kBlockQ) of one bias entry (batch entry, head entry, query
// tile): dS before the softcap derivative, summed over the sequences and query heads
// that read the entry in a fixed order (deterministic; the task owns these rows). A
// pass of its own, run only when dbias is wanted: it recomputes S and dP.
template <class T>
void backward_bias_tile(const AttentionParams& p, const Shape& shape, const TensorRef& D_all,
                        int64_t task) {
  const ScoreArray& dbias = p.dbias;
  const auto [eb, eh, qt] = Task(task, shape.q_tiles, p.heads_q / dbias.head_div);
  const int64_t q0 = qt * kBlockQ;
  if (q0 >= p.seqlen_q) return;
  const int64_t rows = std::min(kBlockQ, p.seqlen_q - q0);
  float* out = dbias.at<float>(eb * dbias.batch_div, eh * dbias.head_div) + q0 * dbias.row_stride;
  for (int64_t r = 0; r < rows; ++r)
    std::fill(out + r * dbias.row_stride, out + r * dbias.row_stride + p.seqlen_k, 0.0f);
  thread_local Scratch scratch;
  BackwardTiles t(scratch, shape);
  for (int64_t b = eb * dbias.batch_div; b < (eb + 1) * dbias.batch_div; ++b) {
    const SeqlenInfo seq(p, b);
    const SegmentIds segments(p, b);
    const int64_t used = used_rows(seq.seqlen_q, q0, rows);
    if (used == 0) continue;
    for (int64_t h = eh * dbias.head_div; h < (eh + 1) * dbias.head_div; ++h) {
      const BackwardHead<T> head{p, shape, D_all, seq, segments, b, h};
      head.each_key_tile(t, q0, used, out, dbias.row_stride, [] {});
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

// Rows of an lse-like array (per query row and head) over all sequences.
int64_t stat_rows(const AttentionParams& p) {
  return p.heads_q * (p.packed() ? p.total_q : p.batch * p.seqlen_q);
}

// Packed layouts: tensor rows outside every sequence's slot get zeros (and
// lse -inf); zeroing all rows first is cheap next to the attention itself.
template <class T>
void zero_rows(const TensorRef& ref, int64_t rows, int64_t heads, int64_t dim) {
  T* data = static_cast<T*>(ref.data);
  std::fill(data, data + rows * heads * dim, from_float<T>(0.0f));
}

template <class T>
void backward_impl(const AttentionParams& p) {
  const Shape shape(p);
  const int64_t bh_q = p.batch * p.heads_q;
  if (p.packed()) {
    zero_rows<T>(p.dq, p.total_q, p.heads_q, p.head_dim);
    zero_rows<T>(p.dk, p.total_k, p.heads_kv, p.head_dim);
    zero_rows<T>(p.dv, p.total_k, p.heads_kv, p.head_dim_v);
  }
  std::vector<float> D_storage(stat_rows(p));
  const TensorRef D_all{D_storage.data(), p.lse.batch_stride, p.lse.row_stride,
                        p.lse.head_stride};
  parallel_for(bh_q * shape.q_tiles,
               [&](int64_t task) { backward_preprocess<T>(p, shape, task, D_all); });
  std::vector<float> dsink_parts(p.sinks ? bh_q * shape.q_tiles : 0);
  if (use_one_pass(p, shape)) {
    parallel_for(p.batch * p.heads_kv, [&](int64_t task) {
      backward_group<T>(p, shape, D_all, task, dsink_parts.data());
    });
  } else {
    parallel_for(p.batch * p.heads_kv * shape.k_tiles,
                 [&](int64_t task) { backward_key_tile<T>(p, shape, D_all, task); });
    parallel_for(bh_q * shape.q_tiles, [&](int64_t task) {
      backward_query_tile<T>(p, shape, D_all, task, dsink_parts.data());
    });
  }
  if (p.dbias) {
    const int64_t entries = (p.batch / p.dbias.batch_div) * (p.heads_q / p.dbias.head_div);
    parallel_for(entries * shape.q_tiles,
                 [&](int64_t task) { backward_bias_tile<T>(p, shape, D_all, task); });
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

void append_to_cache(const AttentionParams& p) {
  const KvCache& c = p.cache;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_cache_element<T>(c.element, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      // A new row as the cache stores it: as it is, or (float8) x * (1 / descale)
      // rounded, as jnp.asarray(x * (1 / descale), dtype) does.
      const auto store = [&](C* dst, const T* src, int64_t dim, const float* descales,
                             int64_t at) {
        if constexpr (kIsFloat8<C>) {
          const float inverse = 1.0f / descales[at];
          for (int64_t e = 0; e < dim; ++e) dst[e] = C::from(to_float(src[e]) * inverse);
        } else {
          std::memcpy(dst, src, sizeof(T) * dim);
        }
      };
      for (int64_t b = 0; b < p.batch; ++b)
        for (int64_t j = 0; j < c.new_rows; ++j) {
          int64_t slot, row;
          if (!c.append_location(b, j, slot, row)) continue;
          for (int64_t hk = 0; hk < p.heads_kv; ++hk) {
            store(p.k.at<C>(slot, row, hk), c.k_new.at<const T>(b, j, hk), p.head_dim,
                  c.k_descale, b * p.heads_kv + hk);
            store(p.v.at<C>(slot, row, hk), c.v_new.at<const T>(b, j, hk), p.head_dim_v,
                  c.v_descale, b * p.heads_kv + hk);
          }
        }
    });
  });
}

void attention_forward(const AttentionParams& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Shape shape(p);
    if (p.packed()) {
      zero_rows<T>(p.out, p.total_q, p.heads_q, p.head_dim_v);
      float* lse = static_cast<float*>(p.lse.data);
      std::fill(lse, lse + stat_rows(p), kNegInf);
    }
    thread_local Scratch converted_storage;  // (per calling thread: calls may overlap)
    const ConvertedKeys converted = convert_keys<T>(p, shape, converted_storage);
    parallel_for(p.batch * p.heads_q * shape.forward_q_tiles,
                 [&](int64_t task) { forward_tile<T>(p, shape, converted, task); });
  });
}

void attention_backward(const AttentionParams& p) {
  dispatch_dtype(p.dtype, [&](auto tag) { backward_impl<decltype(tag)>(p); });
}

}  // namespace flashjax::cpu
