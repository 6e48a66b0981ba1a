"""flashjax.flash_attention_with_kvcache: attention over a KV cache, the new tokens
appended to it first (FlashAttention's ``flash_attn_with_kvcache``).

One FFI call (``flashjax_kvcache``) appends the new rows into the caches, whose
outputs alias the inputs (in place under donation), and attends over the cache where
it lies (contiguous, leftpad, cache_batch_idx or paged): on the GPU a split-KV kernel
with a combine step for fp16/bf16, the SIMT path for float32; on the CPU the threaded
C++ path. Rotary embedding of q and the new k is a JAX elementwise op before it. On
the GPU, query blocks too large for decoding (prefill) attend with the dense kernels
instead, after the same FFI call appends. Under jax.jit the call shards along heads,
and along batch when each sequence owns its cache entry (_partitioning).

Score terms (bias, mask, alibi_slopes) are not operands of the KV-cache target: a call
with them appends through the FFI call and attends with flash_attention over the cache
(the platform's dense kernels, which read the terms). Bias and mask are given over
the logical cache positions (capacity columns) and sliced or gathered to the keys that
flash_attention sees (`_terms_on_keys`).
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp

from . import _checks, _ffi, _ffi_calls, _fp8, _partitioning, _route
from ._spec import KVCACHE, Config
from .attention import flash_attention

__all__ = ["flash_attention_with_kvcache", "apply_rotary"]


def _no_derivative(_primals, _tangents):
    raise TypeError(
        "flash_attention_with_kvcache is an inference interface and has no gradient; "
        "differentiate flash_attention or flash_attention_varlen instead")


def _inference_only(fn, *args):
    """fn(*args), whose differentiation (grad, jvp) raises a TypeError."""
    f = jax.custom_jvp(fn)
    f.defjvp(_no_derivative)
    return f(*args)


def apply_rotary(x, cos, sin, positions, interleaved: bool):
    """Rotary embedding of the first 2 * cos.shape[1] features of x (..., rows, heads,
    dim) at `positions` (..., rows) (clamped to cos's rows): GPT-J style pairs (2i,
    2i + 1) when interleaved, else NeoX style halves (i, i + rotary_dim / 2). Computed
    in float32, returned in x's dtype."""
    half = cos.shape[1]
    pos = jnp.clip(positions, 0, cos.shape[0] - 1)
    c = cos.astype(jnp.float32)[pos][..., None, :]  # (..., rows, 1, half)
    s = sin.astype(jnp.float32)[pos][..., None, :]
    rot, rest = x[..., :2 * half].astype(jnp.float32), x[..., 2 * half:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(rot.shape)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rotated = jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)


def _first_key_rows(leftpad, batch: int, capacity: int):
    """Each sequence's first valid cache row: cache_leftpad clamped to [0, capacity]."""
    if leftpad is None:
        return jnp.zeros((batch,), jnp.int32)
    return jnp.clip(leftpad, 0, capacity)


def cache_capacity(cache, page_table=None) -> int:
    """Logical rows a sequence can hold: seqlen_cache, or max_pages * page_size."""
    return cache.shape[1] * (1 if page_table is None else page_table.shape[1])


