"""flashjax.xla_attention (implementation="xla"): the pure-JAX blockwise attention,
called directly (Layout / Config built here, no FFI) against the float64 reference:
forward (out, lse) and gradients (dq, dk, dv, dsinks, with cotangents on out and lse)
for every option (causal, windows, softcap, sinks, GQA/MQA, head dims, dtypes, sequence
lengths, rows and keys that see nothing; combined several to a case, since the C++
matrices of test_forward.py / test_backward.py cross them all), positions (traced,
near the int32 limits), seqused, segment ids, packed batches (with adversarial
metadata), jit / vmap / shard_map, and a 32k-row run in bounded memory.

Most tests run with small blocks (BLOCK_Q / BLOCK_K lowered) so that every case has
several query and key blocks: skipped, unmasked and masked block pairs all occur.
The shared checks of helpers.py / varlen_helpers.py call flashjax.flash_attention /
flash_attention_varlen; here those names are bound to thin wrappers around
xla_attention.attention_core.
"""

import dataclasses
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import _checks, reference, xla_attention
from flashjax._spec import Extras, Layout
from helpers import (POSITION_STARTS, Case, case_inputs, check_close, check_forward,
                     check_forward_and_gradients, check_forward_values, check_gradient_values,
                     compiled_references, counting_jit, gradient_inputs, ids,
                     jitted_reference, rand, run_on_host_devices, value_and_vjp)
from varlen_helpers import (SegmentCase, VarlenCase, check_varlen_values,
                            varlen_gradient_inputs)


# ----------------------------------------------------------------------------- the wrappers


def dense_xla(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              sinks=None, return_lse=False, deterministic=False, q_segment_ids=None,
              kv_segment_ids=None, seqused_q=None, seqused_k=None, q_offset=None,
              kv_offset=None, implementation=None):
    """flash_attention's contract on xla_attention.attention_core."""
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              deterministic, "xla")
    as_i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    layout = Layout(seqused_q=as_i32(seqused_q), seqused_k=as_i32(seqused_k),
                    q_segment_ids=as_i32(q_segment_ids), kv_segment_ids=as_i32(kv_segment_ids),
                    diagonal_offset=_checks.diagonal_offset(q_offset, kv_offset, q.shape[0],
                                                            "(batch,)"))
    out, lse = xla_attention.attention_core(q, k, v, Extras(sinks=sinks), layout, cfg)
    return (out, lse) if return_lse else out


def varlen_xla(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
               window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False,
               deterministic=False, q_offset=None, kv_offset=None, implementation=None):
    """flash_attention_varlen's contract on xla_attention.attention_core."""
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              deterministic, "xla", packed=True,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    as_i32 = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    sequences = np.shape(cu_seqlens_q)[0] - 1
    layout = Layout(cu_seqlens_q=as_i32(cu_seqlens_q), cu_seqlens_k=as_i32(cu_seqlens_k),
                    seqused_q=as_i32(seqused_q), seqused_k=as_i32(seqused_k),
                    diagonal_offset=_checks.diagonal_offset(q_offset, kv_offset, sequences,
                                                            "(num_seqs,)"))
    out, lse = xla_attention.attention_core(q, k, v, Extras(sinks=sinks), layout, cfg)
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


# ----------------------------------------------------------------------------- dense cases
# The C++ matrices (test_forward.py, test_backward.py) cross every option with every
# other; this path needs each option, and each interaction with its own code (block
# pairs skipped / unmasked / masked, rows or keys that see nothing, group-major GQA
# blocks, padded head dims), once. Compilation dominates (a few seconds per program,
# small shapes or big), so each case combines several options and is checked forward
# and backward from one compiled program (check_forward_and_gradients); inputs that
# differ only in traced metadata share one compilation.

