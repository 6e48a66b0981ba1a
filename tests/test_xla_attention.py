"""flashjax.xla_attention (implementation="xla"): the pure-JAX blockwise attention,
called directly (Layout / Config built here, no FFI) against the float64 reference:
forward (out, lse) and gradients (dq, dk, dv, dsinks, with cotangents on out and lse)
for the option matrix, GQA/MQA, sequence lengths, rows without keys, positions,
seqused, segment ids, packed batches (with adversarial metadata), low precision,
jit / vmap / shard_map, and a 32k-row run in bounded memory.

Most tests run with small blocks (BLOCK_Q / BLOCK_K lowered) so that every case has
several query and key blocks: skipped, unmasked and masked block pairs all occur.
The shared checks of helpers.py / varlen_helpers.py call flashjax.flash_attention /
flash_attention_varlen; here those names are bound to thin wrappers around
xla_attention.attention_core.
"""

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import _checks, reference, xla_attention
from flashjax._calls import Layout
from helpers import (Case, case_inputs, check_close, check_forward, check_gradients, counting_jit,
                     empty_row_cases, gqa_cases, ids, option_cases, position_cases, rand,
                     run_on_host_devices, seqlen_cases)
from varlen_helpers import (SegmentCase, VarlenCase, check_segments, check_varlen,
                            segment_cases, varlen_cases)


# ----------------------------------------------------------------------------- the wrappers


def dense_xla(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              sinks=None, return_lse=False, deterministic=False, q_segment_ids=None,
              kv_segment_ids=None, seqused_q=None, seqused_k=None, q_offset=None,
              kv_offset=None, implementation=None):
    """flash_attention's contract on xla_attention.attention_core."""
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              sinks is not None, deterministic, "xla")
    as_i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    layout = Layout(seqused_q=as_i32(seqused_q), seqused_k=as_i32(seqused_k),
                    q_segment_ids=as_i32(q_segment_ids), kv_segment_ids=as_i32(kv_segment_ids),
                    diagonal_offset=_checks.diagonal_offset(q_offset, kv_offset, q.shape[0],
                                                            "(batch,)"))
    if sinks is None:
        sinks = jnp.zeros((q.shape[2],), jnp.float32)
    out, lse = xla_attention.attention_core(q, k, v, sinks, layout, cfg)
    return (out, lse) if return_lse else out


def varlen_xla(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False,
               deterministic=False, q_offset=None, kv_offset=None, implementation=None):
    """flash_attention_varlen's contract on xla_attention.attention_core."""
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              sinks is not None, deterministic, "xla", packed=True,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    as_i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    sequences = np.shape(cu_seqlens_q)[0] - 1
    layout = Layout(cu_seqlens_q=as_i32(cu_seqlens_q), cu_seqlens_k=as_i32(cu_seqlens_k),
                    seqused_q=as_i32(seqused_q), seqused_k=as_i32(seqused_k),
                    diagonal_offset=_checks.diagonal_offset(q_offset, kv_offset, sequences,
                                                            "(num_seqs,)"))
    if sinks is None:
        sinks = jnp.zeros((q.shape[1],), jnp.float32)
    out, lse = xla_attention.attention_core(q, k, v, sinks, layout, cfg)
    return (out, lse) if return_lse else out


@pytest.fixture(autouse=True)
def xla_path(monkeypatch):
    """The shared checks call the wrappers; several blocks per case."""
    monkeypatch.setattr(flashjax, "flash_attention", dense_xla)
    monkeypatch.setattr(flashjax, "flash_attention_varlen", varlen_xla)
    monkeypatch.setattr(xla_attention, "BLOCK_Q", 32)
    monkeypatch.setattr(xla_attention, "BLOCK_K", 16)


@pytest.fixture
def default_blocks(monkeypatch):
    monkeypatch.setattr(xla_attention, "BLOCK_Q", 512)
    monkeypatch.setattr(xla_attention, "BLOCK_K", 512)


def check(case):
    check_forward(case)
    check_gradients(case)


# ----------------------------------------------------------------------------- dense cases

