"""flashjax.flash_attention: dense, right-padded (seqused) and segment-id batches.

Argument checking happens here, at trace time, so that mistakes surface as
ValueError/TypeError naming the argument before anything runs. Gradients come
from the C++ backward through jax.custom_vjp (`_core.attention_core`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _checks, _core, _dropout, _ffi, _fp8, _introspection, _route
from ._spec import Extras, Layout

MAX_HEAD_DIM = _checks.MAX_HEAD_DIM


def _check_arrays(q, k, v, sinks):
    _checks.check_qkv(q, k, v, 4, ("(batch, seqlen_q, heads_q, head_dim)",
                                   "(batch, seqlen_k, heads_kv, head_dim)",
                                   "(batch, seqlen_k, heads_kv, head_dim_v)"), "seqlen_k")
    (batch, seqlen_q, heads_q, _), ks, vs = q.shape, k.shape, v.shape
    if ks[0] != batch or vs[0] != batch:
        raise ValueError(f"batch of q, k, v must match, got shapes q {q.shape}, k {ks}, v {vs}")
    _checks.check_sinks(sinks, heads_q)


def _layout(q, k, seqused_q, seqused_k, q_segment_ids, kv_segment_ids, q_offset,
            kv_offset, mask=None, alibi_slopes=None, dropout=None) -> Layout:
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    _checks.check_int_array("seqused_q", seqused_q, (batch,), "(batch,)")
    _checks.check_int_array("seqused_k", seqused_k, (batch,), "(batch,)")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    _checks.check_int_array("q_segment_ids", q_segment_ids, (batch, seqlen_q),
                            "(batch, seqlen_q)")
    _checks.check_int_array("kv_segment_ids", kv_segment_ids, (batch, seqlen_k),
                            "(batch, seqlen_k)")
    return Layout(seqused_q=seqused_q, seqused_k=seqused_k, q_segment_ids=q_segment_ids,
                  kv_segment_ids=kv_segment_ids,
                  diagonal_offset=_checks.diagonal_offset(q_offset, kv_offset, batch, "(batch,)"),
                  mask=_checks.check_scores("mask", mask, batch, q.shape[2], k.shape[2], seqlen_q,
                                            seqlen_k),
                  alibi_slopes=_checks.check_alibi_slopes(alibi_slopes, batch, q.shape[2]),
                  dropout=dropout)


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, sinks=None, return_lse=False, deterministic=False,
                    q_segment_ids=None, kv_segment_ids=None, seqused_q=None, seqused_k=None,
                    q_offset=None, kv_offset=None, bias=None, mask=None, alibi_slopes=None,
                    dropout_rate=0.0, dropout_key=None, implementation=None, q_descale=None,
                    k_descale=None, v_descale=None, out_dtype=None):
    """Exact attention softmax(q k^T * scale) v, computed tile by tile.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), float16/bfloat16/float32.
      k: (batch, seqlen_k, heads_kv, head_dim); heads_q % heads_kv == 0 (MQA/GQA).
      v: (batch, seqlen_k, heads_kv, head_dim_v).
      softmax_scale: scale of q.k; default 1/sqrt(head_dim). A static number.
      causal: mask keys after the query's diagonal, aligned bottom-right when
        seqlen_q != seqlen_k (FlashAttention 2/3 convention); with seqused, on
        each sequence's used lengths; with q_offset / kv_offset, by position.
      window_size: (left, right) sliding window around the diagonal, -1 = unbounded.
      softcap: if > 0, scores become softcap * tanh(scores / softcap).
      sinks: optional float32 (heads_q,) sink logits that join the softmax
        denominator only (gpt-oss style); differentiable.
      return_lse: also return the float32 log-sum-exp (batch, heads_q, seqlen_q),
        the full softmax normaliser (sink included). Differentiable.
      deterministic: bitwise-repeatable backward on the GPU (CPU always is).
      q_segment_ids, kv_segment_ids: optional int32 (batch, seqlen_q) and
        (batch, seqlen_k), given together: a query sees a key only when their
        ids are equal (packed documents), on top of causal/window.
      seqused_q, seqused_k: optional int32 (batch,): only the first n rows of
        each batch entry take part (right-padded batches; clamped to
        [0, seqlen]).
      q_offset, kv_offset: optional positions of the first query row and of the
        first key row in the whole sequence: an int or an integer array of
        shape () or (batch,), traced or static (default 0 for the one not
        given). Given either, causal and windows compare positions (query i
        sees key j, causal, iff kv_offset + j <= q_offset + i) instead of
        aligning bottom-right: for rows that are a part of a longer sequence,
        e.g. a query shard inside shard_map (docs/sharding.md).
      bias: optional float array (1 or batch, 1 or heads_q or heads_kv, seqlen_q,
        seqlen_k) added to the scores after scale and softcap:
        s = softcap(scale * q.k) + bias (a heads_kv bias serves each query head of its
        group). Differentiable; its gradient is summed over the broadcast dims and
        computed only when bias is differentiated (a constant bias costs none).
      mask: optional bool array of the same shapes: True = may attend (jax.nn's
        convention), on top of causal / window / segment ids.
      alibi_slopes: optional float32 (heads_q,) or (batch, heads_q): ALiBi,
        -slope * |i + seqlen_k - seqlen_q - j| added to query i / key j's score after
        the softcap (positions by q_offset / kv_offset when given); never materialised.
        Not differentiated.
        bias, mask and alibi_slopes run on every path (CUDA, CPU, pure JAX).
      dropout_rate: static float in [0, 1): attention dropout on the probabilities
        (FlashAttention 2's): each is dropped with this probability, the kept ones
        scaled by 1 / (1 - dropout_rate). 0 (default): no dropout, the key unused.
        The returned lse is the one before dropout.
      dropout_key: a JAX PRNG key (jax.random.key(seed), or a legacy uint32
        jax.random.PRNGKey(seed): same mask), traced; needed when dropout_rate > 0.
        The keep mask is exactly flashjax.dropout_mask(dropout_key, dropout_rate,
        batch, heads_q, seqlen_q, seqlen_k) (True = kept), whatever causal, window,
        bias or mask are set, on every path; under jax.vmap over keys each instance
        gets the mask of the unbatched call with its key. Not differentiated.
        Dropout runs on every path (CUDA, CPU, pure JAX). Under shard_map the indices
        are the local call's.
      implementation: None (flashjax's kernels on CUDA GPUs and the CPU, the pure-JAX
        path elsewhere), "cuda" (the fastest CUDA kernels: Hopper, else mma.sync, else
        SIMT), "cuda:mma" / "cuda:simt" (at most the mma.sync / only the SIMT kernels),
        "cpu", or "xla" (pure JAX, blockwise: any platform). Static; a forced one that
        cannot run on the arrays' platform raises ValueError.

      q_descale, k_descale, v_descale: float8 q, k, v only (float8_e4m3fn or
        float8_e5m2, all three alike: FlashAttention 3's fp8 forward): float32
        descale factors per (batch, kv head), of shape (), (1, 1), (batch, 1),
        (1, heads_kv) or (batch, heads_kv); None: 1.0. The inputs mean x * descale
        (q's heads by their kv head). Forward only: differentiating q, k or v raises
        TypeError. Today every platform dequantises them and runs the kernels of
        out_dtype (exact: the bf16 kernel's result on the dequantised inputs); the
        Hopper fp8 kernel is not built yet.
      out_dtype: float8 inputs only: out's dtype, bfloat16 (default), float16 or
        float32.

    Returns:
      out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype (float8 inputs:
      out_dtype), and lse if asked.
      A row that sees no key gets out 0 and lse -inf (or its sink logit); rows
      past seqused_q get out 0 and lse -inf.
    """
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if any(map(_fp8.is_fp8, (q, k, v))):
        options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                       softcap=softcap, sinks=sinks, return_lse=return_lse,
                       deterministic=deterministic, q_segment_ids=q_segment_ids,
                       kv_segment_ids=kv_segment_ids, seqused_q=seqused_q,
                       seqused_k=seqused_k, q_offset=q_offset, kv_offset=kv_offset, bias=bias,
                       mask=mask, alibi_slopes=alibi_slopes, dropout_rate=dropout_rate,
                       dropout_key=dropout_key, implementation=implementation)
        return _fp8_attention(q, k, v, descales, out_dtype, options)
    _fp8.check_no_fp8_options(q, out_dtype, descales)
    extras, layout, cfg = _describe(q, k, v, softmax_scale, causal, window_size, softcap, sinks,
                                    return_lse, deterministic, q_segment_ids, kv_segment_ids,
                                    seqused_q, seqused_k, q_offset, kv_offset, bias, mask,
                                    alibi_slopes, dropout_rate, dropout_key, implementation)
    out, lse = _core.attention(q, k, v, extras, layout, cfg)
    return (out, lse) if return_lse else out


def _fp8_attention(q, k, v, descales: dict, out_dtype, options: dict):
    """flash_attention of float8 q, k, v (_fp8): on Hopper GPUs the float8 kernel where
    it takes the call, else the exact fallback (dequantised inputs in out's dtype, its
    kernels); out in out_dtype."""
    _fp8.check_inputs(q, k, v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 (batch, seqlen, heads, head_dim), got "
                             f"shape {x.shape}")
    batch, heads_q, heads_kv = q.shape[0], q.shape[2], k.shape[2]
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) "
                         "for MQA/GQA")
    out_dtype = _fp8.out_dtype_of(out_dtype)
    scales = tuple(_fp8.descale_of(name, descales[name], batch, heads_kv)
                   for name in _fp8.DESCALES)
    q, k, v = map(_fp8.forward_only, (q, k, v))

    def dequantised(q, k, v, q_descale, k_descale, v_descale):  # (out, lse)
        # (rounding float8 to out's dtype is exact; the kernels of that dtype)
        q = _fp8.dequantize(q, q_descale, out_dtype, heads_q // heads_kv)
        k, v = _fp8.dequantize(k, k_descale, out_dtype), _fp8.dequantize(v, v_descale, out_dtype)
        out, lse = flash_attention(q, k, v, **dict(options, return_lse=True))
        return out.astype(out_dtype), lse

    if _fp8.native_candidate(q, k, v, out_dtype, options):
        # (the checks and Config of the call, on stand-ins of the dequantised inputs)
        like = lambda x: jax.ShapeDtypeStruct(x.shape, out_dtype)
        extras, layout, cfg = _describe(like(q), like(k), like(v), **options)
        # (omitted descales are 1: no sign of q to flip)
        signed = descales["q_descale"] is not None or descales["k_descale"] is not None

        def on_cuda(*args):
            if not _introspection.float8_kernel_runs(q, k, v, cfg.window, out_dtype):
                return dequantised(*args)
            q_, k_, v_, q_descale, k_descale, v_descale = args
            q_, score_descale = _fp8.native_operands(q_, q_descale, k_descale, signed)
            return _core.float8_forward(q_, k_, v_, _fp8.permuted_transpose(v_), score_descale,
                                        v_descale, extras, layout, cfg, out_dtype)

        out, lse = _route.run(cfg, (q, k, v) + scales, cuda=on_cuda, cpu=dequantised,
                              xla=dequantised, arrays=(q,))
    else:
        out, lse = dequantised(q, k, v, *scales)
    return (out, lse) if options["return_lse"] else out


def _describe(q, k, v, softmax_scale, causal, window_size, softcap, sinks, return_lse,
              deterministic, q_segment_ids, kv_segment_ids, seqused_q, seqused_k, q_offset,
              kv_offset, bias, mask, alibi_slopes, dropout_rate, dropout_key, implementation):
    """(extras, layout, cfg) of a flash_attention call, its arguments checked."""
    _check_arrays(q, k, v, sinks)
    rate = _dropout.check_dropout(dropout_rate, dropout_key)
    layout = _layout(q, k, seqused_q, seqused_k, q_segment_ids, kv_segment_ids, q_offset,
                     kv_offset, mask, alibi_slopes,
                     _dropout.key_rows(dropout_key, q.shape[0], q.shape[2]) if rate else None)
    bias = _checks.check_scores("bias", bias, q.shape[0], q.shape[2], k.shape[2], q.shape[1],
                                k.shape[1])
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              deterministic, implementation, return_lse, dropout_rate=rate)
    _ffi.load()
    return Extras(sinks=sinks, bias=bias), layout, cfg


def flash_attention_forward(q, k, v, **options):
    """The forward as a building block (FlashAttention's `_flash_attn_forward`): (out,
    lse) of `flash_attention(q, k, v, **options)`, for code that composes calls itself
    (ring attention over blocks, merging partial results by their lse) and runs
    `flash_attention_backward` on the merged out and lse. Takes flash_attention's
    keyword arguments (return_lse is implied)."""
    if "return_lse" in options:
        raise TypeError("flash_attention_forward always returns (out, lse): drop return_lse")
    return flash_attention(q, k, v, return_lse=True, **options)


def flash_attention_backward(dout, q, k, v, out, lse, *, dlse=None, softmax_scale=None,
                             causal=False, window_size=(-1, -1), softcap=0.0, sinks=None,
                             deterministic=False, q_segment_ids=None, kv_segment_ids=None,
                             seqused_q=None, seqused_k=None, q_offset=None, kv_offset=None,
                             bias=None, mask=None, alibi_slopes=None, dropout_rate=0.0,
                             dropout_key=None, implementation=None):
    """The backward as a building block (FlashAttention's `_flash_attn_backward`): the
    gradients of a flash_attention call with these options, given its output `out` and
    `lse` and their cotangents `dout` and `dlse` (None: zeros), without recomputing the
    forward. out and lse need not be this call's own: ring attention passes the merged
    ones of the whole sequence, so that each block's gradients are its share of the
    whole's (D = rowsum(dout * out) - dlse is taken from them).

    Args:
      dout: (batch, seqlen_q, heads_q, head_dim_v), like out.
      q, k, v, and the keyword arguments: as in flash_attention.
      out: (batch, seqlen_q, heads_q, head_dim_v); lse: float32 (batch, heads_q, seqlen_q)
        (lse -inf: a row that sees nothing, whose gradients are 0).
      dlse: None or float32 like lse.

    Returns:
      (dq, dk, dv), then dsinks when sinks are given, then dbias (bias's shape, summed
      over what it broadcasts) when bias is given.
    """
    extras, layout, cfg = _describe(q, k, v, softmax_scale, causal, window_size, softcap, sinks,
                                    True, deterministic, q_segment_ids, kv_segment_ids,
                                    seqused_q, seqused_k, q_offset, kv_offset, bias, mask,
                                    alibi_slopes, dropout_rate, dropout_key, implementation)
    batch, seqlen_q, heads_q = q.shape[:3]
    out_shape = (batch, seqlen_q, heads_q, v.shape[-1])
    for name, x in (("out", out), ("dout", dout)):
        if getattr(x, "shape", None) != out_shape:
            raise ValueError(f"{name} must have shape (batch, seqlen_q, heads_q, head_dim_v) = "
                             f"{out_shape}, got {getattr(x, 'shape', type(x).__name__)}")
    for name, x in (("lse", lse), ("dlse", dlse)):
        if x is not None and getattr(x, "shape", None) != (batch, heads_q, seqlen_q):
            raise ValueError(f"{name} must have shape (batch, heads_q, seqlen_q) = "
                             f"{(batch, heads_q, seqlen_q)}, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    lse = jnp.asarray(lse, jnp.float32)
    dlse = jnp.zeros_like(lse) if dlse is None else jnp.asarray(dlse, jnp.float32)
    dq, dk, dv, d_extras = _core.attention_backward(q, k, v, out.astype(q.dtype), dout, lse,
                                                    dlse, extras, layout, cfg)
    return (dq, dk, dv) + tuple(d for d, x in ((d_extras.sinks, sinks), (d_extras.bias, bias))
                                if x is not None)
