"""flashjax.flash_attention_with_kvcache on the CPU against a float64 reference
assembled from the cache by hand (kvcache_helpers.py), the API's errors, donation, and
continuous batching through flash_attention_varlen."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from kvcache_helpers import KVCase, check, expected, make_inputs


CASES = [
    KVCase(),
    KVCase(seqlen_new=3, causal=True),
    KVCase(seqlen_new=2, batch_cache=5, leftpad=(2, 0, 4), causal=True, sinks=True),
    KVCase(seqlens=(0, 20, 9), seqlen_new=4, seqlen_q=4, causal=True, rotary_dim=16),
    KVCase(seqlen_new=1, rotary_dim=32, interleaved=False, window_size=(6, 0), softcap=5.0),
    KVCase(seqlen_q=3, heads_q=8, heads_kv=1, head_dim=64, head_dim_v=40, seqlens=(30, 1, 12),
           capacity=40, seqlen_new=2, rotary_dim=16),
    KVCase(page_size=1, num_pages=80, capacity=24, seqlen_new=2, causal=True),
    KVCase(page_size=16, num_pages=9, capacity=48, seqlens=(33, 3, 15), seqlen_new=3,
           rotary_dim=16, interleaved=False, causal=True),
    KVCase(page_size=64, num_pages=7, capacity=128, seqlens=(100, 64, 0), seqlen_new=1,
           sinks=True, leftpad=(10, 0, 0)),
    KVCase(page_size=256, num_pages=4, capacity=256, seqlens=(200, 1, 255), seqlen_new=2,
           seqlen_q=2, causal=True),
    KVCase(seqlen_new=2, causal=True, rotary_dim=16, dtype="bfloat16"),
    KVCase(seqlens=(20, 23, 24), seqlen_new=3, causal=True),  # appends past the capacity
    KVCase(page_size=4, num_pages=30, capacity=24, seqlens=(9, 2, 20), seqlen_new=2,
           leftpad=(3, 0, 1), causal=True, poison=True),  # NaN in every unread row
    KVCase(seqlen_q=20, heads_q=8, heads_kv=2, seqlens=(30, 3, 0), capacity=64, seqlen_new=20,
           causal=True, rotary_dim=16),  # a prefill block (dense kernels on the GPU)
    # FlashAttention's addressing: rotary at cache rows with leftpad; a paged cache whose
    # page-table rows cache_batch_idx picks; more cache entries / table rows than sequences
    KVCase(seqlen_q=2, seqlen_new=2, leftpad=(2, 0, 4), rotary_dim=16, causal=True),
    KVCase(page_size=4, num_pages=40, capacity=24, batch_cache=5, seqlens=(9, 2, 20),
           seqlen_new=2, leftpad=(3, 0, 1), rotary_dim=16, interleaved=False, causal=True),
    KVCase(batch_cache=5, batch_idx=False, seqlen_new=1),
    KVCase(page_size=8, num_pages=20, batch_cache=5, batch_idx=False, seqlen_new=1),
]


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("case", CASES, ids=map(str, CASES))
def test_kvcache(case, implementation):
    check(case, implementation=implementation)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_num_splits_give_the_same_result(num_splits):
    check(CASES[2], num_splits=num_splits)


# The CPU decode path's split-K (csrc/cpu/kvcache_cpu.cc): caches of several 128-key
# tiles, split as the library chooses and forced (FLASHJAX_CPU_KVCACHE_SPLITS); head
# dims of whole vector lines (float: read in place) and not (converted per tile).
SPLIT_CASES = [
    KVCase(heads_q=8, heads_kv=2, head_dim=64, head_dim_v=64, capacity=600,
           seqlens=(590, 0, 300), leftpad=(5, 0, 40), seqlen_new=2, seqlen_q=2, causal=True,
           sinks=True),
    KVCase(heads_q=6, heads_kv=3, head_dim_v=40, page_size=32, num_pages=60, capacity=512,
           seqlens=(500, 129, 7), seqlen_new=1, window_size=(100, 0), softcap=5.0),
    KVCase(capacity=400, seqlens=(390, 200, 50), seqlen_new=3, seqlen_q=3, causal=True,
           rotary_dim=16, dtype="bfloat16"),
    KVCase(heads_q=4, heads_kv=4, head_dim=64, head_dim_v=64, page_size=64, num_pages=30,
           capacity=512, seqlens=(500, 64, 200), seqlen_new=2, seqlen_q=2, causal=True,
           sinks=True, dtype="float16"),
]


@pytest.mark.parametrize("splits", [None, "1", "3"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=map(str, SPLIT_CASES))
def test_cpu_decode_splits(case, splits, monkeypatch):
    if splits:
        monkeypatch.setenv("FLASHJAX_CPU_KVCACHE_SPLITS", splits)
    check(case, implementation="cpu")


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[8], CASES[-2]],
                         ids=["contiguous", "batch_idx", "paged", "paged_leftpad"])
def test_gpu_prefill_route_on_the_cpu(case):
    """The GPU's prefill route (append through the FFI call, then flash_attention on the
    cache in place or gathered) gives the reference's answer."""
    check_prefill_route(case)