OPTION_CASES = (option_cases(seqlens=((70, 90), (90, 70)),
                             windows=[(-1, -1), (12, -1), (-1, 5), (7, 3)])
                + option_cases(dtypes=("bfloat16",), seqlens=((90, 70),),
                               windows=[(-1, -1), (7, 3)], head_dim=32)[::3])
GQA_CASES = gqa_cases(dtypes=("float32", "bfloat16"))
SEQLEN_CASES = seqlen_cases(seqlens=[(1, 1), (1, 33), (33, 1), (17, 128), (128, 17), (200, 200)],
                            head_dim=16)
EMPTY_ROW_CASES = empty_row_cases() + [
    Case(seqlen_q=16, seqlen_k=64, head_dim=8, causal=True, window_size=(4, -1), sinks=True)]
POSITION_CASES = position_cases()[::2] + position_cases(dtypes=("bfloat16",), head_dim=32)[1::6]
HEAD_DIM_CASES = [Case(seqlen_q=70, seqlen_k=70, head_dim=d, head_dim_v=dv, causal=True)
                  for d, dv in [(1, 1), (64, 32), (40, 72), (256, 1)]]
INT32_EDGE_CASES = [
    # Positions near the int32 limits: the window bounds saturate instead of wrapping.
    Case(seqlen_q=40, seqlen_k=50, head_dim=8, window_size=(5, -1), q_offset=0,
         kv_offset=2**31 - 1, sinks=True),
    Case(seqlen_q=40, seqlen_k=50, head_dim=8, window_size=(-1, 3), q_offset=2**31 - 1,
         kv_offset=0),
    Case(seqlen_q=40, seqlen_k=50, head_dim=8, window_size=(6, 2), q_offset=2**31 - 30,
         kv_offset=2**31 - 40),
    Case(seqlen_q=40, seqlen_k=50, head_dim=8, window_size=(2**33, 2**31 + 5),
         q_offset=-(2**31), kv_offset=0),
    Case(seqlen_q=40, seqlen_k=50, head_dim=8, causal=True, window_size=(2**31 + 3, -1),
         q_offset=2**31 - 1, kv_offset=40),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=ids(OPTION_CASES))
def test_option_matrix(case):
    check(case)


@pytest.mark.parametrize("case", GQA_CASES, ids=ids(GQA_CASES))
def test_gqa_mqa(case):
    check(case)


@pytest.mark.parametrize("case", SEQLEN_CASES, ids=ids(SEQLEN_CASES))
def test_seqlens(case):
    check(case)


@pytest.mark.parametrize("case", EMPTY_ROW_CASES, ids=ids(EMPTY_ROW_CASES))
def test_rows_without_keys(case):
    # The checks assert out == 0 and dq == 0 on rows that see no key, lse == -inf (or
    # the sink), dk == dv == 0 on keys no row sees; the lse cotangent is nonzero there.
    assert (~case.mask().any(axis=1)).any() or (~case.mask().any(axis=0)).any()
    check(case)


@pytest.mark.parametrize("case", POSITION_CASES, ids=ids(POSITION_CASES))
def test_positions(case):
    check(case)


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=ids(HEAD_DIM_CASES))
def test_head_dims(case):
    check(case)


@pytest.mark.parametrize("case", INT32_EDGE_CASES, ids=ids(INT32_EDGE_CASES))
def test_positions_near_int32_limits(case):
    check(case)


@pytest.mark.parametrize("case", [
    Case(batch=2, seqlen_q=600, seqlen_k=700, heads_q=4, heads_kv=2, head_dim=16, causal=True,
         sinks=True),
    Case(seqlen_q=1100, seqlen_k=300, heads_q=2, heads_kv=1, head_dim=16, window_size=(40, 7),
         softcap=5.0),
], ids=str)
def test_default_block_sizes(case, default_blocks):
    check(case)


@pytest.mark.parametrize("case", [
    Case(seqlen_q=40, seqlen_k=50, heads_q=4, heads_kv=2, head_dim=16, sinks=True, causal=True),
    Case(seqlen_q=40, seqlen_k=50, heads_q=4, heads_kv=1, head_dim=32, dtype="bfloat16",
         softcap=5.0),
], ids=str)
def test_gradient_of_out_only(case):
    check_gradients(case, return_lse=False)


