"""Bad input raises ValueError (shapes, ranges) or TypeError (dtypes, argument types)
naming the argument, before anything runs (also at trace time, under jit/eval_shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import rand


def shapes(b=1, sq=8, sk=8, hq=4, hk=2, d=16, dv=16):
    return (b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)


def arrays(*shape_triple, dtype=jnp.float32):
    shape_triple = shape_triple or shapes()
    # Random, not zeros: nothing here may depend on the values anyway (numpy-drawn:
    # jax.random would compile a program for every shape).
    return [rand(i, s, dtype) for i, s in enumerate(shape_triple)]


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
    "scale_jax_vector": (dict(softmax_scale=jnp.ones((2,))), TypeError, "softmax_scale"),
    "scale_str": (dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
    "scale_complex": (dict(softmax_scale=1j), TypeError, "softmax_scale"),
    "scale_nan": (dict(softmax_scale=float("nan")), (TypeError, ValueError), "softmax_scale"),
    "softcap_negative": (dict(softcap=-1.0), ValueError, "softcap"),
    "softcap_str": (dict(softcap="1.0"), TypeError, "softcap"),
    "causal_str": (dict(causal="yes"), TypeError, "causal"),
    "causal_int": (dict(causal=1), TypeError, "causal"),
    "causal_vector": (dict(causal=jnp.ones((2,), bool)), TypeError, "causal"),
    "deterministic_str": (dict(deterministic="no"), TypeError, "deterministic"),
    "deterministic_none": (dict(deterministic=None), TypeError, "deterministic"),
    "return_lse_int": (dict(return_lse=0), TypeError, "return_lse"),
    "window_jax_float": (dict(window_size=(jnp.float32(2.0), 0)), TypeError, "window_size"),
    "softcap_jax_vector": (dict(softcap=jnp.ones((2,))), TypeError, "softcap"),
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


def test_traced_window_or_flag_rejected_under_jit():
    q, k, v = arrays()
    with pytest.raises(TypeError, match=r"window_size\[0\].*traced"):
        jax.jit(lambda q, k, v, w: flashjax.flash_attention(q, k, v, window_size=(w, 0)))(
            q, k, v, 3)
    with pytest.raises(TypeError, match="causal.*traced"):
        jax.jit(lambda q, k, v, c: flashjax.flash_attention(q, k, v, causal=c))(q, k, v, True)


def test_concrete_jax_and_numpy_scalars_are_static_values():
    """A concrete (not traced) JAX or NumPy scalar is taken wherever a static number or
    flag is, with the same result as the Python value."""
    q, k, v = arrays()
    want = flashjax.flash_attention(q, k, v, softmax_scale=0.5, softcap=3.0, causal=True,
                                    window_size=(5, 0), return_lse=True)
    for cast_f, cast_i, cast_b in ((jnp.float32, jnp.int32, jnp.bool_),
                                   (np.float64, np.int64, np.bool_),
                                   (np.asarray, np.asarray, np.asarray)):
        got = flashjax.flash_attention(q, k, v, softmax_scale=cast_f(0.5), softcap=cast_f(3.0),
                                       causal=cast_b(True), window_size=(cast_i(5), cast_i(0)),
                                       return_lse=cast_b(True), deterministic=cast_b(False))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


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
    q = rand(0, (1, 16, 2, 32))
    f = lambda q: flashjax.flash_attention(q, q, q).sum()
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (q,), (q,))
    with pytest.raises(ValueError, match="cannot be differentiated"):
        jax.grad(lambda q: jax.grad(f)(q).sum())(q)


@pytest.mark.parametrize("value", ["two", "0", "-3", "", "1.5"])
def test_invalid_cpu_threads_variable_is_an_error_naming_it(value, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CPU_THREADS", value)
    with pytest.raises(ValueError, match="FLASHJAX_CPU_THREADS"):
        flashjax.flash_attention(*arrays())


def test_bench_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    import importlib.util

    from flashjax import bench
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit):
        bench.parse_args(["--plot", "out.png"])
    assert "flashjax[plot]" in capsys.readouterr().err
