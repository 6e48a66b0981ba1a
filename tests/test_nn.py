"""flashjax.nn.dot_product_attention against jax.nn.dot_product_attention(implementation=
"xla") itself: rank 3 and 4, GQA, top-left causal, int and (left, right) windows
(negative bounds too), sequence lengths, bias and mask of several broadcast shapes,
scale, the residual, gradients of query, key, value and bias, implementation names,
and the errors jax.nn raises.

Rows that see no key are where the two differ by design (jax.nn averages every value,
flashjax gives 0): they are found from jax.nn's residual (its masked scores are a large
finite negative) and compared with 0, and the gradients' cotangent is 0 there.
One shape serves the cases (the C++ CPU kernels; the pure-JAX path on a few), each
case one jitted program per implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import _dropin, nn
from helpers import cpu, rand

B, T, S, N, K, H = 2, 40, 72, 4, 2, 16
QUERY_SHAPE, KEY_SHAPE = (B, T, N, H), (B, S, K, H)
TOL = 1e-5
QUERY_LENGTHS = np.array([31, 40], np.int32)
KEY_LENGTHS = np.array([50, 9], np.int32)
TRACED = ("mask", "query_seq_lengths", "key_value_seq_lengths")


def bool_array(shape, seed, p=0.75):
    return jax.device_put(np.random.default_rng(seed).random(shape) < p, cpu())


# (name, keyword arguments); bias / mask given as the shape to draw
CASES = [
    ("window-int", dict(local_window_size=5)),
    ("window-tuple-causal", dict(local_window_size=(6, 3), is_causal=True)),
    ("window-right-negative", dict(local_window_size=(9, -2))),
    ("window-left-negative", dict(local_window_size=(-3, 12))),
    ("window-empty", dict(local_window_size=(-4, 2))),
    ("lengths-causal", dict(query_seq_lengths=QUERY_LENGTHS, key_value_seq_lengths=KEY_LENGTHS,
                            is_causal=True)),
    ("query-lengths-window", dict(query_seq_lengths=QUERY_LENGTHS, local_window_size=(4, 7))),
    ("bias-full-scale", dict(bias=(B, N, T, S), scale=0.3)),
    ("bias-heads-mask-keys", dict(bias=(1, N, T, S), mask=(B, 1, 1, S))),
    ("bias-rank2-causal", dict(bias=(T, S), is_causal=True)),
    ("bias-columns-mask-rows", dict(bias=(1, 1, 1, S), mask=(N, T, 1),
                                    key_value_seq_lengths=KEY_LENGTHS)),
    ("mask-full-window", dict(mask=(B, N, T, S), local_window_size=(10, 0))),
]


def arguments(kwargs, seed=10):
    """Case kwargs with bias / mask shapes drawn as arrays."""
    kwargs = dict(kwargs)
    if "bias" in kwargs:
        kwargs["bias"] = rand(seed, kwargs["bias"])
    if "mask" in kwargs:
        kwargs["mask"] = bool_array(kwargs["mask"], seed + 1)
    return kwargs


def run(fn, implementation, q, k, v, kwargs, grads=True):
    """(out, residual) (0 and -inf on rows that see no key), and the gradients of q, k,
    v (and bias) of sum(out * w) over the other rows: one jitted program. Empty rows are
    told by the residual (jax.nn's: a large finite negative; flashjax's: -inf). Masks and
    lengths are traced."""
    kwargs = dict(kwargs)
    bias = kwargs.pop("bias", None)
    traced = {name: kwargs.pop(name) for name in TRACED if name in kwargs}
    w = rand(3, q.shape, jnp.float32)

    def loss(q, k, v, bias, traced):
        out, residual = fn(q, k, v, bias, implementation=implementation,
                           return_residual=True, **traced, **kwargs)
        empty = residual.astype(jnp.float32) < -1e30
        out = jnp.where(empty[..., None], 0, out)
        residual = jnp.where(empty, -jnp.inf, residual)
        return (out.astype(jnp.float32) * w).sum(), (out, residual)

    if not grads:
        return jax.jit(loss)(q, k, v, bias, traced)[1], ()
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    (_, outs), d = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, bias,
                                                                            traced)
    return outs, d


def check(q, k, v, kwargs, implementation, grads=True, tol=TOL):
    """Output, residual and gradients of q, k, v (and bias) against jax.nn's."""
    got = run(nn.dot_product_attention, implementation, q, k, v, kwargs, grads)
    want = run(jax.nn.dot_product_attention, "xla", q, k, v, kwargs, grads)
    assert got[0][1].shape == q.shape[:-1]
    np.testing.assert_allclose(np.asarray(got[0][1], np.float32),
                               np.asarray(want[0][1], np.float32), rtol=tol, err_msg="residual")
    for name, g, e in zip(("out", "dq", "dk", "dv", "dbias"), (got[0][0], *got[1]),
                          (want[0][0], *want[1])):
        assert g.shape == e.shape and g.dtype == e.dtype, (name, g.shape, g.dtype, e.dtype)
        e = np.asarray(e, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), e, atol=tol * np.abs(e).max(),
                                   err_msg=name)


