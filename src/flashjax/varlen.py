"""flashjax.flash_attention_varlen: packed batches of variable-length sequences
(FlashAttention's varlen interface: concatenated rows plus cumulative lengths)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _checks, _core, _dropout, _ffi, _fp8
from ._spec import Extras, Layout
from .kvcache import cache_capacity, gather_rows


def _unpage(k_cache, v_cache, page_table, seqused_k, max_seqlen_k):
    """Paged caches as packed keys: each sequence's first max_seqlen_k logical rows
    (gathered), cu_seqlens_k of equal slots, seqused_k clamped to the slot."""
    sequences = page_table.shape[0]
    slot = max(1, min(max_seqlen_k, cache_capacity(k_cache, page_table)))
    logical = jnp.broadcast_to(jnp.arange(slot, dtype=jnp.int32), (sequences, slot))
    k, v = (gather_rows(c, logical, page_table).reshape((sequences * slot,) + c.shape[2:])
            for c in (k_cache, v_cache))
    cu_seqlens_k = jnp.arange(sequences + 1, dtype=jnp.int32) * slot
    return k, v, cu_seqlens_k, jnp.clip(seqused_k, 0, slot)


def _check_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks,
                 page_table):
    if page_table is None:
        _checks.check_qkv(q, k, v, 3, ("(total_q, heads_q, head_dim)",
                                       "(total_k, heads_kv, head_dim)",
                                       "(total_k, heads_kv, head_dim_v)"), "total_k")
    else:  # paged caches: q packed, k and v pages
        qs = _checks.shape_of("q", q)
        if len(qs) != 3:
            raise ValueError(f"q must have rank 3 (total_q, heads_q, head_dim), got shape {qs}")
        q_rows = jax.ShapeDtypeStruct((qs[0], 1) + qs[1:], q.dtype)  # (checks only)
        if _fp8.is_fp8(k) or _fp8.is_fp8(v):  # float8 caches: q's dtype once dequantised
            if not (_fp8.is_fp8(k) and v.dtype == k.dtype):
                raise TypeError("float8 paged caches need k and v of one float8 dtype, got "
                                f"{k.dtype}, {v.dtype}")
            k, v = (jax.ShapeDtypeStruct(c.shape, q.dtype) for c in (k, v))
        _checks.check_qkv(q_rows, k, v, 4, (
            "(total_q, heads_q, head_dim)", "(num_pages, page_size, heads_kv, head_dim)",
            "(num_pages, page_size, heads_kv, head_dim_v)"), "page_size")
    cu_shape = _checks.shape_of("cu_seqlens_q", cu_seqlens_q)
    if len(cu_shape) != 1 or cu_shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must have shape (num_seqs + 1,), got {cu_shape}")
    sequences = cu_shape[0] - 1
    _checks.check_int_array("cu_seqlens_q", cu_seqlens_q, cu_shape, "(num_seqs + 1,)")
    if page_table is not None:
        if cu_seqlens_k is not None or seqused_k is None:
            raise ValueError("with page_table, the keys of sequence i are its first "
                             "seqused_k[i] cache rows: give seqused_k, and cu_seqlens_k=None")
        s = _checks.shape_of("page_table", page_table)
        if len(s) != 2 or s[0] != sequences or s[1] < 1:
            raise ValueError(f"page_table must have shape (num_seqs, max_pages) = ({sequences}, "
                             f"max_pages >= 1), got {s}")
        _checks.check_int_array("page_table", page_table, s, "(num_seqs, max_pages)")
    else:
        _checks.check_int_array("cu_seqlens_k", cu_seqlens_k, cu_shape,
                                "(num_seqs + 1,) like cu_seqlens_q")
    _checks.check_int_array("seqused_q", seqused_q, (sequences,), "(num_seqs,)")
    _checks.check_int_array("seqused_k", seqused_k, (sequences,), "(num_seqs,)")
    _checks.check_sinks(sinks, q.shape[1])


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False,
                           deterministic=False, page_table=None, q_offset=None, kv_offset=None,
                           alibi_slopes=None, dropout_rate=0.0, dropout_key=None,
                           q_descale=None, k_descale=None, v_descale=None, out_dtype=None,
                           implementation=None):
    """Attention over a packed batch of sequences of different lengths.

    Args:
      q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim);
        v: (total_k, heads_kv, head_dim_v): the sequences' rows concatenated.
      cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,): sequence i is rows
        [cu[i], cu[i + 1]) of q (of k and v). Traced: no recompilation when
        the values change.
      max_seqlen_q, max_seqlen_k: static Python ints, upper bounds of the
        sequences' lengths (they size the launch; longer sequences are cut).
      seqused_q, seqused_k: optional int32 (num_seqs,): only the first n rows of
        each sequence take part.
      softmax_scale, causal, window_size, softcap, sinks, deterministic: as in
        `flash_attention`; causal and windows are aligned bottom-right within
        each sequence, on its used lengths (or by position with q_offset /
        kv_offset).
      return_lse: also return the float32 lse, shape (heads_q, total_q).
      page_table: optional int32 (num_seqs, max_pages): k and v are then paged
        caches (num_pages, page_size, heads_kv, head_dim[_v]) (continuous batching:
        prefill and decode rows in one call), cu_seqlens_k must be None and the
        keys of sequence i are its logical cache rows [0, seqused_k[i]) (row p is
        row p % page_size of page page_table[i, p // page_size]), at most
        max_seqlen_k of them. Pages are gathered for now (see
        flash_attention_with_kvcache). The caches may be float8 (e4m3 / e5m2, q in
        bfloat16 / float16 / float32) with k_descale / v_descale.
      q_offset, kv_offset: optional positions of each sequence's first query
        row and first key row (an int or an integer array of shape () or
        (num_seqs,)), as in `flash_attention`: given either, causal and windows
        compare positions.
      alibi_slopes: optional float32 (heads_q,) or (num_seqs, heads_q) (one row per
        sequence): FlashAttention's varlen ALiBi, -slope * |i + seqlen_k_b -
        seqlen_q_b - j| added to query i / key j of sequence b (counted within it,
        on its used lengths; by position with q_offset / kv_offset) after the
        softcap; never materialised, not differentiated. Runs on every path (CUDA,
        CPU, pure JAX), as for flash_attention.
      dropout_rate, dropout_key: attention dropout as in `flash_attention`; element
        (b, h, i, j) of the keep mask is sequence b, query head h, query row i and key
        j counted within the sequence (flashjax.dropout_mask(dropout_key, rate,
        num_seqs, heads_q, max_seqlen_q, max_seqlen_k)[b, h, i, j]).
      k_descale, v_descale: float32 descales of float8 paged caches, as
        flash_attention_with_kvcache takes them, per (sequence, kv head): shapes (),
        (1, 1), (num_seqs, 1), (1, heads_kv), (num_seqs, heads_kv); None: 1.0. The
        gathered rows are dequantised (x * descale in float32, rounded to q's dtype).
      q_descale, out_dtype: float8 q, k, v (one float8 dtype; k and v packed, or
        float8 paged caches), as flash_attention takes them: descales per (sequence,
        kv head) of the shapes above (q's heads use their kv head's), each row at its
        sequence's; out in out_dtype (bfloat16 by default); forward only. Today the
        exact fallback: the rows dequantised, then the kernels of out_dtype.
      implementation: as in `flash_attention`.

    Returns:
      out (total_q, heads_q, head_dim_v) [, lse (heads_q, total_q)]. Rows that
      belong to no sequence or lie past seqused_q get out 0 and lse -inf.

    No bias= or mask= (FlashAttention's varlen interface has neither; a packed score
    array would be (total_q, total_k) or ragged): for masks over packed documents, use
    flash_attention on the packed rows with q_segment_ids / kv_segment_ids and mask=
    (and bias=) of shape (1, heads, total_q, total_k).

    Inconsistent metadata is clamped, never trusted: cu_seqlens entries to
    [0, total], a sequence's end to at least its start, lengths to max_seqlen,
    seqused to the sequence's length. Rows outside every sequence are zero when
    cu_seqlens is non-decreasing (unspecified otherwise); nothing is read or
    written out of bounds.
    """
    if _fp8.is_fp8(q):
        return _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                           v_descale, out_dtype, page_table, dict(
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                               seqused_q=seqused_q, seqused_k=seqused_k,
                               softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, sinks=sinks,
                               return_lse=return_lse, deterministic=deterministic,
                               page_table=page_table, q_offset=q_offset,
                               kv_offset=kv_offset, alibi_slopes=alibi_slopes,
                               dropout_rate=dropout_rate, dropout_key=dropout_key,
                               implementation=implementation))
    _fp8.check_no_fp8_options(q, out_dtype, {"q_descale": q_descale})
    _check_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks, page_table)
    rate = _dropout.check_dropout(dropout_rate, dropout_key)
    max_q = _checks.check_static_length("max_seqlen_q", max_seqlen_q)
    max_k = _checks.check_static_length("max_seqlen_k", max_seqlen_k)
    sequences = cu_seqlens_q.shape[0] - 1
    fp8_caches = page_table is not None and _fp8.is_fp8(k)
    if not fp8_caches:  # (float8 packed k, v with another q: _check_arrays said no)
        for name, value in (("k_descale", k_descale), ("v_descale", v_descale)):
            if value is not None:
                raise ValueError(f"{name} is for float8 paged caches; got {k.dtype} k, v")
    if page_table is not None:
        descales = ((_fp8.descale_of("k_descale", k_descale, sequences, k.shape[2]),
                     _fp8.descale_of("v_descale", v_descale, sequences, k.shape[2]))
                    if fp8_caches else None)
        k, v, cu_seqlens_k, seqused_k = _unpage(k, v, page_table, seqused_k, max_k)
        if fp8_caches:  # each gathered row at its sequence's descales
            owner = jnp.repeat(jnp.arange(sequences), k.shape[0] // max(sequences, 1))
            k, v = (_fp8.forward_only(_fp8.dequantize(x, d, q.dtype, row_batch=owner))
                    for x, d in zip((k, v), descales))
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              deterministic, implementation, return_lse, packed=True,
                              max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_rate=rate)
    layout = Layout(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                    seqused_k=seqused_k,
                    diagonal_offset=_checks.diagonal_offset(
                        q_offset, kv_offset, sequences, "(num_seqs,)"),
                    alibi_slopes=_checks.check_alibi_slopes(alibi_slopes, sequences, q.shape[1],
                                                            "num_seqs"),
                    dropout=(_dropout.key_rows(dropout_key, sequences, q.shape[1]) if rate
                             else None))
    _ffi.load()
    out, lse = _core.attention(q, k, v, Extras(sinks=sinks), layout, cfg)
    return (out, lse) if return_lse else out


def _token_sequences(cu_seqlens, tokens: int):
    """The sequence of each of `tokens` packed rows (rows outside every sequence: a
    neighbour's; cu_seqlens clamped, never trusted)."""
    sequences = cu_seqlens.shape[0] - 1
    ends = jnp.clip(cu_seqlens[1:].astype(jnp.int32), 0, tokens)
    owner = jnp.searchsorted(ends, jnp.arange(tokens, dtype=jnp.int32), side="right")
    return jnp.clip(owner, 0, max(sequences - 1, 0))


def _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale,
                out_dtype, page_table, options: dict):
    """flash_attention_varlen of float8 q, k, v: the exact fallback (_fp8): each row
    dequantised at its sequence's descales (packed k, v here; float8 pages by the
    paged path, q's dtype then the compute dtype), the kernels of out_dtype."""
    _fp8.check_inputs(q, k, v)
    if q.ndim != 3:
        raise ValueError(f"q must have rank 3 (total_q, heads_q, head_dim), got shape {q.shape}")
    if page_table is None and (k.ndim != 3 or v.ndim != 3):
        raise ValueError("k and v must have rank 3 (total_k, heads_kv, head_dim[_v]), got "
                         f"shapes {k.shape}, {v.shape}")
    sequences, heads_kv = cu_seqlens_q.shape[0] - 1, k.shape[-2]
    compute = _fp8.out_dtype_of(out_dtype)  # (the kernels of out's dtype)
    q = _fp8.dequantize_query(q, q_descale, sequences, heads_kv, compute,
                              row_batch=_token_sequences(cu_seqlens_q, q.shape[0]))
    scales = {name: _fp8.descale_of(name, value, sequences, heads_kv)
              for name, value in (("k_descale", k_descale), ("v_descale", v_descale))}
    more = {}
    if page_table is None:
        owner = _token_sequences(cu_seqlens_k, k.shape[0])
        k, v = (_fp8.dequantize(_fp8.forward_only(x), scales[name], compute, row_batch=owner)
                for x, name in ((k, "k_descale"), (v, "v_descale")))
    else:  # float8 pages: the paged path dequantises (and guards) the gathered rows
        more = scales
    # (out comes in q's dtype, the compute dtype: out_dtype)
    return flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **options, **more)
