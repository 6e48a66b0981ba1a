#include "ffi_params.h"

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

namespace flashjax::ffi_layer {
namespace {

std::string shape_string(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << (dims.size() == 1 ? ",)" : ")");
  return out.str();
}

ffi::Error invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("flashjax: " + message);
}

bool to_dtype(ffi::DataType type, DType& dtype) {
  switch (type) {
    case ffi::DataType::F32: dtype = DType::kFloat32; return true;
    case ffi::DataType::F16: dtype = DType::kFloat16; return true;
    case ffi::DataType::BF16: dtype = DType::kBFloat16; return true;
    default: return false;
  }
}

bool to_cache_element(ffi::DataType type, CacheElement& element) {
  switch (type) {
    case ffi::DataType::F8E4M3FN: element = CacheElement::kFloat8E4M3; return true;
    case ffi::DataType::F8E5M2: element = CacheElement::kFloat8E5M2; return true;
    default: return false;
  }
}

// Product of all but the last `trailing` dims: the (vmapped) batch.
int64_t leading_product(ffi::Span<const int64_t> dims, size_t trailing) {
  int64_t n = 1;
  for (size_t i = 0; i + trailing < dims.size(); ++i) n *= dims[i];
  return n;
}

bool same_leading(ffi::Span<const int64_t> a, size_t trailing_a, ffi::Span<const int64_t> b,
                  size_t trailing_b) {
  if (a.size() < trailing_a || b.size() < trailing_b) return false;
  if (a.size() - trailing_a != b.size() - trailing_b) return false;
  for (size_t i = 0; i + trailing_a < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// The options every target has (FLASHJAX_SHARED_OPTIONS), checked and copied
// into the AttentionParams fields of the same name.
template <class TargetOptions>
ffi::Error set_shared_options(AttentionParams& p, const TargetOptions& options) {
  if (options.window_left < -1 || options.window_right < -1)
    return invalid("window sizes must be >= -1");
  if (!(options.softcap >= 0.0f) || !std::isfinite(options.softmax_scale))
    return invalid("softcap must be >= 0 and softmax_scale finite");
  if (options.kernel_cap < static_cast<int64_t>(KernelCap::kAny) ||
      options.kernel_cap > static_cast<int64_t>(KernelCap::kSimt))
    return invalid("kernel_cap must be 0 (any), 1 (mma) or 2 (simt)");
#define FLASHJAX_COPY_OPTION(type, name) p.name = static_cast<decltype(p.name)>(options.name);
  FLASHJAX_SHARED_OPTIONS(FLASHJAX_COPY_OPTION)
#undef FLASHJAX_COPY_OPTION
  return ffi::Error::Success();
}

// The checks every call shares once shapes are read. A KV-cache call
// (p.cache.active()) may also read float8 caches (the platforms say which calls).
template <class TargetOptions>
ffi::Error check_and_set_common(AttentionParams& p, const ffi::AnyBuffer& q,
                                const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                const TargetOptions& options) {
  // (float8 q, k, v: start_float8 has set their type and p.dtype, out's)
  if (!p.float8.active() && !to_dtype(q.element_type(), p.dtype))
    return invalid("q must be float16, bfloat16 or float32");
  const bool float8_cache = p.cache.active() && k.element_type() == v.element_type() &&
                            to_cache_element(k.element_type(), p.cache.element);
  if (!float8_cache && (k.element_type() != q.element_type() ||
                        v.element_type() != q.element_type()))
    return invalid(p.cache.active() ? "k_cache and v_cache must have q's dtype, or one float8 "
                                      "dtype (float8_e4m3fn, float8_e5m2)"
                                    : "q, k and v must share one dtype");
  if (p.heads_kv < 1 || p.heads_q < 1) return invalid("heads must be >= 1");
  if (p.heads_q % p.heads_kv != 0) return invalid("heads_q must be a multiple of heads_kv");
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim || p.head_dim_v < 1 ||
      p.head_dim_v > kMaxHeadDim)
    return invalid("head_dim and head_dim_v must be in [1, 256]");
  if (ffi::Error e = set_shared_options(p, options); e.failure()) return e;
  p.q = row_tensor(p, q.untyped_data(), true, p.heads_q, p.head_dim);
  p.k = row_tensor(p, k.untyped_data(), false, p.heads_kv, p.head_dim);
  p.v = row_tensor(p, v.untyped_data(), false, p.heads_kv, p.head_dim_v);
  return ffi::Error::Success();
}

// An int32 array of `rows` leading entries (batch..) and `trailing` given dims.
bool is_int32_array(const ffi::AnyBuffer& buffer, int64_t rows, std::initializer_list<int64_t> trailing) {
  auto d = buffer.dimensions();
  if (buffer.element_type() != ffi::DataType::S32 || d.size() < trailing.size()) return false;
  size_t i = d.size() - trailing.size();
  for (int64_t t : trailing)
    if (d[i++] != t) return false;
  return leading_product(d, trailing.size()) == rows;
}

// Checks an optional input's dtype and shape by its kind (operands.h).
ffi::Error check_input(const char* name, InputKind kind, const ffi::AnyBuffer& buffer,
                       const AttentionParams& p) {
  auto expected = [&](const char* what) {
    return invalid(std::string(name) + " must be int32 " + what + "; got " +
                   shape_string(buffer.dimensions()));
  };
  switch (kind) {
    case InputKind::kPerHead:
      return expect_per_head(name, buffer, p);
    case InputKind::kPerKvHead: {
      auto d = buffer.dimensions();
      if (buffer.element_type() == ffi::DataType::F32 && d.size() == 2 && d[0] == p.batch &&
          d[1] == p.heads_kv)
        return ffi::Error::Success();
      return invalid(std::string(name) + " must be float32 (batch, heads_kv); got " +
                     shape_string(d));
    }
    case InputKind::kPerSequence:
      if (is_int32_array(buffer, p.batch, {})) return ffi::Error::Success();
      return expected("(batch,)");
    case InputKind::kQueryRows:
      if (p.packed()) return invalid("segment ids are for the dense layout only");
      if (is_int32_array(buffer, p.batch, {p.seqlen_q})) return ffi::Error::Success();
      return expected("(batch, seqlen_q)");
    case InputKind::kKeyRows:
      if (p.packed()) return invalid("segment ids are for the dense layout only");
      if (is_int32_array(buffer, p.batch, {p.seqlen_k})) return ffi::Error::Success();
      return expected("(batch, seqlen_k)");
    case InputKind::kScores:
    case InputKind::kScoreMask: {
      const bool is_mask = kind == InputKind::kScoreMask;
      if (p.packed() || p.cache.active())
        return invalid(std::string(name) + " is for the dense layout only");
      auto d = buffer.dimensions();
      const auto type = is_mask ? ffi::DataType::PRED : ffi::DataType::F32;
      bool ok = buffer.element_type() == type && d.size() >= 3;
      if (ok) {
        const size_t r = d.size();
        const int64_t entries = leading_product(d, 3), heads = d[r - 3];
        ok = d[r - 2] == p.seqlen_q && d[r - 1] == p.seqlen_k && entries >= 1 &&
             p.batch % entries == 0 && (heads == 1 || heads == p.heads_kv || heads == p.heads_q);
      }
      if (ok) return ffi::Error::Success();
      return invalid(std::string(name) + " must be " + (is_mask ? "bool" : "float32") +
                     " [batch.. or 1, heads_q, heads_kv or 1, seqlen_q, seqlen_k]; got " +
                     shape_string(d));
    }
    case InputKind::kDropout: {
      auto d = buffer.dimensions();
      if (buffer.element_type() == ffi::DataType::U32 && d.size() >= 2 &&
          d[d.size() - 2] == p.heads_q && d[d.size() - 1] == 4 && leading_product(d, 2) == p.batch)
        return ffi::Error::Success();
      return invalid(std::string(name) + " must be uint32 (batch.., heads_q, 4); got " +
                     shape_string(d));
    }
    case InputKind::kPageTable: {
      auto d = buffer.dimensions();
      if (buffer.element_type() == ffi::DataType::S32 && d.size() == 2 && d[0] == p.batch &&
          d[1] >= 1)
        return ffi::Error::Success();
      return expected("(batch, max_pages)");
    }
  }
  return invalid(std::string(name) + " has an unknown kind");
}

// The attention targets' checks: the shared ones and their own options.
ffi::Error check_and_set_attention(AttentionParams& p, const ffi::AnyBuffer& q,
                                   const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                   const Options& options) {
  p.deterministic = options.deterministic;
  if (!(options.dropout_rate >= 0.0 && options.dropout_rate < 1.0))
    return invalid("dropout_rate must be in [0, 1)");
  p.dropout.threshold = dropout::threshold(options.dropout_rate);
  p.dropout.scale = static_cast<float>(1.0 / (1.0 - options.dropout_rate));
  return check_and_set_common(p, q, k, v, options);
}

// Fills the slots whose flag is set, in order, from the call's remaining
// inputs (present ones only, no placeholders); every input must be claimed.
template <size_t kCount>
ffi::Error take_present_inputs(const ffi::RemainingArgs& rest, const bool (&present)[kCount],
                               std::optional<ffi::AnyBuffer>* const (&slots)[kCount]) {
  size_t next = 0;
  for (size_t i = 0; i < kCount; ++i) {
    if (!present[i]) continue;
    auto buffer = rest.get<ffi::AnyBuffer>(next++);
    if (buffer.has_error()) return invalid("missing an optional input the attributes announce");
    *slots[i] = *buffer;
  }
  if (next != rest.size()) return invalid("more optional inputs than the attributes announce");
  return ffi::Error::Success();
}

}  // namespace

#define FLASHJAX_INPUT_FLAG(name, flag, kind, field) options.flag,
#define FLASHJAX_INPUT_ADDRESS(name, flag, kind, field) &inputs.name,
ffi::Error take_optional_inputs(const ffi::RemainingArgs& rest, const Options& options,
                                OptionalInputs& inputs) {
  return take_present_inputs(rest, {FLASHJAX_ATTENTION_INPUTS(FLASHJAX_INPUT_FLAG)},
                             {FLASHJAX_ATTENTION_INPUTS(FLASHJAX_INPUT_ADDRESS)});
}

TensorRef row_tensor(const AttentionParams& p, void* data, bool query_side, int64_t heads,
                     int64_t dim) {
  if (p.packed()) return {data, 0, heads * dim, dim};
  return TensorRef::rows_heads_dim(data, query_side ? p.seqlen_q : p.seqlen_k, heads, dim);
}

TensorRef row_stats(const AttentionParams& p, void* data) {
  if (p.packed()) return {data, 0, 1, p.total_q};
  return TensorRef::heads_rows(data, p.seqlen_q, p.heads_q);
}

ffi::Error fill_dense_inputs(AttentionParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                             const ffi::AnyBuffer& v, const Options& options) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size() || vd.size() != qd.size())
    return invalid("q, k, v must have rank 4 (batch, seqlen, heads, head_dim); got " +
                   shape_string(qd) + ", " + shape_string(kd) + ", " + shape_string(vd));
  if (!same_leading(qd, 3, kd, 3) || !same_leading(qd, 3, vd, 3))
    return invalid("q, k, v batch dims differ: " + shape_string(qd) + ", " + shape_string(kd) +
                   ", " + shape_string(vd));
  const size_t r = qd.size();
  p.batch = leading_product(qd, 3);
  p.seqlen_q = qd[r - 3];
  p.heads_q = qd[r - 2];
  p.head_dim = qd[r - 1];
  p.seqlen_k = kd[r - 3];
  p.heads_kv = kd[r - 2];
  p.head_dim_v = vd[r - 1];
  if (kd[r - 1] != p.head_dim) return invalid("k head_dim must equal q head_dim");
  if (vd[r - 3] != p.seqlen_k || vd[r - 2] != p.heads_kv)
    return invalid("v must have k's seqlen and heads: k " + shape_string(kd) + ", v " +
                   shape_string(vd));
  if (p.seqlen_q < 1 || p.seqlen_k < 1) return invalid("seqlens must be >= 1");
  return check_and_set_attention(p, q, k, v, options);
}

