// The CPU KV-cache forward for decoding (flash_attention_with_kvcache with a few
// query rows per kv head): split-K, as the GPU's split-KV kernel.
//
// A task is (sequence, group of kv heads, split): for each kv head, every query head
// of its GQA group and every query row packed into one tile (GQA packing), streamed
// over a range of key tiles read where they lie in the cache (contiguous, leftpad,
// cache_batch_idx or paged: SeqlenInfo::k_at), an online softmax per row into the
// head's partial (O, m, l); the heads go inner, tile by tile (their rows of a tile lie
// together); the last split of each (sequence, head group) to finish combines the
// partials into out and lse.
// Caches whose head dims fill whole vector lines are read in place (the tile kernels
// widen 16-bit and float8 elements in registers; a float8 cache's descales scale the
// query rows and the output instead); others convert the rows of the tile in use
// (float8: times their descales).
// Larger query blocks (prefill) take the dense forward (attention_forward), which
// reads the cache through k_at too.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_cpu.h"
#include "element.h"
#include "float8.h"
#include "flashjax/seqlen.h"
#include "thread_pool.h"
#include "tile_math.h"

namespace flashjax::cpu {
namespace {

constexpr int64_t kKeyTile = 128;  // keys per tile (multiple of kRowAlign)
// Split tasks per thread, so that sequences of unequal lengths still balance...
constexpr int64_t kTasksPerThread = 4;
// ...but each split streams at least this many key tiles of the capacity (the
// combine reads a partial of every split).
constexpr int64_t kMinTilesPerSplit = 2;
constexpr float kNegInf = kNegInfinity;
constexpr int64_t kConvertAhead = 4;  // keys: converted caches prefetch this far ahead
constexpr int64_t kCacheLine = 64;    // bytes
// A cache's rows count as close together up to this row stride, in head dims
// (Decode::prefetches).
constexpr int64_t kDenseRowStride = 2;
constexpr int64_t kBf16PairsDim = 32;  // row_dots_bf16's head dims: whole 32-element vectors

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Splits of the capacity's key tiles: each at least kMinTilesPerSplit.
int64_t max_splits(const AttentionParams& p) {
  return std::max<int64_t>(1, ceil_div(p.seqlen_k, kKeyTile) / kMinTilesPerSplit);
}

// Splits per (sequence, head group) (Decode): enough tasks for every thread
// (kTasksPerThread), as max_splits allows; `units`: the (sequence, head group) pairs.
// FLASHJAX_CPU_KVCACHE_SPLITS=n forces n (tests).
int64_t split_count(const AttentionParams& p, int64_t units) {
  if (const char* env = std::getenv("FLASHJAX_CPU_KVCACHE_SPLITS")) {
    const int64_t n = std::atoll(env);
    if (n > 0) return n;
  }
  return std::clamp<int64_t>(ceil_div(kTasksPerThread * num_threads(), units), 1, max_splits(p));
}

// The geometry of one call, and its partials: per (sequence, kv head, split) O
// (pad_rows x dvp), then m, l and seen (1 when the row saw a key) per row.
struct Decode {
  int64_t group, rows, pad_rows;  // packed rows: row r is query r / group, head r % group
  int64_t value_rows;             // rows of P V: even (gemm_b_rows' smallest block is 2)
  int64_t dp, dvp;                // head dims padded to whole vector lines
  bool in_place;   // rows of whole vector lines: the kernels read the cache itself
  bool float8_in_place;  // ...of float8 codes: the descales scale q and the output
  float read_unit;       // what the kernels' values of those codes are over (else 1)
  // In place, and a kv head's rows far apart (many kv heads): the hardware's stride
  // prefetch leaves each row a miss, so split_task prefetches them (KeyTile). Rows
  // close together stream well without (bf16 4/2 d64: 4-5% slower with it; 32/8 d128:
  // 6-12% faster; 2-core EPYC, same process, 2026-11-28).
  bool prefetches;
  // There too the kv heads go inner (split_task), in groups of group_heads: as many
  // heads as leave a task for every thread (kTasksPerThread); elsewhere one head a
  // group (bf16 4/2 d64, rows close together: 20% slower with its two heads inner;
  // twenty-seventh session).
  int64_t group_heads, head_groups;
  int64_t splits;  // per (sequence, head group)
  RowType row_type;  // the element type of the rows the kernels read
  int64_t partial_floats;