DENSE_CASES = [
    # No mask at all (128 keys are whole key blocks): the unmasked loop only; MQA; dv < d.
    Case(seqlen_q=17, seqlen_k=128, heads_q=4, heads_kv=1, head_dim=64, head_dim_v=32),
    # Causal with rows that see no key (seqlen_q > seqlen_k), sinks, GQA.
    Case(seqlen_q=90, seqlen_k=70, heads_q=4, heads_kv=2, head_dim=16, causal=True, sinks=True),
    # Left window, softcap, GQA 6/3, batch 2.
    Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=6, heads_kv=3, head_dim=16,
         window_size=(12, -1), softcap=5.0),
    # Right window, softcap and sinks, MQA 8/1, dv > d.
    Case(seqlen_q=90, seqlen_k=70, heads_q=8, heads_kv=1, head_dim=40, head_dim_v=72,
         window_size=(-1, 5), softcap=5.0, sinks=True),
    # Both edges, bfloat16, batch 2.
    Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=32,
         dtype="bfloat16", window_size=(7, 3), sinks=True),
    # Causal + left window + softcap, float16, most rows without keys.
    Case(seqlen_q=64, seqlen_k=16, heads_q=4, heads_kv=2, head_dim=40, dtype="float16",
         causal=True, window_size=(7, -1), softcap=5.0),
    # Keys that no row sees (window left edge): dk = dv = 0 there.
    Case(seqlen_q=16, seqlen_k=64, head_dim=8, causal=True, window_size=(4, -1), sinks=True),
    # Rows without keys from a two-sided window; MQA, softcap, sinks.
    Case(seqlen_q=40, seqlen_k=30, heads_q=4, heads_kv=1, head_dim=8, window_size=(2, 1),
         sinks=True, softcap=3.0),
    # Head dim 1, one query row; head dims 256 / 1, one key; one row and one key.
    Case(seqlen_q=1, seqlen_k=33, head_dim=1, causal=True),
    Case(seqlen_q=33, seqlen_k=1, head_dim=256, head_dim_v=1, window_size=(2, 1)),
    Case(seqlen_q=1, seqlen_k=1, head_dim=16),
    # Many blocks (7 x 13): skipped, unmasked and masked pairs.
    Case(seqlen_q=200, seqlen_k=200, head_dim=16, causal=True),
]


@pytest.mark.parametrize("case", DENSE_CASES, ids=ids(DENSE_CASES))
def test_dense(case):
    # Checks out == 0 and dq == 0 on rows that see no key, lse == -inf (or the sink),
    # dk == dv == 0 on keys no row sees (the lse cotangent is nonzero there).
    check_forward_and_gradients(case)


def test_default_block_sizes(default_blocks):
    # 2 query blocks x 2 key blocks of the default size; causal + window skip a pair.
    check_forward_and_gradients(Case(seqlen_q=1100, seqlen_k=700, heads_q=4, heads_kv=2,
                                     head_dim=16, causal=True, window_size=(400, -1),
                                     softcap=5.0, sinks=True))


def test_gradient_of_out_only():
    # return_lse=False: the backward gets no lse cotangent.
    check_forward_and_gradients(Case(seqlen_q=40, seqlen_k=50, heads_q=4, heads_kv=1,
                                     head_dim=32, dtype="bfloat16", softcap=5.0),
                                return_lse=False)


INT32_MAX = 2**31 - 1
POSITION_GROUPS = [
    # (case without positions, its (q_offset, kv_offset) starts): the starts of
    # position_cases and ones near the int32 limits, where the window bounds saturate
    # instead of wrapping; windows beyond int32 (static: one program each).
    (Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=16, causal=True,
          sinks=True), POSITION_STARTS + [(INT32_MAX, 40)]),
    (Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=16,
          window_size=(16, 4)),
     POSITION_STARTS + [(INT32_MAX, 0), (INT32_MAX - 29, INT32_MAX - 39)]),
    (Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=32,
          dtype="bfloat16", causal=True, window_size=(8, -1), sinks=True),
     POSITION_STARTS + [(0, INT32_MAX)]),
    (Case(seqlen_q=40, seqlen_k=50, head_dim=8, window_size=(2**33, 2**31 + 5)),
     [(-(2**31), 0), (INT32_MAX, 0)]),
    (Case(seqlen_q=40, seqlen_k=50, head_dim=8, causal=True, window_size=(2**31 + 3, -1),
          sinks=True), [(INT32_MAX, 40), (0, INT32_MAX)]),
]