def cache_rows(logical, cache, page_table=None, batch_idx=None):
    """Where logical rows `logical` (batch, n) of each sequence lie in a cache:
    (slot, row, valid). Paged (page_table (batch, max_pages)): logical row p of
    sequence i is row p % page_size of page page_table[i, p // page_size]; contiguous:
    row p of cache entry batch_idx[i] (default i). valid: inside the capacity and in a
    batch entry / page of the cache; invalid rows get a clamped (row, slot)... but the
    slot is left as is, for the caller to drop or clamp."""
    slots, rows_per_slot = cache.shape[:2]
    capacity = cache_capacity(cache, page_table)
    inside = (logical >= 0) & (logical < capacity)
    row = jnp.clip(logical, 0, capacity - 1)
    if page_table is not None:
        slot = jnp.take_along_axis(page_table, row // rows_per_slot, axis=1)
        row = row % rows_per_slot
    else:
        entries = jnp.arange(logical.shape[0], dtype=jnp.int32) if batch_idx is None else batch_idx
        slot = entries[:, None] * jnp.ones_like(row)
    return slot, row, inside & (slot >= 0) & (slot < slots)


def gather_rows(cache, logical, page_table=None, batch_idx=None):
    """The cache rows of logical rows (batch, n): (batch, n, ...); invalid rows read a
    clamped row (in bounds, unspecified values)."""
    slot, row, _ = cache_rows(logical, cache, page_table, batch_idx)
    return cache[jnp.clip(slot, 0, cache.shape[0] - 1), row]


def _score_terms(q, k_cache, page_table, bias, mask, alibi_slopes) -> dict:
    """The present score terms, checked: bias (float32) and mask over the logical cache
    positions, alibi_slopes as (batch, heads_q)."""
    batch, seqlen_q, heads_q, _ = q.shape
    dims = (batch, heads_q, k_cache.shape[2], seqlen_q, cache_capacity(k_cache, page_table),
            "capacity (seqlen_cache, or max_pages * page_size)")
    terms = dict(bias=_checks.check_scores("bias", bias, *dims),
                 mask=_checks.check_scores("mask", mask, *dims),
                 alibi_slopes=_checks.check_alibi_slopes(alibi_slopes, batch, heads_q))
    return {name: x for name, x in terms.items() if x is not None}


def _terms_on_keys(terms: dict, first, rows: int) -> dict:
    """bias and mask (over logical cache positions) at the keys an attention over the
    cache sees: key j of sequence b is position j (first None) or first[b] + j (clamped
    to the capacity: such keys are past the sequence's used ones), j < rows."""
    out = dict(terms)
    for name in ("bias", "mask"):
        x = terms.get(name)
        if x is None:
            continue
        if first is None:
            out[name] = x[..., :rows]
            continue
        columns = jnp.minimum(first[:, None] + jnp.arange(rows, dtype=jnp.int32)[None, :],
                              x.shape[3] - 1)
        x = jnp.broadcast_to(x, (first.shape[0],) + x.shape[1:])
        out[name] = jnp.take_along_axis(x, columns[:, None, None, :], axis=3)
    return out


def _check(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
           page_table, rotary_cos, rotary_sin, rotary_interleaved, num_splits, return_lse):
    """Checks every argument; returns the static options as Python values
    (rotary_interleaved, return_lse, num_splits) and the integer metadata as int32
    arrays (or None; cache_seqlens may stay a Python int), in FlashAttention's terms:
    see _metadata."""
    cache_dtype = k_cache.dtype
    if _fp8.is_fp8(k_cache) or _fp8.is_fp8(v_cache):  # (fp8 caches: _fp8_cache)
        if not (_fp8.is_fp8(k_cache) and v_cache.dtype == k_cache.dtype):
            raise TypeError("an fp8 KV cache needs k_cache and v_cache of one float8 dtype, got "
                            f"{k_cache.dtype}, {v_cache.dtype}")
        k_cache, v_cache = (jax.ShapeDtypeStruct(c.shape, q.dtype) for c in (k_cache, v_cache))
    _checks.check_qkv(q, k_cache, v_cache, 4, (
        "(batch, seqlen_q, heads_q, head_dim)",
        "(batch_cache, seqlen_cache, heads_kv, head_dim) or (num_pages, page_size, heads_kv, "
        "head_dim)", "like k_cache, with head_dim_v"), "rows", names=("q", "k_cache", "v_cache"))
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    for name, n in (("batch", batch), ("seqlen_q", seqlen_q), ("k_cache rows", k_cache.shape[1]),
                    ("k_cache batch_cache / num_pages", k_cache.shape[0])):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got q {q.shape}, k_cache {k_cache.shape}")
    if (k is None) != (v is None):
        raise ValueError("k and v (the new tokens) must be given together")
    if k is not None:
        for name, x, last in (("k", k, head_dim), ("v", v, head_dim_v)):
            s = _checks.shape_of(name, x)
            if len(s) != 4 or s[0] != batch or s[2] != heads_kv or s[3] != last:
                raise ValueError(
                    f"{name} must have shape (batch, seqlen_new, heads_kv, "
                    f"{'head_dim' if name == 'k' else 'head_dim_v'}) = "
                    f"({batch}, seqlen_new, {heads_kv}, {last}), got {s}")
            if x.dtype != q.dtype and not (_fp8.is_fp8(x) and x.dtype == cache_dtype
                                           and k.dtype == v.dtype):
                raise TypeError(f"{name} must have q's dtype {q.dtype} (or, k and v both, a "
                                f"float8 cache's), got {x.dtype}")
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"k and v must have the same seqlen_new, got {k.shape}, {v.shape}")
    if _checks.is_int(cache_seqlens):
        if not 0 <= cache_seqlens <= _checks.INT32_MAX:
            raise ValueError(f"cache_seqlens must be in [0, 2^31), got {cache_seqlens}")
    elif cache_seqlens is None:  # (FlashAttention: the whole cache)
        cache_seqlens = cache_capacity(k_cache, page_table)
    else:
        cache_seqlens = _checks.int_metadata("cache_seqlens", cache_seqlens, (batch,), "(batch,)")
    cache_leftpad = _checks.int_metadata("cache_leftpad", cache_leftpad, (batch,), "(batch,)")
    cache_batch_idx = _checks.int_metadata("cache_batch_idx", cache_batch_idx, (batch,),
                                           "(batch,)")
    if page_table is not None:
        s = _checks.shape_of("page_table", page_table)
        rows = "rows" if cache_batch_idx is not None else f"rows >= batch = {batch}"
        if len(s) != 2 or s[0] < (1 if cache_batch_idx is not None else batch) or s[1] < 1:
            raise ValueError(f"page_table must have shape (cache sequences, max_pages) with "
                             f"{rows} and max_pages >= 1, got {s}")
        page_table = _checks.int_metadata("page_table", page_table, s,
                                          "(cache sequences, max_pages)")
    elif cache_batch_idx is None and k_cache.shape[0] < batch:
        raise ValueError(
            f"without cache_batch_idx, k_cache needs an entry per sequence: its batch_cache "
            f"must be >= q's batch ({batch}), got k_cache shape {k_cache.shape}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and k is not None and _fp8.is_fp8(k):
        raise ValueError("rotary embedding of float8 new tokens is not supported: pass k, v "
                         f"in {q.dtype} (they are then rotated and quantised)")
    if rotary_cos is not None:
        s = _checks.shape_of("rotary_cos", rotary_cos)
        if len(s) != 2 or _checks.shape_of("rotary_sin", rotary_sin) != s or s[0] < 1:
            raise ValueError("rotary_cos and rotary_sin must both have shape (seqlen_ro, "
                             f"rotary_dim / 2), got {s} and {tuple(rotary_sin.shape)}")
        rotary_dim = 2 * s[1]
        if rotary_dim % 16 != 0 or not 16 <= rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be a "
                             f"multiple of 16 in [16, head_dim = {head_dim}]")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if x.dtype not in (jnp.float32, q.dtype):
                raise TypeError(f"{name} must be float32 or q's dtype {q.dtype}, got {x.dtype}")
    num_splits = _checks.static_int("num_splits", num_splits)
    if num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    statics = (_checks.static_flag("rotary_interleaved", rotary_interleaved),
               _checks.static_flag("return_lse", return_lse), num_splits)
    return statics, _metadata(batch, k_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                              page_table)


