"""flashjax.reference: the attention of flashjax.flash_attention in plain jax.numpy.

It materialises the (seqlen_q, seqlen_k) score matrix, so it is for checking and
small shapes. Same signature and semantics (docs/api.md), plus `compute_dtype`:
float32 by default; pass jnp.float64 (with jax_enable_x64) for a high-precision
reference, or the input dtype for a same-precision one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Bool (seqlen_q, seqlen_k): which keys each query sees (bottom-right aligned)."""
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)
    mask = np.ones((seqlen_q, seqlen_k), bool)
    if left >= 0:
        mask &= j >= diagonal - left
    if right >= 0:
        mask &= j <= diagonal + right
    return mask


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              sinks=None, return_lse=False, compute_dtype=None):
    """softmax(q k^T * scale) v with flashjax's masking, softcap and sinks."""
    out_dtype = q.dtype
    dtype = jnp.dtype(compute_dtype or jnp.float32)
    if dtype == jnp.float64:
        out_dtype = jnp.float64
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    seqlen_q, heads_q, head_dim = q.shape[-3:]
    seqlen_k, heads_kv = k.shape[-3], k.shape[-2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    group = heads_q // heads_kv
    k = jnp.repeat(k, group, axis=-2)
    v = jnp.repeat(v, group, axis=-2)

    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * jnp.asarray(softmax_scale, dtype)
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size)
    scores = jnp.where(mask, scores, -jnp.inf)

    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(dtype)[:, None, None]
        row_max = jnp.maximum(row_max, sink)
    # Rows with nothing visible (and no sink) keep max -inf: shift by 0 instead.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(scores - row_max)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    safe = jnp.where(denom > 0, denom, 1.0)
    probs = weights / safe
    out = jnp.einsum("...hqk,...khd->...qhd", probs, v).astype(out_dtype)
    if not return_lse:
        return out
    lse = jnp.where(denom[..., 0] > 0, jnp.log(safe[..., 0]) + row_max[..., 0], -jnp.inf)
    lse_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    return out, lse.astype(lse_dtype)
