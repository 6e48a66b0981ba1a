"""flashjax.flash_attention: the public JAX API over the C++/CUDA kernels.

Argument checking happens here, at trace time, so that mistakes surface as
ValueError/TypeError naming the argument before anything runs. Gradients come
from the C++ backward through jax.custom_vjp.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi

MAX_HEAD_DIM = 256
_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) description of one call; mirrors AttentionParams."""

    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    has_sinks: bool
    deterministic: bool

    def attributes(self) -> dict:
        return dict(
            softmax_scale=np.float32(self.softmax_scale),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            softcap=np.float32(self.softcap),
            has_sinks=np.bool_(self.has_sinks),
        )


def _shape(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def _check_arrays(q, k, v, sinks):
    qs, ks, vs = _shape("q", q), _shape("k", k), _shape("v", v)
    for name, s, dims in (
        ("q", qs, "(batch, seqlen_q, heads_q, head_dim)"),
        ("k", ks, "(batch, seqlen_k, heads_kv, head_dim)"),
        ("v", vs, "(batch, seqlen_k, heads_kv, head_dim_v)"),
    ):
        if len(s) != 4:
            raise ValueError(f"{name} must have rank 4 {dims}, got shape {s}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seqlen_q, heads_q, head_dim = qs
    if ks[0] != batch or vs[0] != batch:
        raise ValueError(f"batch of q, k, v must match, got shapes q {qs}, k {ks}, v {vs}")
    if ks[3] != head_dim:
        raise ValueError(f"head_dim of k must equal q's ({head_dim}), got k shape {ks}")
    if vs[1] != ks[1] or vs[2] != ks[2]:
        raise ValueError(
            f"v must have k's seqlen_k and heads_kv {ks[1:3]}, got v shape {vs}"
        )
    for name, n in (("seqlen_q", seqlen_q), ("seqlen_k", ks[1]), ("heads_q", heads_q),
                    ("heads_kv", ks[2]), ("batch", batch)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n} (q {qs}, k {ks})")
    if heads_q % ks[2] != 0:
        raise ValueError(
            f"heads_q ({heads_q}) must be a multiple of heads_kv ({ks[2]}) for MQA/GQA"
        )
    for name, d in (("head_dim", head_dim), ("head_dim_v", vs[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}], got {d}")
    if sinks is not None:
        if _shape("sinks", sinks) != (heads_q,):
            raise ValueError(f"sinks must have shape (heads_q,) = ({heads_q},), got {sinks.shape}")
        if sinks.dtype != jnp.float32:
            raise TypeError(f"sinks must be float32, got {sinks.dtype}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _make_config(head_dim, softmax_scale, causal, window_size, softcap, has_sinks,
                 deterministic) -> _Config:
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if not _is_real(softmax_scale) or not math.isfinite(float(softmax_scale)):
        raise TypeError(
            "softmax_scale must be a finite Python/NumPy real number (a static value, not a "
            f"traced array), got {softmax_scale!r}"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(_is_int(w) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size}")
    if not _is_real(softcap):
        raise TypeError(f"softcap must be a real number (0 = off), got {softcap!r}")
    if not (float(softcap) >= 0.0) or not math.isfinite(float(softcap)):
        raise ValueError(f"softcap must be a finite real >= 0 (0 = off), got {softcap!r}")
    if causal:
        right = 0
    return _Config(float(softmax_scale), left, right, float(softcap), bool(has_sinks),
                   bool(deterministic))


def _batch_shape(q):
    return q.shape[:-3]


# Inside jax.shard_map, arrays carry the mesh axes they vary over. An FFI call's
# results must be declared with them (the union over its operands), and a
# cotangent must vary over no more axes than its primal: the rest is a sum over
# shards (e.g. dk for a k replicated across a query-sharded axis).
def _varying_axes(*xs) -> frozenset:
    axes = frozenset()
    for x in xs:
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return axes


def _result_types(like, varying: frozenset, *shape_dtypes):
    """ShapeDtypeStructs for an FFI call's results, varying over `varying` (the mesh
    is taken from the operand `like`)."""
    if not varying:
        return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shape_dtypes)
    if not hasattr(jax.sharding, "ManualAxisType"):  # jax < 0.10
        return tuple(jax.ShapeDtypeStruct(shape, dtype, vma=varying) for shape, dtype in shape_dtypes)
    mesh = jax.typeof(like).sharding.mesh
    manual = jax.sharding.ManualAxisType(varying=varying)
    return tuple(
        jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        for shape, dtype in shape_dtypes)


def _sum_to_varying(cotangent, primal):
    extra = _varying_axes(cotangent) - _varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def _forward_call(q, k, v, sinks_rows, cfg: _Config):
    lead, (seqlen_q, heads_q) = _batch_shape(q), q.shape[-3:-1]
    out_types = _result_types(q, _varying_axes(q, k, v, sinks_rows),
                              (q.shape[:-1] + (v.shape[-1],), q.dtype),
                              (lead + (heads_q, seqlen_q), jnp.float32))
    call = jax.ffi.ffi_call(_ffi.FORWARD_TARGET, out_types, vmap_method="broadcast_all")
    return call(q, k, v, sinks_rows, **cfg.attributes())


def _backward_call(q, k, v, out, dout, lse, dlse, sinks_rows, cfg: _Config):
    out_types = _result_types(q, _varying_axes(q, k, v, out, dout, lse, dlse, sinks_rows),
                              (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype),
                              (sinks_rows.shape, jnp.float32))
    call = jax.ffi.ffi_call(_ffi.BACKWARD_TARGET, out_types, vmap_method="broadcast_all")
    return call(q, k, v, out, dout, lse, dlse, sinks_rows, **cfg.attributes(),
                deterministic=np.bool_(cfg.deterministic))


def _sink_rows(q, sinks):
    # One sink vector per batch row, so that vmap can batch sinks like q.
    return jnp.broadcast_to(sinks, q.shape[:-4] + (q.shape[-4], q.shape[-2]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, sinks, cfg: _Config):
    return _forward_call(q, k, v, _sink_rows(q, sinks), cfg)


def _attention_fwd(q, k, v, sinks, cfg: _Config):
    out, lse = _forward_call(q, k, v, _sink_rows(q, sinks), cfg)
    return (out, lse), (q, k, v, sinks, out, lse)


def _attention_bwd(cfg: _Config, residuals, cotangents):
    q, k, v, sinks, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dsink_rows = _backward_call(
        q, k, v, out, dout.astype(out.dtype), lse, dlse.astype(jnp.float32),
        _sink_rows(q, sinks), cfg)
    dsinks = jnp.sum(dsink_rows, axis=tuple(range(dsink_rows.ndim - 1))).astype(sinks.dtype)
    return tuple(_sum_to_varying(ct, primal)
                 for ct, primal in zip((dq, dk, dv, dsinks), (q, k, v, sinks)))


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, sinks=None, return_lse=False, deterministic=False):
    """Exact attention softmax(q k^T * scale) v, computed tile by tile.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim), float16/bfloat16/float32.
      k: (batch, seqlen_k, heads_kv, head_dim); heads_q % heads_kv == 0 (MQA/GQA).
      v: (batch, seqlen_k, heads_kv, head_dim_v).
      softmax_scale: scale of q.k; default 1/sqrt(head_dim). A static number.
      causal: mask keys after the query's diagonal, aligned bottom-right when
        seqlen_q != seqlen_k (FlashAttention 2/3 convention).
      window_size: (left, right) sliding window around the diagonal, -1 = unbounded.
      softcap: if > 0, scores become softcap * tanh(scores / softcap).
      sinks: optional float32 (heads_q,) sink logits that join the softmax
        denominator only (gpt-oss style); differentiable.
      return_lse: also return the float32 log-sum-exp (batch, heads_q, seqlen_q),
        the full softmax normaliser (sink included). Differentiable.
      deterministic: bitwise-repeatable backward on the GPU (CPU always is).

    Returns:
      out (batch, seqlen_q, heads_q, head_dim_v) in q's dtype, and lse if asked.
      A row that sees no key gets out 0 and lse -inf (or its sink logit).
    """
    _check_arrays(q, k, v, sinks)
    cfg = _make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                       sinks is not None, deterministic)
    _ffi.load()
    if sinks is None:
        sinks = jnp.zeros((q.shape[2],), jnp.float32)  # ignored: has_sinks is False
    out, lse = _attention(q, k, v, sinks, cfg)
    return (out, lse) if return_lse else out