@pytest.mark.parametrize("cached", [0, 30, 44, 70], ids=lambda n: f"cached{n}")
def test_gpu_prefill_route_with_static_lengths_on_the_cpu(cached):
    """cache_seqlens as a Python int: the route reads the cache's first rows with no
    seqused_k (part of the cache, all of it, appends past it)."""
    check_prefill_route(KVCase(seqlen_q=20, heads_q=8, heads_kv=2, seqlens=(cached,) * 3,
                               capacity=64, seqlen_new=20, causal=True), static_seqlens=cached)


def check_prefill_route(case, static_seqlens=None):
    from flashjax import _checks, kvcache

    q, k_cache, v_cache, new, extra = make_inputs(case)
    want_out, want_lse, want_kc, _ = expected(case, q, k_cache, v_cache, new, extra)
    cfg = _checks.make_config(q.shape[-1], None, case.causal, case.window_size, case.softcap,
                              False)
    sinks = extra.get("sinks")
    call = kvcache._KvcacheCall(cfg, extra.get("cache_leftpad"), extra.get("cache_batch_idx"),
                                extra.get("page_table"),
                                None if sinks is None else jnp.broadcast_to(
                                    sinks, (case.batch, case.heads_q)))
    options = dict(softmax_scale=None, causal=case.causal, window_size=case.window_size,
                   softcap=case.softcap, sinks=sinks, implementation=None)
    out, lse, kc, _ = kvcache._prefill_dense(
        call, static_seqlens, options, q, k_cache, v_cache, new.get("k"), new.get("v"),
        jnp.asarray(case.seqlens, jnp.int32))
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(kc, np.float64), want_kc, rtol=2e-4, atol=2e-4)


def test_python_int_cache_seqlens_and_no_lse():
    case = KVCase(seqlens=(7, 7, 7), seqlen_new=1)
    q, k_cache, v_cache, new, extra = make_inputs(case)
    out, kc, vc = flashjax.flash_attention_with_kvcache(q, k_cache, v_cache, **new,
                                                       cache_seqlens=7, **extra)
    want, _, want_kc, _ = expected(case, q, k_cache, v_cache, new, extra)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(kc, np.float64), want_kc, rtol=2e-4, atol=2e-4)