@pytest.mark.parametrize("case, starts", POSITION_GROUPS, ids=[str(c) for c, _ in POSITION_GROUPS])
def test_positions(case, starts):
    """Traced q_offset / kv_offset: one compilation checks the case at every start."""
    args, ct = gradient_inputs(case)

    def run(args, ct, q_offset, kv_offset):
        attention = lambda q, k, v, s: dense_xla(q, k, v, sinks=s, return_lse=True,
                                                 q_offset=q_offset, kv_offset=kv_offset,
                                                 **case.options())
        return value_and_vjp(attention, args, ct)
    run, traces = counting_jit(run)
    for q_offset, kv_offset in starts:
        at = dataclasses.replace(case, q_offset=q_offset, kv_offset=kv_offset)
        (out, lse), grads = run(args, ct, np.int32(q_offset), np.int32(kv_offset))
        forward_refs, gradient_refs = compiled_references(at)  # (one program per group too)
        check_forward_values(at, out, lse, references=forward_refs)
        check_gradient_values(at, grads, references=gradient_refs)
    assert len(traces) == 1


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
    want = jax.jit(grads(reference.attention, compute_dtype=jnp.float64))(
        *(x.astype(jnp.float64) for x in (q, k, v, s)))
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), ours, want):
        check_close(g, w, name=name)
    np.testing.assert_array_equal(np.asarray(ours[2]), 0.0)


def test_large_logits_and_dominating_sinks():
    case = Case(seqlen_q=70, seqlen_k=90, heads_q=2, heads_kv=1, head_dim=32, softmax_scale=8.0,
                sinks=True)
    _, lse = check_forward(case, new_shape=True)
    assert np.abs(lse).max() > 88
    # One program (traced sinks): negligible sinks give the plain attention, dominating
    # ones an output of ~0 and lse = the sink.
    q, k, v, _ = case_inputs(Case(seqlen_q=40, seqlen_k=40, heads_q=2, heads_kv=2, head_dim=16))
    with_sinks = jax.jit(lambda s: dense_xla(q, k, v, causal=True, sinks=s, return_lse=True))
    tiny, _ = with_sinks(jnp.full((2,), -1e4, jnp.float32))
    plain = jitted_reference(*(x.astype(jnp.float64) for x in (q, k, v)), causal=True)
    check_close(tiny, plain, name="negligible sinks")
    huge, lse = with_sinks(jnp.full((2,), 1e3, jnp.float32))
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
        out, lse = jax.jit(lambda q, k, v: dense_xla(q, k, v, softmax_scale=1.0, return_lse=True,
                                                     **options))(q, k, v)
        want_out, want_lse = jax.jit(lambda q, k, v: reference.attention(
            q, k, v, softmax_scale=1.0, return_lse=True, **options))(
                *(x.astype(jnp.float64) for x in (q, k, v)))
        check_close(out, want_out, name="out")
        check_close(lse, want_lse, name="lse")


# ----------------------------------------------------------------------------- seqused, segments


def check_options_against_reference(q, k, v, sinks, opts):
    """dense_xla(..., **opts) (out, lse, and gradients under random cotangents; one
    compiled program) against the float64 reference; returns (out, lse, grads)."""
    batch, seqlen_q, heads_q, _ = q.shape
    ct = rand(5, (batch, seqlen_q, heads_q, v.shape[-1])), rand(6, (batch, heads_q, seqlen_q))
    (out, lse), grads = jax.jit(functools.partial(
        value_and_vjp, lambda q, k, v, s: dense_xla(q, k, v, sinks=s, **opts)))((q, k, v, sinks), ct)
    hi = [x.astype(jnp.float64) for x in (q, k, v, sinks)]
    (r_out, r_lse), r_grads = jax.jit(functools.partial(
        value_and_vjp, lambda q, k, v, s: reference.attention(q, k, v, sinks=s,
                                                              compute_dtype=jnp.float64, **opts)))(
        hi, tuple(x.astype(jnp.float64) for x in ct))
    check_close(out, r_out, name="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
    finite = np.isfinite(np.asarray(r_lse))
    check_close(np.asarray(lse)[finite], np.asarray(r_lse)[finite], name="lse")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads):
        check_close(g, r, name=name)
    return out, lse, grads


@pytest.mark.parametrize("causal, positions", [(True, False), (False, True)],
                         ids=["causal", "positions"])