ffi::Error fill_packed_inputs(AttentionParams& p, const ffi::AnyBuffer& q,
                              const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& cu_seqlens_q,
                              const ffi::AnyBuffer& cu_seqlens_k, const Options& options) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3)
    return invalid("packed q, k, v must have rank 3 (total, heads, head_dim); got " +
                   shape_string(qd) + ", " + shape_string(kd) + ", " + shape_string(vd));
  auto cq = cu_seqlens_q.dimensions(), ck = cu_seqlens_k.dimensions();
  if (cu_seqlens_q.element_type() != ffi::DataType::S32 ||
      cu_seqlens_k.element_type() != ffi::DataType::S32 || cq.size() != 1 || ck.size() != 1 ||
      cq[0] != ck[0] || cq[0] < 1)
    return invalid("cu_seqlens_q and cu_seqlens_k must be int32 (num_seqs + 1,); got " +
                   shape_string(cq) + ", " + shape_string(ck));
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_seqlens_q.untyped_data());
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_seqlens_k.untyped_data());
  p.batch = cq[0] - 1;
  p.total_q = qd[0];
  p.heads_q = qd[1];
  p.head_dim = qd[2];
  p.total_k = kd[0];
  p.heads_kv = kd[1];
  p.head_dim_v = vd[2];
  p.seqlen_q = options.max_seqlen_q;
  p.seqlen_k = options.max_seqlen_k;
  if (kd[2] != p.head_dim) return invalid("k head_dim must equal q head_dim");
  if (vd[0] != p.total_k || vd[1] != p.heads_kv)
    return invalid("v must have k's total and heads: k " + shape_string(kd) + ", v " +
                   shape_string(vd));
  if (p.seqlen_q < 0 || p.seqlen_k < 0) return invalid("max_seqlen must be >= 0");
  return check_and_set_attention(p, q, k, v, options);
}

