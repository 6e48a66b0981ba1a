"""float8 KV caches (issue 28 section 2) on flash_attention_with_kvcache: contiguous and
paged e4m3 / e5m2 caches with k_descale / v_descale per (sequence, kv head), new tokens
quantised into them (bit-exact to jnp.asarray(x * (1 / descale), cache dtype)), the
attention against the float64 reference of the dequantised cache (kvcache_helpers.py),
descale broadcasting and argument errors. Decoding blocks' float8 caches are read by the
kernels themselves: the CPU's decode path, and on a GPU the split-KV kernel (the `gpu`
tests below: every layout and option, forced splits, a 64k-key cache, the accuracy bound
against q's dtype); out-of-range new rows on both. Prefill blocks, score terms, float32
q on a GPU and "xla" take the exact fallback (gathered, dequantised rows on the kernels
of q's dtype)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from kvcache_helpers import KVCase, cache_location, expected, make_inputs

CASES = [
    (KVCase(seqlen_new=1, dtype="bfloat16"), "float8_e4m3fn"),
    (KVCase(page_size=4, num_pages=40, capacity=24, batch_cache=5, seqlens=(9, 2, 20),
            seqlen_new=2, seqlen_q=2, leftpad=(3, 0, 1), causal=True, sinks=True,
            dtype="bfloat16"), "float8_e4m3fn"),
    (KVCase(heads_q=8, heads_kv=2, seqlens=(23, 0, 12), seqlen_new=1, batch_cache=4,
            dtype="float16"), "float8_e5m2"),
    (KVCase(seqlens=(20, 3, 24), seqlen_new=2, causal=True, dtype="float32"), "float8_e4m3fn"),
]


def fp8_inputs(case: KVCase, cache_dtype: str, seed: int = 1):
    """The case's inputs with float8 caches and random descales: (q, k_cache, v_cache,
    new, extra, descales, the float64 dequantised caches as sequence i reads them)."""
    q, k_cache, v_cache, new, extra = make_inputs(case)
    rng = np.random.default_rng(seed)
    descales = {name: rng.uniform(0.25, 2.0, (case.batch, case.heads_kv)).astype(np.float32)
                for name in ("k_descale", "v_descale")}
    caches, dequantised = [], []
    for cache, name in ((k_cache, "k_descale"), (v_cache, "v_descale")):
        c8 = jnp.asarray(cache, jnp.float32).astype(cache_dtype)
        stored = np.asarray(c8.astype(jnp.float32), np.float64)
        deq = stored.copy()
        for i in range(case.batch):  # each sequence's rows at its own descales
            slot = cache_location(case, extra, i, np.arange(case.capacity))
            deq[slot] = stored[slot] * descales[name][i][:, None]
        caches.append(c8)
        dequantised.append(deq)
    return (q, *caches, new, extra, {n: jnp.asarray(d) for n, d in descales.items()},
            dequantised)


def quantised(x, descale, dtype):
    """New rows as the cache stores them: jnp.asarray(x * (1 / descale), dtype)."""
    return jnp.asarray(x.astype(jnp.float32) * (1 / descale)[:, None, :, None], dtype)


def call_case(case: KVCase, q, k_cache, v_cache, named: dict, **options):
    """The case's call with the keyword arguments `named` (arrays as the jitted
    function's arguments, Python values static) and `options`: ((out, lse, k_cache,
    v_cache), the lowered call)."""
    arrays = {n: x for n, x in named.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in named.items() if n not in arrays}
    call = jax.jit(lambda q, kc, vc, arrays: flashjax.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=jnp.asarray(case.seqlens, jnp.int32), causal=case.causal,
        window_size=case.window_size, softcap=case.softcap, return_lse=True, **static,
        **arrays, **options))
    return call(q, k_cache, v_cache, arrays), call.lower(q, k_cache, v_cache, arrays)


def run_fp8(case: KVCase, cache_dtype: str, **options):
    """The case's call on float8 caches (options: the call's keyword arguments), jitted:
    ((out, lse, k_cache, v_cache), inputs, the float64 (out, lse) of the dequantised
    inputs, the new rows as the cache stores them (name -> array), the lowered call)."""
    inputs = fp8_inputs(case, cache_dtype)
    q, k_cache, v_cache, new, extra, descales, (deq_k, deq_v) = inputs
    result, lowered = call_case(case, q, k_cache, v_cache, dict(new, **extra, **descales),
                                **options)
    # the new rows, quantised as the cache stores them, then read at the descales
    stored = {n: quantised(new[n], descales[f"{n}_descale"], cache_dtype) for n in new}
    back = {n: np.asarray(stored[n].astype(jnp.float32), np.float64)
            * np.asarray(descales[f"{n}_descale"], np.float64)[:, None, :, None]
            for n in stored}
    want_out, want_lse, _, _ = expected(case, q, deq_k, deq_v, back, extra)
    return result, inputs, (want_out, want_lse), stored, lowered


def kernel_reads_fp8(lowered) -> bool:
    """Whether the compiled call hands the float8 caches to the flashjax_kvcache kernel
    (rather than rows the fallback dequantised in JAX)."""
    return any("flashjax_kvcache" in line and "f8e" in line
               for line in lowered.compile().as_text().splitlines() if "custom-call" in line)


def assert_same_fp8(got, want_bytes, dtype, err_msg=""):
    """got holds want_bytes (uint8 of float8 dtype), bit for bit but for which NaN
    (e5m2 has several; XLA's CPU copies of a float8 array may change them)."""
    got_bytes = np.asarray(got).view(np.uint8)
    nan = np.isnan(got_bytes.view(dtype).astype(np.float32))
    np.testing.assert_array_equal(nan, np.isnan(want_bytes.view(dtype).astype(np.float32)),
                                  err_msg=err_msg)
    np.testing.assert_array_equal(np.where(nan, 0, got_bytes), np.where(nan, 0, want_bytes),
                                  err_msg=err_msg)


def check_fp8_cache(case: KVCase, cache_dtype: str, **options):
    """run_fp8, checked: out and lse against the float64 reference of the dequantised
    inputs, the appended rows bit-exact, every other cache row unchanged; returns
    run_fp8's result."""
    ran = run_fp8(case, cache_dtype, **options)
    (out, lse, kc, vc), (q, k_cache, v_cache, _, extra, _, _), (want_out, want_lse), stored, _ = ran
    assert out.dtype == q.dtype and kc.dtype == k_cache.dtype
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=3e-2, atol=3e-2)
    want_k, want_v = (np.array(c).view(np.uint8) for c in (k_cache, v_cache))
    for i in range(case.batch):
        for j in range(case.seqlen_new):
            r = case.seqlens[i] + j
            if r < case.capacity:
                slot = cache_location(case, extra, i, r)
                want_k[slot] = np.asarray(stored["k"][i, j]).view(np.uint8)
                want_v[slot] = np.asarray(stored["v"][i, j]).view(np.uint8)
    assert_same_fp8(kc, want_k, cache_dtype, "k_cache")
    assert_same_fp8(vc, want_v, cache_dtype, "v_cache")
    return ran


