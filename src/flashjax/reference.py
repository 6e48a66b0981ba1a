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
gradients are 0, never NaN). NaN and inf propagate as docs/api.md ("Non-finite
values") states: row i's result is the IEEE evaluation over the keys row i sees. This module must not import flashjax.attention.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _dropout, _nonfinite
from ._visibility import Window, diagonal_offset, used_rows

__all__ = ["attention", "attention_varlen", "visible_mask"]


def visible_mask(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1), offset=None):
    """Bool numpy array (seqlen_q, seqlen_k): True where query i sees key j.

    Bottom-right aligned (FlashAttention 2/3): with offset = seqlen_k - seqlen_q
    (or the given one: q_offset - kv_offset), row i sees key j iff
    j >= i + offset - left (left >= 0) and j <= i + offset + right (right >= 0);
    causal sets right = 0.
    """
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    offset = diagonal_offset(seqlen_q, seqlen_k, None if offset is None else int(offset))
    return Window.of(causal, window_size).sees(i, j, offset)


def _used_mask(seqlen_q, seqlen_k, causal, window_size, seqused_q, seqused_k, offset=None):
    """(batch, 1, seqlen_q, seqlen_k) visibility on each entry's used lengths, and
    (batch, seqlen_q) which rows are used. offset: (batch,) query position minus key
    position of row 0 (None: bottom-right alignment on the used lengths)."""
    seqlen_q_used = used_rows(jnp.asarray(seqused_q), seqlen_q)[:, None, None]
    seqlen_k_used = used_rows(jnp.asarray(seqused_k), seqlen_k)[:, None, None]
    i = jnp.arange(seqlen_q)[None, :, None]
    j = jnp.arange(seqlen_k)[None, None, :]
    if offset is not None:
        offset = jnp.asarray(offset, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
        offset = offset.reshape(offset.shape + (1, 1))
    offset = diagonal_offset(seqlen_q_used, seqlen_k_used, offset)
    mask = ((i < seqlen_q_used) & (j < seqlen_k_used)
            & Window.of(causal, window_size).sees(i, j, offset))
    return mask[:, None], (i < seqlen_q_used)[:, :, 0]


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              sinks=None, return_lse=False, compute_dtype=None, q_segment_ids=None,
              kv_segment_ids=None, seqused_q=None, seqused_k=None, q_offset=None,
              kv_offset=None, bias=None, mask=None, alibi_slopes=None, dropout_rate=0.0,
              dropout_key=None, _dropout_keep=None):
    """softmax(scale * q k^T [softcapped, + bias and ALiBi, masked, + sink]) [dropped] v,
    materialised.

    q: (..., seqlen_q, heads_q, head_dim); k: (..., seqlen_k, heads_kv, head_dim);
    v: (..., seqlen_k, heads_kv, head_dim_v); sinks: (heads_q,) or None.
    Segment ids ((batch, seqlen)), seqused ((batch,)), q_offset / kv_offset (int,
    () or (batch,)), bias / mask ((1 or batch, 1 or heads_q or heads_kv, seqlen_q,
    seqlen_k)), alibi_slopes ((heads_q,) or (batch, heads_q)) and dropout_rate /
    dropout_key (the probabilities times flashjax.dropout_mask(dropout_key, rate, batch,
    heads_q, seqlen_q, seqlen_k) / (1 - rate); the lse before dropout) as in
    flashjax.flash_attention (they need exactly one leading batch dim).
    Returns out (..., seqlen_q, heads_q, head_dim_v) and, if return_lse, the
    log-sum-exp (..., heads_q, seqlen_q) (float32, or float64 when computing in float64).
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    mask_arg = mask
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
    if bias is not None:
        scores = scores + _per_query_head(jnp.asarray(bias).astype(dtype), group, heads_q)
    row_used = None
    positional = q_offset is not None or kv_offset is not None
    if seqused_q is not None or seqused_k is not None or positional:
        batch = q.shape[0]
        offset = None
        if positional:  # (64-bit where enabled: offsets near the int32 limits)
            position = lambda x: jnp.broadcast_to(jnp.asarray(0 if x is None else x), (batch,))
            offset = position(q_offset) - position(kv_offset)
        mask, row_used = _used_mask(
            seqlen_q, seqlen_k, causal, window_size,
            jnp.full((batch,), seqlen_q) if seqused_q is None else seqused_q,
            jnp.full((batch,), seqlen_k) if seqused_k is None else seqused_k, offset)
    else:
        mask = visible_mask(seqlen_q, seqlen_k, causal, window_size)
    if alibi_slopes is not None:  # -slope * |i + diagonal offset - j|
        if row_used is None:
            offset = seqlen_k - seqlen_q
        else:
            offset = diagonal_offset(
                used_rows(None if seqused_q is None else jnp.asarray(seqused_q), seqlen_q),
                used_rows(None if seqused_k is None else jnp.asarray(seqused_k), seqlen_k),
                offset)
            offset = jnp.reshape(jnp.broadcast_to(offset, (q.shape[0],)), (-1, 1, 1, 1))
        i = jnp.arange(seqlen_q)[:, None]
        j = jnp.arange(seqlen_k)[None, :]
        distance = jnp.abs(i + offset - j).astype(dtype)
        slopes = jnp.asarray(alibi_slopes).astype(dtype)[..., None, None]
        scores = scores - slopes * distance
    if mask_arg is not None:
        mask = mask & _per_query_head(jnp.asarray(mask_arg), group, heads_q)
    if q_segment_ids is not None:
        same = jnp.asarray(q_segment_ids)[:, :, None] == jnp.asarray(kv_segment_ids)[:, None, :]
        mask = mask & same[:, None]
    mask = jnp.broadcast_to(mask, scores.shape)
    scores = jnp.where(mask, scores, -jnp.inf)

    # Rows that see no key and have no sink (or are past seqused_q): out 0, lse -inf,
    # whatever q holds (no score is formed). Decided by the mask, never by the values:
    # a NaN row must stay NaN (docs/api.md, "Non-finite values").
    nonempty = jnp.any(mask, axis=-1, keepdims=True)
    # (NaN if a visible score is NaN; -inf where there are no keys at all)
    row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
    if sinks is not None:
        sink = jnp.asarray(sinks).astype(dtype)[:, None, None]  # (heads_q, 1, 1)
        row_max = jnp.maximum(row_max, sink)
        nonempty = jnp.ones_like(nonempty)
    if row_used is not None:  # rows past seqused_q: out 0 and lse -inf, sink or not
        nonempty = nonempty & row_used[:, None, :, None]
    # The shift cancels out (mathematically), so no gradient flows through it; empty
    # rows shift by 0 so that exp(-inf - 0) = 0. Other rows shift by their maximum as
    # IEEE would: a NaN or +-inf maximum makes the row NaN.
    row_max = jax.lax.stop_gradient(jnp.where(nonempty, row_max, 0))
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0)  # masked: 0, gradient 0
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    safe = jnp.where(nonempty, denom, 1)  # the where trick: no 0/0 in value or gradient
    probs = jnp.where(nonempty, weights / safe, 0)
    rate = _dropout.check_dropout(dropout_rate, dropout_key)
    if rate > 0:
        keep = _dropout_keep
        if keep is None:
            keep = _dropout.dropout_mask(dropout_key, rate, q.shape[0], heads_q, seqlen_q,
                                         seqlen_k)
        probs = jnp.where(keep, probs * jnp.asarray(1 / (1 - rate), dtype), 0)
    # Masked probabilities must not meet a non-finite v (0 * NaN): masked_sum.
    out = _nonfinite.masked_sum(probs, mask, v,
                                lambda p, x: jnp.einsum("...hqk,...khd->...qhd", p, x))
    out = out.astype(out_dtype)
    if not return_lse:
        return out
    lse = jnp.where(nonempty, jnp.log(safe) + row_max, -jnp.inf)[..., 0]
    return out, lse.astype(lse_dtype)


def _per_query_head(x, group: int, heads_q: int):
    """A (batch, heads, seqlen_q, seqlen_k) bias or mask with 1, heads_kv or heads_q
    heads, broadcastable to the scores' (batch, heads_q, ...): a heads_kv one repeated
    over each group."""
    return jnp.repeat(x, group, axis=1) if x.shape[1] not in (1, heads_q) else x


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     seqused_q=None, seqused_k=None, return_lse=False, q_offset=None,
                     kv_offset=None, **options):
    """flashjax.flash_attention_varlen: `attention` on each sequence on its own.

    cu_seqlens, seqused and q_offset / kv_offset must be concrete (NumPy) values; they
    are clamped as flash_attention_varlen documents (for non-decreasing cu_seqlens).
    Rows that no sequence uses get out 0 and lse -inf. Same `options` as `attention`;
    alibi_slopes is (heads_q,) or (num_seqs, heads_q) (sequence b's row for sequence b).
    Evaluated as one batched `attention` call: each sequence's rows and keys gathered
    into a batch entry, zero-padded, its used lengths (and positions) as seqused (and
    q_offset / kv_offset), so that the padding takes no part.
    """
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    total_q, total_k = q.shape[0], k.shape[0]
    dtype = jnp.dtype(jnp.float32 if options.get("compute_dtype") is None
                      else options["compute_dtype"])
    high = dtype == jnp.float64
    out = jnp.zeros(q.shape[:-1] + (v.shape[-1],), jnp.float64 if high else q.dtype)
    lse = jnp.full((q.shape[1], total_q), -jnp.inf, jnp.float64 if high else jnp.float32)
    sequences = len(cu_q) - 1
    at = lambda x, b: 0 if x is None else int(np.broadcast_to(np.asarray(x), (sequences,))[b])
    spans = []  # (first query row, used rows, first key, used keys, q_offset, kv_offset)
    span_sequences = []  # the sequence of each span
    for b in range(sequences):
        q0 = int(np.clip(cu_q[b], 0, total_q))
        k0 = int(np.clip(cu_k[b], 0, total_k))
        slot_q = int(np.clip(min(cu_q[b + 1] - q0, max_seqlen_q), 0, total_q - q0))
        slot_k = int(np.clip(min(cu_k[b + 1] - k0, max_seqlen_k), 0, total_k - k0))
        used_q = slot_q if seqused_q is None else int(np.clip(seqused_q[b], 0, slot_q))
        used_k = slot_k if seqused_k is None else int(np.clip(seqused_k[b], 0, slot_k))
        if used_q > 0:
            spans.append((q0, used_q, k0, used_k, at(q_offset, b), at(kv_offset, b)))
            span_sequences.append(b)
    if not spans:
        return (out, lse) if return_lse else out
    q0, used_q, k0, used_k, q_at, kv_at = (np.array(c, np.int64) for c in zip(*spans))

    def gather(x, first, used, width):  # (sequences, width, ...), zero past `used`
        if x.shape[0] == 0:  # (no packed rows at all: every gathered row is padding)
            x = jnp.zeros((1,) + x.shape[1:], x.dtype)
        i = np.arange(width)[None, :]
        rows = np.where(i < used[:, None], first[:, None] + i, 0)
        valid = (i < used[:, None]).reshape(rows.shape + (1,) * (x.ndim - 1))
        return jnp.where(valid, x[rows], 0)
    width_q, width_k = int(used_q.max()), max(int(used_k.max()), 1)
    positions = {}
    if q_offset is not None or kv_offset is not None:
        positions = dict(q_offset=q_at, kv_offset=kv_at)
    slopes = options.get("alibi_slopes")
    if slopes is not None and jnp.ndim(slopes) == 2:  # (num_seqs, heads_q): a row per span
        options = {**options, "alibi_slopes": jnp.asarray(slopes)[np.array(span_sequences)]}
    if options.get("dropout_rate", 0) > 0:  # sequence b's mask: rows and keys within it
        keep = _dropout.dropout_mask(options["dropout_key"], options["dropout_rate"],
                                     sequences, q.shape[1], width_q, width_k)
        positions["_dropout_keep"] = keep[np.array(span_sequences)]
    o, l = attention(gather(q, q0, used_q, width_q), gather(k, k0, used_k, width_k),
                     gather(v, k0, used_k, width_k), seqused_q=used_q, seqused_k=used_k,
                     return_lse=True, **positions, **options)
    # Each used row back to its packed place (rows of non-decreasing cu_seqlens are
    # disjoint).
    entry = np.concatenate([np.full(n, b) for b, n in enumerate(used_q)])
    row = np.concatenate([np.arange(n) for n in used_q])
    packed = np.concatenate([first + np.arange(n) for first, n in zip(q0, used_q)])
    out = out.at[packed].set(o[entry, row].astype(out.dtype))
    lse = lse.at[:, packed].set(l[entry, :, row].T.astype(lse.dtype))
    return (out, lse) if return_lse else out
