"""Empty axes: no query rows gives an empty output; no keys gives out 0 and lse -inf
(the sink logit for used rows where sinks are given), as for rows that see no key.
No kernel runs for such calls (no FFI call in the compiled program), on every
implementation, dense and packed, eagerly, under jit and under grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import rand

IMPLEMENTATIONS = [None, "cpu", "xla"]


def no_kernel_call(f, *args):
    hlo = jax.jit(f).lower(*args).as_text()
    assert "flashjax" not in hlo, "an empty call reached a flashjax kernel"


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(2, 0, 7), (0, 5, 7), (0, 0, 0), (2, 0, 0)])
def test_no_query_rows_give_empty_results(implementation, batch, seqlen_q, seqlen_k):
    q, k, v = rand(0, (batch, seqlen_q, 4, 16)), rand(1, (batch, seqlen_k, 2, 16)), \
        rand(2, (batch, seqlen_k, 2, 8))
    f = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, return_lse=True,
                                                 implementation=implementation)
    out, lse = f(q, k, v)
    assert out.shape == (batch, seqlen_q, 4, 8) and out.dtype == q.dtype
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == jnp.float32
    no_kernel_call(f, q, k, v)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("sinks", [False, True])
def test_no_keys_give_zero_output_and_the_sink_or_minus_inf(implementation, sinks):
    q, k, v = rand(0, (2, 6, 4, 16)), rand(1, (2, 0, 2, 16)), rand(2, (2, 0, 2, 8))
    sink = rand(3, (4,)) if sinks else None
    seqused_q = jnp.array([6, 2], jnp.int32)
    f = lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s, seqused_q=seqused_q,
                                                    return_lse=True,
                                                    implementation=implementation)
    out, lse = f(q, k, v, sink)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((2, 6, 4, 8), np.float32))
    used = np.arange(6)[None, None, :] < np.asarray(seqused_q)[:, None, None]
    want = np.where(used, np.asarray(sink)[None, :, None] if sinks else -np.inf, -np.inf)
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(want, (2, 4, 6)))
    ref_out, ref_lse = flashjax.reference.attention(q, k, v, sinks=sink, seqused_q=seqused_q,
                                                    return_lse=True)
    np.testing.assert_array_equal(np.asarray(ref_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(ref_lse), np.asarray(lse))
    no_kernel_call(f, q, k, v, sink)
    # Gradients: dq 0, dsinks = the lse cotangent summed over the used rows.
    weights = rand(4, lse.shape)
    loss = lambda q, s: jnp.sum(f(q, k, v, s)[1] * weights, where=jnp.isfinite(lse))
    if sinks:
        dq, dsinks = jax.grad(loss, argnums=(0, 1))(q, sink)
        want_dsinks = np.sum(np.where(used, np.asarray(weights), 0), axis=(0, 2))
        np.testing.assert_allclose(np.asarray(dsinks), want_dsinks, rtol=1e-6)
    else:
        dq = jax.grad(lambda q: jnp.sum(f(q, k, v, None)[0]))(q)
    np.testing.assert_array_equal(np.asarray(dq), np.zeros(q.shape, np.float32))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_batches_without_rows_or_keys(implementation):
    q, k, v = rand(0, (9, 4, 16)), rand(1, (0, 2, 16)), rand(2, (0, 2, 16))
    cu_q = jnp.array([0, 4, 7], jnp.int32)  # rows 7, 8 belong to no sequence
    cu_k = jnp.zeros((3,), jnp.int32)
    sink = rand(3, (4,))
    f = lambda q, k, v: flashjax.flash_attention_varlen(
        q, k, v, cu_q, cu_k, 4, 0, sinks=sink, return_lse=True, implementation=implementation)
    out, lse = f(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((9, 4, 16), np.float32))
    want = np.where(np.arange(9)[None, :] < 7, np.asarray(sink)[:, None], -np.inf)
    np.testing.assert_array_equal(np.asarray(lse), want)
    no_kernel_call(f, q, k, v)
    # The reference agrees (it gathers each sequence's keys: there are none at all).
    ref_out, ref_lse = flashjax.reference.attention_varlen(
        q, k, v, np.asarray(cu_q), np.asarray(cu_k), 4, 0, sinks=sink, return_lse=True)
    np.testing.assert_array_equal(np.asarray(ref_out), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(ref_lse), np.asarray(lse))
    empty_q = rand(0, (0, 4, 16))
    out, lse = flashjax.flash_attention_varlen(
        empty_q, rand(1, (5, 2, 16)), rand(2, (5, 2, 16)), jnp.zeros((3,), jnp.int32),
        jnp.array([0, 2, 5], jnp.int32), 0, 3, return_lse=True, implementation=implementation)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