def test_gradient_through_lse_only():
    case = Case(seqlen_q=30, seqlen_k=45, heads_q=2, heads_kv=1, head_dim=16, window_size=(5, 5),
                sinks=True)
    q, k, v, s = case_inputs(case)

    def grads(attention, **kw):
        def loss(q, k, v, s):
            _, lse = attention(q, k, v, sinks=s, return_lse=True, window_size=(5, 5), **kw)
            return jnp.sum(jnp.sin(lse))
        return jax.grad(loss, argnums=(0, 1, 2, 3))

    ours = jax.jit(grads(dense_xla))(q, k, v, s)
    want = grads(reference.attention, compute_dtype=jnp.float64)(
        *(x.astype(jnp.float64) for x in (q, k, v, s)))
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), ours, want):
        check_close(g, w, name=name)
    np.testing.assert_array_equal(np.asarray(ours[2]), 0.0)


def test_large_logits_and_dominating_sinks():
    case = Case(seqlen_q=70, seqlen_k=90, heads_q=2, heads_kv=1, head_dim=32, softmax_scale=8.0,
                sinks=True)
    _, lse = check_forward(case)
    assert np.abs(lse).max() > 88
    q, k, v, _ = case_inputs(Case(seqlen_q=40, seqlen_k=40, heads_q=2, heads_kv=2, head_dim=16))
    plain = np.asarray(dense_xla(q, k, v, causal=True))
    tiny = dense_xla(q, k, v, causal=True, sinks=jnp.full((2,), -1e4, jnp.float32))
    np.testing.assert_allclose(np.asarray(tiny), plain, rtol=1e-6, atol=1e-6)
    huge, lse = dense_xla(q, k, v, causal=True, sinks=jnp.full((2,), 1e3, jnp.float32),
                          return_lse=True)
    assert np.abs(np.asarray(huge)).max() < 1e-30
    np.testing.assert_allclose(np.asarray(lse), 1e3, rtol=1e-6)


def test_very_negative_scores_are_not_lost():
    # Scores near -1e4 in a row that meets masked blocks first: the running max must not
    # be reset to 0 (exp(-1e4) would underflow and the row would look empty).
    q = jnp.full((1, 8, 1, 4), 100.0, jnp.float32)
    k = jnp.full((1, 40, 1, 4), -25.0, jnp.float32)
    v = rand(1, (1, 40, 1, 4))
    # (Key blocks of 16: row 3 sees keys 16..18 only, after a masked block it sees none of.)
    for options in (dict(window_size=(1, 1), q_offset=14), dict(causal=True)):
        out, lse = dense_xla(q, k, v, softmax_scale=1.0, return_lse=True, **options)
        want_out, want_lse = reference.attention(q.astype(jnp.float64), k.astype(jnp.float64),
                                                 v.astype(jnp.float64), softmax_scale=1.0,
                                                 return_lse=True, **options)
        check_close(out, want_out, name="out")
        check_close(lse, want_lse, name="lse")


# ----------------------------------------------------------------------------- seqused, segments