ScoreArray score_array(const AttentionParams& p, const ffi::AnyBuffer& buffer) {
  auto d = buffer.dimensions();
  const size_t r = d.size();
  const int64_t entries = leading_product(d, 3), heads = d[r - 3];
  ScoreArray a;
  a.data = buffer.untyped_data();
  a.row_stride = d[r - 1];
  a.head_stride = d[r - 2] * d[r - 1];
  a.batch_stride = heads * a.head_stride;
  a.batch_div = p.batch / entries;
  a.head_div = p.heads_q / heads;
  return a;
}

ffi::Error expect_dbias(const ffi::AnyBuffer& buffer, const AttentionParams& p) {
  if (ffi::Error e = check_input("dbias", InputKind::kScores, buffer, p); e.failure()) return e;
  const ScoreArray d = score_array(p, buffer);
  if (d.batch_div != p.bias.batch_div || d.head_div != p.bias.head_div)
    return invalid("dbias must have bias's shape; got " + shape_string(buffer.dimensions()));
  return ffi::Error::Success();
}

namespace {
// The AttentionParams field of an optional input: a pointer to its data, or a
// ScoreArray view.
template <class T>
void set_input(const T*& field, const ffi::AnyBuffer& buffer, const AttentionParams&) {
  field = static_cast<const T*>(buffer.untyped_data());
}
void set_input(ScoreArray& field, const ffi::AnyBuffer& buffer, const AttentionParams& p) {
  field = score_array(p, buffer);
}
}  // namespace