  explicit Decode(const AttentionParams& p)
      : group(p.group_size()),
        rows(group * p.seqlen_q),
        pad_rows(round_up(rows, 4)),
        value_rows(round_up(rows, 2)),
        dp(round_up(p.head_dim, kRowAlign)),
        dvp(round_up(p.head_dim_v, kRowAlign)),
        in_place(dp == p.head_dim && dvp == p.head_dim_v),
        float8_in_place(in_place && p.cache.float8()),
        read_unit(float8_in_place && p.cache.element == CacheElement::kFloat8E4M3
                      ? kFloat8E4M3ReadUnit
                      : 1.0f),
        prefetches(in_place && p.k.row_stride > kDenseRowStride * p.head_dim),
        group_heads(prefetches ? inner_heads(p) : 1),
        head_groups(ceil_div(p.heads_kv, group_heads)),
        splits(split_count(p, p.batch * head_groups)),
        row_type(!in_place          ? RowType::kFloat32
                 : float8_in_place ? cpu::row_type(p.cache.element)
                                   : cpu::row_type(p.dtype)),
        partial_floats(pad_rows * (dvp + 3)) {}
  // The kv heads of a group: all, unless the sequences' splits (max_splits) leave
  // threads without a task (short caches).
  static int64_t inner_heads(const AttentionParams& p) {
    const int64_t groups = std::clamp<int64_t>(
        ceil_div(kTasksPerThread * num_threads(), p.batch * max_splits(p)), 1, p.heads_kv);
    return ceil_div(p.heads_kv, groups);
  }
  // The end of head group g's kv heads (they start at g group_heads; no group is empty).
  int64_t group_end(const AttentionParams& p, int64_t g) const {
    return std::min(p.heads_kv, (g + 1) * group_heads);
  }
  int64_t query(int64_t r) const { return r / group; }
  int64_t head(int64_t hk, int64_t r) const { return hk * group + r % group; }
};

struct Partial {
  float *O, *m, *l, *seen;
  Partial(float* base, const Decode& d)
      : O(base), m(O + d.pad_rows * d.dvp), l(m + d.pad_rows), seen(l + d.pad_rows) {}
};

// Where a key tile's K and V rows are: the cache's own (in place, Decode::row_type) or
// this tile's float copies; columns past the tile's keys point at zeros (of either).
// T: the cache's storage type (float8: converted to the codes' values times k_scale /
// v_scale: the sequence's descales, or 1 where q and the output carry them).
template <class T>
struct KeyTile {
  const Decode& d;
  const AttentionParams& p;
  const SeqlenInfo& seq;
  int64_t hk;
  const void** k_rows;
  const void** v_rows;
  float *k_copy, *v_copy;  // kKeyTile rows of dp / dvp floats (converted caches)
  const float* zeros;      // max(dp, dvp) zeros
  float k_scale, v_scale;  // float8 caches' conversions (else unused)

  // Points columns [lo, hi) at keys k0 + lo.. (those < cols; the rest at zeros).
  void locate(int64_t k0, int64_t cols, int64_t lo, int64_t hi) const {
    for (int64_t j = lo; j < hi; ++j) {
      if (!d.in_place && j + kConvertAhead < std::min(hi, cols)) prefetch(k0 + j + kConvertAhead);
      if (j >= cols) {
        k_rows[j] = v_rows[j] = zeros;
        continue;
      }
      const T* k = seq.k_at<const T>(p.k, k0 + j, hk);
      const T* v = seq.k_at<const T>(p.v, k0 + j, hk);
      if (d.in_place) {
        k_rows[j] = k, v_rows[j] = v;
        continue;
      }
      k_rows[j] = convert(k_copy + j * d.dp, k, p.head_dim, d.dp, k_scale);
      v_rows[j] = convert(v_copy + j * d.dvp, v, p.head_dim_v, d.dvp, v_scale);
    }
  }