def _metadata(batch, k_cache, seqlens, batch_idx, leftpad, page_table) -> dict:
    """FlashAttention's cache addressing on the kernels' (which take one page-table row
    per sequence, and a cache_batch_idx for contiguous caches only): a paged sequence i
    reads page_table row cache_batch_idx[i] (rows outside the table: no page, so
    nothing is read or written there), or row i; a contiguous cache with more entries
    than the batch and no cache_batch_idx serves sequence i from entry i."""
    if page_table is not None:
        if batch_idx is not None:  # (no negative-index wrap-around)
            inside = (batch_idx >= 0) & (batch_idx < page_table.shape[0])
            rows = page_table[jnp.clip(batch_idx, 0, page_table.shape[0] - 1)]
            page_table = jnp.where(inside[:, None], rows, -1)
            batch_idx = None
        elif page_table.shape[0] != batch:
            page_table = page_table[:batch]
    elif batch_idx is None and k_cache.shape[0] != batch:
        batch_idx = jnp.arange(batch, dtype=jnp.int32)
    return dict(cache_seqlens=seqlens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
                page_table=page_table)


def flash_attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                                 cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                 rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                                 softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, sinks=None, num_splits=0, return_lse=False,
                                 bias=None, mask=None, alibi_slopes=None, q_descale=None,
                                 k_descale=None, v_descale=None, out_dtype=None,
                                 implementation=None):
    """Attention of q over a KV cache, with new tokens k, v appended to it first.

    Args:
      q: (batch, seqlen_q, heads_q, head_dim).
      k_cache, v_cache: contiguous (batch_cache, seqlen_cache, heads_kv, head_dim[_v]),
        or paged (num_pages, page_size, heads_kv, head_dim[_v]) with `page_table`.
      k, v: optional new tokens (batch, seqlen_new, heads_kv, head_dim[_v]): written at
        rows cache_seqlens[i]... of sequence i (after rotary on k), then attended.
      cache_seqlens: (batch,) integers or a Python int: the cache row where each
        sequence's cached tokens end (its keys are rows [cache_leftpad, cache_seqlens)),
        where the new tokens go. None: the whole cache (the capacity), as in
        FlashAttention.
      cache_batch_idx: (batch,) integers: the cache entry of each sequence (contiguous:
        k_cache's entry; paged: page_table's row). Default: entry / row i; a cache or
        page table with more entries than the batch then serves sequence i from its
        entry i.
      cache_leftpad: (batch,) integers: first valid cache row of each sequence.
      page_table: (cache sequences, max_pages) integers: logical row p of sequence i is
        row p % page_size of page page_table[cache_batch_idx[i], p // page_size].
        Integer metadata of any integer dtype is taken (as int32; values outside
        int32 saturate, and are then out of range).
      rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), float32 or q's dtype:
        rotary embedding of q and the new k (GPT-J pairs when rotary_interleaved,
        else NeoX halves), at cache rows as FlashAttention: new token j at
        cache_seqlens + j (cache_leftpad does not shift it); q row j at the same
        position as new token j when causal or windowed, else every q row at
        cache_seqlens.
      softmax_scale, causal, window_size, softcap, sinks: as in flash_attention;
        causal and windows are aligned bottom-right on the sequence's keys
        (cache rows [cache_leftpad, cache_seqlens) then the new tokens).
      num_splits: how many ways the GPU's split-KV kernel splits each sequence's keys
        (0: chosen from batch, kv heads, the capacity and the SM count; 1: no
        split; at most 128). Other paths (CPU, float32, prefill blocks) ignore it.
      return_lse: also return the float32 lse (batch, heads_q, seqlen_q).
      bias, mask: optional float / bool arrays (1 or batch, 1 or heads_q or heads_kv,
        seqlen_q, capacity) over the sequence's logical cache positions after the
        append (column p: logical row p, the cache row p of a contiguous entry, row
        p % page_size of page page_table[i, p // page_size] of a paged one; columns
        outside [cache_leftpad, cache_seqlens + seqlen_new) are not keys and are
        ignored): added to the scores after scale and softcap / True = may attend, as
        in flash_attention, on top of causal and windows.
      alibi_slopes: optional float32 (heads_q,) or (batch, heads_q): FlashAttention's
        ALiBi, -slope * |(end - seqlen_q + i) - p| for query i and the key at logical
        position p, end = cache_seqlens + seqlen_new (clamped to the capacity): new
        row i is at position cache_seqlens + i when seqlen_q == seqlen_new (leftpad
        shifts both sides, so it does not change the distance).
        With any of the three the call appends through the FFI call and attends with
        flash_attention's kernels over the cache (not the split-KV kernel). Not
        differentiated.
      k_descale, v_descale: float32 descales of float8 caches (k_cache / v_cache in
        float8_e4m3fn or float8_e5m2, q, k, v in bfloat16 / float16 / float32): cache
        row x of sequence i, kv head h stands for x * descale[i, h]; shapes (), (1, 1),
        (batch, 1), (1, heads_kv) or (batch, heads_kv) (None: 1.0, as FlashAttention
        3). New tokens are quantised into the cache as x * (1 / descale) rounded to the
        cache's dtype (after rotary). Decoding blocks are read from the float8 cache
        by the kernels themselves (GPU: <= 64 query rows per kv head, bfloat16 /
        float16 q, head dims multiples of 16; CPU: <= 32 rows; docs/api.md);
        elsewhere the exact fallback: the new rows scattered and each sequence's rows
        gathered and dequantised in JAX, then flash_attention's kernels of q's dtype.
      q_descale, out_dtype: float8 q (the caches' float8 dtype, FlashAttention 3's
        fp8 call): q_descale per (batch, kv head) of the shapes above (q's heads use
        their kv head's), out in out_dtype (bfloat16 by default, the compute dtype);
        new tokens k, v then come in the caches' float8 dtype too and are appended as
        they are (without rotary), or in out_dtype and are quantised.
      implementation: as in `flash_attention` ("xla": the new rows scattered into the
        caches and each sequence's rows gathered, in JAX).

    Returns:
      out [, lse] when k, v are None; out [, lse], k_cache, v_cache (the caches
      with the new rows written) when they are given. Under
      ``jax.jit(..., donate_argnums=...)`` with the caches donated the update
      happens in place; without donation XLA copies the caches.

    Inconsistent metadata is clamped, never trusted: cache_seqlens and
    cache_leftpad to [0, capacity] (capacity: seqlen_cache, or max_pages *
    page_size), new rows past the capacity, batch indices or pages outside the
    cache are not written (and such keys read a clamped row, unspecified), a
    sequence's keys are at most the capacity's. Not differentiable: gradients
    raise a TypeError.
    """
    if _fp8.is_fp8(q):  # the exact fallback: q dequantised, out in the compute dtype
        q = _fp8_query(q, k_cache, q_descale, out_dtype)
    else:
        _fp8.check_no_fp8_options(q, out_dtype, {"q_descale": q_descale})
    (rotary_interleaved, return_lse, num_splits), metadata = _check(
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        rotary_cos, rotary_sin, rotary_interleaved, num_splits, return_lse)
    cache_seqlens, cache_batch_idx, cache_leftpad, page_table = (
        metadata[name] for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad",
                                    "page_table"))
    terms = _score_terms(q, k_cache, page_table, bias, mask, alibi_slopes)
    descales = _fp8_descales(q, k_cache, k_descale, v_descale)
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap, False,
                              implementation, return_lse)
    static_seqlens = None
    if _checks.is_int(cache_seqlens):
        static_seqlens = int(cache_seqlens)
        cache_seqlens = jnp.full((q.shape[0],), cache_seqlens, jnp.int32)
    return _inference_only(
        functools.partial(_kvcache, cfg, rotary_interleaved,
                          dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, implementation=implementation),
                          num_splits, return_lse, static_seqlens),
        q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
        rotary_cos, rotary_sin, sinks, terms, descales)


