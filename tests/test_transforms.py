"""JAX transformations over flash_attention: jit, vmap (each argument, nested, with
sinks), grad under jit, jax.checkpoint, eval_shape; decode shapes; a long sequence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from helpers import Case, case_inputs, check_close, check_empty_vmap, jitted_reference, rand

CASE = Case(batch=2, seqlen_q=40, seqlen_k=48, heads_q=4, heads_kv=2, head_dim=16, sinks=True)
OPTIONS = dict(causal=True, window_size=(20, -1), softcap=6.0)


def attn(q, k, v, s=None, return_lse=False):
    return flashjax.flash_attention(q, k, v, sinks=s, return_lse=return_lse, **OPTIONS)


def ref(q, k, v, s=None, return_lse=False):
    return reference.attention(q, k, v, sinks=s, return_lse=return_lse, compute_dtype=jnp.float64,
                               **OPTIONS)


def batched(x, axis, n=3):
    """n different copies of x stacked along `axis` (None: x unchanged)."""
    if axis is None:
        return x
    return jnp.stack([x * (1 + 0.25 * i) for i in range(n)], axis=axis)


VMAP_AXES = {
    "all": (0, 0, 0, 0),
    "q_only": (0, None, None, None),
    "kv_only": (None, 0, 0, None),
    "k_only": (None, 0, None, None),
    "v_only": (None, None, 0, None),
    "sinks_only": (None, None, None, 0),
    "q_and_sinks": (0, None, None, 0),
    "inner_axis": (1, 1, 1, None),
    "last_axis": (3, 3, 3, None),
}


@functools.lru_cache(maxsize=None)
def vmapped_reference(in_axes):
    """The float64 reference's (out, lse) of test_vmap's inputs for these axes: one jitted
    program for both return_lse cases (out is the same)."""
    args = [batched(x, ax) for x, ax in zip(case_inputs(CASE), in_axes)]
    return jax.jit(jax.vmap(functools.partial(ref, return_lse=True), in_axes=in_axes))(*args)


@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("in_axes", VMAP_AXES.values(), ids=VMAP_AXES.keys())
def test_vmap(in_axes, return_lse):
    q, k, v, s = case_inputs(CASE)
    args = [batched(x, ax) for x, ax in zip((q, k, v, s), in_axes)]
    f = functools.partial(attn, return_lse=return_lse)
    got = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
    want = vmapped_reference(in_axes) if return_lse else vmapped_reference(in_axes)[0]
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape
        check_close(g, w, dtype=jnp.float32)


def test_nested_vmap():
    q, k, v, s = case_inputs(CASE)
    qs = batched(batched(q, 0, 2), 0, 3)  # (3, 2, batch, ...)
    ss = batched(s, 0, 2)
    f = lambda g: jax.vmap(jax.vmap(lambda q, s: g(q, k, v, s), in_axes=(0, 0)), in_axes=(0, None))
    got = f(attn)(qs, ss)
    assert got.shape == (3, 2) + q.shape
    check_close(got, jax.jit(f(ref))(qs, ss))


@pytest.mark.parametrize("in_axes", [VMAP_AXES["all"], VMAP_AXES["q_only"], VMAP_AXES["kv_only"],
                                     VMAP_AXES["sinks_only"]], ids=["all", "q_only", "kv_only", "sinks_only"])
def test_grad_of_vmap(in_axes):
    q, k, v, s = case_inputs(CASE)
    args = [batched(x, ax) for x, ax in zip((q, k, v, s), in_axes)]
    ct = rand(7, (3,) + q.shape, jnp.float32)

    def loss(f):
        return lambda *a: jnp.sum(jax.vmap(f, in_axes=in_axes)(*a) * ct)
    got = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2, 3)))(*[x.astype(jnp.float64) for x in args])
    for name, g, w, x in zip(("dq", "dk", "dv", "dsinks"), got, want, args):
        assert g.shape == x.shape and g.dtype == x.dtype
        check_close(g, w, name=name)


def test_vmap_of_grad():
    q, k, v, s = case_inputs(CASE)
    qs = batched(q, 0)
    grad = lambda f: jax.grad(lambda q, k, v, s: jnp.sum(jnp.sin(f(q, k, v, s))), argnums=(0, 1, 2, 3))
    got = jax.vmap(grad(attn), in_axes=(0, None, None, None))(qs, k, v, s)
    want = jax.jit(jax.vmap(grad(ref), in_axes=(0, None, None, None)))(qs, k, v, s)
    for g, w in zip(got, want):
        check_close(g, w)


def test_vmap_over_an_empty_axis():
    check_empty_vmap(CASE)


def test_jit_grad_and_checkpoint():
    q, k, v, s = case_inputs(CASE)

    def loss(f):
        def fn(q, k, v, s):
            out, lse = f(q, k, v, s, return_lse=True)
            return jnp.sum(out ** 2) + jnp.sum(jnp.cos(lse))
        return fn
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2, 3)))(q, k, v, s)
    plain = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2, 3)))(q, k, v, s)
    remat = jax.jit(jax.grad(jax.checkpoint(loss(attn)), argnums=(0, 1, 2, 3)))(q, k, v, s)
    for g, r, w in zip(plain, remat, want):
        check_close(g, w)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))


def test_checkpoint_inside_a_layer_stack():
    # A scan over layers with a rematerialised attention block: the usual training set-up.
    q, k, v, s = case_inputs(CASE)
    weights = rand(3, (2, CASE.head_dim, CASE.head_dim), jnp.float32) * 0.3

    def model(f, q):
        def layer(x, w):
            return f(x @ w, k, v, s) + x, None  # head_dim == head_dim_v
        return jnp.sum(jax.lax.scan(jax.checkpoint(layer), q, weights)[0] ** 2)
    got = jax.jit(jax.grad(functools.partial(model, attn)))(q)
    check_close(got, jax.jit(jax.grad(functools.partial(model, ref)))(q.astype(jnp.float64)))


def test_eval_shape():
    case = Case(seqlen_q=5, seqlen_k=7, heads_q=4, heads_kv=2, head_dim=8, head_dim_v=12,
                dtype="bfloat16", sinks=True)
    q, k, v, s = case_inputs(case)
    out, lse = jax.eval_shape(lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s, return_lse=True),
                              q, k, v, s)
    assert out.shape == (1, 5, 4, 12) and out.dtype == jnp.bfloat16
    assert lse.shape == (1, 4, 5) and lse.dtype == jnp.float32
    out = jax.eval_shape(flashjax.flash_attention, q, k, v)
    assert out.shape == (1, 5, 4, 12) and out.dtype == jnp.bfloat16
    grads = jax.eval_shape(jax.grad(lambda q, k, v, s: jnp.sum(flashjax.flash_attention(q, k, v, sinks=s)
                                                               .astype(jnp.float32)), argnums=(0, 1, 2, 3)),
                           q, k, v, s)
    for g, x in zip(grads, (q, k, v, s)):
        assert g.shape == x.shape and g.dtype == x.dtype
    # Abstract inputs only (ShapeDtypeStruct), with vmap on top.
    spec = [jax.ShapeDtypeStruct((3,) + x.shape, x.dtype) for x in (q, k, v)]
    out = jax.eval_shape(jax.vmap(flashjax.flash_attention), *spec)
    assert out.shape == (3, 1, 5, 4, 12) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads_kv", [1, 8])
def test_decode_shapes(dtype, heads_kv):
    # One new query against a cache: sq = 1 sees every key, causal or not (bottom-right).
    case = Case(batch=3, seqlen_q=1, seqlen_k=300, heads_q=8, heads_kv=heads_kv, head_dim=64, dtype=dtype,
                sinks=True)
    q, k, v, s = case_inputs(case)
    step = jax.jit(lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s, causal=True))
    got = step(q, k, v, s)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(flashjax.flash_attention(q, k, v, sinks=s)))
    hi = jitted_reference(q, k, v, sinks=s, compute_dtype=jnp.float64)
    lo = jitted_reference(q, k, v, sinks=s, compute_dtype=jnp.dtype(dtype))
    check_close(got, hi, lo)


@pytest.mark.slow
def test_long_sequence_32k():
    # seqlen 32768, never forming the 32k x 32k matrix; spot-check row slices against the
    # reference: rows [a, b) of a causal call equal a causal call of q[a:b] on k[:b], v[:b].
    n = 32768
    q, k, v = (rand(i, (1, n, 1, 16), jnp.float32) for i in range(3))
    out, lse = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, return_lse=True))(q, k, v)
    out, lse = np.asarray(out), np.asarray(lse)
    assert out.shape == (1, n, 1, 16) and np.isfinite(out).all() and np.isfinite(lse).all()
    for a, b in [(0, 64), (12345, 12409), (n - 64, n)]:
        want, want_lse = jitted_reference(q[:, a:b], k[:, :b], v[:, :b], causal=True, return_lse=True,
                                          compute_dtype=jnp.float64)
        check_close(out[:, a:b], want, dtype=jnp.float32, name=f"out rows {a}:{b}")
        check_close(lse[:, :, a:b], want_lse, dtype=jnp.float32, name=f"lse rows {a}:{b}")
    np.testing.assert_allclose(out[0, 0], np.asarray(v)[0, 0], rtol=1e-6)  # row 0 sees key 0 only
