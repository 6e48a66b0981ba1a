"""Bad input raises ValueError (shapes, ranges) or TypeError (dtypes, argument types)
naming the argument, before anything runs (also at trace time, under jit/eval_shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax


def shapes(b=1, sq=8, sk=8, hq=4, hk=2, d=16, dv=16):
    return (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)


def arrays(*shape_triple, dtype=jnp.float32):
    shape_triple = shape_triple or shapes()
    # Random, not zeros: nothing here may depend on the values anyway.
    return [jax.random.normal(jax.random.key(i), s, jnp.float32).astype(dtype)
            for i, s in enumerate(shape_triple)]


def raises_everywhere(error, match, q, k, v, **kwargs):
    """The error comes eagerly, under jit and under eval_shape, naming the argument."""
    with pytest.raises(error, match=match):
        flashjax.flash_attention(q, k, v, **kwargs)
    with pytest.raises(error, match=match):
        jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, **kwargs))(q, k, v)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda q, k, v: flashjax.flash_attention(q, k, v, **kwargs), *specs)


def _replace(triple, index, shape):
    triple = list(triple)
    triple[index] = shape
    return triple


BAD_SHAPES = {
    "q_rank_3": (_replace(shapes(), 0, (1, 8, 4)), r"\bq\b.*rank|rank.*\bq\b"),
    "k_rank_5": (_replace(shapes(), 1, (1, 1, 8, 2, 16)), r"\bk\b.*rank|rank.*\bk\b"),
    "v_rank_2": (_replace(shapes(), 2, (8, 16)), r"\bv\b.*rank|rank.*\bv\b"),
    "batch_q_vs_kv": (shapes(b=1)[:1] + shapes(b=2)[1:], "batch"),
    "batch_k_vs_v": (_replace(shapes(), 2, (2, 8, 2, 16)), "batch"),
    "head_dim_q_vs_k": (_replace(shapes(), 1, (1, 8, 2, 8)), "head_dim"),
    "seqlen_k_vs_v": (_replace(shapes(), 2, (1, 9, 2, 16)), "seqlen_k"),
    "heads_k_vs_v": (_replace(shapes(), 2, (1, 8, 1, 16)), "heads_kv"),
    "heads_not_multiple": (shapes(hq=4, hk=3), "heads_q"),
    "heads_kv_more_than_q": (shapes(hq=2, hk=4), "heads_q"),
    "head_dim_0": (shapes(d=0), r"head_dim\b"),
    "head_dim_257": (shapes(d=257), r"head_dim\b"),
    "head_dim_v_0": (shapes(dv=0), "head_dim_v"),
    "head_dim_v_257": (shapes(dv=257), "head_dim_v"),
    "seqlen_q_0": (shapes(sq=0), "seqlen_q"),
    "seqlen_k_0": (shapes(sk=0), "seqlen_k"),
}


@pytest.mark.parametrize("triple,match", BAD_SHAPES.values(), ids=BAD_SHAPES.keys())
def test_bad_shapes(triple, match):
    raises_everywhere(ValueError, match, *arrays(*triple))


@pytest.mark.parametrize("dtypes", [
    ("int32",) * 3, ("float64",) * 3, ("int8",) * 3, ("bool",) * 3, ("complex64",) * 3,
    ("float32", "bfloat16", "float32"), ("float16", "float16", "bfloat16"), ("float32", "float32", "float16"),
], ids=str)
def test_bad_dtypes(dtypes):
    q, k, v = (x.astype(dt) for x, dt in zip(arrays(), dtypes))
    raises_everywhere(TypeError, "dtype", q, k, v)


def test_non_array_input():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"\bq\b"):
        flashjax.flash_attention([[1.0]], k, v)
    with pytest.raises(TypeError, match=r"\bv\b"):
        flashjax.flash_attention(q, k, "v")


BAD_OPTIONS = {
    "window_1_entry": (dict(window_size=(1,)), TypeError, "window_size"),
    "window_3_entries": (dict(window_size=(1, 2, 3)), TypeError, "window_size"),
    "window_float": (dict(window_size=(1.5, 2)), TypeError, "window_size"),
    "window_int": (dict(window_size=4), TypeError, "window_size"),
    "window_none": (dict(window_size=None), TypeError, "window_size"),
    "window_str": (dict(window_size="ab"), TypeError, "window_size"),
    "window_left_-2": (dict(window_size=(-2, 0)), ValueError, "window_size"),
    "window_right_-5": (dict(window_size=(3, -5)), ValueError, "window_size"),
    "scale_jax_array": (dict(softmax_scale=jnp.float32(0.5)), TypeError, "softmax_scale"),
    "scale_jax_vector": (dict(softmax_scale=jnp.ones((2,))), TypeError, "softmax_scale"),
    "scale_str": (dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
    "scale_complex": (dict(softmax_scale=1j), TypeError, "softmax_scale"),
    "scale_nan": (dict(softmax_scale=float("nan")), (TypeError, ValueError), "softmax_scale"),
    "softcap_negative": (dict(softcap=-1.0), ValueError, "softcap"),
    "softcap_str": (dict(softcap="1.0"), TypeError, "softcap"),
    "causal_str": (dict(causal="yes"), TypeError, "causal"),
    "sinks_short": (dict(sinks=jnp.zeros((3,), jnp.float32)), ValueError, "sinks"),
    "sinks_2d": (dict(sinks=jnp.zeros((1, 4), jnp.float32)), ValueError, "sinks"),
    "sinks_scalar": (dict(sinks=jnp.zeros((), jnp.float32)), ValueError, "sinks"),
    "sinks_bf16": (dict(sinks=jnp.zeros((4,), jnp.bfloat16)), TypeError, "sinks"),
    "sinks_int": (dict(sinks=jnp.zeros((4,), jnp.int32)), TypeError, "sinks"),
    "sinks_f64": (dict(sinks=jnp.zeros((4,), jnp.float64)), TypeError, "sinks"),
}


@pytest.mark.parametrize("kwargs,error,match", BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_options(kwargs, error, match):
    raises_everywhere(error, match, *arrays(), **kwargs)


def test_traced_scale_or_softcap_rejected_under_jit():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="softmax_scale"):
        jax.jit(lambda q, k, v, s: flashjax.flash_attention(q, k, v, softmax_scale=s))(q, k, v, 0.5)
    with pytest.raises((TypeError, ValueError), match="softcap"):
        jax.jit(lambda q, k, v, c: flashjax.flash_attention(q, k, v, softcap=c))(q, k, v, 2.0)


def test_valid_edge_values_accepted():
    # The boundaries of the valid ranges must not raise.
    q, k, v = arrays(*shapes(d=256, dv=1, hq=3, hk=1))
    flashjax.flash_attention(q, k, v, window_size=(-1, -1), softcap=0.0, softmax_scale=np.float32(0.1))
    flashjax.flash_attention(q, k, v, window_size=(0, 0), causal=np.bool_(True), softmax_scale=2)
    flashjax.flash_attention(q, k, v, window_size=(np.int64(3), 1), sinks=jnp.zeros((3,), jnp.float32))
    q, k, v = arrays(*shapes(d=1, dv=256, sq=1, sk=1))
    flashjax.flash_attention(q, k, v)


def test_unsupported_autodiff_modes_raise_the_documented_errors():
    """docs/api.md "Differentiation": reverse mode first order only."""
    q = jax.random.normal(jax.random.key(0), (1, 16, 2, 32), jnp.float32)
    f = lambda q: flashjax.flash_attention(q, q, q).sum()
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (q,), (q,))
    with pytest.raises(ValueError, match="cannot be differentiated"):
        jax.grad(lambda q: jax.grad(f)(q).sum())(q)