def check_options_against_reference(q, k, v, sinks, opts):
    """dense_xla(..., **opts) (out, lse, and gradients under random cotangents) against the
    float64 reference; returns (out, lse, grads) as JAX arrays."""
    (out, lse), pull = jax.vjp(lambda q, k, v, s: dense_xla(q, k, v, sinks=s, **opts),
                               q, k, v, sinks)
    hi = [x.astype(jnp.float64) for x in (q, k, v, sinks)]
    (r_out, r_lse), r_pull = jax.vjp(
        lambda q, k, v, s: reference.attention(q, k, v, sinks=s, compute_dtype=jnp.float64,
                                               **opts), *hi)
    check_close(out, r_out, name="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
    finite = np.isfinite(np.asarray(r_lse))
    check_close(np.asarray(lse)[finite], np.asarray(r_lse)[finite], name="lse")
    d_out, d_lse = rand(5, out.shape), rand(6, lse.shape)
    grads = pull((d_out, d_lse))
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads,
                          r_pull((d_out.astype(jnp.float64), d_lse.astype(jnp.float64)))):
        check_close(g, r, name=name)
    return out, lse, grads


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_dense(causal):
    """Rows past seqused_q: out 0, lse -inf even with sinks, dq 0; keys past seqused_k
    ignored (dk = dv = 0); causal aligned on the used lengths; with and without positions."""
    case = Case(batch=3, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=24,
                causal=causal, sinks=True)
    q, k, v, sinks = case_inputs(case)
    used_q = jnp.array([70, 0, 33], jnp.int32)
    used_k = jnp.array([5, 90, 64], jnp.int32)
    for positions in ({}, dict(q_offset=jnp.array([3, 0, 40], jnp.int32), kv_offset=7)):
        opts = dict(causal=causal, seqused_q=used_q, seqused_k=used_k, return_lse=True,
                    window_size=(30, -1), **positions)
        out, lse, grads = check_options_against_reference(q, k, v, sinks, opts)
        assert np.all(np.asarray(out)[1] == 0) and np.all(np.asarray(out)[2, 33:] == 0)
        assert np.isneginf(np.asarray(lse)[1]).all() and np.isneginf(np.asarray(lse)[2, :, 33:]).all()
        dq, dk, dv = (np.asarray(g) for g in grads[:3])
        assert np.all(dq[1] == 0) and np.all(dq[2, 33:] == 0)
        assert np.all(dk[0, 5:] == 0) and np.all(dv[0, 5:] == 0) and np.all(dk[2, 64:] == 0)


SEGMENT_CASES = segment_cases() + segment_cases(dtypes=("bfloat16",))[1:2]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=map(str, SEGMENT_CASES))
def test_segment_ids(case):
    check_segments(case)


def test_segment_ids_with_seqused_and_positions():
    case = Case(batch=2, seqlen_q=60, seqlen_k=80, heads_q=4, heads_kv=2, head_dim=16,
                sinks=True)
    q, k, v, sinks = case_inputs(case)
    q_ids = jnp.asarray(np.repeat([[0, 1, 2, 7]], 15, axis=1).repeat(2, 0), jnp.int32)
    k_ids = jnp.asarray(np.repeat([[0, 1, 1, 2, 9]], 16, axis=1).repeat(2, 0), jnp.int32)
    opts = dict(causal=True, window_size=(25, -1), q_segment_ids=q_ids, kv_segment_ids=k_ids,
                seqused_q=jnp.array([60, 41], jnp.int32), seqused_k=jnp.array([70, 80], jnp.int32),
                q_offset=jnp.array([20, 35], jnp.int32), return_lse=True)
    check_options_against_reference(q, k, v, sinks, opts)


# ----------------------------------------------------------------------------- packed


VARLEN_CASES = varlen_cases() + varlen_cases(dtypes=("bfloat16",))[2:3] + [
    VarlenCase(lengths_q=(0, 0, 0), lengths_k=(5, 0, 3), pad_q=4, pad_k=2, sinks=True),
    VarlenCase(lengths_q=(40, 0, 33), lengths_k=(0, 7, 50), causal=True, sinks=True, pad_q=5),
    VarlenCase(lengths_q=(90, 20, 61), lengths_k=(80, 33, 61), window_size=(5, 9), pad_k=9,
               max_seqlen_q=64, max_seqlen_k=70, sinks=True, softcap=3.0),
    VarlenCase(dtype="float16", causal=True, sinks=True, seqused_q=(5, 0, 40, 1, 3)),
]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=map(str, VARLEN_CASES))
def test_varlen(case):
    check_varlen(case)


ADVERSARIAL = {
    # (cu_q, cu_k, seqused_q, seqused_k, max_seqlen): clamped as seqlen.h does.
    "non_monotonic": ([0, 50, 20, 90], [0, 40, 10, 80], None, None, 64),
    "out_of_range": ([-5, 30, 1000, 2 ** 31 - 1], [-100, 60, 70, 5000], None, None, 64),
    "int32_extremes": ([-(2 ** 31), 30, 2 ** 31 - 1, -(2 ** 31)], [0, 2 ** 31 - 1, -(2 ** 31), 80],
                       [2 ** 31 - 1, -(2 ** 31), 5], None, 64),
    "seqused_above_slot": ([0, 30, 60, 90], [0, 30, 60, 80], [100, -3, 2 ** 31 - 1],
                           [40, 5, 1000], 64),
    "longer_than_max": ([0, 90, 90, 90], [0, 80, 80, 80], None, None, 16),
}