@pytest.fixture(scope="module")
def qkv():
    return rand(0, QUERY_SHAPE), rand(1, KEY_SHAPE), rand(2, KEY_SHAPE)


@pytest.mark.parametrize("name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_matches_jax_nn(qkv, name, kwargs):
    check(*qkv, arguments(kwargs), "cpu")


def test_pure_jax_path(qkv):
    check(*qkv, arguments(dict(CASES)["bias-columns-mask-rows"]), "xla")


def test_rank3_and_mqa():
    q, k, v = rand(4, (T, N, H)), rand(5, (S, 1, H)), rand(6, (S, 1, H))
    check(q, k, v, dict(bias=rand(7, (N, T, S)), is_causal=True), "cpu")


def test_bfloat16(qkv):
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv)
    check(q, k, v, arguments(dict(bias=(1, N, T, S), is_causal=True)), "cpu", grads=False,
          tol=2e-2)


@pytest.mark.parametrize("name,expected", [(None, None), ("xla", "xla"), ("cudnn", "cuda"),
                                           ("cpu", "cpu"), ("cuda:mma", "cuda:mma")])
def test_implementation_names(qkv, monkeypatch, name, expected):
    """jax.nn's names and flashjax's reach flash_attention as flashjax's (traced only)."""
    seen = []

    def flash_attention(*args, implementation, **kwargs):
        seen.append(implementation)
        return args[0]
    monkeypatch.setattr(_dropin, "flash_attention", flash_attention)
    jax.eval_shape(lambda *a: nn.dot_product_attention(*a, implementation=name), *qkv)
    assert seen == [expected]


def test_cudnn_off_gpu_raises(qkv):
    """"cudnn" runs flashjax's CUDA kernels: on the CPU a ValueError, as jax.nn's."""
    with pytest.raises(ValueError, match="cuda"):
        jax.eval_shape(lambda *a: nn.dot_product_attention(*a, implementation="cudnn"), *qkv)


def _bad_inputs():
    """(name, (query, key, value), kwargs) that jax.nn rejects with a ValueError."""
    q, k, v = (np.zeros(s, np.float32) for s in (QUERY_SHAPE, KEY_SHAPE, KEY_SHAPE))
    return [
        ("rank5", (q[None], k[None], v[None]), {}),
        ("value-shape", (q, k, v[:, :-1]), {}),
        ("value-dtype", (q, k, v.astype(np.float16)), {}),
        ("query-dtype", (q.astype(np.float16), k, v), {}),
        ("query-batch", (q[:1], k, v), {}),
        ("query-head-dim", (q[..., :8], k, v), {}),
        ("heads", (q[:, :, :3], k, v), {}),
        ("mask-dtype", (q, k, v), dict(mask=np.ones((T, S), np.float32))),
        ("mask-rank", (q, k, v), dict(mask=np.ones((1, B, N, T, S), bool))),
        ("bias-rank", (q, k, v), dict(bias=np.ones((1, B, N, T, S), np.float32))),
        ("lengths-dtype", (q, k, v), dict(query_seq_lengths=np.ones(B, np.int64))),
        ("lengths-shape", (q, k, v), dict(key_value_seq_lengths=np.ones(B + 1, np.int32))),
        ("implementation", (q, k, v), dict(implementation="flash")),
    ]


@pytest.mark.parametrize("name,arrays,kwargs", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_errors_as_jax_nn(name, arrays, kwargs):
    arrays = [jnp.asarray(x) for x in arrays]
    for fn in (jax.nn.dot_product_attention, nn.dot_product_attention):
        with pytest.raises(ValueError):
            jax.eval_shape(lambda *a: fn(*a, **kwargs), *arrays)


@pytest.mark.parametrize("kwargs", [dict(bias=np.ones((1, K, T, S), np.float32)),
                                    dict(mask=np.ones((B, N, T, 2), bool)),
                                    dict(bias=np.ones((3, 1, T, S), np.float32))])
def test_errors_broadcast(qkv, kwargs):
    """Shapes not broadcastable to (B, N, T, S): ValueError (jax.nn: an assertion or a
    broadcasting error)."""
    with pytest.raises(ValueError, match="bias|mask"):
        jax.eval_shape(lambda *a: nn.dot_product_attention(*a, **kwargs), *qkv)


def test_errors_static_options(qkv):
    with pytest.raises(TypeError, match="local_window_size"):
        jax.eval_shape(lambda *a: nn.dot_product_attention(*a, local_window_size=(1, 2, 3)),
                       *qkv)
    with pytest.raises(TypeError, match="is_causal"):
        jax.eval_shape(lambda *a: nn.dot_product_attention(*a, is_causal="yes"), *qkv)
    with pytest.raises(TypeError, match="softmax_scale"):
        jax.jit(lambda s: nn.dot_product_attention(*qkv, scale=s)).eval_shape(0.5)