def test_seqused_dense(causal, positions):
    """Rows past seqused_q: out 0, lse -inf even with sinks, dq 0; keys past seqused_k
    ignored (dk = dv = 0); causal aligned on the used lengths, or positions."""
    case = Case(batch=3, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=24,
                causal=causal, sinks=True)
    q, k, v, sinks = case_inputs(case)
    used_q = jnp.array([70, 0, 33], jnp.int32)
    used_k = jnp.array([5, 90, 64], jnp.int32)
    at = dict(q_offset=jnp.array([3, 0, 40], jnp.int32), kv_offset=7) if positions else {}
    opts = dict(causal=causal, seqused_q=used_q, seqused_k=used_k, return_lse=True,
                window_size=(30, -1), **at)
    out, lse, grads = check_options_against_reference(q, k, v, sinks, opts)
    assert np.all(np.asarray(out)[1] == 0) and np.all(np.asarray(out)[2, 33:] == 0)
    assert np.isneginf(np.asarray(lse)[1]).all() and np.isneginf(np.asarray(lse)[2, :, 33:]).all()
    dq, dk, dv = (np.asarray(g) for g in grads[:3])
    assert np.all(dq[1] == 0) and np.all(dq[2, 33:] == 0)
    assert np.all(dk[0, 5:] == 0) and np.all(dv[0, 5:] == 0) and np.all(dk[2, 64:] == 0)


def test_segment_ids():
    """Documents with padding (id -1) in a dense batch, a two-sided window, softcap, MQA."""
    case = SegmentCase(window_size=(5, 2), softcap=3.0, heads_kv=1, sinks=True)
    q, k, v, sinks = case_inputs(Case(batch=case.batch, seqlen_q=case.seqlen,
                                      seqlen_k=case.seqlen, heads_q=case.heads_q,
                                      heads_kv=case.heads_kv, head_dim=case.head_dim, sinks=True))
    ids = jnp.asarray(case.segment_ids())
    check_options_against_reference(q, k, v, sinks, dict(q_segment_ids=ids, kv_segment_ids=ids,
                                                         return_lse=True, **case.options()))


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


PACKED_GROUPS = [
    # Cases of one group differ in traced metadata only (cu_seqlens, seqused, positions):
    # one compilation runs them all.
    [VarlenCase(causal=True, sinks=True, pad_q=7, pad_k=3),
     VarlenCase(lengths_q=(70, 40, 0, 6, 0), lengths_k=(130, 0, 80, 7, 0), causal=True,
                sinks=True)],
    # Positions per sequence (chunked prefill), seqused_k, window, softcap.
    [VarlenCase(window_size=(9, 3), softcap=4.0, sinks=True, q_offset=(0, 3, 30, 1, 500),
                kv_offset=(5, 0, 0, 2, 400), seqused_k=(9, 2, 64, 1, 100)),
     VarlenCase(window_size=(9, 3), softcap=4.0, sinks=True, q_offset=(4, 0, 0, 0, 97),
                kv_offset=(0, 0, 0, 0, 0), seqused_k=(9, 4, 70, 1, 130))],
    [VarlenCase(lengths_q=(1, 1, 1), lengths_k=(200, 1, 77), heads_q=8, heads_kv=1, causal=True,
                dtype="bfloat16")],
    [VarlenCase(lengths_q=(130, 64, 3), lengths_k=(130, 64, 3), head_dim=40, head_dim_v=72,
                dtype="float16", causal=True, sinks=True, seqused_q=(100, 64, 0),
                seqused_k=(120, 10, 3))],
    # Sequences without queries or keys (with sinks: lse = the sink); no used row at all.
    [VarlenCase(lengths_q=(40, 0, 33), lengths_k=(0, 7, 50), causal=True, sinks=True, pad_q=5),
     VarlenCase(lengths_q=(0, 0, 0), lengths_k=(5, 0, 3), pad_q=78, pad_k=49, max_seqlen_q=40,
                max_seqlen_k=50, causal=True, sinks=True)],
    # Sequences longer than max_seqlen (clamped), padding rows.
    [VarlenCase(lengths_q=(90, 20, 61), lengths_k=(80, 33, 61), window_size=(5, 9), pad_k=9,
                max_seqlen_q=64, max_seqlen_k=70, sinks=True, softcap=3.0)],
]


