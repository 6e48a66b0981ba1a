"""float8 inputs for flash_attention, made from bfloat16 / float16 / float32 ones.

`quantize(x)` gives a float8 tensor and the float32 descale per (batch, kv head) that
flash_attention's `q_descale` / `k_descale` / `v_descale` take (x ~ x8 * descale, the
head's largest magnitude mapped to the float8 type's largest value).

`quantize_qkv(q, k, v, rotate=True)` also applies FlashAttention 3's "incoherent
processing" (its section 3.3): q and k are multiplied by one random orthogonal matrix M
(random signs, then a normalised Walsh-Hadamard transform over blocks of the head dim)
before they are quantised. Since (q M)(k M)^T = q k^T, the attention is unchanged in
exact arithmetic, while an outlier channel's magnitude is spread over its block, so a
head's scale no longer flattens its other channels. Keys kept for later calls (a KV
cache) must be rotated with the same `key`; v is never rotated.

    q8, k8, v8, descales = flashjax.fp8.quantize_qkv(q, k, v, rotate=True, key=key)
    out = flashjax.flash_attention(q8, k8, v8, causal=True, **descales)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ._fp8 import FP8_DTYPES, per_row

__all__ = ["hadamard_block", "quantize", "quantize_qkv", "rotate"]


def _check_float(name: str, x) -> None:
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"{name} must be (batch, seqlen, heads, head_dim), got shape "
                         f"{getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype in FP8_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("dtype", "heads_kv"))
def quantize(x, dtype=jnp.float8_e4m3fn, heads_kv: int | None = None):
    """(x8, descale): x (batch, seqlen, heads, head_dim) in float8 `dtype` and its float32
    descale (batch, heads_kv), one per kv head (heads_kv: default x's heads; for q, the
    call's kv heads: a descale covers its query-head group). x8 is jnp.asarray(x * (1 /
    descale), dtype) (clipped to the type's range), descale = the group's largest |x| /
    the type's largest value (1.0 for an all-zero group)."""
    _check_float("x", x)
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    batch, _, heads, _ = x.shape
    heads_kv = heads if heads_kv is None else heads_kv
    if heads_kv <= 0 or heads % heads_kv:
        raise ValueError(f"heads_kv must divide x's {heads} heads, got {heads_kv}")
    top = float(jnp.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    grouped = x32.reshape(batch, x.shape[1], heads_kv, heads // heads_kv, x.shape[3])
    amax = jnp.max(jnp.abs(grouped), axis=(1, 3, 4))  # (batch, heads_kv)
    descale = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    x8 = jnp.asarray(jnp.clip(x32 * per_row(1 / descale, heads // heads_kv), -top, top), dtype)
    return x8, descale


def hadamard_block(head_dim: int) -> int:
    """The Walsh-Hadamard block `rotate` uses: the largest power of two dividing
    head_dim, at most 128."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return min(head_dim & -head_dim, 128)


@jax.jit
def rotate(x, key=None):
    """x (..., head_dim) times the orthogonal M = diag(signs) H: random signs drawn from
    `key` (none without one), then the Walsh-Hadamard transform normalised by
    1/sqrt(block) over each block of hadamard_block(head_dim) channels. Computed in
    float32, returned in x's dtype; rotating q and k with the same key leaves q k^T as
    it was."""
    head_dim = x.shape[-1]
    block = hadamard_block(head_dim)
    y = x.astype(jnp.float32)
    if key is not None:
        y = y * jax.random.rademacher(key, (head_dim,), jnp.float32)
    lead = y.shape[:-1]
    y = y.reshape(*lead, head_dim // block, block)
    h = 1
    while h < block:  # butterflies: pairs (i, i + h) within groups of 2h channels
        y = y.reshape(*lead, head_dim // block, block // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    y = y.reshape(*lead, head_dim) * (1.0 / float(block) ** 0.5)
    return y.astype(x.dtype)


def quantize_qkv(q, k, v, dtype=jnp.float8_e4m3fn, *, rotate: bool = False, key=None):
    """(q8, k8, v8, descales) for flash_attention(q8, k8, v8, **descales): each quantised
    per (batch, kv head) by `quantize` (q over its query-head group); with `rotate`, q
    and k first multiplied by the same orthogonal M (`rotate`'s, random signs from
    `key`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
    heads_kv = k.shape[2]
    if rotate:
        q, k = _rotate(q, key), _rotate(k, key)
    q8, q_descale = quantize(q, dtype, heads_kv)
    k8, k_descale = quantize(k, dtype)
    v8, v_descale = quantize(v, dtype)
    return q8, k8, v8, dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


_rotate = rotate  # (quantize_qkv's `rotate` argument shadows the function)
