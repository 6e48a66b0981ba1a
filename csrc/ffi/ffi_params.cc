#include "ffi_params.h"

#include <cmath>
#include <sstream>

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

}  // namespace

ffi::Error fill_forward_inputs(AttentionParams& p, const ffi::AnyBuffer& q,
                               const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const ffi::AnyBuffer& sinks, const Options& options) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() < 4 || kd.size() != qd.size() || vd.size() != qd.size())
    return invalid("q, k, v must have rank 4 (batch, seqlen, heads, head_dim); got " +
                   shape_string(qd) + ", " + shape_string(kd) + ", " + shape_string(vd));
  if (!to_dtype(q.element_type(), p.dtype))
    return invalid("q must be float16, bfloat16 or float32");
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid("q, k and v must share one dtype");
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
  if (p.seqlen_q < 1 || p.seqlen_k < 1 || p.heads_kv < 1 || p.heads_q < 1)
    return invalid("seqlens and heads must be >= 1");
  if (p.heads_q % p.heads_kv != 0) return invalid("heads_q must be a multiple of heads_kv");
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim || p.head_dim_v < 1 ||
      p.head_dim_v > kMaxHeadDim)
    return invalid("head_dim and head_dim_v must be in [1, 256]");
  if (options.window_left < -1 || options.window_right < -1)
    return invalid("window sizes must be >= -1");
  if (!(options.softcap >= 0.0f) || !std::isfinite(options.softmax_scale))
    return invalid("softcap must be >= 0 and softmax_scale finite");
  p.softmax_scale = options.softmax_scale;
  p.softcap = options.softcap;
  p.window_left = options.window_left;
  p.window_right = options.window_right;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.sinks = nullptr;
  if (options.has_sinks) {
    if (ffi::Error e = expect_rows("sinks", sinks, p, 0); e.failure()) return e;
    p.sinks = static_cast<const float*>(sinks.untyped_data());
  }
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

ffi::Error expect_rows(const char* name, const ffi::AnyBuffer& buffer, const AttentionParams& p,
                       int64_t rows_per_head) {
  auto d = buffer.dimensions();
  const size_t trailing = rows_per_head > 0 ? 2 : 1;
  const bool ok = buffer.element_type() == ffi::DataType::F32 && d.size() >= trailing &&
                  leading_product(d, trailing) == p.batch &&
                  d[d.size() - trailing] == p.heads_q &&
                  (rows_per_head == 0 || d[d.size() - 1] == rows_per_head);
  if (!ok)
    return invalid(std::string(name) + " must be float32 [batch.., heads_q" +
                   (rows_per_head > 0 ? ", seqlen_q]" : "]") + "; got " + shape_string(d));
  return ffi::Error::Success();
}

ffi::Error expect_output(const char* name, const ffi::AnyBuffer& buffer,
                         const ffi::AnyBuffer& q, const AttentionParams& p) {
  auto bd = buffer.dimensions(), qd = q.dimensions();
  const bool ok = buffer.element_type() == q.element_type() && same_leading(bd, 1, qd, 1) &&
                  bd[bd.size() - 1] == p.head_dim_v;
  if (!ok) return invalid(std::string(name) + " has the wrong dtype or shape " + shape_string(bd));
  return ffi::Error::Success();
}

}  // namespace flashjax::ffi_layer
