"""Packed (flash_attention_varlen), right-padded (seqused) and segment-id batches on the
C++ CPU kernels (implementation="cpu": the conftest fixture cpu_kernels): forward, lse
and gradients against float64 references computed sequence by sequence / segment by
segment; adversarial metadata; jit, vmap and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from helpers import Case, both_paths, case_inputs, check_close, counting_jit, rand
from varlen_helpers import (SegmentCase, VarlenCase, check_segments, check_varlen,
                            segment_cases, segment_reference, value_and_pullback,
                            varlen_cases)

VARLEN_CASES = varlen_cases() + varlen_cases(dtypes=("bfloat16",))[:3] + [
    VarlenCase(dtype="float16", causal=True, sinks=True, seqused_q=(5, 0, 40, 1, 3))]
SEGMENT_CASES = segment_cases() + segment_cases(dtypes=("bfloat16",))[:1]

pytestmark = pytest.mark.usefixtures("cpu_kernels")


@pytest.fixture(params=["one-pass", "two-pass"])
def path(request):
    """The CPU backward path (tests parametrized over `path` choose their own)."""
    return request.param


@pytest.fixture
def cpu_backward_path(path, monkeypatch):
    monkeypatch.setenv("FLASHJAX_CPU_BACKWARD", path)
    return path


# Two-pass (which differs from one-pass in dQ and dsinks only): every other case.
@pytest.mark.parametrize("path, case", both_paths(VARLEN_CASES, VARLEN_CASES[::2]))
def test_varlen(case, cpu_backward_path):
    check_varlen(case)


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=map(str, SEGMENT_CASES))
def test_segment_ids(case):
    check_segments(case)


def test_segment_reference_is_attention_per_segment():
    """The reference with segment ids (what check_segments compares to) equals the
    varlen reference run segment by segment, forward and gradients (float64)."""
    case = SegmentCase(causal=True, sinks=True, window_size=(9, -1), softcap=4.0, heads_kv=1)
    q = rand(0, (case.batch, case.seqlen, case.heads_q, case.head_dim), jnp.float64)
    k, v = (rand(i, (case.batch, case.seqlen, case.heads_kv, case.head_dim), jnp.float64)
            for i in (1, 2))
    sinks = rand(3, (case.heads_q,), jnp.float64)
    ct = (rand(4, q.shape, jnp.float64), rand(5, (case.batch, case.heads_q, case.seqlen),
                                              jnp.float64))
    results = [value_and_pullback(segment_reference(case, per_segment), (q, k, v, sinks), ct)
               for per_segment in (False, True)]
    for got, want in zip(*(jax.tree.leaves(r) for r in results)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_dense(causal, cpu_backward_path):
    """Right-padded dense batches: rows past seqused_q give 0 / -inf, keys past
    seqused_k are ignored, causal aligned on the used lengths; gradients too."""
    case = Case(batch=3, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=24,
                causal=causal, sinks=True)
    q, k, v, sinks = case_inputs(case)
    used_q = jnp.array([70, 0, 33], jnp.int32)
    used_k = jnp.array([5, 90, 64], jnp.int32)
    opts = dict(causal=causal, seqused_q=used_q, seqused_k=used_k, return_lse=True)
    (out, lse), pull = jax.vjp(
        lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s, **opts), q, k, v, sinks)
    hi = [x.astype(jnp.float64) for x in (q, k, v, sinks)]
    ref = lambda q, k, v, s: reference.attention(q, k, v, sinks=s, compute_dtype=jnp.float64,
                                                 **opts)
    (r_out, r_lse), r_pull = jax.vjp(jax.jit(ref), *hi)
    check_close(out, r_out, name="out")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(r_lse))
    finite = np.isfinite(np.asarray(r_lse))
    check_close(np.asarray(lse)[finite], np.asarray(r_lse)[finite], name="lse")
    assert np.all(np.asarray(out)[1] == 0) and np.all(np.asarray(out)[2, 33:] == 0)
    d_out, d_lse = rand(5, out.shape), rand(6, lse.shape)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), pull((d_out, d_lse)),
                          r_pull((d_out.astype(jnp.float64), d_lse.astype(jnp.float64)))):
        check_close(g, r, name=name)


def test_seqused_full_equals_dense():
    case = Case(batch=2, seqlen_q=50, seqlen_k=50, causal=True)
    q, k, v, _ = case_inputs(case)
    full = jnp.array([50, 50], jnp.int32)
    np.testing.assert_array_equal(
        flashjax.flash_attention(q, k, v, causal=True, seqused_q=full, seqused_k=full),
        flashjax.flash_attention(q, k, v, causal=True))


def test_varlen_matches_dense_on_equal_lengths():
    """Packing equal-length sequences gives the dense result bit for bit (same tiles)."""
    case = Case(batch=3, seqlen_q=80, seqlen_k=80, heads_q=4, heads_kv=2, causal=True)
    q, k, v, _ = case_inputs(case)
    cu = jnp.arange(0, 241, 80, dtype=jnp.int32)
    packed = flashjax.flash_attention_varlen(q.reshape(240, 4, 32), k.reshape(240, 2, 32),
                                             v.reshape(240, 2, 32), cu, cu, 80, 80, causal=True)
    dense = flashjax.flash_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(packed.reshape(dense.shape), dense)


ADVERSARIAL = {
    # (cu_q, cu_k, seqused_q, seqused_k, max_seqlen): clamped, never out of bounds.
    "non_monotonic": ([0, 50, 20, 90], [0, 40, 10, 80], None, None, 64),
    "out_of_range": ([-5, 30, 1000, 2 ** 31 - 1], [-100, 60, 70, 5000], None, None, 64),
    "seqused_above_slot": ([0, 30, 60, 90], [0, 30, 60, 80], [100, -3, 2 ** 31 - 1],
                           [40, 5, 1000], 64),
    "longer_than_max": ([0, 90, 90, 90], [0, 80, 80, 80], None, None, 16),
}


@pytest.mark.parametrize("cu_q,cu_k,used_q,used_k,max_len", ADVERSARIAL.values(),
                         ids=ADVERSARIAL.keys())
def test_inconsistent_metadata_is_clamped(cu_q, cu_k, used_q, used_k, max_len):
    """Garbage metadata: finite results; for non-decreasing cu_seqlens they equal the
    documented clamping (the reference applies it); gradients finite too."""
    q, k, v = rand(0, (90, 2, 16)), rand(1, (80, 2, 16)), rand(2, (80, 2, 16))
    meta = [None if x is None else jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used_q, used_k)]

    def f(q, k, v):
        return flashjax.flash_attention_varlen(q, k, v, meta[0], meta[1], max_len, max_len,
                                               seqused_q=meta[2], seqused_k=meta[3], causal=True)
    out = f(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    grads = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    if np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_k) >= 0):
        want = jax.jit(lambda q, k, v: reference.attention_varlen(
            q, k, v, np.asarray(cu_q), np.asarray(cu_k), max_len, max_len, causal=True,
            seqused_q=used_q, seqused_k=used_k, compute_dtype=jnp.float64))(
            q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64))
        check_close(out, want, name="out")


def test_metadata_is_traced_no_recompilation():
    """New cu_seqlens / seqused values reuse the compiled function."""
    q, k, v = rand(0, (64, 2, 16)), rand(1, (64, 2, 16)), rand(2, (64, 2, 16))

    f, traces = counting_jit(lambda q, k, v, cu, used: flashjax.flash_attention_varlen(
        q, k, v, cu, cu, 64, 64, seqused_q=used))

    a = f(q, k, v, jnp.array([0, 10, 64], jnp.int32), jnp.array([10, 54], jnp.int32))
    b = f(q, k, v, jnp.array([0, 40, 64], jnp.int32), jnp.array([3, 24], jnp.int32))
    assert len(traces) == 1
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_vmap_of_segment_ids_and_seqused():
    case = Case(batch=2, seqlen_q=40, seqlen_k=40, causal=True)
    q, k, v, _ = case_inputs(case)
    stack = lambda x: jnp.stack([x, x[::-1]])
    ids = jnp.array(np.repeat([[0, 1, 2, 3]], 10, axis=1).repeat(2, 0), jnp.int32)
    used = jnp.array([[40, 7], [1, 0]], jnp.int32)

    def f(q, k, v, ids, used):
        return flashjax.flash_attention(q, k, v, causal=True, q_segment_ids=ids,
                                        kv_segment_ids=ids, seqused_q=used, seqused_k=used)
    batched = jax.vmap(f)(stack(q), stack(k), stack(v), jnp.stack([ids, ids]), used)
    for i in range(2):
        np.testing.assert_array_equal(batched[i], f(stack(q)[i], stack(k)[i], stack(v)[i], ids,
                                                    used[i]))


def test_vmap_of_varlen():
    q, k, v = rand(0, (3, 50, 2, 16)), rand(1, (3, 60, 2, 16)), rand(2, (3, 60, 2, 16))
    cu_q, cu_k = jnp.array([0, 20, 50], jnp.int32), jnp.array([0, 45, 60], jnp.int32)
    f = lambda q, k, v: flashjax.flash_attention_varlen(q, k, v, cu_q, cu_k, 30, 45, causal=True)
    batched = jax.vmap(f)(q, k, v)
    for i in range(3):
        np.testing.assert_array_equal(batched[i], f(q[i], k[i], v[i]))


def varlen_args(total_q=20, total_k=20, seqs=2, heads=2, dim=16):
    return (rand(0, (total_q, heads, dim)), rand(1, (total_k, heads, dim)),
            rand(2, (total_k, heads, dim)), jnp.array([0, 10, 20][:seqs + 1], jnp.int32),
            jnp.array([0, 10, 20][:seqs + 1], jnp.int32))


BAD_VARLEN = {
    "q_rank_4": (dict(q=rand(0, (1, 20, 2, 16))), ValueError, r"\bq\b.*rank"),
    "cu_float": (dict(cu_seqlens_q=jnp.array([0., 10., 20.])), TypeError, "cu_seqlens_q.*int32"),
    "cu_rank_2": (dict(cu_seqlens_k=jnp.zeros((3, 1), jnp.int32)), ValueError, "cu_seqlens_k"),
    "cu_lengths_differ": (dict(cu_seqlens_k=jnp.array([0, 20], jnp.int32)), ValueError,
                          "cu_seqlens_k"),
    "seqused_shape": (dict(seqused_q=jnp.zeros((3,), jnp.int32)), ValueError, "seqused_q"),
    "seqused_dtype": (dict(seqused_k=jnp.zeros((2,), jnp.int64)), TypeError, "seqused_k"),
    "max_float": (dict(max_seqlen_q=10.0), TypeError, "max_seqlen_q"),
    "max_negative": (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
    "max_array": (dict(max_seqlen_q=jnp.int32(10)), TypeError, "max_seqlen_q"),
    "v_total": (dict(v=rand(2, (19, 2, 16))), ValueError, "total_k"),
}


@pytest.mark.parametrize("override,error,match", BAD_VARLEN.values(), ids=BAD_VARLEN.keys())
def test_varlen_argument_errors(override, error, match):
    q, k, v, cu_q, cu_k = varlen_args()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=10,
                max_seqlen_k=10)
    args.update(override)
    call = lambda: flashjax.flash_attention_varlen(
        args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens_q"),
        args.pop("cu_seqlens_k"), args.pop("max_seqlen_q"), args.pop("max_seqlen_k"), **args)
    with pytest.raises(error, match=match):
        call()


def test_traced_max_seqlen_is_a_type_error():
    q, k, v, cu_q, cu_k = varlen_args()
    with pytest.raises(TypeError, match="max_seqlen_q"):
        jax.jit(lambda q, n: flashjax.flash_attention_varlen(q, k, v, cu_q, cu_k, n, 10))(q, 10)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(q_segment_ids=jnp.zeros((1, 8), jnp.int32)), ValueError, "together"),
    (dict(q_segment_ids=jnp.zeros((1, 8), jnp.float32),
          kv_segment_ids=jnp.zeros((1, 8), jnp.int32)), TypeError, "q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((1, 8), jnp.int32),
          kv_segment_ids=jnp.zeros((1, 9), jnp.int32)), ValueError, "kv_segment_ids"),
    (dict(seqused_q=jnp.zeros((2,), jnp.int32)), ValueError, "seqused_q"),
    (dict(seqused_k=jnp.zeros((1,), jnp.float32)), TypeError, "seqused_k"),
], ids=["segments_alone", "segments_dtype", "segments_shape", "seqused_shape", "seqused_dtype"])
def test_dense_layout_argument_errors(kwargs, error, match):
    q, k, v = rand(0, (1, 8, 2, 16)), rand(1, (1, 8, 2, 16)), rand(2, (1, 8, 2, 16))
    with pytest.raises(error, match=match):
        flashjax.flash_attention(q, k, v, **kwargs)
