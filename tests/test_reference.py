"""flashjax.reference against a naive float64 NumPy loop (straight from docs/api.md),
so that the reference the other tests compare to can be trusted."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from flashjax import reference
from helpers import Case, case_inputs, ids, jitted_reference, rand, rel_err


def naive(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, sinks=None):
    """One row at a time, in float64, the contract's formulas verbatim."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, sq, hq, v.shape[-1]))
    lse = np.full((b, hq, sq), -np.inf)
    left, right = window
    if causal:
        right = 0
    offset = sk - sq
    for bi, h, i in itertools.product(range(b), range(hq), range(sq)):
        kh = h // (hq // hk)
        js = [j for j in range(sk)
              if (left < 0 or j >= i + offset - left) and (right < 0 or j <= i + offset + right)]
        logits = [scale * float(q[bi, i, h] @ k[bi, j, kh]) for j in js]
        if softcap > 0:
            logits = [softcap * math.tanh(s / softcap) for s in logits]
        terms = logits + ([float(sinks[h])] if sinks is not None else [])
        if not terms:
            continue  # no key, no sink: out 0, lse -inf
        m = max(terms)
        z = sum(math.exp(s - m) for s in terms)
        lse[bi, h, i] = m + math.log(z)
        for s, j in zip(logits, js):
            out[bi, i, h] += math.exp(s - lse[bi, h, i]) * v[bi, j, kh]
    return out, lse


def naive_mask(sq, sk, causal, window):
    left, right = window
    right = 0 if causal else right
    return np.array([[(left < 0 or j >= i + sk - sq - left) and (right < 0 or j <= i + sk - sq + right)
                      for j in range(sk)] for i in range(sq)])


REF_CASES = [
    Case(seqlen_q=sq, seqlen_k=sk, heads_q=2, heads_kv=1, head_dim=4, head_dim_v=3,
         causal=c, window_size=w, softcap=cap, sinks=s)
    for (sq, sk), c, w, cap, s in itertools.product(
        [(9, 13), (13, 9)], (False, True), [(-1, -1), (2, 1), (0, 0), (-1, 0), (3, -1)],
        (0.0, 2.0), (False, True))
] + [
    Case(batch=2, seqlen_q=1, seqlen_k=7, heads_q=4, heads_kv=2, head_dim=5, sinks=True),
    Case(seqlen_q=7, seqlen_k=1, heads_q=3, heads_kv=3, head_dim=1, causal=True),
    Case(seqlen_q=6, seqlen_k=6, heads_q=2, heads_kv=2, head_dim=8, softmax_scale=0.7, softcap=1.5),
    Case(seqlen_q=6, seqlen_k=6, heads_q=2, heads_kv=2, head_dim=8, softmax_scale=3.0, causal=True),
]


@pytest.mark.parametrize("case", REF_CASES, ids=ids(REF_CASES))
def test_reference_matches_naive_loop(case):
    q, k, v, sinks = case_inputs(case)
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, compute_dtype=jnp.float64,
                                   **case.options())
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    want_out, want_lse = naive(q, k, v, scale=case.softmax_scale, causal=case.causal,
                               window=case.window_size, softcap=case.softcap,
                               sinks=None if sinks is None else np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-10)
    # Without return_lse: the same output.
    out2 = reference.attention(q, k, v, sinks=sinks, compute_dtype=jnp.float64, **case.options())
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))


@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (1, 4), (4, 1), (6, 6)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (2, -1), (-1, 2), (1, 3), (7, 0)])
def test_visible_mask(sq, sk, causal, window):
    mask = reference.visible_mask(sq, sk, causal, window)
    assert mask.dtype == bool and mask.shape == (sq, sk)
    np.testing.assert_array_equal(mask, naive_mask(sq, sk, causal, window))


def test_visible_mask_bottom_right_examples():
    # sq < sk, causal: the last query sees every key; the first sees sk - sq + 1 keys.
    np.testing.assert_array_equal(reference.visible_mask(2, 4, True, (-1, -1)),
                                  [[1, 1, 1, 0], [1, 1, 1, 1]])
    # sq > sk, causal: the first sq - sk rows see nothing.
    np.testing.assert_array_equal(reference.visible_mask(4, 2, True, (-1, -1)),
                                  [[0, 0], [0, 0], [1, 0], [1, 1]])
    # causal keeps `left`: window (1, 5) + causal = (1, 0).
    np.testing.assert_array_equal(reference.visible_mask(3, 3, True, (1, 5)),
                                  [[1, 0, 0], [1, 1, 0], [0, 1, 1]])


def test_rows_without_keys():
    case = Case(seqlen_q=12, seqlen_k=4, heads_q=2, heads_kv=1, head_dim=4, causal=True, sinks=True)
    q, k, v, sinks = case_inputs(case)
    for s in (None, sinks):
        out, lse = jitted_reference(q, k, v, sinks=s, causal=True, return_lse=True)
        assert not np.isnan(np.asarray(out)).any() and not np.isnan(np.asarray(lse)).any()
        np.testing.assert_array_equal(np.asarray(out)[:, :8], 0.0)
        want = -np.inf if s is None else np.asarray(s)[None, :, None]
        np.testing.assert_array_equal(np.asarray(lse)[:, :, :8], np.broadcast_to(want, (1, 2, 8)))