  // Sparse in-place rows (Decode::prefetches): asks for the rows the tile will read,
  // all at once, so that their misses overlap (the tile kernels read a row at a time,
  // each a demand miss: bf16 32/8 d128 spent half of row_dots' cycles on its first
  // load of a row): V of columns [lo, hi) of this tile (read after its scores), K of
  // the next tile from k_next (cols_next keys).
  void prefetch_in_place(int64_t lo, int64_t hi, int64_t k_next, int64_t cols_next) const {
    if (!d.prefetches) return;
    for (int64_t j = lo; j < hi; ++j)
      if (v_rows[j] != zeros) prefetch_row(v_rows[j], p.head_dim_v);
    for (int64_t j = 0; j < cols_next; ++j)
      prefetch_row(seq.k_at<const T>(p.k, k_next + j, hk), p.head_dim);
  }

  // v_rows as float rows over columns [lo, hi) (16-bit rows read in place converted
  // to the tile's copies), indexed by column.
  const float* const* values_as_float(int64_t lo, int64_t hi) const {
    if (d.row_type != RowType::kFloat32)
      for (int64_t j = lo; j < hi; ++j)
        if (v_rows[j] != zeros)
          v_rows[j] = convert(v_copy + j * d.dvp, static_cast<const T*>(v_rows[j]), p.head_dim_v,
                              d.dvp, v_scale);
    return reinterpret_cast<const float* const*>(v_rows);
  }

 private:
  // The rows of the key converted kConvertAhead keys later: a row at a time, the
  // conversion alone waited on memory (bf16 at 32/8 d128, before 16-bit rows were
  // read in place: 28% fewer cycles with the prefetch).
  void prefetch(int64_t key) const {
    prefetch_row(seq.k_at<const T>(p.k, key, hk), p.head_dim);
    prefetch_row(seq.k_at<const T>(p.v, key, hk), p.head_dim_v);
  }
  // The cache lines of a row of dim elements.
  static void prefetch_row(const void* row, int64_t dim) {
    const char* bytes = static_cast<const char*>(row);
    for (int64_t b = 0; b < dim * int64_t{sizeof(T)}; b += kCacheLine)
      __builtin_prefetch(bytes + b);
  }
  static const float* convert(float* dst, const T* src, int64_t dim, int64_t padded,
                              float scale) {
    if constexpr (kIsFloat8<T>)
      tile_kernels().float8_to_float(dst, &src->bits, dim, T::kElement, scale);
    else
      to_float_row(dst, src, dim);
    std::fill(dst + dim, dst + padded, 0.0f);
    return dst;
  }
};

// The row type the kernels read `count` rows of `bytes` codes as: e4m3fn rows without a
// NaN code (S.1111.111) take the shorter widening; a tile's check reads the rows the
// kernels then find in cache.
RowType rows_type(RowType type, const void* const* rows, int64_t count, int64_t bytes) {
  if (type != RowType::kFloat8E4M3) return type;
  uint8_t nan = 0;  // (bit 7 of (code & 0x7f) + 1 is set for NaN codes only: an OR loop)
  for (int64_t j = 0; j < count; ++j) {
    const uint8_t* codes = static_cast<const uint8_t*>(rows[j]);
    for (int64_t c = 0; c < bytes; ++c) nan |= static_cast<uint8_t>((codes[c] & 0x7f) + 1);
  }
  return (nan & 0x80) != 0 ? type : RowType::kFloat8E4M3NanFree;
}

// One kv head's share of a split (split_task): its packed rows against the split's
// key tiles, one tile at a time (tile), into its partial. T: q's storage type; C: the
// cache's. The tile's row pointers, scores and converted rows are the split's, shared
// by its heads (a head's tile is done before the next head's starts).
template <class T, class C>
struct HeadSplit {
  const AttentionParams& p;
  const Decode& d;
  const SeqlenInfo& seq;
  Partial part;
  KeyTile<C> keys;
  float* Q;           // pad_rows x dp floats, pre-scaled (not bf16_pairs)
  uint16_t* q_bf16;   // rows x dp bf16 bits (bf16_pairs)
  float* S;           // pad_rows x kKeyTile
  bool bf16_pairs;
  float v_factor;     // float8 read in place: v's descale, which its rows do not carry