def _fp8_query(q, k_cache, q_descale, out_dtype):
    """A float8 q over float8 caches, dequantised (x * q_descale in float32, rounded to
    out_dtype) with a derivative that raises."""
    if k_cache.dtype != q.dtype:
        raise TypeError(f"a float8 q needs float8 caches of its dtype {q.dtype}, got k_cache "
                        f"{k_cache.dtype}")
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 (batch, seqlen_q, heads_q, head_dim), got shape "
                         f"{q.shape}")
    return _fp8.dequantize_query(q, q_descale, q.shape[0], k_cache.shape[2],
                                 _fp8.out_dtype_of(out_dtype))


def _fp8_descales(q, k_cache, k_descale, v_descale):
    """(k_descale, v_descale) as (batch, heads_kv) float32 for float8 caches; None for
    others (which take no descales)."""
    if not _fp8.is_fp8(k_cache):
        for name, value in (("k_descale", k_descale), ("v_descale", v_descale)):
            if value is not None:
                raise ValueError(f"{name} is for float8 caches; got a {k_cache.dtype} k_cache")
        return None
    batch, heads_kv = q.shape[0], k_cache.shape[2]
    return (_fp8.descale_of("k_descale", k_descale, batch, heads_kv),
            _fp8.descale_of("v_descale", v_descale, batch, heads_kv))


