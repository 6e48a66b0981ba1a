// Platform-independent bodies of the flashjax FFI handlers: validate, fill
// AttentionParams, then call the platform's `run(params)`. The CPU and CUDA
// handler files only bind these to XLA with their own context.
//
// Targets (the same five on every platform):
//   forward         (q, k, v, [optional..]) -> (out, lse)
//   float8_forward  (q, k, v, vt, score_descale, v_descale, [optional..]) -> (out, lse):
//                   float8 q, k, v (Float8Inputs; the platforms say which calls run)
//   backward        (q, k, v, out, dout, lse, dlse, [optional..]) -> (dq, dk, dv, dsinks
//                   [, dbias]): dbias (bias's shape) when Options::bias_gradient
//   varlen_forward  (q, k, v, cu_seqlens_q, cu_seqlens_k, [optional..]) -> (out, lse)
//   varlen_backward (q, k, v, cu_seqlens_q, cu_seqlens_k, out, dout, lse, dlse, [optional..])
//                   -> (dq, dk, dv, dsinks)
//   kvcache         (q, k_cache, v_cache, k_new, v_new, cache_seqlens, [optional..])
//                   -> (out, lse, workspace
//                   [, k_cache, v_cache]): the cache outputs, present when new
//                   rows are appended, alias the cache inputs.
// [optional..]: the present ones of FLASHJAX_ATTENTION_INPUTS (sinks, seqused_q,
// seqused_k, q_segment_ids, kv_segment_ids, diagonal_offset, bias, mask,
// alibi_slopes, dropout; flashjax/operands.h),
// in that order, as the Options flags announce; the KV-cache target's likewise
// (FLASHJAX_KVCACHE_INPUTS).
#pragma once

#include "ffi_params.h"

// The library is built with hidden visibility; handler symbols are its API.
#define FLASHJAX_EXPORT_HANDLER(name) \
  extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* name(XLA_FFI_CallFrame*)