@pytest.mark.parametrize("case,cache_dtype", CASES, ids=[f"{c}-{d}" for c, d in CASES])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_fp8_cache(case, cache_dtype, implementation):
    """The kernels read these decoding blocks' float8 caches themselves (the CPU's
    decode path; the GPU's split-KV kernel under 16-bit q); "xla" takes the fallback."""
    *_, lowered = check_fp8_cache(case, cache_dtype, implementation=implementation)
    in_kernel = jax.default_backend() == "cpu" or case.dtype != "float32"
    assert kernel_reads_fp8(lowered) == (implementation is None and in_kernel)


def test_fp8_descales_broadcast():
    case = dataclasses.replace(CASES[0][0], seqlen_new=0)
    q, k_cache, v_cache, _, extra, descales, _ = fp8_inputs(case, "float8_e4m3fn")
    n = jnp.asarray(case.seqlens, jnp.int32)

    @jax.jit
    def attend(k_descale, v_descale):
        return flashjax.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=n,
                                                     k_descale=k_descale, v_descale=v_descale)
    full = lambda x: jnp.broadcast_to(x, (case.batch, case.heads_kv)).astype(jnp.float32)
    scale = jnp.asarray(0.75, jnp.float32)
    rows, heads = descales["k_descale"][:, :1], descales["k_descale"][:1, :]
    for k_descale in (scale, scale.reshape(1, 1), rows, heads):
        np.testing.assert_array_equal(np.asarray(attend(k_descale, scale)),
                                      np.asarray(attend(full(k_descale), full(scale))))
    ones = jnp.ones((case.batch, case.heads_kv), jnp.float32)
    np.testing.assert_array_equal(  # no descales: 1.0, as FlashAttention 3
        np.asarray(flashjax.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=n)),
        np.asarray(attend(ones, ones)))


