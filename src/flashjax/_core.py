"""The core every dense and packed call ends in: `attention(q, k, v, extras, layout, cfg)`
picks the implementation (_route), and `attention_core`, the kernels' one, is a
jax.custom_vjp (_autodiff) whose forward and backward are the FFI calls (_ffi_calls).

`extras` holds the differentiable inputs besides q, k, v (sinks; their gradients come
back as the backward's extra results), `layout` the traced integer metadata
(cu_seqlens, seqused, segment ids, diagonal offset; absent ones are None), `cfg` the
static description of the call.

Under jax.jit every call goes through _partitioning (sharded along batch, heads, and
the sequence by a ring (_sharded); packed calls along heads) as its flat FFI operand
list: the required operands, then the present optional ones (_spec.Target.operands).
"""

from __future__ import annotations

import jax.numpy as jnp

import dataclasses

from . import _ffi_calls, _partitioning, _route, _sharded, xla_attention
from ._autodiff import differentiable
from ._spec import (DQ, DK, DV, EXTRA_OPERANDS, FLOAT8_FORWARD, LSE, OPERANDS, OUT, Config,
                    Extras, Layout, attention_targets, gradients)

__all__ = ["attention", "attention_backward", "attention_core", "float8_forward"]


def _structured(target, present, operands):
    """(values by name, extras, layout) of a call's flat operands."""
    values = target.values(present, operands)
    return values, Extras.of(values), Layout.of(values)


def _local_forward(cfg: Config, present: tuple, *operands):
    target, _ = attention_targets(cfg.packed)
    values, rows, layout = _structured(target, present, operands)
    return _ffi_calls.forward(values["q"], values["k"], values["v"], rows, layout, cfg)


def _local_backward(cfg: Config, present: tuple, *operands):
    _, target = attention_targets(cfg.packed)
    values, rows, layout = _structured(target, present, operands)
    dq, dk, dv, d_rows = _ffi_calls.backward(
        *(values[n] for n in ("q", "k", "v", "out", "dout", "lse", "dlse")), rows, layout, cfg)
    return (dq, dk, dv, *d_rows.given())


def _local_float8_forward(cfg: Config, present: tuple, out_dtype, *operands):
    values, rows, layout = _structured(FLOAT8_FORWARD, present, operands)
    return _ffi_calls.float8_forward(
        *(values[n] for n in ("q", "k", "v", "vt", "score_descale", "v_descale")), rows, layout,
        cfg, out_dtype)


def _partitioned(target, local, ring, results, values: dict, cfg: Config, static: tuple = ()):
    """The partitioned call of `target` on `values` (name -> array); `static`: local's
    hashable arguments after (cfg, present)."""
    present, operands = target.operands(values)
    q, k = values["q"], values["k"]
    # Score arrays (bias, mask) and dbias: dims of their own broadcast shape.
    scores = {name: _partitioning.score_dims(values[name].shape, q.shape[-4], q.shape[-2],
                                             k.shape[-2])
              for name in present if OPERANDS[name].shape == "scores"}
    scores.update({"dbias": scores["bias"]} if "bias" in scores else {})
    dims = lambda names, default: tuple(scores.get(n, d) for n, d in zip(names, default))
    spec = _partitioning.CallSpec(
        target.name, local, (cfg, present) + static,
        dims([op.name for op in target.inputs] + list(present),
             target.operand_dims(present, cfg.packed)),
        dims([op.name for op in results], [op.dims_in(cfg.packed) for op in results]),
        # (the ring's blocks carry no score terms and no dropout: a sequence-sharded
        # call with them is gathered)
        q.shape[-2] // k.shape[-2], k.shape[-2],
        None if cfg.packed or scores or {"alibi_slopes", "dropout"} & set(present) else ring,
        fold_vmap=not cfg.packed)
    return _partitioning.partitioned(spec)(*operands)


def _forward(q, k, v, extras: Extras, layout: Layout, cfg: Config):
    rows = _ffi_calls.extra_rows(q, extras, layout, cfg)
    target, _ = attention_targets(cfg.packed)
    return _partitioned(target, _local_forward, _sharded.sharded_forward, (OUT, LSE),
                        _ffi_calls.values(q, k, v, rows, layout), cfg)


