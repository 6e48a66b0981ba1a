"""dropout_rate= / dropout_key= on flash_attention and flash_attention_varlen, on the C++
CPU kernels and the pure-JAX path: the output, lse and gradients of q, k, v equal the
float64 reference computed with flashjax.dropout_mask's mask (alone and with causal,
windows, GQA, bias, mask, sinks, softcap, seqused); lse is the undropped one; rate 0 is
no dropout; keys: same key same output, different keys differ, typed and legacy keys
agree, vmap over keys is the loop over them; the mean over many keys tends to the
undropped output; jit, checkpoint; validation errors.

One shape (GQA 4/2 heads, seqlen_q != seqlen_k spanning two CPU key tiles and several
pure-JAX blocks, as test_bias_mask.py) serves the reference cases; the key is a traced
argument, so cases that differ only in their key share one compilation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference, xla_attention
from helpers import cpu, rand

B, SQ, SK, H, HK, D = 2, 72, 200, 4, 2, 32
RATE = 0.2
TOL = 2e-4
KEY = jax.random.key(11)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several pure-JAX blocks per sequence (masked, unmasked and skipped pairs)."""
    monkeypatch.setattr(xla_attention, "BLOCK_Q", 32)
    monkeypatch.setattr(xla_attention, "BLOCK_K", 64)


def qkv(seed=0, sq=SQ, sk=SK):
    return rand(seed, (B, sq, H, D)), rand(seed + 1, (B, sk, HK, D)), rand(seed + 2, (B, sk, HK, D))


def finite(lse):
    return jnp.where(jnp.isfinite(lse), lse, 0)


@functools.partial(jax.jit, static_argnames=("static",))
def _reference(q, k, v, key, arrays, ct, static):
    """out, lse and the gradients of q, k, v of the float64 reference with dropout_key
    `key` (jitted: one compilation per set of static options, for every key)."""
    def f(q, k, v):
        out, lse = reference.attention(q, k, v, return_lse=True, compute_dtype=jnp.float64,
                                       dropout_key=key, **dict(static), **arrays)
        return out, finite(lse)
    (out, lse), pullback = jax.vjp(f, q, k, v)
    return out, lse, pullback(ct)


@functools.partial(jax.jit, static_argnames=("static",))
def _flash(q, k, v, key, arrays, ct, static):
    def f(q, k, v):
        out, lse = flashjax.flash_attention(q, k, v, return_lse=True, dropout_key=key,
                                            **dict(static), **arrays)
        return out, finite(lse)
    (out, lse), pullback = jax.vjp(f, q, k, v)
    return out, lse, pullback(ct)


def check(impl, key=KEY, **options):
    """flash_attention(implementation=impl, dropout_rate=RATE, dropout_key=key) with
    `options` against the float64 reference: out, lse, dq, dk, dv."""
    q, k, v = qkv()
    options.setdefault("dropout_rate", RATE)
    arrays = {n: x for n, x in options.items() if hasattr(x, "shape")}
    static = tuple(sorted((n, x) for n, x in options.items() if n not in arrays))
    ct = (rand(7, (B, SQ, H, D)), rand(8, (B, H, SQ)))
    expected = _reference(q, k, v, key, arrays, tuple(x.astype(jnp.float64) for x in ct),
                          static)
    got = _flash(q, k, v, key, arrays, ct, static + (("implementation", impl),))
    for name, g, r in zip(("out", "lse"), got[:2], expected[:2]):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=name)
    for name, g, r in zip(("dq", "dk", "dv"), got[2], expected[2]):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=name)
    return got


def mask_of(shape, seed=4, p=0.7):
    return jax.device_put(np.random.default_rng(seed).random(shape) < p, cpu())


SEQUSED = lambda: dict(seqused_q=jax.device_put(np.array([60, 72], np.int32), cpu()),
                       seqused_k=jax.device_put(np.array([150, 200], np.int32), cpu()))
CASES = {
    "plain": lambda: {},
    "causal_sinks": lambda: dict(sinks=rand(9, (H,)), causal=True),
    "window_softcap_bias_mask": lambda: dict(
        window_size=(30, 10), softcap=3.0, bias=rand(3, (1, H, SQ, SK)),
        mask=mask_of((B, 1, SQ, SK))),
    "seqused_alibi": lambda: dict(alibi_slopes=jax.device_put(
        np.array([0.5, 0.25, 0.125, 0.0625], np.float32), cpu()), causal=True, **SEQUSED()),
    "rate_0.9": lambda: dict(dropout_rate=0.9),
}
# (the pure-JAX path's compilations dominate: one case, whose options it masks by)
XLA_CASES = ("window_softcap_bias_mask",)


