"""bias=, mask= and alibi_slopes= against the float64 reference, on the C++ CPU kernels
and the pure-JAX path: every broadcast shape of bias and mask, random, block-structured
and all-False mask rows, ALiBi with positions, their combinations with causal, windows,
segment ids, GQA, softcap, sinks and seqused; gradients of q, k, v and bias; no dbias
when bias is constant; validation errors; jit, vmap and checkpoint.

One shape (GQA 4/2 heads, seqlen_q != seqlen_k spanning two CPU key tiles and several
pure-JAX blocks) serves every case, so the reference's compilations are shared."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import _ffi_calls, reference, xla_attention
from helpers import cpu, rand

B, SQ, SK, H, HK, D = 2, 72, 200, 4, 2, 32
IMPLS = ("cpu", "xla")
TOL = 2e-4


def cases(values, xla_values):
    """(impl, value) pairs: the C++ CPU kernels on every value, the pure-JAX path (its
    compilations dominate this file's time) on `xla_values` only, as the CPU suite's
    time budget allows."""
    return ([pytest.param("cpu", v, id=f"cpu-{v}") for v in values]
            + [pytest.param("xla", v, id=f"xla-{v}") for v in xla_values])


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several pure-JAX blocks per sequence (masked, unmasked and skipped pairs)."""
    monkeypatch.setattr(xla_attention, "BLOCK_Q", 32)
    monkeypatch.setattr(xla_attention, "BLOCK_K", 64)


def qkv(seed=0):
    return rand(seed, (B, SQ, H, D)), rand(seed + 1, (B, SK, HK, D)), rand(seed + 2, (B, SK, HK, D))


def bias_of(shape, seed=3):
    return rand(seed, shape)


def random_mask(shape, seed=4, p=0.7):
    return jax.device_put(np.random.default_rng(seed).random(shape) < p, cpu())


def block_mask(shape):
    """Whole 16x40 blocks on or off (a block-sparse pattern), plus two all-False rows."""
    rng = np.random.default_rng(5)
    blocks = rng.random(shape[:2] + (SQ // 8 + 1, SK // 40 + 1)) < 0.5
    m = np.repeat(np.repeat(blocks, 8, axis=2), 40, axis=3)[:, :, :SQ, :SK].copy()
    m[:, :, [3, 50], :] = False
    return jax.device_put(m, cpu())


SLOPES = jax.device_put(np.array([0.5, 0.25, 0.125, 0.0625], np.float32), cpu())


@functools.partial(jax.jit, static_argnames=("static",))
def _reference(q, k, v, bias, arrays, ct, static):
    """out, lse and the gradients of q, k, v, bias of the float64 reference (jitted:
    one compilation per set of options)."""
    def f(q, k, v, bias):
        out, lse = reference.attention(q, k, v, bias=bias, return_lse=True,
                                       compute_dtype=jnp.float64, **dict(static), **arrays)
        return out, jnp.where(jnp.isfinite(lse), lse, 0)
    (out, lse), pullback = jax.vjp(f, q, k, v, bias)
    return out, lse, pullback(ct)


def check(impl, *, bias=None, grads=True, **options):
    """flash_attention(implementation=impl) with these options against the reference."""
    q, k, v = qkv()
    arrays = {n: x for n, x in options.items() if hasattr(x, "shape")}
    static = tuple(sorted((n, x) for n, x in options.items() if n not in arrays))

    def f(q, k, v, bias):
        out, lse = flashjax.flash_attention(q, k, v, bias=bias, return_lse=True,
                                            implementation=impl, **options)
        return out, jnp.where(jnp.isfinite(lse), lse, 0)
    ct = (rand(7, (B, SQ, H, D)), rand(8, (B, H, SQ)))
    ref_out, ref_lse, ref_grads = _reference(q, k, v, bias, arrays, (ct[0].astype(jnp.float64),
                                                                     ct[1].astype(jnp.float64)),
                                             static)
    if grads:
        (out, lse), pullback = jax.vjp(jax.jit(f), q, k, v, bias)
        got = pullback(ct)
        for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref_grads):
            if r is not None:
                np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=name)
    else:
        out, lse = jax.jit(f)(q, k, v, bias)
    np.testing.assert_allclose(out, ref_out, atol=TOL, rtol=TOL, err_msg="out")
    np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=TOL, err_msg="lse")


