"""KV-cache test cases and their float64 reference, assembled from the cache by hand
(NumPy: rows located one by one, rotary in float64, the append done row by row, then
flashjax.reference.attention per sequence). Shared by the CPU and GPU tests."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import flashjax
from helpers import jitted_reference


@dataclasses.dataclass(frozen=True)
class KVCase:
    batch: int = 3
    seqlen_q: int = 1
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int = 32
    seqlens: tuple = (5, 0, 17)        # cache_seqlens
    capacity: int = 24                 # seqlen_cache, or max_pages * page_size
    seqlen_new: int = 0
    page_size: int = 0                 # 0: contiguous
    num_pages: int = 0                 # paged: pages in the pool
    batch_cache: int = 0               # cache sequences (contiguous entries / page-table
                                       # rows; 0: the batch), chosen by cache_batch_idx
    batch_idx: bool = True             # with batch_cache: pass cache_batch_idx (else
                                       # sequence i uses entry / row i)
    leftpad: tuple = ()
    rotary_dim: int = 0
    interleaved: bool = True
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    dtype: str = "float32"
    poison: bool = False               # NaN in every cache row no sequence reads

    def __str__(self):
        parts = [f"b{self.batch}", f"sq{self.seqlen_q}", f"h{self.heads_q}/{self.heads_kv}",
                 f"d{self.head_dim}", f"cache{'-'.join(map(str, self.seqlens))}/{self.capacity}",
                 f"new{self.seqlen_new}"]
        if self.page_size:
            parts.append(f"page{self.page_size}")
        if self.batch_cache:
            parts.append(f"{'bidx' if self.batch_idx else 'entries'}{self.batch_cache}")
        if self.leftpad:
            parts.append("leftpad")
        if self.rotary_dim:
            parts.append(f"rot{self.rotary_dim}{'i' if self.interleaved else 'n'}")
        for flag in ("causal", "sinks"):
            if getattr(self, flag):
                parts.append(flag)
        if self.window_size != (-1, -1):
            parts.append(f"w{self.window_size[0]}_{self.window_size[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        return "-".join(parts + [self.dtype])


# Arrays up to this many elements are drawn by numpy (no compilation per shape); larger
# ones (the FA3 grid's 128k-key pools: a minute and gigabytes of host memory by numpy)
# by jax.random.
NUMPY_DRAWS = 1 << 24


def make_inputs(case: KVCase, seed=0):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(case.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 8))

    def normal(*shape):
        if math.prod(shape) > NUMPY_DRAWS:  # by jax.random on the default device
            return jax.random.normal(next(keys), shape, dt)
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dt)
    hkv, d, dv = case.heads_kv, case.head_dim, case.head_dim_v
    sequences = case.batch_cache or case.batch  # cache entries / page-table rows
    if case.page_size:
        pages_per_seq = case.capacity // case.page_size
        k_cache = normal(case.num_pages, case.page_size, hkv, d)
        v_cache = normal(case.num_pages, case.page_size, hkv, dv)
        table = rng.permutation(case.num_pages)[:sequences * pages_per_seq]
        extra = dict(page_table=jnp.asarray(table.reshape(sequences, pages_per_seq), jnp.int32))
    else:
        k_cache = normal(sequences, case.capacity, hkv, d)
        v_cache = normal(sequences, case.capacity, hkv, dv)
        extra = {}
    if case.batch_cache and case.batch_idx:
        extra["cache_batch_idx"] = jnp.asarray(
            rng.permutation(case.batch_cache)[:case.batch], jnp.int32)
    if case.leftpad:
        extra["cache_leftpad"] = jnp.asarray(case.leftpad, jnp.int32)
    if case.rotary_dim:
        angles = rng.uniform(0, 2 * np.pi, (case.capacity + case.seqlen_q, case.rotary_dim // 2))
        extra["rotary_cos"] = jnp.asarray(np.cos(angles), jnp.float32)
        extra["rotary_sin"] = jnp.asarray(np.sin(angles), jnp.float32)
        extra["rotary_interleaved"] = case.interleaved
    if case.sinks:
        extra["sinks"] = jnp.asarray(rng.standard_normal(case.heads_q), jnp.float32)
    new = {}
    if case.seqlen_new:
        new = dict(k=normal(case.batch, case.seqlen_new, hkv, d),
                   v=normal(case.batch, case.seqlen_new, hkv, dv))
    q = normal(case.batch, case.seqlen_q, case.heads_q, d)
    if case.poison:
        k_cache, v_cache = poison_unread_rows(case, k_cache, v_cache, extra)
    return q, k_cache, v_cache, new, extra


def cache_location(case: KVCase, extra, i, r):
    """(slot, row) of logical row r (an int or an integer array) of sequence i: sequence
    i is cache entry / page-table row cache_batch_idx[i] (default i), as FlashAttention
    addresses caches. Vectorised: a 128k-row cache is one numpy gather, not a Python
    loop of jax indexing."""
    entry = int(extra["cache_batch_idx"][i]) if "cache_batch_idx" in extra else i
    if case.page_size:
        table = np.asarray(extra["page_table"])
        return table[entry, np.asarray(r) // case.page_size], np.asarray(r) % case.page_size
    return entry, r


def read_rows(case: KVCase, i: int) -> np.ndarray:
    """The logical cache rows sequence i attends to: [leftpad, seqlen + new) within capacity."""
    left = case.leftpad[i] if case.leftpad else 0
    return np.arange(left, min(case.seqlens[i] + case.seqlen_new, case.capacity))


def poison_unread_rows(case: KVCase, k_cache, v_cache, extra):
    """NaN in every cache row outside each sequence's keys [leftpad, seqlen + new)."""
    read = np.zeros(k_cache.shape[:2], bool)
    for i in range(case.batch):
        read[cache_location(case, extra, i, read_rows(case, i))] = True
    mask = jnp.asarray(read)[:, :, None, None]
    return (jnp.where(mask, k_cache, jnp.nan).astype(k_cache.dtype),
            jnp.where(mask, v_cache, jnp.nan).astype(v_cache.dtype))