// Points p.field at an optional input once its shape (kind) is checked.
#define FLASHJAX_FILL_INPUT(name, flag, kind, field)                                    \
  if (inputs.name) {                                                                     \
    if (ffi::Error e = check_input(#name, InputKind::kind, *inputs.name, p); e.failure()) \
      return e;                                                                          \
    set_input(p.field, *inputs.name, p);                                                 \
  }

ffi::Error fill_optional_inputs(AttentionParams& p, const OptionalInputs& inputs) {
  FLASHJAX_ATTENTION_INPUTS(FLASHJAX_FILL_INPUT)
  return ffi::Error::Success();
}

ffi::Error fill_kvcache_inputs(AttentionParams& p, const KvcacheInputs& in,
                               const ffi::RemainingArgs& rest, const KvcacheOptions& options) {
  auto qd = in.q.dimensions(), kd = in.k_cache.dimensions(), vd = in.v_cache.dimensions();
  auto knd = in.k_new.dimensions(), vnd = in.v_new.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || knd.size() != 4 || vnd.size() != 4)
    return invalid("q, k_cache, v_cache, k, v must have rank 4; got " + shape_string(qd) + ", " +
                   shape_string(kd) + ", " + shape_string(vd) + ", " + shape_string(knd) + ", " +
                   shape_string(vnd));
  p.batch = qd[0];
  p.seqlen_q = qd[1];
  p.heads_q = qd[2];
  p.head_dim = qd[3];
  p.heads_kv = kd[2];
  p.head_dim_v = vd[3];
  KvCache& c = p.cache;
  c.slots = kd[0];
  c.slot_rows = kd[1];
  c.new_rows = knd[1];
  if (kd[3] != p.head_dim || vd[0] != c.slots || vd[1] != c.slot_rows || vd[2] != p.heads_kv)
    return invalid("k_cache must be (slots, rows, heads_kv, head_dim) and v_cache (slots, rows, "
                   "heads_kv, head_dim_v); got " + shape_string(kd) + ", " + shape_string(vd));
  if (knd[0] != p.batch || knd[2] != p.heads_kv || knd[3] != p.head_dim || vnd[0] != p.batch ||
      vnd[1] != c.new_rows || vnd[2] != p.heads_kv || vnd[3] != p.head_dim_v)
    return invalid("k and v must be (batch, seqlen_new, heads_kv, head_dim[_v]); got " +
                   shape_string(knd) + ", " + shape_string(vnd));
  if (c.slots < 1 || c.slot_rows < 1 || c.slots > INT32_MAX || c.slot_rows > INT32_MAX)
    return invalid("the cache's slots and rows must be in [1, 2^31)");  // (seqlen_q 0: append only)
  if (in.k_new.element_type() != in.q.element_type() ||
      in.v_new.element_type() != in.q.element_type())
    return invalid("k and v must have q's dtype");
  if (!is_int32_array(in.cache_seqlens, p.batch, {}) || in.cache_seqlens.dimensions().size() != 1)
    return invalid("cache_seqlens must be int32 (batch,); got " +
                   shape_string(in.cache_seqlens.dimensions()));
  c.seqlens = static_cast<const int32_t*>(in.cache_seqlens.untyped_data());

  KvcacheOptionalInputs inputs;
  if (ffi::Error e = take_present_inputs(rest, {FLASHJAX_KVCACHE_INPUTS(FLASHJAX_INPUT_FLAG)},
                                         {FLASHJAX_KVCACHE_INPUTS(FLASHJAX_INPUT_ADDRESS)});
      e.failure())
    return e;
  FLASHJAX_KVCACHE_INPUTS(FLASHJAX_FILL_INPUT)
  if (inputs.page_table) {
    if (inputs.cache_batch_idx)
      return invalid("cache_batch_idx is for contiguous caches, not paged ones");
    c.max_pages = inputs.page_table->dimensions()[1];
  }
  p.seqlen_k = c.capacity();
  if (ffi::Error e = check_and_set_common(p, in.q, in.k_cache, in.v_cache, options); e.failure())
    return e;
  if (options.num_splits < 1) return invalid("num_splits must be >= 1");
  if (c.float8() != options.has_descales)
    return invalid("k_descale and v_descale come with float8 caches, and only with them");
  p.k = TensorRef::rows_heads_dim(in.k_cache_data, c.slot_rows, p.heads_kv, p.head_dim);
  p.v = TensorRef::rows_heads_dim(in.v_cache_data, c.slot_rows, p.heads_kv, p.head_dim_v);
  c.k_new = TensorRef::rows_heads_dim(in.k_new.untyped_data(), c.new_rows, p.heads_kv, p.head_dim);
  c.v_new = TensorRef::rows_heads_dim(in.v_new.untyped_data(), c.new_rows, p.heads_kv,
                                      p.head_dim_v);
  return ffi::Error::Success();
}

ffi::Error expect_like(const char* name, const ffi::AnyBuffer& buffer,
                       const ffi::AnyBuffer& like) {
  auto bd = buffer.dimensions(), ld = like.dimensions();
  if (buffer.element_type() != like.element_type() || !same_leading(bd, 0, ld, 0))
    return invalid(std::string(name) + " has the wrong dtype or shape " + shape_string(bd) +
                   ", expected " + shape_string(ld));
  return ffi::Error::Success();
}

ffi::Error expect_row_stats(const char* name, const ffi::AnyBuffer& buffer,
                            const AttentionParams& p) {
  auto d = buffer.dimensions();
  bool ok = buffer.element_type() == ffi::DataType::F32 && d.size() >= 2;
  if (ok && p.packed())
    ok = d.size() == 2 && d[0] == p.heads_q && d[1] == p.total_q;
  else if (ok)
    ok = leading_product(d, 2) == p.batch && d[d.size() - 2] == p.heads_q &&
         d[d.size() - 1] == p.seqlen_q;
  if (!ok)
    return invalid(std::string(name) + " must be float32 " +
                   (p.packed() ? "[heads_q, total_q]" : "[batch.., heads_q, seqlen_q]") +
                   "; got " + shape_string(d));
  return ffi::Error::Success();
}

ffi::Error expect_per_head(const char* name, const ffi::AnyBuffer& buffer,
                           const AttentionParams& p) {
  auto d = buffer.dimensions();
  const bool ok = buffer.element_type() == ffi::DataType::F32 && d.size() >= 1 &&
                  leading_product(d, 1) == p.batch && d[d.size() - 1] == p.heads_q;
  if (!ok)
    return invalid(std::string(name) + " must be float32 [batch.., heads_q]; got " +
                   shape_string(d));
  return ffi::Error::Success();
}

ffi::Error expect_output(const char* name, const ffi::AnyBuffer& buffer,
                         const ffi::AnyBuffer& q, const AttentionParams& p) {
  auto bd = buffer.dimensions(), qd = q.dimensions();
  DType dtype;  // (q's, or out's for float8 q)
  const bool ok = to_dtype(buffer.element_type(), dtype) && dtype == p.dtype &&
                  same_leading(bd, 1, qd, 1) && bd[bd.size() - 1] == p.head_dim_v;
  if (!ok) return invalid(std::string(name) + " has the wrong dtype or shape " + shape_string(bd));
  return ffi::Error::Success();
}

ffi::Error start_float8(AttentionParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& out) {
  if (!to_cache_element(q.element_type(), p.float8.element))
    return invalid("the float8 forward takes float8_e4m3fn or float8_e5m2 q, k, v");
  if (!to_dtype(out.element_type(), p.dtype) || p.dtype == DType::kFloat32)
    return invalid("the float8 forward's out must be bfloat16 or float16");
  return ffi::Error::Success();
}

ffi::Error fill_float8_inputs(AttentionParams& p, const ffi::AnyBuffer& q,
                              const ffi::AnyBuffer& vt,
                              std::initializer_list<const ffi::AnyBuffer*> descales) {
  if (p.packed()) return invalid("float8 q, k, v take the dense layout");
  static const char* const kNames[] = {"score_descale", "v_descale"};
  const float** fields[] = {&p.float8.score_descale, &p.float8.v_descale};
  int i = 0;
  for (const ffi::AnyBuffer* descale : descales) {  // (batch.., heads_kv): vmap folds batch
    auto d = descale->dimensions();
    if (descale->element_type() != ffi::DataType::F32 || d.size() == 0 ||
        d[d.size() - 1] != p.heads_kv || leading_product(d, 1) != p.batch)
      return invalid(std::string(kNames[i]) + " must be float32 (batch, heads_kv); got " +
                     shape_string(d));
    *fields[i++] = static_cast<const float*>(descale->untyped_data());
  }
  // V^T: (batch.., heads_kv, head_dim_v, keys), keys >= seqlen_k in whole permuted blocks.
  auto d = vt.dimensions();
  const size_t r = d.size();
  if (vt.element_type() != q.element_type() || r < 3 || d[r - 3] != p.heads_kv ||
      d[r - 2] != p.head_dim_v || d[r - 1] < p.seqlen_k || d[r - 1] % kFloat8KeyBlock != 0 ||
      leading_product(d, 3) != p.batch)
    return invalid("vt must be v's dtype, (batch, heads_kv, head_dim_v, keys) with keys >= "
                   "seqlen_k a multiple of " + std::to_string(kFloat8KeyBlock) + "; got " +
                   shape_string(d));
  const int64_t keys = d[r - 1];
  p.float8.vt_keys = keys;
  p.float8.vt = TensorRef{vt.untyped_data(), p.heads_kv * p.head_dim_v * keys, keys,
                          p.head_dim_v * keys};
  return ffi::Error::Success();
}

}  // namespace flashjax::ffi_layer