@pytest.mark.parametrize("cases", PACKED_GROUPS, ids=[str(g[0]) for g in PACKED_GROUPS])
def test_varlen(cases):
    first = cases[0]

    def run(args, ct, metadata, q_offset, kv_offset):
        cu_q, cu_k, used_q, used_k = metadata
        attention = lambda q, k, v, s: varlen_xla(
            q, k, v, cu_q, cu_k, *first.max_seqlens(), seqused_q=used_q, seqused_k=used_k,
            sinks=s, return_lse=True, q_offset=q_offset, kv_offset=kv_offset,
            **dataclasses.replace(first, q_offset=None, kv_offset=None).options())
        return value_and_vjp(attention, args, ct)
    run, traces = counting_jit(run)
    for case in cases:
        args, ct = varlen_gradient_inputs(case)
        positions = [None if x is None else np.asarray(x, np.int32)
                     for x in (case.q_offset, case.kv_offset)]
        (out, lse), grads = run(args, ct, case.metadata(), *positions)
        check_varlen_values(case, out, lse, grads)
    assert len(traces) == 1


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


@pytest.mark.parametrize("max_len", sorted({m for *_, m in ADVERSARIAL.values()}))
def test_inconsistent_metadata_is_clamped(max_len):
    """Each ADVERSARIAL entry with this max_len, through one compiled program (metadata
    traced; a missing seqused passed as INT32_MAX, which the slot clamps to the same)."""
    q, k, v = rand(0, (90, 2, 16)), rand(1, (80, 2, 16)), rand(2, (80, 2, 16))
    sinks = rand(3, (2,))

    def value_and_grads(q, k, v, s, meta):  # the gradient of sum(out)
        f = lambda q, k, v, s: varlen_xla(q, k, v, meta[0], meta[1], max_len, max_len,
                                          seqused_q=meta[2], seqused_k=meta[3], causal=True,
                                          sinks=s, return_lse=True)
        (out, lse), pull = jax.vjp(f, q, k, v, s)
        return out, lse, pull((jnp.ones_like(out), jnp.zeros_like(lse)))
    run, traces = counting_jit(value_and_grads)
    for name, (cu_q, cu_k, used_q, used_k, _) in ((n, a) for n, a in ADVERSARIAL.items()
                                                  if a[-1] == max_len):
        used = [np.full(3, INT32_MAX) if x is None else x for x in (used_q, used_k)]
        meta = [jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, *used)]
        out, lse, grads = run(q, k, v, sinks, meta)
        assert np.isfinite(np.asarray(out)).all() and not np.isnan(np.asarray(lse)).any(), name
        assert all(np.isfinite(np.asarray(g)).all() for g in grads), name
        if np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= 0):
            want, want_lse = jax.jit(lambda q, k, v, s: reference.attention_varlen(
                q, k, v, np.asarray(cu_q), np.asarray(cu_k), max_len, max_len, causal=True,
                seqused_q=used_q, seqused_k=used_k, sinks=s, return_lse=True,
                compute_dtype=jnp.float64))(*(x.astype(jnp.float64) for x in (q, k, v, sinks)))
            check_close(out, want, name=f"{name}: out")
            np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse), err_msg=name)
    assert len(traces) == 1