def _backward(q, k, v, out, dout, lse, dlse, extras: Extras, layout: Layout, cfg: Config,
              needed: Extras):
    rows = _ffi_calls.extra_rows(q, extras, layout, cfg)
    _, target = attention_targets(cfg.packed)
    # dbias only when bias is perturbed (a constant bias: no O(seqlen^2) gradient)
    cfg = dataclasses.replace(cfg, bias_gradient=extras.bias is not None and bool(needed.bias))
    grads = gradients(extras, cfg)
    dq, dk, dv, *d_rows = _partitioned(
        target, _local_backward, _sharded.sharded_backward, (DQ, DK, DV) + grads,
        _ffi_calls.values(q, k, v, rows, layout, out=out, dout=dout.astype(out.dtype), lse=lse,
                          dlse=dlse.astype(jnp.float32)), cfg)
    by_name = dict(zip((g.name for g in grads), d_rows))
    d_rows = Extras(*(by_name.get(op.gradient) for op in EXTRA_OPERANDS))
    return dq, dk, dv, _ffi_calls.from_rows(d_rows, extras)


def float8_forward(q, k, v, vt, score_descale, v_descale, extras: Extras, layout: Layout,
                   cfg: Config, out_dtype):
    """(out in out_dtype, lse) of the Hopper float8 forward (_ffi_calls.float8_forward's
    operands), sharded as the bf16 forward along batch and heads (no ring: a
    sequence-sharded call is gathered). Forward only."""
    rows = _ffi_calls.extra_rows(q, extras, layout, cfg)
    values = _ffi_calls.values(q, k, v, rows, layout, vt=vt, score_descale=score_descale,
                               v_descale=v_descale)
    return _partitioned(FLOAT8_FORWARD, _local_float8_forward, None, (OUT, LSE), values, cfg,
                        static=(out_dtype,))


attention_core = differentiable(_forward, _backward)
attention_core.__doc__ = """(out, lse) of one call on flashjax's kernels; differentiable in q,
k, v and the extras."""


def _no_work(q, k, cfg: Config) -> bool:
    """No query rows or no keys (static shapes): nothing for a kernel to do."""
    rows = lambda x: x.shape[0] if cfg.packed else x.shape[0] * x.shape[1]
    return rows(q) == 0 or rows(k) == 0


def attention(q, k, v, extras: Extras, layout: Layout, cfg: Config, *arrays):
    """(out, lse) of a dense or packed call by cfg's implementation (`arrays`: the
    caller's inputs, for the platform check)."""
    args = (q, k, v, extras, layout)
    if _no_work(q, k, cfg):
        _route.check_platform(cfg, q, *arrays)
        return xla_attention.no_work_attention(*args, cfg)
    kernels = lambda *a: attention_core(*a, cfg)
    in_jax = lambda *a: xla_attention.attention_core(*a, cfg)
    return _route.run(cfg, args, cuda=kernels, cpu=kernels, xla=in_jax, arrays=(q, *arrays))


def attention_backward(q, k, v, out, dout, lse, dlse, extras: Extras, layout: Layout,
                       cfg: Config):
    """(dq, dk, dv, d_extras) of a dense or packed call given its out and lse (the public
    flash_attention_backward), routed as `attention` routes the call; every extra's
    gradient is computed."""
    needed = Extras(*(x is not None for x in extras))
    if _no_work(q, k, cfg):
        _route.check_platform(cfg, q)
        zeros = lambda x: None if x is None else jnp.zeros(x.shape, x.dtype)
        return zeros(q), zeros(k), zeros(v), Extras(*map(zeros, extras))
    args = (q, k, v, out, dout, lse, dlse, extras, layout)
    kernels = lambda *a: _backward(*a, cfg, needed)
    in_jax = lambda *a: xla_attention.attention_backward(*a, cfg, needed)
    return _route.run(cfg, args, cuda=kernels, cpu=kernels, xla=in_jax, arrays=(q,))