@pytest.mark.parametrize("cu_q,cu_k,used_q,used_k,max_len", ADVERSARIAL.values(),
                         ids=ADVERSARIAL.keys())
def test_inconsistent_metadata_is_clamped(cu_q, cu_k, used_q, used_k, max_len):
    q, k, v = rand(0, (90, 2, 16)), rand(1, (80, 2, 16)), rand(2, (80, 2, 16))
    meta = [None if x is None else jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used_q, used_k)]
    sinks = rand(3, (2,))

    def f(q, k, v, s):
        return varlen_xla(q, k, v, meta[0], meta[1], max_len, max_len, seqused_q=meta[2],
                          seqused_k=meta[3], causal=True, sinks=s, return_lse=True)
    out, lse = jax.jit(f)(q, k, v, sinks)
    assert np.isfinite(np.asarray(out)).all() and not np.isnan(np.asarray(lse)).any()
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)[0]), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    if np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= 0):
        want, want_lse = reference.attention_varlen(
            q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64),
            np.asarray(cu_q), np.asarray(cu_k), max_len, max_len, causal=True,
            seqused_q=used_q, seqused_k=used_k, sinks=sinks.astype(jnp.float64),
            return_lse=True, compute_dtype=jnp.float64)
        check_close(out, want, name="out")
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))


def test_no_sequences():
    q, k, v = rand(0, (10, 2, 8)), rand(1, (6, 2, 8)), rand(2, (6, 2, 8))
    cu = jnp.zeros((1,), jnp.int32)
    f = lambda q, k, v: varlen_xla(q, k, v, cu, cu, 8, 8, sinks=jnp.ones((2,), jnp.float32),
                                   return_lse=True)
    (out, lse), pull = jax.vjp(f, q, k, v)
    assert np.all(np.asarray(out) == 0) and np.isneginf(np.asarray(lse)).all()
    for g in pull((jnp.ones_like(out), jnp.ones_like(lse))):
        assert np.all(np.asarray(g) == 0)


def test_varlen_matches_dense_on_equal_lengths():
    case = Case(batch=3, seqlen_q=80, seqlen_k=80, heads_q=4, heads_kv=2, causal=True)
    q, k, v, _ = case_inputs(case)
    cu = jnp.arange(0, 241, 80, dtype=jnp.int32)
    packed = varlen_xla(q.reshape(240, 4, 32), k.reshape(240, 2, 32), v.reshape(240, 2, 32), cu,
                        cu, 80, 80, causal=True)
    dense = dense_xla(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(packed).reshape(dense.shape), np.asarray(dense),
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- transforms


def test_traced_metadata_one_compilation():
    q, k, v = rand(0, (64, 2, 16)), rand(1, (64, 2, 16)), rand(2, (64, 2, 16))

    f, traces = counting_jit(lambda q, k, v, cu, used, offset: varlen_xla(
        q, k, v, cu, cu, 64, 64, seqused_q=used, q_offset=offset, causal=True))

    for cu, used, offset in (([0, 10, 64], [10, 54], [0, 3]), ([0, 40, 64], [3, 24], [9, -2])):
        cu, used, offset = (jnp.asarray(x, jnp.int32) for x in (cu, used, offset))
        want = reference.attention_varlen(q, k, v, np.asarray(cu), np.asarray(cu), 64, 64,
                                          seqused_q=np.asarray(used), q_offset=np.asarray(offset),
                                          causal=True)
        np.testing.assert_allclose(np.asarray(f(q, k, v, cu, used, offset)), np.asarray(want),
                                   rtol=2e-5, atol=2e-5)
    assert len(traces) == 1


def test_vmap_dense_and_packed():
    q, k, v = rand(0, (3, 2, 40, 4, 16)), rand(1, (3, 2, 56, 2, 16)), rand(2, (3, 2, 56, 2, 16))
    used = jnp.array([[40, 7], [1, 0], [13, 40]], jnp.int32)
    f = lambda q, k, v, u: dense_xla(q, k, v, causal=True, seqused_q=u, q_offset=u)
    batched = jax.jit(jax.vmap(f))(q, k, v, used)
    grads = jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))))(
        q, k, v, used)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(f(q[i], k[i], v[i], used[i])),
                                   rtol=1e-6, atol=1e-6)
        want = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q[i], k[i], v[i], used[i])
        for g, w in zip(grads, want):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=1e-5, atol=1e-6)

    qp, kp, vp = q[:, 0], k[:, 0], v[:, 0]
    cu_q, cu_k = jnp.array([0, 15, 40], jnp.int32), jnp.array([0, 45, 56], jnp.int32)
    g = lambda q, k, v: varlen_xla(q, k, v, cu_q, cu_k, 30, 45, causal=True)
    packed = jax.vmap(g)(qp, kp, vp)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(packed[i]), np.asarray(g(qp[i], kp[i], vp[i])),
                                   rtol=1e-6, atol=1e-6)