@pytest.mark.parametrize("impl, name", [("cpu", n) for n in CASES]
                         + [("xla", n) for n in XLA_CASES])
def test_matches_reference(impl, name):
    check(impl, **CASES[name]())


@pytest.mark.parametrize("backward", ["one-pass", "two-pass"])
def test_cpu_backward_paths(backward, monkeypatch):
    """Both C++ backward schedules regenerate the same mask (and the dbias pass too)."""
    monkeypatch.setenv("FLASHJAX_CPU_BACKWARD", backward)
    check("cpu", key=jax.random.key(3))  # (the compilations of test_matches_reference's "plain")


def test_bias_gradient_with_dropout():
    """dbias is dS with the dropped dP: against the reference's."""
    q, k, v = qkv()
    bias = rand(3, (1, H, SQ, SK))

    def loss(fn, **extra):
        return lambda q, bias: jnp.sum(fn(q, k, v, bias=bias, dropout_rate=RATE,
                                          dropout_key=KEY, **extra) ** 2)
    got = jax.jit(jax.grad(loss(flashjax.flash_attention, implementation="cpu"),
                           argnums=(0, 1)))(q, bias)
    expected = jax.jit(jax.grad(loss(reference.attention, compute_dtype=jnp.float64),
                                argnums=(0, 1)))(q, bias)
    for g, r in zip(got, expected):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL)


def tiny(seed=20):
    """A tiny call's q, k, v (1 sequence, 16 rows and keys, 1 head of 8): cheap to compile
    on the pure-JAX path."""
    return (rand(s, (1, 16, 1, 8)) for s in (seed, seed + 1, seed + 2))


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_keys_and_lse(impl):
    """Same key, same output; another key, another output; lse and the rate-0 call equal
    the call without dropout exactly (rate 0 takes the no-dropout path, key ignored)."""
    q, k, v = tiny()
    call = jax.jit(lambda key, rate: flashjax.flash_attention(
        q, k, v, dropout_rate=rate, dropout_key=key, return_lse=True, implementation=impl),
        static_argnums=1)
    out, lse = call(KEY, RATE)
    again, _ = call(KEY, RATE)
    other, _ = call(jax.random.key(12), RATE)
    plain, plain_lse = call(KEY, 0.0)
    none = jax.jit(lambda: flashjax.flash_attention(q, k, v, return_lse=True,
                                                    implementation=impl))()
    np.testing.assert_array_equal(out, again)
    assert float(jnp.mean(jnp.abs(out - other))) > 0.01
    assert float(jnp.mean(jnp.abs(out - plain))) > 0.01
    np.testing.assert_array_equal(lse, plain_lse)
    np.testing.assert_array_equal(plain, none[0])
    np.testing.assert_array_equal(plain_lse, none[1])


def test_typed_and_legacy_keys_agree():
    q, k, v = tiny()
    call = lambda key: flashjax.flash_attention(q, k, v, dropout_rate=RATE, dropout_key=key,
                                                implementation="cpu")
    np.testing.assert_array_equal(call(jax.random.key(5)), call(jax.random.PRNGKey(5)))


def check_vmap(q, k, v, impl, everything):
    """vmap over typed keys against the loop; with `everything`, also over legacy keys,
    the gradients, and over q with one key."""
    f = lambda q, key: flashjax.flash_attention(q, k, v, dropout_rate=RATE, dropout_key=key,
                                                implementation=impl, causal=True)
    one = jax.jit(f)
    typed = jax.random.split(jax.random.key(1), 3)
    loss = lambda q, key: jnp.sum(f(q, key) ** 2)
    grad = jax.jit(jax.grad(loss))
    for keys in (typed, jax.vmap(jax.random.key_data)(typed))[:2 if everything else 1]:
        got = jax.jit(jax.vmap(f, in_axes=(None, 0)))(q, keys)
        for i in range(3):
            np.testing.assert_allclose(got[i], one(q, keys[i]), atol=1e-6)
        if everything:
            got_grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(q, keys)
            for i in range(3):
                np.testing.assert_allclose(got_grads[i], grad(q, keys[i]), atol=1e-5)
    if everything:
        qs = jnp.stack([q, 2 * q])
        got = jax.jit(jax.vmap(f, in_axes=(0, None)))(qs, KEY)
        for i in range(2):
            np.testing.assert_allclose(got[i], one(qs[i], KEY), atol=1e-6)


def test_vmap_over_keys():
    """Each instance gets the unbatched call's mask with its key: the C++ call folds the
    vmapped axis into batch with a key per sequence (forward and gradients; typed and
    legacy keys; a vmap over q with one key); the pure-JAX path batches the generator
    (a tiny call, typed keys, forward: its vmapped compilations are long)."""
    check_vmap(*qkv(), "cpu", everything=True)
    check_vmap(*tiny(), "xla", everything=False)