  // Partial and query rows of kv head hk; k_rows: 2 kKeyTile pointers; q_rows: its Q or
  // q_bf16 storage (pad_rows x dp floats); tile_rows: S, then the converted K and V
  // rows, then zeros (split_task).
  HeadSplit(const AttentionParams& p_, const Decode& d_, const SeqlenInfo& seq_, float* partial,
            int64_t hk, const void** k_rows, float* q_rows, float* tile_rows)
      : p(p_),
        d(d_),
        seq(seq_),
        part(partial, d_),
        keys{d_,
             p_,
             seq_,
             hk,
             k_rows,
             k_rows + kKeyTile,
             tile_rows + d_.pad_rows * kKeyTile,
             tile_rows + d_.pad_rows * kKeyTile + kKeyTile * d_.dp,
             tile_rows + d_.pad_rows * kKeyTile + kKeyTile * (d_.dp + d_.dvp),
             1.0f,
             1.0f},
        Q(q_rows),
        q_bf16(reinterpret_cast<uint16_t*>(q_rows)),
        S(tile_rows) {
    std::fill(part.O, part.O + d.pad_rows * d.dvp, 0.0f);
    std::fill(part.m, part.m + d.pad_rows, kNegInf);
    std::fill(part.l, part.l + d.pad_rows, 0.0f);
    std::fill(part.seen, part.seen + d.pad_rows, 0.0f);
    const int64_t b = seq.batch;
    // Float8 caches: this sequence and kv head's descales scale the converted rows, or,
    // read in place, q's rows (k) and the output (v).
    const float k_descale = kIsFloat8<C> ? p.cache.k_descale[b * p.heads_kv + hk] : 1.0f;
    const float v_descale = kIsFloat8<C> ? p.cache.v_descale[b * p.heads_kv + hk] : 1.0f;
    // (Read in place, a code's value over d.read_unit: V rows converted for a mixed tile
    // take the same unit, so that every tile adds to O alike.)
    keys.k_scale = d.float8_in_place ? 1.0f : k_descale;
    keys.v_scale = d.float8_in_place ? 1.0f / d.read_unit : v_descale;
    v_factor = v_descale * d.read_unit;
    const float q_scale = p.softmax_scale * (d.float8_in_place ? k_descale * d.read_unit : 1.0f);
    // bf16 caches on CPUs with bf16 pair products: the scores from q's own bf16 rows
    // (unscaled: exact), the scale after (row_dots_bf16; ~half row_dots' instructions).
    // Else Q in float, pre-scaled; padding rows zero.
    bf16_pairs = std::is_same_v<T, BFloat16> && std::is_same_v<C, BFloat16> &&
                 tile_kernels().row_dots_bf16 && d.in_place && d.dp % kBf16PairsDim == 0;
    if (bf16_pairs) {
      for (int64_t r = 0; r < d.rows; ++r)  // (in place: dp == head_dim, every element written)
        std::memcpy(q_bf16 + r * d.dp, seq.q_at<const T>(p.q, d.query(r), d.head(hk, r)),
                    p.head_dim * sizeof(T));
      return;
    }
    std::fill(Q, Q + d.pad_rows * d.dp, 0.0f);
    for (int64_t r = 0; r < d.rows; ++r) {
      const T* q = seq.q_at<const T>(p.q, d.query(r), d.head(hk, r));
      for (int64_t c = 0; c < p.head_dim; ++c) Q[r * d.dp + c] = to_float(q[c]) * q_scale;
    }
  }