def test_fp8_cache_errors():
    case = CASES[0][0]
    q, k_cache, v_cache, new, _, descales, _ = fp8_inputs(case, "float8_e4m3fn")
    call = flashjax.flash_attention_with_kvcache
    n = jnp.asarray(case.seqlens, jnp.int32)
    with pytest.raises(TypeError, match="k_cache and v_cache of one float8 dtype"):
        call(q, k_cache, v_cache.astype(jnp.float8_e5m2), cache_seqlens=n)
    with pytest.raises(ValueError, match="k_descale must have shape"):
        call(q, k_cache, v_cache, cache_seqlens=n, k_descale=jnp.ones((2, 3), jnp.float32))
    with pytest.raises(TypeError, match="v_descale must be float32"):
        call(q, k_cache, v_cache, cache_seqlens=n, v_descale=jnp.ones((), jnp.bfloat16))
    with pytest.raises(TypeError, match="k must have q's dtype"):
        call(q, k_cache, v_cache, new["k"].astype(jnp.float16), new["v"], cache_seqlens=n)
    bf16_cache = k_cache.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="k_descale is for float8 caches"):
        call(q, bf16_cache, bf16_cache, cache_seqlens=n, k_descale=descales["k_descale"])


def test_fp8_paged_caches_in_continuous_batching():
    """flash_attention_varlen with page_table= and float8 caches: the call on bf16 caches
    holding each sequence's pages dequantised at its descales, bit for bit."""
    rng = np.random.default_rng(3)
    sequences, page, pages, heads, heads_kv, dim = 3, 4, 12, 4, 2, 32
    table = jnp.asarray(rng.permutation(pages).reshape(sequences, 4), jnp.int32)
    k8, v8 = (jnp.asarray(rng.standard_normal((pages, page, heads_kv, dim)), jnp.float8_e4m3fn)
              for _ in range(2))
    descales = [jnp.asarray(rng.uniform(0.5, 2.0, (sequences, heads_kv)), jnp.float32)
                for _ in range(2)]
    owner = np.zeros(pages, np.int32)
    owner[np.asarray(table).ravel()] = np.repeat(np.arange(sequences), 4)
    k16, v16 = ((c.astype(jnp.float32) * d[owner][:, None, :, None]).astype(jnp.bfloat16)
                for c, d in zip((k8, v8), descales))
    cu_q = jnp.asarray([0, 1, 3, 7], jnp.int32)
    q = jnp.asarray(rng.standard_normal((7, heads, dim)), jnp.bfloat16)
    used = jnp.asarray([5, 16, 9], jnp.int32)
    call = lambda k, v, q=q, **kw: flashjax.flash_attention_varlen(
        q, k, v, cu_q, None, 4, 16, seqused_k=used, page_table=table, causal=True, **kw)
    got = call(k8, v8, k_descale=descales[0], v_descale=descales[1])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(call(k16, v16)))
    # float8 q too: each row at its sequence's q_descale (rows 0 | 1-2 | 3-6)
    q8 = q.astype(jnp.float8_e4m3fn)
    q_descale = jnp.asarray(rng.uniform(0.5, 2.0, (sequences, heads_kv)), jnp.float32)
    rows = np.repeat(np.arange(sequences), np.diff(np.asarray(cu_q)))
    q16 = (q8.astype(jnp.float32) * jnp.repeat(q_descale, heads // heads_kv, axis=1)[rows][:, :, None]
           ).astype(jnp.bfloat16)
    got = call(k8, v8, q=q8, q_descale=q_descale, k_descale=descales[0], v_descale=descales[1])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(call(k16, v16, q=q16)))
    with pytest.raises(ValueError, match="k_descale is for float8 paged caches"):
        call(k16, v16, k_descale=descales[0])


