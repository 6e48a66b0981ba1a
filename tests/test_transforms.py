"""jit, vmap, grad, checkpoint, eval_shape and long sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from helpers import Case, inputs, rel_err


def attn(q, k, v, s=None):
    return flashjax.flash_attention(q, k, v, sinks=s, causal=True, window_size=(20, -1))


def ref(q, k, v, s=None):
    return reference.attention(q, k, v, sinks=s, causal=True, window_size=(20, -1),
                               compute_dtype=jnp.float64)


CASE = Case(batch=2, seqlen_q=40, seqlen_k=48, heads_q=4, heads_kv=2, head_dim=16, sinks=True)


@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (0, None, None, None), (None, 0, 0, None),
                                     (None, None, None, 0), (1, 1, 1, None)])
def test_vmap(in_axes):
    q, k, v, s = inputs(CASE)
    n = 3
    batched = [jnp.stack([x * (1 + 0.1 * i) for i in range(n)], axis=ax) if ax is not None else x
               for x, ax in zip((q, k, v, s), in_axes)]
    got = jax.vmap(attn, in_axes=in_axes)(*batched)
    want = jax.vmap(ref, in_axes=in_axes)(*batched)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-5


def test_nested_vmap_and_grad():
    q, k, v, s = inputs(CASE)
    qs = jnp.stack([jnp.stack([q, q * 0.5]), jnp.stack([q * 2, q])])
    got = jax.vmap(jax.vmap(lambda q: attn(q, k, v, s)))(qs)
    want = jax.vmap(jax.vmap(lambda q: ref(q, k, v, s)))(qs)
    assert rel_err(got, want) < 1e-5
    loss = lambda f: (lambda q, s: jnp.sum(jax.vmap(lambda q: f(q, k, v, s))(q) ** 2))
    g = jax.grad(loss(attn), argnums=(0, 1))(qs[0], s)
    r = jax.grad(loss(ref), argnums=(0, 1))(qs[0], s)
    assert rel_err(g[0], r[0]) < 1e-4 and rel_err(g[1], r[1]) < 1e-4


def test_jit_grad_checkpoint():
    q, k, v, s = inputs(CASE)
    f = jax.checkpoint(lambda q, k, v, s: jnp.sum(attn(q, k, v, s) ** 2))
    g = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, s)
    r = jax.grad(lambda q, k, v, s: jnp.sum(ref(q, k, v, s) ** 2), argnums=(0, 1, 2, 3))(q, k, v, s)
    for a, b in zip(g, r):
        assert rel_err(a, b) < 1e-4


def test_eval_shape():
    q, k, v, s = inputs(Case(seqlen_q=5, seqlen_k=7, heads_q=4, heads_kv=2, head_dim=8,
                             head_dim_v=12, dtype="bfloat16", sinks=True))
    out, lse = jax.eval_shape(lambda *a: flashjax.flash_attention(*a[:3], sinks=a[3], return_lse=True),
                              q, k, v, s)
    assert out.shape == (1, 5, 4, 12) and out.dtype == jnp.bfloat16
    assert lse.shape == (1, 4, 5) and lse.dtype == jnp.float32


def test_decode_shape():
    case = Case(batch=3, seqlen_q=1, seqlen_k=300, heads_q=8, heads_kv=1, head_dim=64, causal=True)
    q, k, v, _ = inputs(case)
    got = flashjax.flash_attention(q, k, v, causal=True)
    assert rel_err(got, reference.attention(q, k, v, causal=True, compute_dtype=jnp.float64)) < 1e-5


def test_long_sequence_32k():
    # Never forms the 32k x 32k matrix; check a slice of queries against the reference.
    case = Case(seqlen_q=32768, seqlen_k=32768, heads_q=1, heads_kv=1, head_dim=16)
    q, k, v, _ = inputs(case)
    out = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True))(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    rows = slice(32768 - 64, 32768)
    want = reference.attention(q[:, rows], k, v, causal=True, compute_dtype=jnp.float64)
    assert rel_err(out[:, rows], want) < 1e-5