  // Key tile t (keys k0 = t kKeyTile.. of cols), with each row's visible columns
  // [lo[r], hi[r]) and their union [lo_all, hi_all) (non-empty); k_next / cols_next:
  // the split's next tile (0 columns: none).
  void tile(int64_t k0, int64_t cols, const int64_t* lo, const int64_t* hi, int64_t lo_all,
            int64_t hi_all, bool same_columns, int64_t k_next, int64_t cols_next) {
    const TileKernels& kernels = tile_kernels();
    // Scores of columns [c0, n) (whole vector lines), -inf outside each row's keys.
    const int64_t c0 = lo_all / kRowAlign * kRowAlign, n = round_up(hi_all, kRowAlign);
    keys.locate(k0, cols, c0, n);
    keys.prefetch_in_place(lo_all, hi_all, k_next, cols_next);
    if (bf16_pairs)
      kernels.row_dots_bf16(S + c0, kKeyTile, q_bf16, d.dp, d.rows, keys.k_rows + c0, n - c0,
                            d.dp);
    else
      kernels.row_dots(S + c0, kKeyTile, Q, d.dp, d.rows, keys.k_rows + c0,
                       rows_type(d.row_type, keys.k_rows + c0, n - c0, p.head_dim), n - c0,
                       d.dp);
    for (int64_t r = 0; r < d.rows; ++r) {
      float* s = S + r * kKeyTile;
      if (bf16_pairs)
        for (int64_t j = c0; j < n; ++j) s[j] *= p.softmax_scale;
      if (p.softcap > 0.0f)
        for (int64_t j = lo[r]; j < hi[r]; ++j) s[j] = p.softcap * std::tanh(s[j] / p.softcap);
      std::fill(s, s + lo[r], kNegInf);
      std::fill(s + hi[r], s + n, kNegInf);
      if (lo[r] < hi[r]) part.seen[r] = 1.0f;
    }
    kernels.softmax_step(S, kKeyTile, d.rows, d.pad_rows, n, part.m, part.l, part.O, d.dvp);
    // P V over columns [lo_all, hi_all). Where rows see different keys, a hidden pair
    // (P = 0) would multiply an inf / NaN value into NaN: then float rows, checked,
    // and visible pairs only if one is not finite.
    if (same_columns) {
      kernels.gemm_b_rows(part.O, d.dvp, S + lo_all, kKeyTile, keys.v_rows + lo_all,
                          rows_type(d.row_type, keys.v_rows + lo_all, hi_all - lo_all,
                                    p.head_dim_v),
                          d.value_rows, d.dvp, hi_all - lo_all);
      return;
    }
    const float* const* v_rows = keys.values_as_float(lo_all, hi_all);
    bool finite = true;
    for (int64_t j = lo_all; finite && j < hi_all; ++j)
      finite = kernels.all_finite(v_rows[j], d.dvp);
    if (finite) {
      kernels.gemm_b_rows(part.O, d.dvp, S + lo_all, kKeyTile,
                          reinterpret_cast<const void* const*>(v_rows + lo_all), RowType::kFloat32,
                          d.value_rows, d.dvp, hi_all - lo_all);
      return;
    }
    for (int64_t r = 0; r < d.rows; ++r)
      for (int64_t j = lo[r]; j < hi[r]; ++j) {
        const float pj = S[r * kKeyTile + j];
        for (int64_t c = 0; c < d.dvp; ++c) part.O[r * d.dvp + c] += pj * v_rows[j][c];
      }
  }

