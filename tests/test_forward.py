"""Forward of flashjax.flash_attention against the float64 reference (default device)."""

import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import Case, check_forward, inputs

DTYPES = ["float32", "bfloat16", "float16"]

HEAD_DIMS = [(1, 1), (8, 8), (64, 64), (72, 72), (96, 96), (200, 200), (256, 256), (64, 32), (40, 72)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,head_dim_v", HEAD_DIMS)
def test_head_dims(dtype, head_dim, head_dim_v):
    check_forward(Case(seqlen_q=80, seqlen_k=80, head_dim=head_dim, head_dim_v=head_dim_v,
                       dtype=dtype, causal=True))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 17), (17, 17), (128, 128), (1000, 1000),
                                               (17, 128), (128, 17), (300, 1000), (1000, 300)])
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(seqlen_q, seqlen_k, causal):
    check_forward(Case(seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=24, causal=causal))


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_mqa(heads_q, heads_kv, dtype):
    check_forward(Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=heads_q, heads_kv=heads_kv,
                       head_dim=32, dtype=dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window_size", [(-1, -1), (16, -1), (-1, 8), (10, 5), (0, 0)])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("sinks", [False, True])
def test_option_matrix(causal, window_size, softcap, sinks):
    check_forward(Case(seqlen_q=90, seqlen_k=130, heads_q=4, heads_kv=2, head_dim=16,
                       causal=causal, window_size=window_size, softcap=softcap, sinks=sinks))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_option_matrix_low_precision(dtype):
    check_forward(Case(seqlen_q=130, seqlen_k=90, heads_q=4, heads_kv=1, head_dim=64, dtype=dtype,
                       causal=True, window_size=(20, 3), softcap=10.0, sinks=True))


@pytest.mark.parametrize("sinks", [False, True])
def test_rows_without_keys(sinks):
    # seqlen_q > seqlen_k with causal: the first rows see no key at all.
    case = Case(seqlen_q=64, seqlen_k=16, head_dim=8, causal=True, sinks=sinks)
    out, lse = check_forward(case)
    empty = slice(0, 48)
    np.testing.assert_array_equal(out[:, empty], 0.0)
    if not sinks:
        assert np.all(np.isneginf(lse[:, :, empty]))


def test_window_leaving_rows_empty():
    # right = -1 is unbounded; a left window with causal and sq > sk leaves rows empty.
    out, lse = check_forward(Case(seqlen_q=50, seqlen_k=20, head_dim=8, causal=True, window_size=(3, -1)))
    assert np.isneginf(lse).any() and not np.isnan(out).any()


def test_default_scale_and_explicit_scale():
    case = Case(seqlen_q=33, seqlen_k=33, head_dim=16)
    q, k, v, _ = inputs(case)
    a = flashjax.flash_attention(q, k, v)
    b = flashjax.flash_attention(q, k, v, softmax_scale=1.0 / 4.0)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    c = flashjax.flash_attention(q, k, v, softmax_scale=0.1)
    assert not np.allclose(np.asarray(a), np.asarray(c))


def test_output_dtype_follows_input():
    for dtype in DTYPES:
        q, k, v, _ = inputs(Case(dtype=dtype))
        assert flashjax.flash_attention(q, k, v).dtype == jnp.dtype(dtype)
