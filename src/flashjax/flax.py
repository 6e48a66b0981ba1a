"""flashjax.flax: an `attention_fn` for Flax's attention modules.

    nnx.MultiHeadAttention(..., attention_fn=flashjax.flax.attention_fn)
    linen.MultiHeadDotProductAttention(..., attention_fn=flashjax.flax.attention_fn)

This module does not import flax (the modules call it with arrays only), so flashjax
needs no flax to import it; `pip install flashjax[flax]` pins a Flax it is tested with.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from . import _dropin

__all__ = ["attention_fn"]


def flatten_batch(x, batch_dims: tuple):
    """x of shape (*lead, a, b, c), lead broadcastable to batch_dims, as one batch axis
    of batch_dims' size, or of 1 where lead is all ones (broadcast by flashjax)."""
    if x is None:
        return None
    x = x.reshape((1,) * (len(batch_dims) + 3 - x.ndim) + x.shape)
    lead, tail = x.shape[:-3], x.shape[-3:]
    if all(n == 1 for n in lead):
        return x.reshape((1,) + tail)
    return jnp.broadcast_to(x, batch_dims + tail).reshape((math.prod(batch_dims),) + tail)


def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, is_causal=False, *, implementation=None):
    """flax's dot_product_attention, computed by flashjax (`flashjax.nn` conventions).

    Args:
      query: (batch..., q_length, num_heads, depth); any number of batch dims.
      key, value: (batch..., kv_length, num_kv_heads, depth); num_heads a multiple of
        num_kv_heads.
      bias: optional, broadcastable to (batch..., num_heads, q_length, kv_length);
        added to the scaled scores; differentiable.
      mask: optional, broadcastable like bias; True, or any nonzero value (Flax's
        `make_causal_mask` / `make_attention_mask` give float masks), = may attend.
      broadcast_dropout: accepted and not followed: flashjax draws one keep bit per
        (batch, head, query row, key column) (flashjax.dropout_mask), never one mask
        shared along the batch dims.
      dropout_rng, dropout_rate, deterministic: attention dropout (the probabilities,
        kept ones scaled by 1/(1 - rate)) when not deterministic and dropout_rate > 0,
        drawn from dropout_rng (flash_attention's dropout_key).
      dtype: the computation's dtype (query, key and value are cast to it); default
        their promoted dtype. float16, bfloat16 or float32.
      precision: accepted and ignored: flashjax multiplies in the inputs' dtype and
        accumulates in float32.
      module: must be None: `sow_weights=True` records the attention weights, which
        flashjax never forms (ValueError).
      is_causal: query row i sees keys j <= i (top-left, as jax.nn and flax).
      implementation: flashjax.nn.dot_product_attention's (bind it with
        functools.partial; flax does not pass it).

    Returns:
      (batch..., q_length, num_heads, depth) in the computation's dtype.
    """
    if module is not None:
        raise ValueError("flashjax.flax.attention_fn does not form the attention weights, "
                         "so it cannot sow them (sow_weights=True); use flax's own "
                         "dot_product_attention for that call")
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch_dims = query.shape[:-3]
    if mask is not None:
        mask = jnp.asarray(mask)
        mask = mask if mask.dtype == jnp.bool_ else mask != 0
    query, key, value, bias, mask = (flatten_batch(x, batch_dims)
                                     for x in (query, key, value, bias, mask))
    dropout = {} if deterministic or not dropout_rate else dict(dropout_rate=dropout_rate,
                                                                dropout_key=dropout_rng)
    out = _dropin.attention(query, key, value, bias, mask, is_causal=is_causal,
                            implementation=implementation, **dropout)
    return out.reshape(batch_dims + out.shape[1:])
