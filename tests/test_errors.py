"""Bad input raises ValueError/TypeError naming the argument, before anything runs."""

import jax
import jax.numpy as jnp
import pytest

import flashjax


def arrays(b=1, sq=8, sk=8, hq=4, hk=2, d=16, dv=16, dtype=jnp.float32):
    return (jnp.ones((b, sq, hq, d), dtype), jnp.ones((b, sk, hk, d), dtype),
            jnp.ones((b, sk, hk, dv), dtype))


@pytest.mark.parametrize("shapes,match", [
    (((1, 8, 4), (1, 8, 2, 16), (1, 8, 2, 16)), "q must have rank 4"),
    (((1, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)), "batch"),
    (((1, 8, 4, 16), (1, 8, 2, 8), (1, 8, 2, 16)), "head_dim of k"),
    (((1, 8, 4, 16), (1, 8, 2, 16), (1, 9, 2, 16)), "seqlen_k and heads_kv"),
    (((1, 8, 4, 16), (1, 8, 3, 16), (1, 8, 3, 16)), "multiple of heads_kv"),
    (((1, 8, 4, 300), (1, 8, 2, 300), (1, 8, 2, 16)), "head_dim must be in"),
    (((1, 8, 4, 16), (1, 8, 2, 16), (1, 8, 2, 257)), "head_dim_v must be in"),
    (((1, 0, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16)), "seqlen_q must be >= 1"),
])
def test_bad_shapes(shapes, match):
    q, k, v = (jnp.ones(s, jnp.float32) for s in shapes)
    with pytest.raises(ValueError, match=match):
        flashjax.flash_attention(q, k, v)


def test_bad_dtypes():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="q dtype"):
        flashjax.flash_attention(q.astype(jnp.int32), k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        flashjax.flash_attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match="must be an array"):
        flashjax.flash_attention([[1.0]], k, v)


def test_float64_inputs_rejected():
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        q, k, v = arrays(dtype=jnp.float64)
        with pytest.raises(TypeError, match="q dtype"):
            flashjax.flash_attention(q, k, v)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(window_size=(1,)), TypeError, "window_size"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(softmax_scale=jnp.float32(0.5)), TypeError, "softmax_scale"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
    (dict(softmax_scale=float("nan")), TypeError, "softmax_scale"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(sinks=jnp.zeros((3,), jnp.float32)), ValueError, "sinks"),
    (dict(sinks=jnp.zeros((4,), jnp.bfloat16)), TypeError, "sinks"),
])
def test_bad_options(kwargs, error, match):
    q, k, v = arrays()
    with pytest.raises(error, match=match):
        flashjax.flash_attention(q, k, v, **kwargs)


def test_traced_scale_rejected_under_jit():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="softmax_scale"):
        jax.jit(lambda q, k, v, s: flashjax.flash_attention(q, k, v, softmax_scale=s))(q, k, v, 0.5)
