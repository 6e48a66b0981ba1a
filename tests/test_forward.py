"""Forward (out and lse) of flashjax.flash_attention against the float64 reference,
on the C++ CPU kernels (implementation="cpu": the conftest fixture cpu_kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import (DTYPES, Case, case_inputs, check_forward, empty_row_cases, gqa_cases,
                     head_dim_cases, ids, option_cases, position_cases, rel_err,
                     seqlen_cases)

HEAD_DIM_CASES = head_dim_cases(lowp_in_turn=True)
SEQLEN_CASES = seqlen_cases()
GQA_CASES = gqa_cases()
OPTION_CASES = option_cases() + option_cases(dtypes=("bfloat16", "float16"), seqlens=((130, 90),),
                                             windows=[(-1, -1), (10, 5)], head_dim=64)
EMPTY_ROW_CASES = empty_row_cases()
POSITION_CASES = position_cases() + position_cases(dtypes=("bfloat16",), head_dim=64)[::4]

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=ids(HEAD_DIM_CASES))
def test_head_dims(case):
    check_forward(case, new_shape=True)


@pytest.mark.parametrize("case", SEQLEN_CASES, ids=ids(SEQLEN_CASES))
def test_seqlens(case):
    check_forward(case, new_shape=True)


@pytest.mark.parametrize("case", GQA_CASES, ids=ids(GQA_CASES))
def test_gqa_mqa(case):
    check_forward(case, new_shape=True)


@pytest.mark.parametrize("case", OPTION_CASES, ids=ids(OPTION_CASES))
def test_option_matrix(case):
    check_forward(case)


@pytest.mark.parametrize("case", POSITION_CASES, ids=ids(POSITION_CASES))
def test_positions(case):
    check_forward(case)


# Calls whose K / V do not fit the forward's once-per-call conversion convert each key
# tile where it is used (FLASHJAX_CPU_FORWARD_KEYS forces either; the rest of this file
# runs the default, the conversion): several query tiles, windows, GQA, head dims.
PER_TILE_CASES = [
    Case(seqlen_q=1000, seqlen_k=300, head_dim=24, causal=True),
    Case(seqlen_q=300, seqlen_k=1000, heads_q=4, heads_kv=1, head_dim=40, head_dim_v=72,
         window_size=(100, 7), softcap=5.0, sinks=True),
    Case(batch=2, seqlen_q=600, seqlen_k=600, heads_q=6, heads_kv=2, head_dim=64,
         dtype="bfloat16", causal=True, sinks=True),
]


@pytest.mark.parametrize("case", PER_TILE_CASES, ids=ids(PER_TILE_CASES))
def test_keys_converted_per_tile(case, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CPU_FORWARD_KEYS", "per-tile")
    check_forward(case, new_shape=True)


@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=ids(EMPTY_ROW_CASES))
def test_rows_without_keys(case):
    # check_forward asserts out == 0 exactly and lse == -inf (or the sink) on those rows.
    out, lse = check_forward(case, new_shape=True)
    empty = ~case.mask().any(axis=1)
    assert empty.any(), "the case must leave some rows without keys"
    assert np.isfinite(out).all() and not np.isnan(lse).any()


@pytest.mark.parametrize("scale", [None, 0.05, 1.0, 2.5])
def test_softmax_scale(scale):
    check_forward(Case(seqlen_q=33, seqlen_k=40, head_dim=16, softmax_scale=scale, softcap=8.0))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = case_inputs(Case(seqlen_q=33, seqlen_k=33, head_dim=16))
    a = flashjax.flash_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(flashjax.flash_attention(q, k, v, softmax_scale=0.25)))
    assert rel_err(flashjax.flash_attention(q, k, v, softmax_scale=0.1), a) > 1e-2


def test_causal_equals_window_right_zero():
    case = Case(seqlen_q=50, seqlen_k=70, head_dim=16, sinks=True)
    q, k, v, s = case_inputs(case)
    a = flashjax.flash_attention(q, k, v, sinks=s, causal=True, window_size=(9, 4))
    b = flashjax.flash_attention(q, k, v, sinks=s, window_size=(9, 0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_return_lse_false_returns_out_only(dtype):
    case = Case(seqlen_q=20, seqlen_k=30, heads_q=4, heads_kv=2, head_dim=16, dtype=dtype, sinks=True)
    q, k, v, s = case_inputs(case)
    out = flashjax.flash_attention(q, k, v, sinks=s)
    assert isinstance(out, jax.Array) and out.dtype == jnp.dtype(dtype) and out.shape == (1, 20, 4, 16)
    out2, lse = flashjax.flash_attention(q, k, v, sinks=s, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
    assert lse.dtype == jnp.float32 and lse.shape == (1, 4, 20)


def test_large_logits_are_stable():
    # Scores beyond 88, where exp overflows float32: a kernel must subtract the running max.
    # (The scale is moderate because the float32 rounding of q.k, amplified by the scale,
    # already costs a float32 reference ~1e-5 at scale 20.)
    case = Case(seqlen_q=70, seqlen_k=90, heads_q=2, heads_kv=1, head_dim=32, softmax_scale=8.0, sinks=True)
    out, lse = check_forward(case)
    assert np.abs(lse).max() > 88


def test_sinks_dominating_and_negligible():
    case = Case(seqlen_q=40, seqlen_k=40, heads_q=2, heads_kv=2, head_dim=16, causal=True)
    q, k, v, _ = case_inputs(case)
    plain = np.asarray(flashjax.flash_attention(q, k, v, causal=True))
    tiny = np.asarray(flashjax.flash_attention(q, k, v, causal=True, sinks=jnp.full((2,), -1e4, jnp.float32)))
    np.testing.assert_allclose(tiny, plain, rtol=1e-6, atol=1e-6)
    huge, lse = flashjax.flash_attention(q, k, v, causal=True, sinks=jnp.full((2,), 1e3, jnp.float32),
                                         return_lse=True)
    assert np.abs(np.asarray(huge)).max() < 1e-30
    np.testing.assert_allclose(np.asarray(lse), 1e3, rtol=1e-6)


def test_outputs_finite_on_random_inputs():
    # No poisoning is possible on the CPU path: just no NaN/inf anywhere.
    for dtype in DTYPES:
        case = Case(batch=2, seqlen_q=300, seqlen_k=257, heads_q=4, heads_kv=2, head_dim=72,
                    dtype=dtype, causal=True, window_size=(40, 7), softcap=20.0, sinks=True)
        q, k, v, s = case_inputs(case, seed=3)
        out, lse = flashjax.flash_attention(q, k, v, sinks=s, return_lse=True, **case.options())
        assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(np.asarray(lse)).all()