def test_checkpoint():
    q, k, v = qkv()
    loss = lambda q, key: jnp.sum(flashjax.flash_attention(
        q, k, v, dropout_rate=RATE, dropout_key=key, implementation="cpu") ** 2)
    np.testing.assert_allclose(jax.jit(jax.grad(jax.checkpoint(loss)))(q, KEY),
                               jax.jit(jax.grad(loss))(q, KEY), atol=1e-6)


def test_mean_over_keys_tends_to_undropped():
    """Dropout is unbiased: the mean over 512 keys of a tiny call is the undropped output
    to within 4.5 standard errors at each of its 128 elements (their own spread over the
    keys, ~0.2 on average here: a bias of ~0.04 fails; unbiased, a maximum that large has
    probability ~1e-3)."""
    q, k, v = tiny()
    n = 512
    keys = jax.random.split(jax.random.key(2), n)
    outs = jax.jit(jax.vmap(lambda key: flashjax.flash_attention(
        q, k, v, dropout_rate=0.25, dropout_key=key, implementation="cpu")))(keys)
    expected = flashjax.flash_attention(q, k, v, implementation="cpu")
    spread = jnp.std(outs, axis=0)
    assert float(spread.mean()) > 0.05  # (keys do differ)
    standard_error = spread / np.sqrt(n)
    assert np.all(np.abs(jnp.mean(outs, axis=0) - expected) <= 4.5 * standard_error + 1e-6)


CU_Q, CU_K = np.array([0, 13, 13, 72], np.int32), np.array([0, 90, 120, 200], np.int32)
VARLEN = dict(causal=True, dropout_rate=RATE, dropout_key=KEY)


def _varlen_loss(fn, **extra):
    return lambda q, k, v: jnp.sum(fn(q, k, v, CU_Q, CU_K, 59, 90, **VARLEN, **extra) ** 2)


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_varlen(impl):
    """Packed sequences: element (b, h, i, j) counts rows and keys within sequence b
    (the reference runs each sequence with its slice of dropout_mask); gradients on the
    C++ kernels (the pure-JAX path's packed backward reads the forward's dropout
    factors, and compiles for long: forward only)."""
    q, k, v = (x[0] for x in qkv(30))
    if impl == "xla":
        run = lambda fn, **extra: jax.jit(lambda q, k, v: fn(
            q, k, v, CU_Q, CU_K, 59, 90, **VARLEN, **extra))(q, k, v)
        np.testing.assert_allclose(run(flashjax.flash_attention_varlen, implementation=impl),
                                   run(reference.attention_varlen, compute_dtype=jnp.float64),
                                   atol=TOL, rtol=TOL)
        return
    grad = lambda fn, **extra: jax.jit(jax.value_and_grad(_varlen_loss(fn, **extra),
                                                          argnums=(0, 1, 2)))(q, k, v)
    got = grad(flashjax.flash_attention_varlen, implementation=impl)
    expected = grad(reference.attention_varlen, compute_dtype=jnp.float64)
    np.testing.assert_allclose(got[0], expected[0], rtol=TOL)
    for g, r in zip(got[1], expected[1]):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL)


BAD = {
    "no_key": (ValueError, "needs dropout_key", dict(dropout_rate=0.1)),
    "rate_one": (ValueError, "dropout_rate must be in", dict(dropout_rate=1.0, dropout_key=KEY)),
    "rate_negative": (ValueError, "dropout_rate must be in",
                      dict(dropout_rate=-0.1, dropout_key=KEY)),
    "rate_array": (TypeError, "dropout_rate", dict(dropout_rate=jnp.ones(2) / 4,
                                                   dropout_key=KEY)),
    "key_float": (TypeError, "dropout_key", dict(dropout_rate=0.1, dropout_key=jnp.ones(2))),
    "key_batch": (ValueError, "dropout_key", dict(dropout_rate=0.1,
                                                  dropout_key=jax.random.split(KEY, 2))),
}


@pytest.mark.parametrize("error, match, kwargs", BAD.values(), ids=BAD.keys())
def test_bad_input(error, match, kwargs):
    """flash_attention and flash_attention_varlen raise before anything runs, naming the
    argument."""
    q, k, v = tiny()
    cu = jax.device_put(np.array([0, 16], np.int32), cpu())
    for call in (lambda: flashjax.flash_attention(q, k, v, **kwargs),
                 lambda: flashjax.flash_attention_varlen(q[0], k[0], v[0], cu, cu, 16, 16,
                                                         **kwargs)):
        with pytest.raises(error, match=match):
            call()