  void finish() {
    if (d.float8_in_place)
      for (int64_t i = 0; i < d.pad_rows * d.dvp; ++i) part.O[i] *= v_factor;
  }
};

// One split of a sequence and head group: the group's kv heads' packed rows against
// key tiles [first, last) of the sequence's visible keys, into their partials, tile by
// tile with the heads inner: a tile's rows of all kv heads lie together in the cache
// (a head's alone are heads x head_dim elements apart). A head at a time, bf16 32/8
// d128 ran at 0.55x the speed of the same bytes in one kv head; heads inner, its step
// (b1, 4096 keys) took 0.78-0.92x the time (medians of three rounds of five process
// pairs, twenty-seventh session, 2-core EPYC). T: q's storage type; C: the cache's.
template <class T, class C>
void split_task(const AttentionParams& p, const Decode& d, float* partials, int64_t task) {
  const int64_t split = task % d.splits, group = task / d.splits % d.head_groups;
  const int64_t b = task / d.splits / d.head_groups;
  const SeqlenInfo seq(p, b);
  const int64_t head0 = group * d.group_heads, heads = d.group_end(p, group) - head0;
  const auto partial = [&](int64_t hk) {
    return partials + ((b * p.heads_kv + hk) * d.splits + split) * d.partial_floats;
  };
  const int64_t begin = seq.first_key(0), end = seq.last_key(p.seqlen_q - 1) + 1;
  const int64_t first_tile = begin / kKeyTile,
                tiles = end > begin ? ceil_div(end, kKeyTile) - first_tile : 0;
  const int64_t per_split = ceil_div(tiles, d.splits);
  const int64_t first = first_tile + split * per_split;
  const int64_t last = std::min(first + per_split, first_tile + tiles);

  // Per head: its query rows; shared: the tile's scores, converted rows and zeros.
  const int64_t q_floats = d.pad_rows * d.dp;
  const int64_t tile_floats =
      d.pad_rows * kKeyTile + kKeyTile * (d.dp + d.dvp) + std::max(d.dp, d.dvp);
  thread_local Scratch scratch;
  float* q_rows = scratch.get(heads * q_floats + tile_floats);
  float* tile_rows = q_rows + heads * q_floats;
  float* zeros = tile_rows + tile_floats - std::max(d.dp, d.dvp);
  std::fill(zeros, zeros + std::max(d.dp, d.dvp), 0.0f);  // (zero bits in every element type)
  thread_local std::vector<const void*> row_storage;
  row_storage.resize(2 * kKeyTile);
  thread_local std::vector<HeadSplit<T, C>> head_splits;
  head_splits.clear();
  for (int64_t h = 0; h < heads; ++h)
    head_splits.emplace_back(p, d, seq, partial(head0 + h), head0 + h, row_storage.data(),
                             q_rows + h * q_floats, tile_rows);
  std::vector<int64_t> lo(d.rows), hi(d.rows);  // each row's visible columns of the tile
  for (int64_t t = first; t < last; ++t) {
    const int64_t k0 = t * kKeyTile, cols = std::min(kKeyTile, seq.seqlen_k - k0);
    int64_t lo_all = cols, hi_all = 0;
    bool same_columns = true;  // every row sees the same keys: no hidden pair is multiplied
    for (int64_t r = 0; r < d.rows; ++r) {
      const int64_t i = d.query(r);
      lo[r] = std::clamp<int64_t>(seq.first_key(i) - k0, 0, cols);
      hi[r] = std::clamp<int64_t>(seq.last_key(i) + 1 - k0, lo[r], cols);
      same_columns = same_columns && lo[r] == lo[0] && hi[r] == hi[0];
      if (lo[r] < hi[r]) lo_all = std::min(lo_all, lo[r]), hi_all = std::max(hi_all, hi[r]);
    }
    if (hi_all <= lo_all) continue;
    const int64_t k_next = k0 + kKeyTile;
    const int64_t cols_next = t + 1 < last ? std::min(kKeyTile, seq.seqlen_k - k_next) : 0;
    for (HeadSplit<T, C>& head : head_splits)
      head.tile(k0, cols, lo.data(), hi.data(), lo_all, hi_all, same_columns, k_next, cols_next);
  }
  for (HeadSplit<T, C>& head : head_splits) head.finish();
}

// out and lse of one (sequence, kv head)'s packed rows from its splits' partials,
// with the sink folded in. A row that saw no key (and has no sink) gets 0 and -inf;
// one whose visible scores are all -inf gets NaN, as the dense forward.
template <class T>
void combine(const AttentionParams& p, const Decode& d, float* partials, int64_t pair) {
  const int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
  const SeqlenInfo seq(p, b);
  thread_local Scratch scratch;
  float* o = scratch.get(d.dvp);
  const auto split = [&](int64_t s) {
    return Partial(partials + (pair * d.splits + s) * d.partial_floats, d);
  };
  for (int64_t r = 0; r < d.rows; ++r) {
    const int64_t i = d.query(r), h = d.head(hk, r);
    float m = kNegInf;
    bool seen = false;
    for (int64_t s = 0; s < d.splits; ++s)
      if (split(s).seen[r] != 0.0f) m = nan_max(m, split(s).m[r]), seen = true;
    const float sink = p.sinks ? p.sinks[b * p.heads_q + h] : kNegInf;
    float* lse = p.lse.at<float>(seq.batch, seq.q_row(i), h);
    T* out = seq.q_at<T>(p.out, i, h);
    if (!seen && sink == kNegInf) {
      std::fill(out, out + p.head_dim_v, from_float<T>(0.0f));
      *lse = kNegInf;
      continue;
    }
    m = nan_max(m, sink);
    float total = std::exp(sink - m);
    std::fill(o, o + d.dvp, 0.0f);
    for (int64_t s = 0; s < d.splits; ++s) {
      const Partial part = split(s);
      if (part.seen[r] == 0.0f) continue;
      const float w = std::exp(part.m[r] - m);
      total += part.l[r] * w;
      for (int64_t c = 0; c < d.dvp; ++c) o[c] += part.O[r * d.dvp + c] * w;
    }
    for (int64_t c = 0; c < p.head_dim_v; ++c) out[c] = from_float<T>(o[c] / total);
    *lse = m + std::log(total);
  }
}

}  // namespace

// The decode path reads none of these (the KV-cache target passes none today).
bool kvcache_decodes(const AttentionParams& p) {
  return p.group_size() * p.seqlen_q <= kKvcacheDecodeMaxRows && !p.has_score_terms() &&
         !p.dropout && !p.has_segments() && !p.packed() && !p.seqused_q && !p.diagonal_offset;
}

void kvcache_forward(const AttentionParams& p) {
  if (p.seqlen_q == 0) return;  // append only
  // (never float8 caches: the FFI refuses them on the dense forward)
  if (!kvcache_decodes(p)) return attention_forward(p);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Decode d(p);
    const int64_t pairs = p.batch * p.heads_kv;
    thread_local Scratch partial_storage;  // (per calling thread: calls may overlap)
    float* partials = partial_storage.get(pairs * d.splits * d.partial_floats);
    // The last split of a (sequence, head group) to finish combines its kv heads'
    // partials: one hand-off to the thread pool a call, not two (bf16 4/2 d64: 5-9% of a
    // decode step, in one process). Its acquire sees the other splits' partials, which
    // their releases publish.
    const int64_t groups = p.batch * d.head_groups;
    std::vector<std::atomic<int64_t>> finished(groups);
    parallel_for(groups * d.splits, [&](int64_t task) {
      dispatch_cache_element<T>(p.cache.element, [&](auto cache_tag) {
        split_task<T, decltype(cache_tag)>(p, d, partials, task);
      });
      const int64_t group = task / d.splits;
      if (finished[group].fetch_add(1, std::memory_order_acq_rel) != d.splits - 1) return;
      const int64_t b = group / d.head_groups, g = group % d.head_groups;
      for (int64_t hk = g * d.group_heads; hk < d.group_end(p, g); ++hk)
        combine<T>(p, d, partials, b * p.heads_kv + hk);
    });
  });
}

}  // namespace flashjax::cpu