BIAS_SHAPES = [(1, 1, SQ, SK), (B, HK, SQ, SK), (B, H, SQ, SK), (1, H, SQ, SK)]


@pytest.mark.parametrize("impl, shape", cases(BIAS_SHAPES, BIAS_SHAPES[1:2]))
def test_bias_shapes(impl, shape):
    check(impl, bias=bias_of(shape))


@pytest.mark.parametrize("impl, name", cases(["random", "blocks", "random_heads_kv"], ["blocks"]))
def test_mask(impl, name):
    mask = {"random": lambda: random_mask((B, H, SQ, SK)),
            "blocks": lambda: block_mask((1, 1, SQ, SK)),
            "random_heads_kv": lambda: random_mask((1, HK, SQ, SK), p=0.3)}[name]()
    check(impl, mask=mask)


@pytest.mark.parametrize("impl", IMPLS)
def test_mask_rows_seeing_nothing_with_sinks(impl):
    check(impl, mask=block_mask((B, 1, SQ, SK)), sinks=rand(9, (H,)))


def test_neg_inf_bias_rows():
    """docs/api.md, "Non-finite values": a row whose visible scores are all -inf through
    the bias is NaN (out and lse) on both paths, as with jax.nn; its gradients are 0 (the
    -inf pairs add nothing, as masked ones), the same on the C++ kernels and pure JAX;
    other rows are the reference's. (tests/test_gpu_terms.py: the CUDA paths.)"""
    q, k, v = qkv()
    bias = np.array(bias_of((B, H, SQ, SK)))
    bias[0, 1, 5, :] = -np.inf
    bias[1, 3, 40, :169] = -np.inf  # the keys row 40 sees (causal: 0..168)
    bias = jax.device_put(bias, cpu())
    ct = (rand(7, (B, SQ, H, D)), rand(8, (B, H, SQ)))

    def run(impl):
        def f(q, k, v, bias):
            return flashjax.flash_attention(q, k, v, bias=bias, causal=True, return_lse=True,
                                            implementation=impl)
        (out, lse), pullback = jax.vjp(jax.jit(f), q, k, v, bias)
        return (out, lse) + pullback(ct)
    results = [[np.asarray(x) for x in run(impl)] for impl in IMPLS]
    for got in results:
        out, lse = got[0], got[1]
        assert np.isnan(out[0, 5, 1]).all() and np.isnan(lse[0, 1, 5])
        assert np.isnan(out[1, 40, 3]).all() and np.isnan(lse[1, 3, 40])
        assert np.isfinite(np.delete(out[0], 5, axis=0)).all()
        for g in got[2:]:
            assert np.isfinite(g).all()
        assert (got[2][0, 5, 1] == 0).all() and (got[5][0, 1, 5] == 0).all()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), *results):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=name)


@pytest.mark.parametrize("impl, per_batch", cases([False, True], [True]))
def test_alibi(impl, per_batch):
    slopes = jnp.stack([SLOPES, SLOPES[::-1]]) if per_batch else SLOPES
    check(impl, alibi_slopes=jax.device_put(slopes, cpu()))


COMBOS = {
    "causal_softcap_all": dict(bias=(1, H), mask=(B, 1), alibi=True, causal=True, softcap=3.0),
    "window_bias": dict(bias=(B, HK), window_size=(30, 10)),
    "segments_mask": dict(mask=(1, H), segments=True),
    "sinks_bias_alibi": dict(bias=(1, 1), alibi=True, sinks=True),
    "seqused_alibi_mask": dict(alibi=True, mask=(B, H), seqused=True, causal=True),
    "positions_alibi_bias": dict(alibi=True, bias=(B, H), q_offset=40, kv_offset=0,
                                 causal=True),
}


@pytest.mark.parametrize("impl, name", cases(list(COMBOS), ["causal_softcap_all",
                                                           "positions_alibi_bias"]))