namespace flashjax::ffi_layer {

// A call's required tensors: q, k, v, plus cu_seqlens when packed.
struct Inputs {
  ffi::AnyBuffer q, k, v;
  const ffi::AnyBuffer* cu_seqlens_q = nullptr;  // null: dense layout
  const ffi::AnyBuffer* cu_seqlens_k = nullptr;
};

// Shapes, semantics, q/k/v and the optional inputs.
inline ffi::Error fill_inputs(AttentionParams& p, const Inputs& in, const ffi::RemainingArgs& rest,
                              const Options& options) {
  ffi::Error e = in.cu_seqlens_q ? fill_packed_inputs(p, in.q, in.k, in.v, *in.cu_seqlens_q,
                                                      *in.cu_seqlens_k, options)
                                 : fill_dense_inputs(p, in.q, in.k, in.v, options);
  if (e.failure()) return e;
  OptionalInputs optional;
  if (e = take_optional_inputs(rest, options, optional); e.failure()) return e;
  if (e = fill_optional_inputs(p, optional); e.failure()) return e;
  if (options.dropout_rate > 0.0 && !p.dropout)
    return ffi::Error::InvalidArgument("flashjax: dropout_rate > 0 needs the dropout input");
  return ffi::Error::Success();
}

template <class Run>
ffi::Error forward_handler(const Inputs& in, const ffi::RemainingArgs& rest, ffi::AnyBuffer out,
                           ffi::AnyBuffer lse, const Options& options, Run&& run) {
  AttentionParams p;
  if (ffi::Error e = fill_inputs(p, in, rest, options); e.failure()) return e;
  if (ffi::Error e = expect_output("out", out, in.q, p); e.failure()) return e;
  if (ffi::Error e = expect_row_stats("lse", lse, p); e.failure()) return e;
  p.out = row_tensor(p, out.untyped_data(), true, p.heads_q, p.head_dim_v);
  p.lse = row_stats(p, lse.untyped_data());
  if (p.batch == 0) return ffi::Error::Success();  // vmap over an empty axis: nothing to do
  return run(p);
}

// The float8 forward (flash_attention's fp8 path, the Hopper kernel): float8 q, k, v
// of one type, V^T with its keys permuted and the descales of q.k and of V
// (Float8Inputs), then the forward's optional inputs; out in bfloat16 (or float16), lse.
struct Float8Operands {
  ffi::AnyBuffer vt, score_descale, v_descale;
};
template <class Run>
ffi::Error float8_forward_handler(const Inputs& in, const Float8Operands& f,
                                  const ffi::RemainingArgs& rest, ffi::AnyBuffer out,
                                  ffi::AnyBuffer lse, const Options& options, Run&& run) {
  AttentionParams p;
  if (ffi::Error e = start_float8(p, in.q, out); e.failure()) return e;
  if (ffi::Error e = fill_inputs(p, in, rest, options); e.failure()) return e;
  if (ffi::Error e = fill_float8_inputs(p, in.q, f.vt, {&f.score_descale, &f.v_descale});
      e.failure())
    return e;
  if (ffi::Error e = expect_output("out", out, in.q, p); e.failure()) return e;
  if (ffi::Error e = expect_row_stats("lse", lse, p); e.failure()) return e;
  p.out = row_tensor(p, out.untyped_data(), true, p.heads_q, p.head_dim_v);
  p.lse = row_stats(p, lse.untyped_data());
  if (p.batch == 0) return ffi::Error::Success();
  return run(p);
}

// The backward's extra inputs.
struct BackwardInputs {
  ffi::AnyBuffer out, dout, lse, dlse;
};

template <class Run>
ffi::Error backward_handler(const Inputs& in, const BackwardInputs& b,
                            const ffi::RemainingArgs& rest, ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                            ffi::AnyBuffer dv, ffi::AnyBuffer dsinks,
                            const ffi::RemainingRets& more, const Options& options, Run&& run) {
  AttentionParams p;
  if (ffi::Error e = fill_inputs(p, in, rest, options); e.failure()) return e;
  if (ffi::Error e = expect_output("out", b.out, in.q, p); e.failure()) return e;
  if (ffi::Error e = expect_like("dout", b.dout, b.out); e.failure()) return e;
  if (ffi::Error e = expect_row_stats("lse", b.lse, p); e.failure()) return e;
  if (ffi::Error e = expect_like("dlse", b.dlse, b.lse); e.failure()) return e;
  if (ffi::Error e = expect_like("dq", dq, in.q); e.failure()) return e;
  if (ffi::Error e = expect_like("dk", dk, in.k); e.failure()) return e;
  if (ffi::Error e = expect_like("dv", dv, in.v); e.failure()) return e;
  if (ffi::Error e = expect_per_head("dsinks", dsinks, p); e.failure()) return e;
  p.out = row_tensor(p, b.out.untyped_data(), true, p.heads_q, p.head_dim_v);
  p.dout = row_tensor(p, b.dout.untyped_data(), true, p.heads_q, p.head_dim_v);
  p.lse = row_stats(p, b.lse.untyped_data());  // the forward's lse is only read here
  p.dlse = row_stats(p, b.dlse.untyped_data());
  p.dq = row_tensor(p, dq.untyped_data(), true, p.heads_q, p.head_dim);
  p.dk = row_tensor(p, dk.untyped_data(), false, p.heads_kv, p.head_dim);
  p.dv = row_tensor(p, dv.untyped_data(), false, p.heads_kv, p.head_dim_v);
  p.dsinks = static_cast<float*>(dsinks.untyped_data());
  if (more.size() != (options.bias_gradient ? 1u : 0u) || (options.bias_gradient && !p.bias))
    return ffi::Error::InvalidArgument(
        "flashjax: a backward returns dbias (one more result) exactly when bias_gradient is "
        "set, which needs a bias");
  if (options.bias_gradient) {
    auto dbias = more.get<ffi::AnyBuffer>(0);
    if (dbias.has_error()) return ffi::Error::InvalidArgument("flashjax: unreadable dbias");
    if (ffi::Error e = expect_dbias(**dbias, p); e.failure()) return e;
    p.dbias = score_array(p, **dbias);
  }
  if (p.batch == 0) return ffi::Error::Success();  // (no zero-block kernel launches)
  return run(p);
}

// The KV-cache target: appends k_new / v_new to the caches (the aliased cache
// outputs), then attends; `workspace` is a float32 output of at least the
// bytes the platform asks (the split-KV partials: no allocation, so that the
// call can be captured in a command buffer).
template <class Run>
ffi::Error kvcache_handler(KvcacheInputs in, const ffi::RemainingArgs& rest, ffi::AnyBuffer out,
                           ffi::AnyBuffer lse, ffi::AnyBuffer workspace,
                           const ffi::RemainingRets& caches, const KvcacheOptions& options,
                           Run&& run) {
  in.k_cache_data = in.k_cache.untyped_data();
  in.v_cache_data = in.v_cache.untyped_data();
  if (caches.size() == 2) {
    auto k_out = caches.get<ffi::AnyBuffer>(0), v_out = caches.get<ffi::AnyBuffer>(1);
    if (k_out.has_error() || v_out.has_error())
      return ffi::Error::InvalidArgument("flashjax: unreadable cache outputs");
    if (ffi::Error e = expect_like("k_cache output", **k_out, in.k_cache); e.failure()) return e;
    if (ffi::Error e = expect_like("v_cache output", **v_out, in.v_cache); e.failure()) return e;
    in.k_cache_data = (*k_out)->untyped_data();
    in.v_cache_data = (*v_out)->untyped_data();
  } else if (!caches.empty()) {
    return ffi::Error::InvalidArgument("flashjax: the cache outputs come as a pair");
  }
  AttentionParams p;
  if (ffi::Error e = fill_kvcache_inputs(p, in, rest, options); e.failure()) return e;
  if (p.cache.new_rows > 0 && caches.empty())
    return ffi::Error::InvalidArgument("flashjax: appending new rows needs the cache outputs");
  if (ffi::Error e = expect_output("out", out, in.q, p); e.failure()) return e;
  if (ffi::Error e = expect_row_stats("lse", lse, p); e.failure()) return e;
  if (workspace.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("flashjax: the workspace must be float32");
  p.out = row_tensor(p, out.untyped_data(), true, p.heads_q, p.head_dim_v);
  p.lse = row_stats(p, lse.untyped_data());
  if (p.batch == 0) return ffi::Error::Success();
  return run(p, static_cast<int>(options.num_splits), workspace.untyped_data(),
             workspace.size_bytes());
}

// XLA bindings of the four targets' buffers and attributes, after any context.
template <class Binding>
auto bind_forward(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .RemainingArgs()                 // optional inputs
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attrs<Options>();
}

template <class Binding>
auto bind_float8_forward(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // vt
      .template Arg<ffi::AnyBuffer>()  // score_descale
      .template Arg<ffi::AnyBuffer>()  // v_descale
      .RemainingArgs()                 // optional inputs
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attrs<Options>();
}
template <class Binding>
auto bind_varlen_forward(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k
      .template Arg<ffi::AnyBuffer>()  // v
      .template Arg<ffi::AnyBuffer>()  // cu_seqlens_q
      .template Arg<ffi::AnyBuffer>()  // cu_seqlens_k
      .RemainingArgs()
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Attrs<Options>();
}

template <class Binding>
auto bind_backward_tail(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // out
      .template Arg<ffi::AnyBuffer>()  // dout
      .template Arg<ffi::AnyBuffer>()  // lse
      .template Arg<ffi::AnyBuffer>()  // dlse
      .RemainingArgs()
      .template Ret<ffi::AnyBuffer>()  // dq
      .template Ret<ffi::AnyBuffer>()  // dk
      .template Ret<ffi::AnyBuffer>()  // dv
      .template Ret<ffi::AnyBuffer>()  // dsinks
      .RemainingRets()                 // dbias, when bias_gradient
      .template Attrs<Options>();
}

template <class Binding>
auto bind_backward(Binding binding) {
  return bind_backward_tail(std::move(binding)
                                .template Arg<ffi::AnyBuffer>()   // q
                                .template Arg<ffi::AnyBuffer>()   // k
                                .template Arg<ffi::AnyBuffer>());  // v
}

template <class Binding>
auto bind_varlen_backward(Binding binding) {
  return bind_backward_tail(std::move(binding)
                                .template Arg<ffi::AnyBuffer>()   // q
                                .template Arg<ffi::AnyBuffer>()   // k
                                .template Arg<ffi::AnyBuffer>()   // v
                                .template Arg<ffi::AnyBuffer>()   // cu_seqlens_q
                                .template Arg<ffi::AnyBuffer>());  // cu_seqlens_k
}

template <class Binding>
auto bind_kvcache(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q
      .template Arg<ffi::AnyBuffer>()  // k_cache
      .template Arg<ffi::AnyBuffer>()  // v_cache
      .template Arg<ffi::AnyBuffer>()  // k_new
      .template Arg<ffi::AnyBuffer>()  // v_new
      .template Arg<ffi::AnyBuffer>()  // cache_seqlens
      .RemainingArgs()                 // optional inputs
      .template Ret<ffi::AnyBuffer>()  // out
      .template Ret<ffi::AnyBuffer>()  // lse
      .template Ret<ffi::AnyBuffer>()  // workspace
      .RemainingRets()                 // k_cache, v_cache when appending
      .template Attrs<KvcacheOptions>();
}

// The handler functions of one platform, from its `Platform::forward(ctx.., p)`
// and `Platform::backward(ctx.., p)`; Ctx are the context parameters XLA
// passes first (device ordinal, stream, scratch allocator).
template <class Platform, class... Ctx>
struct Handlers {
  static ffi::Error forward(Ctx... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> lse, Options options) {
    return forward_handler(Inputs{q, k, v}, rest, *out, *lse, options,
                           [&](const AttentionParams& p) { return Platform::forward(ctx..., p); });
  }
  static ffi::Error float8_forward(Ctx... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                   ffi::AnyBuffer v, ffi::AnyBuffer vt,
                                   ffi::AnyBuffer score_descale, ffi::AnyBuffer v_descale,
                                   ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> lse, Options options) {
    return float8_forward_handler(
        Inputs{q, k, v}, Float8Operands{vt, score_descale, v_descale}, rest, *out, *lse,
        options, [&](const AttentionParams& p) { return Platform::forward(ctx..., p); });
  }
  static ffi::Error varlen_forward(Ctx... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                   ffi::AnyBuffer v, ffi::AnyBuffer cu_q, ffi::AnyBuffer cu_k,
                                   ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> lse, Options options) {
    return forward_handler(Inputs{q, k, v, &cu_q, &cu_k}, rest, *out, *lse, options,
                           [&](const AttentionParams& p) { return Platform::forward(ctx..., p); });
  }
  static ffi::Error backward(Ctx... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                             ffi::AnyBuffer dlse, ffi::RemainingArgs rest,
                             ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                             ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dsinks,
                             ffi::RemainingRets more, Options options) {
    return backward_handler(
        Inputs{q, k, v}, BackwardInputs{out, dout, lse, dlse}, rest, *dq, *dk, *dv, *dsinks,
        more, options, [&](const AttentionParams& p) { return Platform::backward(ctx..., p); });
  }
  static ffi::Error varlen_backward(Ctx... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k,
                                    ffi::AnyBuffer v, ffi::AnyBuffer cu_q, ffi::AnyBuffer cu_k,
                                    ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                                    ffi::AnyBuffer dlse, ffi::RemainingArgs rest,
                                    ffi::Result<ffi::AnyBuffer> dq,
                                    ffi::Result<ffi::AnyBuffer> dk,
                                    ffi::Result<ffi::AnyBuffer> dv,
                                    ffi::Result<ffi::AnyBuffer> dsinks, ffi::RemainingRets more,
                                    Options options) {
    return backward_handler(
        Inputs{q, k, v, &cu_q, &cu_k}, BackwardInputs{out, dout, lse, dlse}, rest, *dq, *dk, *dv,
        *dsinks, more, options, [&](const AttentionParams& p) { return Platform::backward(ctx..., p); });
  }
};

// The KV-cache handler of one platform, from its `Platform::kvcache(ctx.., p,
// splits, workspace, workspace_bytes)`; Ctx: its contexts (device ordinal and
// stream only: no scratch allocator, so that command buffers can capture it).
template <class Platform, class... Ctx>
struct KvcacheHandler {
  static ffi::Error kvcache(Ctx... ctx, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                            ffi::AnyBuffer v_cache, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                            ffi::AnyBuffer cache_seqlens, ffi::RemainingArgs rest,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                            ffi::Result<ffi::AnyBuffer> workspace, ffi::RemainingRets caches,
                            KvcacheOptions options) {
    return kvcache_handler(
        KvcacheInputs{q, k_cache, v_cache, k_new, v_new, cache_seqlens, nullptr, nullptr}, rest,
        *out, *lse, *workspace, caches, options,
        [&](const AttentionParams& p, int splits, void* ws, size_t ws_bytes) {
          return Platform::kvcache(ctx..., p, splits, ws, ws_bytes);
        });
  }
};

}  // namespace flashjax::ffi_layer

// Defines the four exported handler symbols Prefix{Forward,Backward,VarlenForward,
// VarlenBackward}Suffix of a platform; `bind` is its Ffi::Bind() with contexts.
#define FLASHJAX_DEFINE_HANDLERS(H, bind, Forward, Backward, VarlenForward, VarlenBackward, \
                                 Float8Forward)                                              \
  FLASHJAX_EXPORT_HANDLER(Forward);                                                          \
  FLASHJAX_EXPORT_HANDLER(Float8Forward);                                                    \
  FLASHJAX_EXPORT_HANDLER(Backward);                                                         \
  FLASHJAX_EXPORT_HANDLER(VarlenForward);                                                    \
  FLASHJAX_EXPORT_HANDLER(VarlenBackward);                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Forward, H::forward, flashjax::ffi_layer::bind_forward(bind)); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Float8Forward, H::float8_forward,                            \
                                flashjax::ffi_layer::bind_float8_forward(bind));             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Backward, H::backward,                                       \
                                flashjax::ffi_layer::bind_backward(bind));                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(VarlenForward, H::varlen_forward,                            \
                                flashjax::ffi_layer::bind_varlen_forward(bind));             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(VarlenBackward, H::varlen_backward,                          \
                                flashjax::ffi_layer::bind_varlen_backward(bind))

// Defines the exported KV-cache handler symbol of a platform, command-buffer
// compatible (a jitted decoding step can be captured in a CUDA graph: the
// handler allocates nothing and never synchronises).
#define FLASHJAX_DEFINE_KVCACHE_HANDLER(H, bind, Kvcache)                                    \
  FLASHJAX_EXPORT_HANDLER(Kvcache);                                                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Kvcache, H::kvcache, flashjax::ffi_layer::bind_kvcache(bind), \
                                {::xla::ffi::Traits::kCmdBufferCompatible})