GRAD_CASES = [
    Case(seqlen_q=6, seqlen_k=5, heads_q=2, heads_kv=1, head_dim=3, head_dim_v=2, causal=True, sinks=True),
    Case(seqlen_q=5, seqlen_k=7, heads_q=2, heads_kv=2, head_dim=3, window_size=(1, 1), softcap=1.5),
    Case(seqlen_q=8, seqlen_k=3, heads_q=1, heads_kv=1, head_dim=2, causal=True),  # empty rows
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=ids(GRAD_CASES))
def test_reference_gradients_match_finite_differences(case):
    q, k, v, sinks = case_inputs(case)
    args = [x.astype(jnp.float64) for x in (q, k, v)]

    def f(q, k, v, s):
        out, lse = reference.attention(q, k, v, sinks=s, return_lse=True, compute_dtype=jnp.float64,
                                       **case.options())
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0)

    # jitted: the finite differences evaluate it many times at one shape
    if case.sinks:
        check_grads(jax.jit(f), (*args, sinks.astype(jnp.float64)), order=1, modes=["rev"],
                    eps=1e-6)
    else:
        check_grads(jax.jit(lambda q, k, v: f(q, k, v, None)), args, order=1, modes=["rev"],
                    eps=1e-6)


def test_reference_gradients_of_empty_rows_are_zero_not_nan():
    case = Case(seqlen_q=12, seqlen_k=4, heads_q=2, heads_kv=1, head_dim=4, causal=True, sinks=True)
    q, k, v, sinks = case_inputs(case)
    for dtype in (jnp.float32, jnp.float64, jnp.bfloat16):
        def loss(q, k, v, s):
            out, lse = reference.attention(q, k, v, sinks=s, causal=True, return_lse=True,
                                           compute_dtype=dtype)
            return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isinf(lse), 0, lse))
        for s in (None, sinks):
            dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, s)
            for g in (dq, dk, dv):
                assert np.isfinite(np.asarray(g, np.float32)).all()
            np.testing.assert_array_equal(np.asarray(dq, np.float32)[:, :8], 0.0)


def test_compute_dtype():
    # jitted (one program per dtype setting; eager, each op compiles per dtype)
    attention = jitted_reference
    q, k, v = (rand(i, (1, 20, 2, 16), jnp.bfloat16) for i in range(3))
    assert attention(q, k, v).dtype == jnp.bfloat16
    out, lse = attention(q, k, v, return_lse=True, compute_dtype=jnp.float64)
    assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
    out, lse = attention(q, k, v, return_lse=True, compute_dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    # The same-precision reference is really less precise than the float32 one.
    hi = attention(q, k, v, compute_dtype=jnp.float64)
    err32 = rel_err(attention(q.astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32)), hi)
    err16 = rel_err(attention(q, k, v, compute_dtype=q.dtype), hi)
    assert err32 < 1e-6 < err16 < 0.05


def test_leading_dims_and_gqa_equal_repeated_heads():
    q = rand(0, (2, 3, 10, 4, 8), jnp.float32)
    k = rand(1, (2, 3, 12, 2, 8), jnp.float32)
    v = rand(2, (2, 3, 12, 2, 6), jnp.float32)
    attention = lambda q, k, v: reference.attention(q, k, v, causal=True,
                                                    compute_dtype=jnp.float64)
    # jitted (eager, each op compiles for these new shapes)
    out = jax.jit(attention)(q, k, v)
    per = jax.jit(jax.vmap(attention))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(per), rtol=1e-12, atol=1e-12)
    rep = jax.jit(lambda q, k, v: attention(q, jnp.repeat(k, 2, axis=-2),
                                            jnp.repeat(v, 2, axis=-2)))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(rep), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("positions", [False, True])
def test_varlen_reference_is_attention_per_sequence(positions):
    """reference.attention_varlen (one batched call) equals reference.attention on each
    sequence's rows and keys, forward and gradients (float64): lengths 0 and 1, a
    sequence with no keys (its rows get the sink), seqused, padding rows, GQA."""
    cu_q, cu_k = np.array([0, 5, 5, 45, 46, 70]), np.array([0, 9, 13, 13, 90, 120])
    used_q, used_k = np.array([5, 0, 33, 1, 20]), np.array([9, 4, 0, 70, 30])
    q_at, kv_at = (np.array([3, 0, 7, 500, 0]), np.array([0, 0, 2, 400, 9])) if positions \
        else (None, None)
    q, k, v = (rand(i, (75 if i == 0 else 125, 4 if i == 0 else 2, 8), jnp.float64)
               for i in range(3))
    sinks = rand(3, (4,), jnp.float64)
    options = dict(causal=True, window_size=(11, -1), softcap=4.0, sinks=sinks,
                   compute_dtype=jnp.float64)

    def batched(q, k, v):
        return reference.attention_varlen(q, k, v, cu_q, cu_k, 40, 80, seqused_q=used_q,
                                          seqused_k=used_k, q_offset=q_at, kv_offset=kv_at,
                                          return_lse=True, **options)

    def per_sequence(q, k, v):
        out, lse = jnp.zeros((75, 4, 8), jnp.float64), jnp.full((4, 75), -jnp.inf)
        for b in range(5):
            rows, keys = slice(cu_q[b], cu_q[b] + used_q[b]), slice(cu_k[b], cu_k[b] + used_k[b])
            if used_q[b] == 0:
                continue
            if used_k[b] == 0:  # no key: out 0, lse the sink
                lse = lse.at[:, rows].set(jnp.broadcast_to(sinks[:, None], (4, used_q[b])))
                continue
            at = {} if q_at is None else dict(q_offset=int(q_at[b]), kv_offset=int(kv_at[b]))
            o, l = reference.attention(q[None, rows], k[None, keys], v[None, keys],
                                       return_lse=True, **at, **options)
            out, lse = out.at[rows].set(o[0]), lse.at[:, rows].set(l[0])
        return out, lse

    ct = (rand(4, (75, 4, 8), jnp.float64), rand(5, (4, 75), jnp.float64))
    results = [jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](ct) + f(q, k, v))(q, k, v)
               for f in (batched, per_sequence)]
    for got, want in zip(*results):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