def test_combinations(impl, name):
    combo = dict(COMBOS[name])
    options = {}
    bias = None
    if "bias" in combo:
        bias = bias_of(combo.pop("bias") + (SQ, SK))
    if "mask" in combo:
        options["mask"] = random_mask(combo.pop("mask") + (SQ, SK))
    if combo.pop("alibi", False):
        options["alibi_slopes"] = SLOPES
    if combo.pop("sinks", False):
        options["sinks"] = rand(9, (H,))
    if combo.pop("segments", False):
        ids = np.sort(np.random.default_rng(1).integers(0, 3, (B, SK)), axis=1).astype(np.int32)
        options["q_segment_ids"] = jax.device_put(ids[:, :SQ].copy(), cpu())
        options["kv_segment_ids"] = jax.device_put(ids, cpu())
    if combo.pop("seqused", False):
        options["seqused_q"] = jax.device_put(np.array([60, 72], np.int32), cpu())
        options["seqused_k"] = jax.device_put(np.array([150, 200], np.int32), cpu())
    check(impl, bias=bias, **options, **combo)


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_bias_computes_no_gradient(impl, monkeypatch):
    """custom_vjp's symbolic zeros: a bias that is not differentiated gets no dbias (the
    kernels' backward is called without bias_gradient; the pure-JAX path never
    accumulates it); a differentiated one does."""
    calls = []
    backward = _ffi_calls.backward
    monkeypatch.setattr(_ffi_calls, "backward", lambda *a: calls.append(a[-1].bias_gradient)
                        or backward(*a))
    gradient = xla_attention._Terms.bias_gradient
    monkeypatch.setattr(xla_attention._Terms, "bias_gradient",
                        lambda *a: calls.append(True) or gradient(*a))
    q, k, v = qkv()
    bias = bias_of((1, H, SQ, SK))
    f = lambda q, bias: jnp.sum(flashjax.flash_attention(q, k, v, bias=bias, implementation=impl))
    # jitted (the calls are recorded while the backward is traced): eager, the pure-JAX
    # path compiles each of its ops
    jax.jit(jax.grad(f))(q, bias)
    assert True not in calls
    calls.clear()
    jax.jit(jax.grad(f, argnums=1))(q, bias)
    assert True in calls


def test_transforms_vmap_checkpoint():
    """vmap (an unbatched broadcast bias and a batched mask), checkpoint, jit."""
    q, k, v = qkv()
    bias = bias_of((1, 1, SQ, SK))
    masks = jnp.stack([random_mask((B, H, SQ, SK), seed=s) for s in (1, 2)])

    def f(q, bias, mask):
        return flashjax.flash_attention(q, k, v, bias=bias, mask=mask, implementation="cpu")
    got = jax.jit(jax.vmap(f, in_axes=(None, None, 0)))(q, bias, masks)
    for i in range(2):
        np.testing.assert_allclose(got[i], f(q, bias, masks[i]), atol=1e-6)
    loss = lambda q, bias: jnp.sum(f(q, bias, masks[0]) ** 2)
    g = jax.grad(loss, argnums=(0, 1))(q, bias)
    g_ckpt = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(q, bias)
    for a, b in zip(g, g_ckpt):
        np.testing.assert_allclose(a, b, atol=1e-5)


BAD = {
    "bias_rank": (ValueError, "bias must have shape", dict(bias=jnp.zeros((H, SQ, SK)))),
    "bias_heads": (ValueError, "bias must have shape", dict(bias=jnp.zeros((1, 3, SQ, SK)))),
    "bias_batch": (ValueError, "bias must have shape", dict(bias=jnp.zeros((3, 1, SQ, SK)))),
    "bias_seqlen": (ValueError, "bias must have shape", dict(bias=jnp.zeros((1, 1, SK, SQ)))),
    "bias_int": (TypeError, "bias must be a float", dict(bias=jnp.zeros((1, 1, SQ, SK), int))),
    "mask_int": (TypeError, "mask must be a bool", dict(mask=jnp.ones((1, 1, SQ, SK), int))),
    "mask_float": (TypeError, "mask must be a bool", dict(mask=jnp.ones((1, 1, SQ, SK)))),
    "mask_shape": (ValueError, "mask must have shape", dict(mask=jnp.ones((1, 1, SQ, 1), bool))),
    "alibi_shape": (ValueError, "alibi_slopes must have shape",
                    dict(alibi_slopes=jnp.ones((HK,), jnp.float32))),
    "alibi_dtype": (TypeError, "alibi_slopes must be float32",
                    dict(alibi_slopes=jnp.ones((H,), jnp.bfloat16))),
}


@pytest.mark.parametrize("error, match, kwargs", BAD.values(), ids=BAD.keys())
def test_bad_input(error, match, kwargs):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        flashjax.flash_attention(q, k, v, **kwargs)