def test_no_sequences():
    q, k, v = rand(0, (10, 2, 8)), rand(1, (6, 2, 8)), rand(2, (6, 2, 8))
    cu = jnp.zeros((1,), jnp.int32)
    f = lambda q, k, v, sinks: varlen_xla(q, k, v, cu, cu, 8, 8, sinks=sinks, return_lse=True)
    ct = (jnp.ones((10, 2, 8), jnp.float32), jnp.ones((2, 10), jnp.float32))
    (out, lse), grads = jax.jit(functools.partial(value_and_vjp, f))(
        (q, k, v, jnp.ones((2,), jnp.float32)), ct)
    assert np.all(np.asarray(out) == 0) and np.isneginf(np.asarray(lse)).all()
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_varlen_matches_dense_on_equal_lengths():
    case = Case(batch=3, seqlen_q=80, seqlen_k=80, heads_q=4, heads_kv=2, causal=True)
    q, k, v, _ = case_inputs(case)
    cu = jnp.arange(0, 241, 80, dtype=jnp.int32)
    packed = jax.jit(lambda q, k, v: varlen_xla(q, k, v, cu, cu, 80, 80, causal=True))(
        q.reshape(240, 4, 32), k.reshape(240, 2, 32), v.reshape(240, 2, 32))
    dense = jax.jit(lambda q, k, v: dense_xla(q, k, v, causal=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(packed).reshape(dense.shape), np.asarray(dense),
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- transforms


def test_vmap_dense_and_packed():
    """vmap (seqused and positions batched too) equals the unbatched calls: one compiled
    program each, the batch entries sharing the unbatched one."""
    q, k, v = rand(0, (3, 2, 40, 4, 16)), rand(1, (3, 2, 56, 2, 16)), rand(2, (3, 2, 56, 2, 16))
    used = jnp.array([[40, 7], [1, 0], [13, 40]], jnp.int32)

    def out_and_grads(q, k, v, u):  # the gradients of sum(out ** 2)
        out, pull = jax.vjp(lambda q, k, v: dense_xla(q, k, v, causal=True, seqused_q=u,
                                                      q_offset=u), q, k, v)
        return out, pull(2 * out)
    batched, grads = jax.jit(jax.vmap(out_and_grads))(q, k, v, used)
    single = jax.jit(out_and_grads)
    for i in range(3):
        want, want_grads = single(q[i], k[i], v[i], used[i])
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(want), rtol=1e-6, atol=1e-6)
        for g, w in zip(grads, want_grads):
            np.testing.assert_allclose(np.asarray(g[i]), np.asarray(w), rtol=1e-5, atol=1e-6)

    qp, kp, vp = q[:, 0], k[:, 0], v[:, 0]
    cu_q, cu_k = jnp.array([0, 15, 40], jnp.int32), jnp.array([0, 45, 56], jnp.int32)
    g = lambda q, k, v: varlen_xla(q, k, v, cu_q, cu_k, 30, 45, causal=True)
    packed, single = jax.jit(jax.vmap(g))(qp, kp, vp), jax.jit(g)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(packed[i]), np.asarray(single(qp[i], kp[i], vp[i])),
                                   rtol=1e-6, atol=1e-6)


SHARD_MAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from flashjax import _checks, reference, xla_attention
    from flashjax._spec import Extras, Layout

    xla_attention.BLOCK_Q = xla_attention.BLOCK_K = 16
    mesh = Mesh(np.array(jax.devices()), ("rows",))
    rng = np.random.default_rng(0)  # numpy: jax.random compiles a program per shape
    q, k, v, sinks = (jnp.asarray(rng.standard_normal(shape, np.float32))
                      for shape in ((2, 64, 4, 16), (2, 64, 2, 16), (2, 64, 2, 16), (4,)))
    cfg = _checks.make_config(16, None, True, (20, -1), 0.0, False, "xla")
    rows = P(None, "rows", None, None)

    def local(q, k, v, s):  # query rows sharded, K/V replicated: a traced, varying offset
        offset = jnp.full((q.shape[0],), jax.lax.axis_index("rows") * q.shape[1], jnp.int32)
        return xla_attention.attention_core(q, k, v, Extras(sinks=s), Layout(diagonal_offset=offset),
                                            cfg)[0]

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rows, P(), P(), P()), out_specs=rows))
    ref = lambda q, k, v, s: reference.attention(q, k, v, sinks=s, causal=True,
                                                 window_size=(20, -1), compute_dtype=jnp.float64)

    def loss(f):  # (sum(sin(out)), out)
        def value(*args):
            out = f(*args)
            return jnp.sum(jnp.sin(out)), out
        return value

    # the reference's gradients and out from one jitted program
    want, want_out = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(f(q, k, v, sinks)), np.asarray(want_out),
                               rtol=1e-5, atol=1e-5)
    got, _ = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
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
    want = jitted_reference(q[:, -rows:], k[:, -keys:], v[:, -keys:], causal=True,
                            window_size=(window, -1), compute_dtype=jnp.float64)
    check_close(np.asarray(out[:, -rows:]), np.asarray(want), name="out")
