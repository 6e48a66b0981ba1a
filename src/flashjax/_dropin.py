"""jax.nn.dot_product_attention's conventions onto flash_attention: the one translation
behind `flashjax.nn.dot_product_attention` and `flashjax.flax.attention_fn`.

jax.nn places query row i and key j at positions i and j of one sequence (top-left):
row i sees key j iff i - left <= j <= i + right (window (left, right); causal caps
right at 0), j < key_value_seq_lengths, and padded rows (i >= query_seq_lengths) give 0.
flash_attention expresses any such band as a window around a shifted diagonal
(q_offset - kv_offset = shift), which also keeps it independent of the used lengths.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from . import _checks
from ._route import IMPLEMENTATIONS
from .attention import flash_attention

__all__ = ["attention", "IMPLEMENTATION_NAMES"]

# jax.nn's implementation names and flashjax's own, onto flash_attention's.
IMPLEMENTATION_NAMES = {**{name: name for name in IMPLEMENTATIONS}, "cudnn": "cuda"}


def implementation_of(implementation):
    """flash_attention's implementation= for jax.nn's or flashjax's name."""
    if not isinstance(implementation, (str, type(None))) or (
            implementation not in IMPLEMENTATION_NAMES):
        raise ValueError(f"Unsupported implementation option: {implementation!r} (one of "
                         f"{list(IMPLEMENTATION_NAMES)})")
    return IMPLEMENTATION_NAMES[implementation]


def as_rank4(name: str, x):
    """x with ones prepended up to rank 4 (jax.nn's (T, N, H) -> (1, T, N, H))."""
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} ndim should be at most 4, but got {x.ndim} (shape {x.shape})")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def check_qkv(query, key, value) -> None:
    """jax.nn's rules: value is key's shape and dtype, query key's batch, head dim and
    dtype, query heads a multiple of key heads."""
    batch, _, heads_kv, head_dim = key.shape
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value must have key's shape {key.shape} and dtype {key.dtype}, "
                         f"got {value.shape} {value.dtype}")
    if query.shape[0] != batch or query.shape[3] != head_dim or query.dtype != key.dtype:
        raise ValueError(f"query must have key's batch {batch}, head dim {head_dim} and dtype "
                         f"{key.dtype}, got {query.shape} {query.dtype}")
    if query.shape[2] % heads_kv != 0:
        raise ValueError(f"The number of query heads must be a multiple of key/value heads, "
                         f"but got {query.shape[2]} vs {heads_kv}")


def score_array(name: str, x, full: tuple):
    """A bias or mask broadcastable to full = (B, N, T, S), as flash_attention takes it:
    (1 or B, 1 or N, T, S) (broadcast here along T and S only)."""
    if x is None:
        return None
    x = as_rank4(name, x)
    if name == "mask" and x.dtype != jnp.bool_:
        raise ValueError(f"mask dtype should be bool, but got {x.dtype}")
    if any(n not in (1, m) for n, m in zip(x.shape, full)):
        raise ValueError(f"{name} shape {x.shape} must be broadcastable to (B, N, T, S) = {full}")
    if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)  # jax.nn adds it to float32 logits
    return jnp.broadcast_to(x, x.shape[:2] + full[2:])


def check_lengths(name: str, x, batch: int):
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (batch,) or x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32 of shape ({batch},), got {x.dtype} {x.shape}")
    return x


def window_of(local_window_size):
    """jax.nn's window as (left, right) ints, None for none."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
        return int(local_window_size), int(local_window_size)
    if (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
            and all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                    for w in local_window_size)):
        return tuple(int(w) for w in local_window_size)
    raise TypeError(f"local_window_size must be an int or a pair of ints (left, right), got "
                    f"{local_window_size!r}")


def band(is_causal: bool, window, seqlen_q: int):
    """(window_size, shift) for flash_attention: row i sees [i - left, i + right] as
    [i + shift - L, i + shift + R] with L, R >= 0 or -1 (unbounded); shift None when
    nothing bounds the keys. A band that no row can see (left + right < 0) becomes a
    diagonal before every key."""
    left, right = window if window is not None else (math.inf, math.inf)
    if is_causal:
        right = min(right, 0)
    if left == right == math.inf:
        return (-1, -1), None
    if left + right < 0:
        return (0, 0), -seqlen_q
    shift = -left if left < 0 else min(right, 0)
    bounded = [w if w == math.inf else w - s for w, s in ((left, -shift), (right, shift))]
    return tuple(-1 if w == math.inf else int(w) for w in bounded), shift


def attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
              query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
              implementation=None, return_residual=False, dropout_rate=0.0,
              dropout_key=None):
    """jax.nn.dot_product_attention's call (docs: flashjax.nn), with flash_attention's
    dropout (passed on only when dropout_rate > 0)."""
    out_shape = jnp.shape(query)
    q, k, v = (as_rank4(n, x) for n, x in (("query", query), ("key", key), ("value", value)))
    check_qkv(q, k, v)
    (batch, seqlen_q, heads_q, _), seqlen_k = q.shape, k.shape[1]
    full = (batch, heads_q, seqlen_q, seqlen_k)
    bias, mask = score_array("bias", bias, full), score_array("mask", mask, full)
    seqused_q = check_lengths("query_seq_lengths", query_seq_lengths, batch)
    seqused_k = check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    implementation = implementation_of(implementation)
    window_size, shift = band(_checks.static_flag("is_causal", is_causal),
                              window_of(local_window_size), seqlen_q)
    # positions only where flash_attention's bottom-right alignment (on the used
    # lengths) could differ from position 0 for both (they take the general kernels)
    aligned = shift is None or (shift == 0 and seqlen_q == seqlen_k
                                and seqused_q is None and seqused_k is None)
    positions = {} if aligned else dict(q_offset=shift, kv_offset=0)
    dropout = dict(dropout_rate=dropout_rate, dropout_key=dropout_key) if dropout_rate else {}
    out = flash_attention(q, k, v, softmax_scale=scale, window_size=window_size,
                          seqused_q=seqused_q, seqused_k=seqused_k, bias=bias, mask=mask,
                          return_lse=return_residual, implementation=implementation,
                          **positions, **dropout)
    if not return_residual:
        return out.reshape(out_shape)
    out, lse = out
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(k.dtype))
    return out.reshape(out_shape), residual.reshape(out_shape[:-1])