def test_fp8_query_with_fp8_new_tokens():
    """FlashAttention 3's fp8 call: float8 q (q_descale per (batch, kv head)) over float8
    caches, new tokens in the caches' dtype appended as they are (bit for bit), out in
    out_dtype, against the float64 reference of the dequantised inputs."""
    case = CASES[1][0]  # paged, leftpad, causal, sinks, two new tokens
    q, k_cache, v_cache, new, extra, descales, (deq_k, deq_v) = fp8_inputs(case, "float8_e4m3fn")
    rng = np.random.default_rng(5)
    q8 = q.astype(jnp.float8_e4m3fn)
    q_descale = jnp.asarray(rng.uniform(0.25, 2.0, (case.batch, case.heads_kv)), jnp.float32)
    new8 = {n: x.astype(jnp.float8_e4m3fn) for n, x in new.items()}
    out, lse, kc, vc = flashjax.flash_attention_with_kvcache(
        q8, k_cache, v_cache, **new8, **extra, **descales, q_descale=q_descale,
        cache_seqlens=jnp.asarray(case.seqlens, jnp.int32), causal=case.causal, return_lse=True,
        out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    group = case.heads_q // case.heads_kv
    q_deq = (np.asarray(q8.astype(jnp.float32), np.float64)
             * np.repeat(np.asarray(q_descale, np.float64), group, axis=1)[:, None, :, None])
    back = {n: np.asarray(new8[n].astype(jnp.float32), np.float64)
            * np.asarray(descales[f"{n}_descale"], np.float64)[:, None, :, None] for n in ("k", "v")}
    want_out, want_lse, _, _ = expected(case, jnp.asarray(q_deq, jnp.float32), deq_k, deq_v, back,
                                        extra)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=1e-4, atol=1e-4)
    for got, cache, name in ((kc, k_cache, "k"), (vc, v_cache, "v")):
        want = np.array(cache).view(np.uint8)
        for i in range(case.batch):
            for j in range(case.seqlen_new):
                r = case.seqlens[i] + j
                if r < case.capacity:
                    want[cache_location(case, extra, i, r)] = np.asarray(new8[name][i, j]).view(np.uint8)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want)


def test_fp8_query_errors():
    case = CASES[0][0]
    q, k_cache, v_cache, new, extra, descales, _ = fp8_inputs(case, "float8_e4m3fn")
    n = jnp.asarray(case.seqlens, jnp.int32)
    call = lambda q, k_cache, **kw: flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache if k_cache.dtype == v_cache.dtype else k_cache, cache_seqlens=n, **kw)
    with pytest.raises(TypeError, match="a float8 q needs float8 caches of its dtype"):
        call(q.astype(jnp.float8_e4m3fn), k_cache.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="q_descale is for float8"):
        call(q, k_cache, q_descale=jnp.ones((), jnp.float32), **descales)
    with pytest.raises(TypeError, match="must have q's dtype"):
        call(q, k_cache, k=new["k"].astype(jnp.float8_e5m2), v=new["v"].astype(jnp.float8_e5m2))


# The split-KV kernel's float8 path (tests/test_gpu_kvcache.py has the same layouts in
# q's dtype); head dims that are not multiples of 16 take the fallback.
D128 = dict(head_dim=128, head_dim_v=128)
GPU_CASES = [
    (KVCase(batch=2, heads_q=32, heads_kv=8, seqlens=(700, 1000), capacity=1024, seqlen_new=1,
            causal=True, dtype="bfloat16", **D128), "float8_e4m3fn"),
    (KVCase(seqlen_q=3, heads_q=8, heads_kv=1, seqlens=(300, 5, 509), capacity=512, seqlen_new=3,
            causal=True, dtype="float16", head_dim=64, head_dim_v=64), "float8_e5m2"),
    (KVCase(page_size=16, num_pages=110, capacity=512, seqlens=(400, 17, 0), seqlen_new=2,
            window_size=(100, 0), sinks=True, dtype="bfloat16", **D128), "float8_e4m3fn"),
    (KVCase(page_size=64, num_pages=40, capacity=640, seqlens=(600, 64, 1), seqlen_new=1,
            leftpad=(70, 0, 0), softcap=10.0, dtype="bfloat16", poison=True, head_dim=256,
            head_dim_v=256), "float8_e4m3fn"),
    (KVCase(batch_cache=5, capacity=300, seqlens=(250, 0, 299), seqlen_new=2, leftpad=(5, 0, 100),
            sinks=True, causal=True, dtype="bfloat16", poison=True, **D128), "float8_e5m2"),
    (KVCase(heads_q=4, heads_kv=4, head_dim=96, head_dim_v=64, capacity=256,
            seqlens=(255, 7, 128), seqlen_new=1, dtype="float16"), "float8_e4m3fn"),
    (KVCase(heads_q=6, heads_kv=2, head_dim=40, head_dim_v=40, capacity=200,
            seqlens=(150, 3, 199), seqlen_new=1, dtype="bfloat16"), "float8_e4m3fn"),  # fallback
]