def rotary_np(x, cos, sin, positions, interleaved):
    """x (rows, heads, dim) float64; positions (rows,)."""
    half = cos.shape[1]
    c = cos[np.clip(positions, 0, cos.shape[0] - 1)][:, None, :]
    s = sin[np.clip(positions, 0, cos.shape[0] - 1)][:, None, :]
    out = x.copy()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = a * c - b * s, a * s + b * c
    return out


def logical_terms(case: KVCase, terms, i, left, end):
    """Sequence i's score terms at its keys, logical cache positions [left, end), for the
    reference, padded to the capacity (one shape for every sequence and term): a float64
    bias (1, heads_q, seqlen_q, capacity), the given one plus ALiBi written out,
    -slope * |(end - seqlen_q + r) - p| for query r and position p, and a bool mask of
    the same shape (True where none is given, False past the keys)."""
    shape, n = (case.heads_q, case.seqlen_q, case.capacity), end - left
    bias, mask = np.zeros(shape), np.zeros(shape, bool)
    mask[..., :n] = True
    for name, full in (("bias", bias), ("mask", mask)):
        if terms.get(name) is not None:
            x = np.asarray(terms[name])[min(i, terms[name].shape[0] - 1)]
            x = np.repeat(x, case.heads_q // x.shape[0], axis=0)  # 1 or heads_kv heads
            full[..., :n] = x[..., left:end]
    if terms.get("alibi_slopes") is not None:
        slopes = np.broadcast_to(np.asarray(terms["alibi_slopes"], np.float64),
                                 (case.batch, case.heads_q))[i]
        rows = end - case.seqlen_q + np.arange(case.seqlen_q)
        distance = np.abs(rows[:, None] - np.arange(left, end)[None, :])
        bias[..., :n] -= slopes[:, None, None] * distance[None]
    return dict(bias=bias[None], mask=mask[None])


def expected(case: KVCase, q, k_cache, v_cache, new, extra, terms=None):
    """(out, lse, k_cache, v_cache) in float64, by hand (terms: bias, mask over logical
    cache positions, alibi_slopes; see logical_terms)."""
    f64 = lambda x: np.asarray(x).astype(np.float64)
    # the caches stay in their own dtype (a 128k-key pool in float64 is gigabytes): the
    # appended rows are written rounded to it, as the cache stores them, and only the
    # rows a sequence reads are converted
    q, kc, vc = f64(q), np.array(k_cache), np.array(v_cache)
    kn = f64(new["k"]) if new else None
    vn = f64(new["v"]) if new else None
    rot = case.rotary_dim > 0
    cos = np.asarray(extra["rotary_cos"], np.float64) if rot else None
    sin = np.asarray(extra["rotary_sin"], np.float64) if rot else None
    outs, lses = [], []
    for i in range(case.batch):
        def loc(r, i=i):
            return cache_location(case, extra, i, r)
        seqlen = case.seqlens[i]
        left = case.leftpad[i] if case.leftpad else 0
        position = seqlen  # rotary at cache rows, as FlashAttention (leftpad included)
        for j in range(case.seqlen_new):
            r = seqlen + j
            if r >= case.capacity:
                continue
            kj = kn[i, j:j + 1]
            if rot:
                kj = rotary_np(kj, cos, sin, np.array([position + j]), case.interleaved)
            kc[loc(r)], vc[loc(r)] = kj[0], vn[i, j]
        end = min(seqlen + case.seqlen_new, case.capacity)
        key_rows = read_rows(case, i)
        keys, vals = ((f64(kc[loc(key_rows)]), f64(vc[loc(key_rows)])) if key_rows.size
                      else (None, None))
        qi = q[i]
        if rot:
            per_row = case.causal or case.window_size != (-1, -1)
            rows = position + (np.arange(case.seqlen_q) if per_row else 0 * np.arange(case.seqlen_q))
            qi = rotary_np(qi, cos, sin, rows, case.interleaved)
        if keys is None:  # no key: out 0, lse = the sink or -inf
            outs.append(np.zeros((case.seqlen_q, case.heads_q, case.head_dim_v)))
            sink = np.asarray(extra["sinks"], np.float64) if case.sinks else np.full(case.heads_q, -np.inf)
            lses.append(np.repeat(sink[:, None], case.seqlen_q, axis=1))
            continue
        # keys padded to the capacity (seqused_k): one reference shape, one compilation
        # for every sequence
        more = dict(logical_terms(case, terms, i, left, end) if terms is not None else {},
                    seqused_k=np.array([end - left], np.int32))
        pad = ((0, case.capacity - (end - left)), (0, 0), (0, 0))
        keys, vals = np.pad(keys, pad), np.pad(vals, pad)
        o, l = jitted_reference(
            qi[None], keys[None], vals[None], causal=case.causal, window_size=case.window_size,
            softcap=case.softcap, sinks=extra.get("sinks"), return_lse=True,
            compute_dtype=jnp.float64, **more)
        outs.append(np.asarray(o[0]))
        lses.append(np.asarray(l[0]))
    return np.stack(outs), np.stack(lses), kc, vc


def run(case: KVCase, int_seqlens: bool = False, terms=None, **options):
    """int_seqlens: cache_seqlens passed as a Python int (every sequence's the same);
    terms: bias / mask / alibi_slopes arrays."""
    q, k_cache, v_cache, new, extra = make_inputs(case)
    seqlens = jnp.asarray(case.seqlens, jnp.int32)
    if int_seqlens:
        assert len(set(case.seqlens)) == 1, case.seqlens
        seqlens = case.seqlens[0]
    # jitted, as decoding loops are (eagerly, each op of the call's set-up would compile
    # for every new shape): arrays as arguments, Python values static
    named = dict(cache_seqlens=seqlens, **new, **extra, **(terms or {}))
    arrays = {n: x for n, x in named.items() if isinstance(x, (jax.Array, np.ndarray))}
    static = {n: x for n, x in named.items() if n not in arrays}

    def call(q, k_cache, v_cache, arrays):
        return flashjax.flash_attention_with_kvcache(
            q, k_cache, v_cache, causal=case.causal, window_size=case.window_size,
            softcap=case.softcap, return_lse=True, **static, **arrays, **options)
    want = _expected(case) if terms is None else expected(case, q, k_cache, v_cache, new, extra,
                                                          terms)
    return jax.jit(call)(q, k_cache, v_cache, arrays), want


@functools.lru_cache(maxsize=16)
def _expected(case: KVCase):
    """expected() on the case's inputs, cached: each case runs on several implementations."""
    return expected(case, *make_inputs(case))


def check(case: KVCase, **options):
    """options: run's (int_seqlens, terms) and the call's keyword arguments."""
    result, (out, lse, kc, vc) = run(case, **options)
    tol = 2e-4 if case.dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(result[0], np.float64), out, rtol=tol, atol=tol,
                               err_msg=f"{case}: out")
    np.testing.assert_allclose(np.asarray(result[1], np.float64), lse, rtol=tol, atol=tol,
                               err_msg=f"{case}: lse")
    if case.seqlen_new:
        assert len(result) == 4
        for name, got, want in (("k_cache", result[2], kc), ("v_cache", result[3], vc)):
            check_cache(np.asarray(got), want, tol, f"{case}: {name}")
    else:
        assert len(result) == 2


def check_cache(got: np.ndarray, want: np.ndarray, tol: float, what: str):
    """A returned cache against expected()'s, both in the cache's dtype: bit-equal rows
    (untouched ones, NaN poison included) pass as they are; the elements that differ
    (appended rows rounded differently) within tol in float64."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    bits = np.dtype(f"u{got.dtype.itemsize}")
    differs = got.view(bits) != want.view(bits)
    np.testing.assert_allclose(got[differs].astype(np.float64), want[differs].astype(np.float64),
                               rtol=tol, atol=tol, err_msg=what)
