"""Gradients (the C++ backward behind jax.custom_vjp, implementation="cpu") against
jax.vjp of the float64 reference: dq, dk, dv, dsinks, with random cotangents on out and
on lse. Both CPU backward paths (one pass per kv-head group, two passes per tile) are
chosen with FLASHJAX_CPU_BACKWARD (read by the library at each call): every case runs
on the one-pass path; the two-pass path shares its dK/dV tile code and differs in dQ
(a query tile over its key span) and the dsinks shares, so it runs a subset of each
case list in which every option, head dim, dtype, mask and position kind still occurs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from helpers import (HEAD_DIMS, Case, both_paths, case_inputs, check_close,
                     check_gradients,
                     empty_row_cases, gqa_cases, head_dim_cases, option_cases, position_cases,
                     seqlen_cases)

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(params=["one-pass", "two-pass"])
def path(request):
    """The CPU backward path (tests parametrized over `path` choose their own)."""
    return request.param


@pytest.fixture(autouse=True)
def cpu_backward_path(path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CPU_BACKWARD", path)


HEAD_DIM_CASES = head_dim_cases(seqlen=70, lowp_in_turn=True)
# Two-pass: each head-dim pair once, float32 and low precision in turn.
TWO_PASS_HEAD_DIMS = [HEAD_DIM_CASES[i + (len(HEAD_DIMS) if i % 2 else 0)]
                      for i in range(len(HEAD_DIMS))]
SEQLEN_CASES = seqlen_cases(seqlens=[(1, 1), (1, 33), (33, 1), (17, 128), (128, 17), (200, 200)],
                            head_dim=16)
GQA_CASES = gqa_cases(dtypes=("float32", "bfloat16"))
OPTION_CASES = (option_cases(seqlens=((70, 90), (90, 70)),
                             windows=[(-1, -1), (12, -1), (-1, 5), (7, 3)])
                + option_cases(dtypes=("bfloat16", "float16"), seqlens=((90, 70),),
                               windows=[(-1, -1), (7, 3)], head_dim=32))
EMPTY_ROW_CASES = empty_row_cases() + [
    # Keys that no row sees (window left edge): their dk, dv must be exactly 0.
    Case(seqlen_q=16, seqlen_k=64, head_dim=8, causal=True, window_size=(4, -1), sinks=True),
]
# The two-pass subsets (besides TWO_PASS_HEAD_DIMS; the option and position lists are
# cut with strides that still meet every mask, seqlen pair and start): each length pair,
# causal or not in turn; each GQA grouping, the dtypes in turn.
TWO_PASS_SEQLENS = SEQLEN_CASES[::4] + SEQLEN_CASES[3::4]
TWO_PASS_GQA = GQA_CASES[::3] + GQA_CASES[5::3]


@pytest.mark.parametrize("path, case", both_paths(HEAD_DIM_CASES, TWO_PASS_HEAD_DIMS))
def test_head_dims(case):
    check_gradients(case, new_shape=True)


@pytest.mark.parametrize("path, case", both_paths(SEQLEN_CASES, TWO_PASS_SEQLENS))
def test_seqlens(case):
    check_gradients(case, new_shape=True)


@pytest.mark.parametrize("path, case", both_paths(GQA_CASES, TWO_PASS_GQA))
def test_gqa_sums_over_group(case):
    check_gradients(case, new_shape=True)


@pytest.mark.parametrize("path, case", both_paths(OPTION_CASES, OPTION_CASES[::3]))
def test_option_matrix(case):
    check_gradients(case)


POSITION_CASES = position_cases()[::2] + position_cases(dtypes=("bfloat16",), head_dim=32)[1::6]


@pytest.mark.parametrize("path, case", both_paths(POSITION_CASES, POSITION_CASES[::2]))
def test_positions(case):
    check_gradients(case)


@pytest.mark.parametrize("path, case", both_paths(EMPTY_ROW_CASES, EMPTY_ROW_CASES))
def test_rows_without_keys(case):
    # check_gradients asserts finite gradients, dq == 0 on rows that see no key and
    # dk == dv == 0 on keys that no row sees; the lse cotangent is nonzero on -inf rows.
    check_gradients(case, new_shape=True)


@pytest.mark.parametrize("case", [
    Case(seqlen_q=40, seqlen_k=50, heads_q=4, heads_kv=2, head_dim=16, sinks=True, causal=True),
    Case(seqlen_q=40, seqlen_k=50, heads_q=4, heads_kv=1, head_dim=32, dtype="bfloat16", softcap=5.0),
    Case(seqlen_q=64, seqlen_k=16, head_dim=8, causal=True, sinks=True),
], ids=str)
def test_gradient_of_out_only(case):
    # return_lse=False: the backward gets no lse cotangent.
    check_gradients(case, return_lse=False, new_shape=True)


LSE_ONLY_CASE = Case(seqlen_q=30, seqlen_k=45, heads_q=2, heads_kv=1, head_dim=16,
                     window_size=(5, 5), sinks=True)


def lse_only_grads(attention, **kw):
    def loss(q, k, v, s):
        _, lse = attention(q, k, v, sinks=s, return_lse=True, window_size=(5, 5), **kw)
        return jnp.sum(jnp.sin(lse))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


@functools.lru_cache(maxsize=None)
def lse_only_reference():
    """The float64 reference's gradients of test_gradient_through_lse_only (one jitted
    program for both paths; eager, each op compiles for this shape)."""
    args = (x.astype(jnp.float64) for x in case_inputs(LSE_ONLY_CASE))
    return lse_only_grads(reference.attention, compute_dtype=jnp.float64)(*args)


def test_gradient_through_lse_only():
    # A loss on lse alone: the out cotangent is zero, and dv must be exactly 0.
    ours = lse_only_grads(flashjax.flash_attention)(*case_inputs(LSE_ONLY_CASE))
    want = lse_only_reference()
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), ours, want):
        check_close(g, w, name=name)
    np.testing.assert_array_equal(np.asarray(ours[2]), 0.0)


def test_sinks_gradient_sums_over_batch():
    case = Case(batch=3, seqlen_q=20, seqlen_k=20, heads_q=4, heads_kv=2, head_dim=8, sinks=True)
    check_gradients(case, new_shape=True)


def test_cpu_backward_is_deterministic():
    case = Case(batch=2, seqlen_q=130, seqlen_k=130, heads_q=4, heads_kv=1, head_dim=32, sinks=True)
    for deterministic in (False, True):
        a = check_gradients(case, deterministic=deterministic, new_shape=True)
        b = check_gradients(case, deterministic=deterministic, new_shape=True)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