SHARD_MAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from flashjax import _checks, reference, xla_attention
    from flashjax._calls import Layout

    xla_attention.BLOCK_Q = xla_attention.BLOCK_K = 16
    mesh = Mesh(np.array(jax.devices()), ("rows",))
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(ks[0], (2, 64, 4, 16), jnp.float32)
    k = jax.random.normal(ks[1], (2, 64, 2, 16), jnp.float32)
    v = jax.random.normal(ks[2], (2, 64, 2, 16), jnp.float32)
    sinks = jax.random.normal(ks[3], (4,), jnp.float32)
    cfg = _checks.make_config(16, None, True, (20, -1), 0.0, True, False, "xla")
    rows = P(None, "rows", None, None)

    def local(q, k, v, s):  # query rows sharded, K/V replicated: a traced, varying offset
        offset = jnp.full((q.shape[0],), jax.lax.axis_index("rows") * q.shape[1], jnp.int32)
        return xla_attention.attention_core(q, k, v, s, Layout(diagonal_offset=offset), cfg)[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rows, P(), P(), P()), out_specs=rows))
    ref = lambda q, k, v, s: reference.attention(q, k, v, sinks=s, causal=True,
                                                 window_size=(20, -1), compute_dtype=jnp.float64)
    np.testing.assert_allclose(np.asarray(f(q, k, v, sinks)), np.asarray(ref(q, k, v, sinks)),
                               rtol=1e-5, atol=1e-5)
    loss = lambda f: (lambda *a: jnp.sum(jnp.sin(f(*a))))
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_inside_shard_map_with_check_vma():
    """Loop carries vary over the mesh axes (check_vma), replicated K/V and sinks get
    their gradients summed over the shards."""
    run_on_host_devices(SHARD_MAP_SCRIPT, 2, timeout=300)


# ----------------------------------------------------------------------------- long sequences


def test_32k_rows_in_bounded_memory(default_blocks):
    """32k rows (batch 1, 2 heads): compiles to O(seqlen) temporaries (no 32k x 32k array)
    and runs; the last rows match the reference on the keys they can see."""
    n, window = 32768, 300
    q, k, v = rand(0, (1, n, 2, 16)), rand(1, (1, n, 1, 16)), rand(2, (1, n, 1, 16))
    f = jax.jit(lambda q, k, v: dense_xla(q, k, v, causal=True, window_size=(window, -1),
                                          return_lse=True))
    compiled = f.lower(q, k, v).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < n * n * 4 // 64, f"{temp} bytes of temporaries"
    out, lse = compiled(q, k, v)
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()
    rows = 64
    keys = rows + window
    want = reference.attention(q[:, -rows:], k[:, -keys:], v[:, -keys:], causal=True,
                               window_size=(window, -1), compute_dtype=jnp.float64)
    check_close(np.asarray(out[:, -rows:]), np.asarray(want), name="out")