def frobenius_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.gpu
@pytest.mark.parametrize("case,cache_dtype", GPU_CASES, ids=[f"{c}-{d}" for c, d in GPU_CASES])
def test_gpu_fp8_cache_kernel(case, cache_dtype):
    """The kernel's answer and appended rows (check_fp8_cache), and its accuracy: a
    relative error against the float64 reference of the dequantised inputs at most 1.5x
    that of the same call on caches of q's dtype holding the dequantised values."""
    ran = check_fp8_cache(case, cache_dtype)
    (out, *_), inputs, (want_out, _), stored, lowered = ran
    q, _, _, _, extra, descales, (deq_k, deq_v) = inputs
    assert kernel_reads_fp8(lowered) == (case.head_dim % 16 == 0 and case.head_dim_v % 16 == 0)
    named = dict(extra, **{n: (stored[n].astype(jnp.float32) * descales[f"{n}_descale"][
        :, None, :, None]).astype(q.dtype) for n in stored})
    (same_dtype, *_), _ = call_case(case, q, jnp.asarray(deq_k, q.dtype),
                                    jnp.asarray(deq_v, q.dtype), named)
    assert frobenius_error(out, want_out) <= 1.5 * frobenius_error(same_dtype, want_out) + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 7, 40])
@pytest.mark.parametrize("index", [0, 2])
def test_gpu_fp8_forced_splits(index, num_splits):
    check_fp8_cache(*GPU_CASES[index], num_splits=num_splits)


@pytest.mark.gpu
def test_gpu_fp8_long_cache():
    """64k cached keys of one sequence in e4m3, the automatic split count."""
    check_fp8_cache(KVCase(batch=1, heads_q=8, heads_kv=1, seqlens=(65000,), capacity=65536,
                           seqlen_new=1, causal=True, dtype="bfloat16", **D128), "float8_e4m3fn")


@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_append_out_of_range(cache_dtype):
    """New rows past the float8 range (and inf, NaN, ties, tiny values) are stored as
    jnp.asarray(x * (1 / descale), cache dtype) stores them on the same device (bit for
    bit, but for which of e5m2's NaNs), by the kernels' own rounding."""
    case = KVCase(batch=2, heads_q=4, heads_kv=2, head_dim=64, head_dim_v=64, seqlens=(3, 10),
                  capacity=16, seqlen_new=1, dtype="bfloat16")
    q, k_cache, v_cache, new, _, descales, _ = fp8_inputs(case, cache_dtype)
    descales["k_descale"] = jnp.ones_like(descales["k_descale"])  # (k's ties stay ties)
    special = jnp.asarray([1e3, -1e4, 500.0, 464.0, 449.0, 6e4, 61440.0, np.inf, -np.inf, np.nan,
                           1e-9, -3e-3, 0.0, -0.0, 1.5 * 2.0 ** -9, 65504.0], jnp.float32)
    k = jnp.resize(special, new["k"].size).reshape(new["k"].shape).astype(q.dtype)
    v = (new["v"].astype(jnp.float32) * 1e3).astype(q.dtype)
    call = jax.jit(flashjax.flash_attention_with_kvcache)
    seqlens = jnp.asarray(case.seqlens, jnp.int32)
    assert kernel_reads_fp8(call.lower(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                       **descales))
    _, kc, vc = call(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, **descales)
    for got, x, name in ((kc, k, "k"), (vc, v, "v")):
        want = np.asarray(quantised(x, descales[f"{name}_descale"], cache_dtype)).view(np.uint8)
        rows = np.asarray(got)[np.arange(case.batch), np.asarray(case.seqlens)]
        assert_same_fp8(rows, want[:, 0], cache_dtype, name)