def test_cache_seqlens_none_is_the_whole_cache():
    """As FlashAttention: no cache_seqlens means every cache row is a key (new tokens,
    at the capacity, are not written)."""
    case = KVCase(page_size=8, num_pages=12, seqlen_new=1, causal=True)
    q, k_cache, v_cache, new, extra = make_inputs(case)
    attend = jax.jit(lambda n, **kw: flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, **new, **extra, cache_seqlens=n, causal=True, **kw),
        static_argnums=0)
    whole = attend(case.capacity)
    for got, want in zip(attend(None), whole):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    want, _, _, _ = expected(dataclasses.replace(case, seqlens=(case.capacity,) * case.batch),
                             q, k_cache, v_cache, new, extra)
    np.testing.assert_allclose(np.asarray(whole[0], np.float64), want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", ["int64", "uint16", "int8"])
def test_integer_metadata_of_any_dtype(dtype):
    """Integer metadata of any integer dtype is taken as int32 (the same result)."""
    case = KVCase(page_size=4, num_pages=40, capacity=24, batch_cache=5, seqlens=(9, 2, 20),
                  seqlen_new=1, leftpad=(3, 0, 1))
    q, k_cache, v_cache, new, extra = make_inputs(case)
    metadata = dict(extra, cache_seqlens=jnp.asarray(case.seqlens, jnp.int32))

    @jax.jit
    def attend(metadata):
        return flashjax.flash_attention_with_kvcache(q, k_cache, v_cache, **new, **metadata)
    want = attend(metadata)
    got = attend({name: x.astype(dtype) for name, x in metadata.items()})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_donated_caches_are_updated_in_place():
    """Under jit with the caches donated, XLA aliases them to the returned caches."""
    case = KVCase(seqlen_new=1)
    q, k_cache, v_cache, new, extra = make_inputs(case)
    step = jax.jit(lambda q, kc, vc, k, v, n: flashjax.flash_attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n), donate_argnums=(1, 2))
    lowered = step.lower(q, k_cache, v_cache, new["k"], new["v"],
                         jnp.asarray(case.seqlens, jnp.int32))
    analysis = lowered.compile().memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    assert analysis.alias_size_in_bytes >= k_cache.nbytes + v_cache.nbytes


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_adversarial_metadata_stays_in_bounds(implementation):
    """Garbage lengths, pages and batch indices: no fault, finite results, the cache
    rows no valid append reaches unchanged."""
    # jitted (every argument an array): eager, each set-up op compiles per shape
    attend = jax.jit(functools.partial(flashjax.flash_attention_with_kvcache,
                                       implementation=implementation))
    case = KVCase(page_size=4, num_pages=12, capacity=16, seqlen_new=2)
    q, k_cache, v_cache, new, extra = make_inputs(case)
    table = jnp.asarray([[0, 1, 99, -5], [2, 3, 4, 5], [6, 7, 8, 2 ** 31 - 1]], jnp.int32)
    for seqlens in ([-7, 15, 2 ** 31 - 1], [16, 0, 3]):
        out, kc, vc = attend(
            q, k_cache, v_cache, **new, cache_seqlens=jnp.asarray(seqlens, jnp.int32),
            page_table=table, cache_leftpad=jnp.asarray([-3, 40, 1], jnp.int32))
        assert np.isfinite(np.asarray(out)).all()
        untouched = np.asarray(kc)[9:12]  # pages no sequence's table names
        np.testing.assert_array_equal(untouched, np.asarray(k_cache)[9:12])
    q, k_cache, v_cache, new, extra = make_inputs(KVCase(seqlen_new=1, batch_cache=4))
    out, kc, _ = attend(
        q, k_cache, v_cache, **new, cache_seqlens=jnp.asarray([1, 2, 3], jnp.int32),
        cache_batch_idx=jnp.asarray([-1, 4, 2 ** 31 - 1], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(k_cache))  # no valid row
    # a paged cache's cache_batch_idx outside the page table: no page, nothing written
    q, k_cache, v_cache, new, extra = make_inputs(
        KVCase(page_size=4, num_pages=24, capacity=16, batch_cache=4, seqlen_new=1))
    out, kc, _ = attend(
        q, k_cache, v_cache, **new, cache_seqlens=jnp.asarray([1, 2, 3], jnp.int32),
        page_table=extra["page_table"],
        cache_batch_idx=jnp.asarray([-1, 4, 2 ** 31 - 1], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(k_cache))


def test_gradients_raise():
    case = KVCase()
    q, k_cache, v_cache, _, _ = make_inputs(case)
    f = lambda q: flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=3).sum()
    with pytest.raises(TypeError, match="inference interface"):
        jax.grad(f)(q)


def test_argument_errors():
    case = KVCase(seqlen_new=1)
    q, k_cache, v_cache, new, _ = make_inputs(case)
    call = flashjax.flash_attention_with_kvcache
    n = jnp.asarray(case.seqlens, jnp.int32)
    with pytest.raises(ValueError, match="k and v"):
        call(q, k_cache, v_cache, new["k"], cache_seqlens=n)
    with pytest.raises(TypeError, match="k_cache"):
        call(q, k_cache.astype(jnp.bfloat16), v_cache, cache_seqlens=n)
    with pytest.raises(ValueError, match="v_cache must have k_cache's rows"):
        call(q, k_cache, v_cache[:, :5], cache_seqlens=n)
    with pytest.raises(ValueError, match="k_cache must have rank 4"):
        call(q, k_cache[0], v_cache, cache_seqlens=n)
    for name in ("cache_seqlens", "cache_leftpad", "cache_batch_idx"):
        with pytest.raises(TypeError, match=f"{name} must be an integer array"):
            call(q, k_cache, v_cache, **{"cache_seqlens": n, name: n.astype(jnp.float32)})
    with pytest.raises(ValueError, match="cache_leftpad must have shape"):
        call(q, k_cache, v_cache, cache_seqlens=n, cache_leftpad=n[:2])
    with pytest.raises(ValueError, match="page_table"):  # (3 sequences, no cache_batch_idx)
        call(q, k_cache, v_cache, cache_seqlens=n, page_table=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(TypeError, match="page_table"):
        call(q, k_cache, v_cache, cache_seqlens=n, page_table=jnp.zeros((3, 3), jnp.float32))
    with pytest.raises(ValueError, match="k_cache needs an entry per sequence"):
        call(q, k_cache[:2], v_cache[:2], cache_seqlens=n)
    with pytest.raises(ValueError, match="rotary_dim"):
        call(q, k_cache, v_cache, cache_seqlens=n, rotary_cos=jnp.ones((8, 3)),
             rotary_sin=jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin"):
        call(q, k_cache, v_cache, cache_seqlens=n, rotary_cos=jnp.ones((8, 8)))
    with pytest.raises(ValueError, match="num_splits"):
        call(q, k_cache, v_cache, cache_seqlens=n, num_splits=-1)
    with pytest.raises(ValueError, match="seqlen_new"):
        call(q, k_cache, v_cache, new["k"], new["v"][:, :0], cache_seqlens=n)
    with pytest.raises(ValueError, match=r"k must have shape"):
        call(q, k_cache, v_cache, new["k"][..., :8], new["v"], cache_seqlens=n)


@pytest.mark.parametrize("page_size", [1, 16])
def test_continuous_batching_with_paged_caches(page_size):
    """flash_attention_varlen over paged caches (prefill and decode rows in one call)
    equals the varlen reference on the keys gathered by hand."""
    rng = np.random.default_rng(3)
    lengths_q, used_k = (5, 1, 1, 3), (9, 30, 1, 17)
    heads_q, heads_kv, d, max_pages = 4, 2, 32, 32 // page_size
    num_pages = len(lengths_q) * max_pages + 3
    k_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, heads_kv, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((num_pages, page_size, heads_kv, d)), jnp.float32)
    table = rng.permutation(num_pages)[:len(lengths_q) * max_pages].reshape(len(lengths_q), -1)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((cu_q[-1], heads_q, d)), jnp.float32)
    out, lse = flashjax.flash_attention_varlen(
        q, k_cache, v_cache, jnp.asarray(cu_q), None, 5, 32, seqused_k=jnp.asarray(used_k, jnp.int32),
        page_table=jnp.asarray(table, jnp.int32), causal=True, return_lse=True)
    keys = [np.stack([np.asarray(k_cache)[table[i, r // page_size], r % page_size]
                      for r in range(n)]) for i, n in enumerate(used_k)]
    vals = [np.stack([np.asarray(v_cache)[table[i, r // page_size], r % page_size]
                      for r in range(n)]) for i, n in enumerate(used_k)]
    cu_k = np.concatenate([[0], np.cumsum(used_k)]).astype(np.int32)
    want, want_lse = jax.jit(lambda q, k, v: reference.attention_varlen(
        q, k, v, cu_q, cu_k, 5, 32, causal=True, return_lse=True, compute_dtype=jnp.float64))(
        np.asarray(q, np.float64), np.concatenate(keys).astype(np.float64),
        np.concatenate(vals).astype(np.float64))
    np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(want), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(lse, np.float64), np.asarray(want_lse), rtol=2e-4,
                               atol=2e-4)


def test_paged_varlen_argument_errors():
    q = jnp.zeros((4, 2, 32), jnp.float32)
    cache = jnp.zeros((6, 4, 2, 32), jnp.float32)
    cu = jnp.asarray([0, 4], jnp.int32)
    table = jnp.zeros((1, 2), jnp.int32)
    used = jnp.asarray([3], jnp.int32)
    call = flashjax.flash_attention_varlen
    with pytest.raises(ValueError, match="seqused_k"):
        call(q, cache, cache, cu, None, 4, 8, page_table=table)
    with pytest.raises(ValueError, match="cu_seqlens_k=None"):
        call(q, cache, cache, cu, cu, 4, 8, seqused_k=used, page_table=table)
    with pytest.raises(ValueError, match="page_table"):
        call(q, cache, cache, cu, None, 4, 8, seqused_k=used, page_table=jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="k must have rank 4"):
        call(q, cache[0], cache[0], cu, None, 4, 8, seqused_k=used, page_table=table)


def test_example_decode_loop_matches_a_full_recompute():
    """examples/decode_loop.py: greedy decoding through the cache (prefill, then one
    token per step, caches donated) picks the tokens a full causal recompute of the
    whole sequence picks."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "decode_loop.py"
    spec = importlib.util.spec_from_file_location("decode_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    batch, prompt, steps, capacity = 2, 5, 6, 16
    params = example.init_params(jax.random.key(0))
    cos, sin = example.rotary_tables(capacity)
    shape = (batch, capacity, example.KV_HEADS, example.HEAD_DIM)
    k_cache, v_cache = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (batch, prompt), 0, example.VOCAB)
    token, k_cache, v_cache = example.prefill(params, tokens, k_cache, v_cache, cos, sin)
    seqlens = jnp.full((batch,), prompt, jnp.int32)
    generated = [token]
    for _ in range(steps - 1):
        token, k_cache, v_cache = example.decode_step(params, token, k_cache, v_cache, seqlens,
                                                      cos, sin)
        seqlens = seqlens + 1
        generated.append(token)
    sequence = jnp.concatenate([tokens, jnp.stack(generated[:-1], axis=1)], axis=1)
    fresh = jnp.zeros(shape, jnp.float32)
    logits, _, _ = example.layer(params, sequence, fresh, fresh, jnp.zeros((batch,), jnp.int32),
                                 cos, sin)
    recomputed = jnp.argmax(logits[:, prompt - 1:], axis=-1)
    np.testing.assert_array_equal(np.asarray(recomputed), np.asarray(jnp.stack(generated, 1)))
