"""Gradients (C++ backward via custom_vjp) against jax.grad of the float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import Case, check_gradients, inputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("head_dim,head_dim_v", [(1, 1), (24, 24), (72, 72), (64, 32), (200, 96), (256, 256)])
def test_head_dims(dtype, head_dim, head_dim_v):
    check_gradients(Case(seqlen_q=70, seqlen_k=70, head_dim=head_dim, head_dim_v=head_dim_v,
                         dtype=dtype, causal=True))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 33), (17, 128), (128, 17), (200, 200)])
def test_seqlens(seqlen_q, seqlen_k):
    check_gradients(Case(seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=16, causal=True))


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 2), (4, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gqa_sums_over_group(heads_q, heads_kv, dtype):
    check_gradients(Case(batch=2, seqlen_q=50, seqlen_k=60, heads_q=heads_q, heads_kv=heads_kv,
                         head_dim=32, dtype=dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_size", [(-1, -1), (12, -1), (7, 3)])
@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("sinks", [False, True])
def test_option_matrix(causal, window_size, softcap, sinks):
    check_gradients(Case(seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=16,
                         causal=causal, window_size=window_size, softcap=softcap, sinks=sinks))


def test_rows_without_keys_have_zero_gradient():
    case = Case(seqlen_q=64, seqlen_k=16, head_dim=8, causal=True)
    dq, _, _ = check_gradients(case)
    np.testing.assert_array_equal(np.asarray(dq)[:, :48], 0.0)


def test_gradient_without_lse_and_vjp_only_out():
    case = Case(seqlen_q=40, seqlen_k=40, head_dim=16, sinks=True)
    q, k, v, sinks = inputs(case)
    out, pullback = jax.vjp(lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s), q, k, v, sinks)
    grads = pullback(jnp.ones_like(out))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert grads[3].shape == sinks.shape and grads[3].dtype == jnp.float32


def test_backward_is_deterministic():
    case = Case(batch=2, seqlen_q=130, seqlen_k=130, heads_q=4, heads_kv=1, head_dim=32, sinks=True)
    a = check_gradients(case, deterministic=True)
    b = check_gradients(case, deterministic=True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