@pytest.mark.parametrize("head_dim,finite_v", [(16, False), (16, True), (40, False)])
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_every_code(cache_dtype, head_dim, finite_v):
    """Every float8 code, read by the decode path, is its value times the descale (one
    rounding of the product): a (0, 0) window shows each query its own key only, so
    with a one-hot float32 q and softmax_scale 1 each out row is that key's V row and
    each lse that key's first K value, exactly (K's non-finite codes, which would make
    the whole row NaN, are left to V). head_dim 16: rows read in place (40: converted);
    finite_v: V without its non-finite codes too, so that e4m3fn's V rows take the
    widening of NaN-free tiles (K's always do)."""
    heads, rows = 8, 32
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(cache_dtype).astype(np.float32)
    k_codes = np.where(np.isfinite(values), codes, 0).reshape(heads, rows)  # (head, key)
    k_bytes = np.broadcast_to(k_codes.T[None, :, :, None], (1, rows, heads, head_dim))
    v_bytes = ((np.arange(heads)[None, None, :, None] * rows + np.arange(rows)[None, :, None, None])
               * head_dim + np.arange(head_dim)) % 256
    if finite_v:
        v_bytes = np.where(np.isfinite(values[v_bytes]), v_bytes, 0)
    k_cache, v_cache = (jnp.asarray(np.ascontiguousarray(x).astype(np.uint8).view(cache_dtype))
                        for x in (k_bytes, v_bytes))
    rng = np.random.default_rng(4)
    k_descale, v_descale = (rng.uniform(0.25, 2.0, (1, heads)).astype(np.float32)
                            for _ in range(2))
    q = np.zeros((1, rows, heads, head_dim), np.float32)
    q[..., 0] = 1.0
    out, lse = flashjax.flash_attention_with_kvcache(
        jnp.asarray(q), k_cache, v_cache, cache_seqlens=jnp.asarray([rows], jnp.int32),
        softmax_scale=1.0, window_size=(0, 0), return_lse=True, k_descale=jnp.asarray(k_descale),
        v_descale=jnp.asarray(v_descale))
    want_out = values[v_bytes] * v_descale[:, None, :, None]
    want_lse = values[k_codes] * k_descale[0][:, None]  # (head, key): lse is (b, h, query)
    np.testing.assert_array_equal(np.asarray(out), want_out)
    np.testing.assert_array_equal(np.asarray(lse)[0], want_lse)


def check_fp8_nonfinite(cache_dtype, device=None):
    """NaN codes in float8 caches: rows past cache_seqlens are never read; a NaN value in
    entry 1's keys reaches its column of entry 1 only, and one in entry 1's last key,
    which only its last query row sees (causal), that row's column only: the other rows'
    hidden pairs take the exact product and stay finite (nonfinite_helpers' KV-cache
    case, on float8 caches)."""
    from helpers import jitted_reference
    from nonfinite_helpers import assert_same_nonfinite

    batch, cache, heads_q, heads_kv, dim, seqlen_q = 2, 64, 4, 2, 64, 3
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((batch, seqlen_q, heads_q, dim)), jnp.bfloat16)
    k8, v8 = (np.asarray(jnp.asarray(rng.standard_normal((batch, cache, heads_kv, dim)),
                                     cache_dtype)).view(np.uint8).copy() for _ in range(2))
    nan = 0x7f  # (a NaN code of either format)
    k8[0, 50] = nan           # past entry 0's length: never read
    v8[0, 45, 1, 2] = nan     # likewise
    v8[1, 10, 0, 5] = nan     # read by entry 1, heads 0-1, column 5
    v8[1, 63, 1, 7] = nan     # entry 1's last key: its last query row, heads 2-3, column 7
    k_cache, v_cache = (jnp.asarray(x.view(cache_dtype)) for x in (k8, v8))
    seqlens = jnp.asarray([40, 64], jnp.int32)
    q, k_cache, v_cache = jax.device_put((q, k_cache, v_cache), device)
    out, lse = flashjax.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                     causal=True, return_lse=True)
    hi = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k_cache, v_cache)]
    want_out, want_lse = jitted_reference(*hi, seqused_k=seqlens, causal=True, return_lse=True,
                                          compute_dtype=jnp.float64)
    assert_same_nonfinite(out.astype(jnp.float32), want_out, jnp.bfloat16, "out")
    assert_same_nonfinite(lse, want_lse, jnp.float32, "lse")
    want_out = np.asarray(want_out)
    assert np.isnan(want_out[1, -1, 2:, 7]).all() and np.isfinite(want_out[1, :-1, :, 7]).all()
    assert np.isfinite(want_out[0]).all()


@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_nonfinite(cache_dtype):
    check_fp8_nonfinite(cache_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_gpu_fp8_nonfinite(cache_dtype):
    """The float8 split kernel's exact product for masked slices (key_major_masked_product)."""
    check_fp8_nonfinite(cache_dtype, jax.devices("gpu")[0])
