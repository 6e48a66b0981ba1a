"""Every `jax.ffi.ffi_call` of flashjax, on local (unsharded) arrays: the attention
targets' forward and backward, dense or packed, and the KV-cache target. Operands,
attributes and results come from the table (_spec): the required operands, then the
present optional ones; an attribute per option and per has_* flag.

The differentiable extras go to the FFI as rows: sinks one per sequence (`extra_rows`:
vmap then folds them into batch like q), their gradients per sequence (`from_rows`
sums them); a bias in its own broadcasting shape (the kernels read it broadcast and
return dbias in that shape, summed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._spec import (EXTRA_OPERANDS, FLOAT8_FORWARD, KVCACHE, OPERANDS, Config, Extras, Layout,
                    attention_targets)
from ._vma import result_types, varying_axes

__all__ = ["values", "extra_rows", "from_rows", "forward", "float8_forward", "backward",
           "kvcache"]


def _ffi_call(target, like, operands, results, vmap_method=None, aliases=None):
    return jax.ffi.ffi_call(target.name, result_types(like, varying_axes(*operands), *results),
                            vmap_method=vmap_method, input_output_aliases=aliases)


def _vmap_method(cfg: Config) -> str:
    # Dense calls vmap by folding vmapped dims into batch; packed ones have no batch
    # dim to fold into, so vmap runs them one after the other.
    return "sequential" if cfg.packed else "broadcast_all"


def values(q, k, v, extras: Extras, layout: Layout, **more) -> dict:
    """A call's arrays by operand name (None: absent)."""
    return dict(q=q, k=k, v=v, **extras._asdict(), **layout._asdict(), **more)


def _rows_shape(operand, x, q, layout: Layout, cfg: Config) -> tuple:
    """The FFI shape of extra x (or its gradient): per-head ones a row per sequence,
    score ones (bias) their own."""
    if operand.shape == "scores":
        return x.shape
    assert operand.shape == "per_head", operand
    if cfg.packed:
        return (layout.cu_seqlens_q.shape[-1] - 1, q.shape[-2])
    return q.shape[:-3] + (q.shape[-2],)


def extra_rows(q, extras: Extras, layout: Layout, cfg: Config) -> Extras:
    """The present extras as the FFI takes them: broadcast to a row per sequence."""
    return Extras(*(None if x is None else
                    jnp.broadcast_to(x, _rows_shape(op, x, q, layout, cfg))
                    for op, x in zip(EXTRA_OPERANDS, extras)))


def from_rows(rows: Extras, extras: Extras) -> Extras:
    """The extras' gradients from their rows' (summed over the sequences)."""
    return Extras(*(None if x is None or r is None else
                    jnp.sum(r, axis=tuple(range(r.ndim - x.ndim))).astype(x.dtype)
                    for r, x in zip(rows, extras)))


def _lse_shape(q, cfg: Config) -> tuple:
    if cfg.packed:  # (heads_q, total_q)
        return (q.shape[-2], q.shape[-3])
    return q.shape[:-3] + (q.shape[-2], q.shape[-3])


def forward(q, k, v, rows: Extras, layout: Layout, cfg: Config):
    """(out, lse) of one call; `rows`: the extras as extra_rows gives them."""
    target, _ = attention_targets(cfg.packed)
    present, operands = target.operands(values(q, k, v, rows, layout))
    call = _ffi_call(target, q, operands, ((q.shape[:-1] + (v.shape[-1],), q.dtype),
                                           (_lse_shape(q, cfg), jnp.float32)), _vmap_method(cfg))
    return call(*operands, **target.attributes(cfg.options(), present))


def float8_forward(q, k, v, vt, score_descale, v_descale, rows: Extras, layout: Layout,
                   cfg: Config, out_dtype):
    """(out in out_dtype, lse) of one dense call with float8 q, k, v (FLOAT8_FORWARD's
    operands: _fp8.native_operands makes vt and the descales)."""
    target = FLOAT8_FORWARD
    present, operands = target.operands(values(q, k, v, rows, layout, vt=vt,
                                               score_descale=score_descale,
                                               v_descale=v_descale))
    call = _ffi_call(target, q, operands, ((q.shape[:-1] + (v.shape[-1],), out_dtype),
                                           (_lse_shape(q, cfg), jnp.float32)), _vmap_method(cfg))
    return call(*operands, **target.attributes(cfg.options(), present))


def backward(q, k, v, out, dout, lse, dlse, rows: Extras, layout: Layout, cfg: Config):
    """(dq, dk, dv, the gradients of `rows`: an Extras like it) of one call."""
    _, target = attention_targets(cfg.packed)
    present, operands = target.operands(values(q, k, v, rows, layout, out=out, dout=dout,
                                               lse=lse, dlse=dlse))
    shapes = {"dq": (q.shape, q.dtype), "dk": (k.shape, k.dtype), "dv": (v.shape, v.dtype)}
    shapes.update({op.gradient: (_rows_shape(op, x, q, layout, cfg),
                                 OPERANDS[op.gradient].dtype)
                   for op, x in zip(EXTRA_OPERANDS, rows) if x is not None})
    shapes["dsinks"] = (_rows_shape(OPERANDS["sinks"], None, q, layout, cfg), jnp.float32)
    returned = target.returned(present, cfg.options())
    call = _ffi_call(target, q, operands, [shapes[op.name] for op in returned], _vmap_method(cfg))
    results = dict(zip((op.name for op in returned),
                       call(*operands, **target.attributes(cfg.options(), present))))
    return (results["dq"], results["dk"], results["dv"],
            Extras(*(None if x is None else results.get(op.gradient)
                     for op, x in zip(EXTRA_OPERANDS, rows))))


def kvcache(cfg: Config, present: tuple, splits: int, appends: bool, *operands):
    """(out, lse, workspace[, k_cache, v_cache]) of one flashjax_kvcache call on
    KVCACHE's operands (`present`: the optional ones given); the caches come back,
    aliased to their inputs, when the call appends new rows."""
    q, k_cache, v_cache = operands[:3]
    batch, seqlen_q, heads_q, _ = q.shape
    dim_v = v_cache.shape[3]
    # The split partials (float32 out and lse per split and row; unused for one split),
    # as Partials::bytes in csrc/cuda/kvcache/kvcache_attention.cu, per (sequence, head) so that
    # the workspace shards like q.
    per_head = splits * seqlen_q * (dim_v + 1) if splits > 1 else 1
    results = [(q.shape[:-1] + (dim_v,), q.dtype), ((batch, heads_q, seqlen_q), jnp.float32),
               ((batch, heads_q, per_head), jnp.float32)]
    if appends:
        results += [(k_cache.shape, k_cache.dtype), (v_cache.shape, v_cache.dtype)]
    call = _ffi_call(KVCACHE, q, operands, results,
                     aliases={1: 3, 2: 4} if appends else None)
    return call(*operands, **KVCACHE.attributes(cfg.options(num_splits=splits), present))