def _kvcache(cfg, rotary_interleaved, options, num_splits, return_lse, static_seqlens, q,
             k_cache, v_cache, k, v, seqlens, cache_batch_idx, cache_leftpad, page_table,
             rotary_cos, rotary_sin, sinks, terms, descales):
    """options: flash_attention's keyword arguments (the prefill and "xla" routes);
    terms: the present score terms (bias, mask over logical cache positions);
    descales: float8 caches' (k_descale, v_descale), else None."""
    per_row_positions = cfg.window.masked  # causal or windowed
    batch, seqlen_q, heads_q, _ = q.shape
    capacity = cache_capacity(k_cache, page_table)
    if rotary_cos is not None:  # at cache rows, as FlashAttention (leftpad included)
        first_position = jnp.clip(seqlens, 0, capacity)[:, None]
        rows_q = jnp.arange(seqlen_q, dtype=jnp.int32)[None, :]
        q = apply_rotary(q, rotary_cos, rotary_sin,
                         first_position + (rows_q if per_row_positions else 0 * rows_q),
                         rotary_interleaved)
        if k is not None:
            k = apply_rotary(k, rotary_cos, rotary_sin,
                             first_position + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :],
                             rotary_interleaved)

    call = _KvcacheCall(cfg, cache_leftpad, cache_batch_idx, page_table,
                        None if sinks is None else jnp.broadcast_to(sinks, (batch, heads_q)))
    kv_heads = k_cache.shape[2]
    options = dict(options, sinks=sinks, **terms)
    on_cpu = on_cuda = functools.partial(_attend_in_kernel, call, num_splits)
    dense = functools.partial(_prefill_dense, call, static_seqlens, options)
    if q.dtype != jnp.float32 and seqlen_q * (heads_q // kv_heads) > SPLIT_KV_MAX_ROWS:
        # Prefill: the dense kernels on the GPU (the split-KV kernel is for short blocks).
        on_cuda = dense
    in_jax = functools.partial(_kvcache_in_jax, call, static_seqlens, options)
    if terms:  # the KV-cache target takes none: flash_attention over the cache
        on_cpu = on_cuda = dense
    if descales is not None:
        # Float8 caches: decoding blocks are read by the kernels themselves (the GPU's
        # split-KV kernel, the CPU's decode path); the rest (prefill blocks, score
        # terms, float8 new rows, ...) take the exact fallback, which dequantises the
        # sequences' rows in JAX.
        fallback = functools.partial(_fp8_cache, call, static_seqlens, options, descales)
        in_kernel = functools.partial(_attend_in_kernel, call.with_descales(*descales),
                                      num_splits)
        rows = seqlen_q * (heads_q // kv_heads)
        new_rows_as_q = k is None or k.dtype == q.dtype
        on_cuda = (in_kernel if on_cuda is not dense and new_rows_as_q
                   and _split_kv_reads_fp8(cfg, q, v_cache) else fallback)
        on_cpu = (in_kernel if not terms and new_rows_as_q and rows <= CPU_DECODE_MAX_ROWS
                  else fallback)
        in_jax = functools.partial(_fp8_cache, call, static_seqlens,
                                   dict(options, implementation="xla"), descales)
    out, lse, k_cache, v_cache = _route.run(cfg, (q, k_cache, v_cache, k, v, seqlens),
                                            cuda=on_cuda, cpu=on_cpu, xla=in_jax,
                                            arrays=(q, k_cache))
    outputs = (out, lse) if return_lse else (out,)
    if k is not None:
        outputs = (*outputs, k_cache, v_cache)
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


# The split-KV kernels' shape (csrc/cuda/kvcache/): 16 packed query rows per CTA over
# caches of q's dtype, 8 over float8 caches (split_kv_float8.cuh: keys as the mma's rows),
# 64-key tiles in a 3-stage pipeline; packed rows past SPLIT_KV_MAX_ROWS attend on the
# dense kernels.
SPLIT_KV_ROWS = 16
SPLIT_KV_FP8_ROWS = 8
SPLIT_KV_FP8_MAX_CTAS_PER_SM = 4  # the float8 kernel's launch bounds (registers) at d <= 128
SPLIT_KV_KEYS = 64
SPLIT_KV_STAGES = 3
SPLIT_KV_HEAD_DIMS = (64, 128, 256)  # the kernel's head-dim buckets
SPLIT_KV_FP8_DIM_MULTIPLE = 16  # float8 rows load in 16-byte chunks
SPLIT_KV_MAX_ROWS = 64
MAX_SPLITS = 128
CPU_DECODE_MAX_ROWS = 32  # csrc/cpu/attention_cpu.h kKvcacheDecodeMaxRows: more, dense forward
MIN_TILES_PER_SPLIT = 2    # each split streams at least this many key tiles
SHARED_MEMORY_PER_SM = 227 * 1024  # Hopper (an A100's 163 KB gives fewer resident CTAs)
DEFAULT_MULTIPROCESSORS = 132


@functools.cache
def _multiprocessors() -> int:
    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", DEFAULT_MULTIPROCESSORS))
    except RuntimeError:  # no GPU: the CPU path ignores splits
        return DEFAULT_MULTIPROCESSORS


def _split_kv_rows(cache_bytes: int) -> int:
    """Packed query rows per CTA of the split-KV kernel of caches of cache_bytes elements."""
    return SPLIT_KV_FP8_ROWS if cache_bytes == 1 else SPLIT_KV_ROWS


def _resident_ctas_per_sm(head_dim: int, cache_bytes: int = 2) -> int:
    """As SplitSmem / Float8Smem (csrc/cuda/kvcache/): a 16-bit query tile and the stages
    of cache elements; float8 caches also the query rows' float32 score scales, and at
    most SPLIT_KV_FP8_MAX_CTAS_PER_SM (registers)."""
    bucket = next((b for b in SPLIT_KV_HEAD_DIMS if head_dim <= b), SPLIT_KV_HEAD_DIMS[-1])
    rows = _split_kv_rows(cache_bytes)
    smem = 2 * bucket * rows + cache_bytes * bucket * SPLIT_KV_STAGES * 2 * SPLIT_KV_KEYS
    if cache_bytes == 1:
        smem += 4 * rows
        return max(1, min(SHARED_MEMORY_PER_SM // smem, SPLIT_KV_FP8_MAX_CTAS_PER_SM))
    return max(1, SHARED_MEMORY_PER_SM // smem)


def _split_kv_reads_fp8(cfg, q, v_cache) -> bool:
    """Whether the split-KV kernel can read a decoding block's float8 cache itself
    (dequantising on chip): float16 / bfloat16 q, head dims multiples of 16 of its
    buckets, and the kernel not excluded by implementation="cuda:simt"."""
    dims = (q.shape[3], v_cache.shape[3])
    return (q.dtype in (jnp.bfloat16, jnp.float16)
            and all(d % SPLIT_KV_FP8_DIM_MULTIPLE == 0 and d <= SPLIT_KV_HEAD_DIMS[-1]
                    for d in dims)
            and cfg.kernel_cap != _route.IMPLEMENTATIONS["cuda:simt"][1])


def split_count(batch: int, kv_heads: int, packed_rows: int, capacity: int, head_dim: int,
                num_splits: int = 0, cache_bytes: int = 2) -> int:
    """Splits of each sequence's keys: num_splits when given, else as many as one wave of
    resident CTAs holds (batch x kv heads x row tiles x splits <= the GPU's resident
    CTAs: a second, partial wave would leave most SMs idle), each split keeping
    MIN_TILES_PER_SPLIT key tiles of the capacity."""
    if num_splits:
        return min(num_splits, MAX_SPLITS)
    ctas = batch * kv_heads * -(-packed_rows // _split_kv_rows(cache_bytes))
    resident = _resident_ctas_per_sm(head_dim, cache_bytes) * _multiprocessors()
    tiles = -(-capacity // SPLIT_KV_KEYS)
    return max(1, min(resident // max(ctas, 1), tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


class _KvcacheCall:
    """The flashjax_kvcache FFI call of one flash_attention_with_kvcache: static
    attributes and the optional metadata inputs (sinks: a row per sequence)."""

    def __init__(self, cfg: Config, leftpad, batch_idx, page_table, sinks):
        self.cfg = cfg
        self.leftpad, self.batch_idx, self.page_table = leftpad, batch_idx, page_table
        self.optional = dict(cache_leftpad=leftpad, cache_batch_idx=batch_idx,
                             page_table=page_table, sinks=sinks)

    def with_descales(self, k_descale, v_descale) -> "_KvcacheCall":
        """This call over float8 caches read by the kernel: descales (batch, heads_kv)."""
        call = copy.copy(self)
        call.optional = dict(self.optional, k_descale=k_descale, v_descale=v_descale)
        return call

    def __call__(self, q, k_cache, v_cache, k, v, seqlens, splits):
        """(out, lse, k_cache, v_cache): k, v (None: nothing) appended, the caches
        aliased in place; q with no rows only appends."""
        batch, heads_kv, dim_v = q.shape[0], k_cache.shape[2], v_cache.shape[3]
        appends = k is not None
        if not appends:
            k = jnp.zeros((batch, 0, heads_kv, k_cache.shape[3]), q.dtype)
            v = jnp.zeros((batch, 0, heads_kv, dim_v), q.dtype)
        present, operands = KVCACHE.operands(dict(
            self.optional, q=q, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v,
            cache_seqlens=seqlens.astype(jnp.int32)))
        # A cache entry per sequence shards with the batch; a shared pool (pages, or
        # entries chosen by cache_batch_idx) stays whole (its own leading dim, c), and
        # batch shards only when the call does not write it.
        own_entries = (self.page_table is None and self.batch_idx is None
                       and k_cache.shape[0] == batch)
        dims = list(KVCACHE.operand_dims(present))
        if not own_entries:
            dims[1:3] = (d.replace("b", "c", 1) for d in dims[1:3])
        results = tuple(op.dims for op in KVCACHE.results) + (tuple(dims[1:3]) if appends else ())
        spec = _partitioning.CallSpec(
            KVCACHE.name, _ffi_calls.kvcache, (self.cfg, present, splits, appends), tuple(dims),
            results, q.shape[2] // heads_kv, heads_kv, fold_vmap=False,
            batch_shards=own_entries or not appends)
        _ffi.load()
        outs = _partitioning.partitioned(spec)(*operands)
        return (outs[0], outs[1]) + ((outs[3], outs[4]) if appends else (k_cache, v_cache))


def _attend_in_kernel(call, num_splits, q, k_cache, v_cache, k, v, seqlens):
    batch, seqlen_q, heads_q, _ = q.shape
    heads_kv = k_cache.shape[2]
    splits = split_count(batch, heads_kv, seqlen_q * (heads_q // heads_kv),
                         cache_capacity(k_cache, call.page_table),
                         max(q.shape[3], v_cache.shape[3]), num_splits, k_cache.dtype.itemsize)
    return call(q, k_cache, v_cache, k, v, seqlens, splits)


def _prefill_dense(call, static_seqlens, options, q, k_cache, v_cache, k, v, seqlens):
    """The FFI call appends (q without rows), then flash_attention reads the caches."""
    if k is not None:
        _, _, k_cache, v_cache = call(q[:, :0], k_cache, v_cache, k, v, seqlens, 1)
    return _attend_dense(call, static_seqlens, options, q, k_cache, v_cache,
                         0 if k is None else k.shape[1], seqlens)


def _append_in_jax(call, k_cache, v_cache, k, v, seqlens):
    """The caches with the new rows k, v (already in the caches' dtype) scattered in
    (rows outside the capacity, entries or pages outside the cache dropped)."""
    capacity = cache_capacity(k_cache, call.page_table)
    logical = (jnp.clip(seqlens, 0, capacity)[:, None]
               + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :])
    slot, row, valid = cache_rows(logical, k_cache, call.page_table, call.batch_idx)
    slot = jnp.where(valid, slot, k_cache.shape[0])  # past the end: dropped
    return (k_cache.at[slot, row].set(k, mode="drop"),
            v_cache.at[slot, row].set(v, mode="drop"))


def _kvcache_in_jax(call, static_seqlens, options, q, k_cache, v_cache, k, v, seqlens):
    """The whole call in JAX (implementation="xla"): the new rows scattered into the
    caches, then the pure-JAX attention over each sequence's rows."""
    if k is not None:
        k_cache, v_cache = _append_in_jax(call, k_cache, v_cache, k.astype(k_cache.dtype),
                                          v.astype(v_cache.dtype), seqlens)
    options = dict(options, implementation="xla")
    return _attend_dense(call, static_seqlens, options, q, k_cache, v_cache,
                         0 if k is None else k.shape[1], seqlens)


def _fp8_cache(call, static_seqlens, options, descales, q, k_cache, v_cache, k, v, seqlens):
    """Float8 caches, the exact fallback: new rows quantised (x * (1 / descale) rounded
    to the cache's dtype) and scattered in JAX, each sequence's rows dequantised
    (x * descale in float32, rounded to q's dtype) and attended by flash_attention as
    `options` say."""
    k_descale, v_descale = descales
    if k is not None:  # (new rows already in the cache's float8 dtype: as they are)
        quantize = lambda x, d: x if x.dtype == k_cache.dtype else (
            x.astype(jnp.float32) * _fp8.per_row(1.0 / d)).astype(k_cache.dtype)
        k_cache, v_cache = _append_in_jax(call, k_cache, v_cache, quantize(k, k_descale),
                                          quantize(v, v_descale), seqlens)
    dequantize = lambda keys, values: (_fp8.dequantize(keys, k_descale, q.dtype),
                                       _fp8.dequantize(values, v_descale, q.dtype))
    return _attend_dense(call, static_seqlens, options, q, k_cache, v_cache,
                         0 if k is None else k.shape[1], seqlens, dequantize)


def _attend_dense(call, static_seqlens, options, q, k_cache, v_cache, new_rows, seqlens,
                  dequantize=None):
    """(out, lse, k_cache, v_cache) of flash_attention over the caches (the new rows
    already in): in place when the cache is contiguous with one entry per sequence and
    no leftpad (its first rows only, and no seqused_k, when cache_seqlens was a Python
    int: the dense kernels' uniform path), else each sequence's rows gathered. A bias
    or mask in `options` (over logical cache positions) follows the keys; dequantize
    (float8 caches) maps the sequences' keys and values (batch, rows, heads_kv, dim)
    to q's dtype."""
    options = dict(options)
    terms = {name: options.pop(name) for name in ("bias", "mask") if name in options}
    batch = q.shape[0]
    capacity = cache_capacity(k_cache, call.page_table)
    end = jnp.minimum(jnp.clip(seqlens, 0, capacity) + new_rows, capacity)
    in_place = (call.page_table is None and call.batch_idx is None and call.leftpad is None
                and k_cache.shape[0] == batch)
    used_rows = None if static_seqlens is None else \
        min(min(max(static_seqlens, 0), capacity) + new_rows, capacity)
    if in_place and used_rows:
        keys, values, used = k_cache[:, :used_rows], v_cache[:, :used_rows], None
        terms = _terms_on_keys(terms, None, used_rows)
    elif in_place:
        keys, values, used = k_cache, v_cache, end
    else:
        start = _first_key_rows(call.leftpad, batch, capacity)
        logical = start[:, None] + jnp.arange(capacity, dtype=jnp.int32)[None, :]
        keys, values = (gather_rows(c, logical, call.page_table, call.batch_idx)
                        for c in (k_cache, v_cache))
        used = jnp.maximum(end - start, 0)
        if call.page_table is None and call.batch_idx is not None:  # outside: no keys
            used = jnp.where((call.batch_idx >= 0) & (call.batch_idx < k_cache.shape[0]), used, 0)
        terms = _terms_on_keys(terms, None if call.leftpad is None else start, capacity)
    if dequantize is not None:
        keys, values = dequantize(keys, values)
    out, lse = flash_attention(q, keys, values, return_lse=True,
                               seqused_k=None if used is None else used.astype(jnp.int32),
                               **options, **terms)
    return out, lse, k_cache, v_cache
