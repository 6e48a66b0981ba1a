"""flashjax.reference: the attention of flashjax.flash_attention in plain jax.numpy.

It materialises the (seqlen_q, seqlen_k) score matrix, so it is for checking and
small shapes. Same signature and semantics as `flashjax.flash_attention`
(docs/api.md), without `deterministic` and plus `compute_dtype`:

- None (default): compute in float32, return the output in the input dtype;
- jnp.float64 (needs jax_enable_x64): a high-precision reference; the output and
  the lse are float64;
- the input dtype (e.g. jnp.bfloat16): a "same precision" reference whose error
  is the yardstick for low-precision kernels (FlashAttention's test rule).

Differentiable with jax.grad / jax.vjp, including rows that see no key (their
gradients are 0, never NaN). This module must not import flashjax.attention.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["attention", "visible_mask"]


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)):
    """Bool numpy array (seqlen_q, seqlen_k): True where query i sees key j.

    Bottom-right aligned (FlashAttention 2/3): with offset = seqlen_k - seqlen_q,
    row i sees key j iff j >= i + offset - left (left >= 0) and
    j <= i + offset + right (right >= 0); causal sets right = 0.
    """
    left, right = (int(w) for w in window_size)
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
    """softmax(scale * q k^T [softcapped, masked, + sink]) v, materialised.

    q: (..., seqlen_q, heads_q, head_dim); k: (..., seqlen_k, heads_kv, head_dim);
    v: (..., seqlen_k, heads_kv, head_dim_v); sinks: (heads_q,) or None.
    Returns out (..., seqlen_q, heads_q, head_dim_v) and, if return_lse, the
    log-sum-exp (..., heads_q, seqlen_q) (float32, or float64 when computing in float64).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    dtype = jnp.dtype(jnp.float32 if compute_dtype is None else compute_dtype)
    high = dtype == jnp.float64
    out_dtype = jnp.float64 if high else q.dtype
    lse_dtype = jnp.float64 if high else jnp.float32

    seqlen_q, heads_q, head_dim = q.shape[-3:]
    seqlen_k, heads_kv = k.shape[-3], k.shape[-2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    group = heads_q // heads_kv
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    # GQA/MQA: query head h uses kv head h // group; the gradient of repeat sums the group.
    k = jnp.repeat(k, group, axis=-2)
    v = jnp.repeat(v, group, axis=-2)

    scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * jnp.asarray(softmax_scale, dtype)
    if softcap > 0:
        scores = jnp.asarray(softcap, dtype) * jnp.tanh(scores / jnp.asarray(softcap, dtype))
    mask = visible_mask(seqlen_q, seqlen_k, causal, window_size)
    scores = jnp.where(mask, scores, -jnp.inf)

    row_max = jnp.max(scores, axis=-1, keepdims=True)  # -inf for rows that see no key
    if sinks is not None:
        sink = jnp.asarray(sinks).astype(dtype)[:, None, None]  # (heads_q, 1, 1)
        row_max = jnp.maximum(row_max, sink)
    # The shift cancels out (mathematically), so no gradient flows through it; rows
    # with nothing visible and no sink shift by 0 so that exp(-inf - 0) = 0, not NaN.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
    weights = jnp.exp(scores - row_max)  # masked entries: exactly 0, gradient 0
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    nonempty = denom > 0
    safe = jnp.where(nonempty, denom, 1)  # the where trick: no 0/0 in value or gradient
    probs = weights / safe
    out = jnp.einsum("...hqk,...khd->...qhd", probs, v).astype(out_dtype)
    if not return_lse:
        return out
    lse = jnp.where(nonempty, jnp.log(safe) + row_max, -jnp.inf)[..., 0]
    return out, lse.astype(lse_dtype)
