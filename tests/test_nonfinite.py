"""Non-finite inputs (issue 15 item 1; docs/api.md, "Non-finite values") on the CPU:
NaN and +-inf in q, k, v propagate exactly as the float64 reference says (a NaN query
row gives a NaN row, a NaN key or value reaches every row that sees it, rows that never
see it stay finite), forward and gradients, for the dense call (masks, GQA, sinks,
softcap, segment ids, seqused), packed sequences, the KV cache and ring attention.

Each check runs on implementation=None (the C++ CPU kernels) and "xla" (the pure-JAX
path, with small blocks so that masked, unmasked and skipped block pairs all occur).
The reference itself is checked against a direct float64 loop.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import reference, xla_attention
from helpers import Case, case_inputs, ids, rand, run_on_host_devices, use_implementation
from nonfinite_helpers import (VALUES, Placement, check_kvcache_nonfinite, check_nonfinite,
                               check_varlen_nonfinite)

IMPLEMENTATIONS = [None, "xla"]


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda x: x or "default")
def implementation(request, monkeypatch):
    use_implementation(monkeypatch, request.param)
    if request.param == "xla":  # several blocks per call: masked blocks occur
        monkeypatch.setattr(xla_attention, "BLOCK_Q", 16)
        monkeypatch.setattr(xla_attention, "BLOCK_K", 16)
    return request.param


CASES = [
    Case(batch=2, seqlen_q=45, seqlen_k=45, heads_q=4, heads_kv=2, head_dim=16),
    Case(batch=2, seqlen_q=45, seqlen_k=45, heads_q=4, heads_kv=2, head_dim=16, causal=True),
    Case(batch=1, seqlen_q=37, seqlen_k=53, heads_q=2, heads_kv=1, head_dim=16, causal=True),
    Case(batch=1, seqlen_q=50, seqlen_k=50, heads_q=2, heads_kv=2, head_dim=16,
         window_size=(8, 4)),
    Case(batch=1, seqlen_q=45, seqlen_k=45, heads_q=2, heads_kv=2, head_dim=16, causal=True,
         softcap=20.0, sinks=True),
]

# Row 20 of batch 1 (or 0), head 1: in the middle, so that causal rows before it do not
# see a key there; v's +-inf are in column 3 only.
PLACEMENTS = [
    Placement("q", "nan", batch=1, row=20, head=1),
    Placement("q", "nan", batch=0, row=20, head=1, column=None),
    Placement("k", "nan", batch=1, row=20, head=1),
    Placement("v", "nan", batch=0, row=20, head=1),
    Placement("v", "inf", batch=1, row=20, head=1),
    Placement("v", "-inf", batch=0, row=20, head=1, column=None),
    Placement("k", "inf", batch=0, row=20, head=1),
    Placement("q", "-inf", batch=1, row=20, head=1),
]
GRADIENT_PLACEMENTS = PLACEMENTS[0:4]


def _fits(case: Case, placement: Placement) -> Placement:
    """The placement moved into the case's shapes."""
    return Placement(placement.tensor, placement.value, min(placement.batch, case.batch - 1),
                     placement.row, min(placement.head, case.heads_kv - 1
                                        if placement.tensor != "q" else case.heads_q - 1),
                     placement.column)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_forward(case, placement, implementation):
    placement = _fits(case, placement)
    want_out, _ = check_nonfinite(case, placement)
    assert np.isfinite(want_out).any()
    if placement.value == "nan":  # (the value reaches something)
        assert np.isnan(want_out).any()


@pytest.mark.parametrize("placement", GRADIENT_PLACEMENTS, ids=str)
@pytest.mark.parametrize("case", CASES[1:4], ids=ids(CASES[1:4]))
def test_gradients(case, placement, implementation):
    check_nonfinite(case, _fits(case, placement), gradients=True)


def test_rows_without_keys_stay_empty(implementation):
    """A NaN query row that sees no key: out 0, lse -inf (no score is formed)."""
    case = Case(batch=1, seqlen_q=40, seqlen_k=20, heads_q=2, heads_kv=2, head_dim=16,
                causal=True)
    _, want_lse = check_nonfinite(case, Placement("q", "nan", row=5, column=None))
    assert np.isneginf(want_lse[0, 0, 5])


def test_segment_ids(implementation):
    """A NaN key of one segment reaches that segment's rows only, gradients too."""
    case = Case(batch=2, seqlen_q=48, seqlen_k=48, heads_q=2, heads_kv=2, head_dim=16)
    ids_ = jnp.asarray(np.repeat([[0, 1, 2]], 16, axis=1).reshape(1, 48).repeat(2, 0), jnp.int32)
    want_out, _ = check_nonfinite(case, Placement("k", "nan", batch=1, row=20, head=0),
                                  gradients=True, q_segment_ids=ids_, kv_segment_ids=ids_)
    nan_rows = np.isnan(want_out[1, :, 0]).all(-1)
    np.testing.assert_array_equal(nan_rows, np.arange(48) // 16 == 1)


def test_seqused_keys_past_the_end_are_never_read(implementation):
    case = Case(batch=2, seqlen_q=30, seqlen_k=40, heads_q=2, heads_kv=1, head_dim=16)
    used = jnp.asarray([25, 40], jnp.int32)
    for tensor in "kv":
        want_out, _ = check_nonfinite(case, Placement(tensor, "nan", batch=0, row=30, head=0),
                                      seqused_k=used)
        assert np.isfinite(want_out).all()


# ----------------------------------------------------------------------------- packed sequences


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_nan_stays_in_its_sequence(causal, implementation):
    check_varlen_nonfinite(causal)


# ----------------------------------------------------------------------------- KV cache


def test_kvcache_nan_past_cache_seqlens_is_never_read(implementation):
    check_kvcache_nonfinite()


def test_kvcache_nan_reaches_only_the_rows_that_see_it(implementation):
    check_kvcache_nonfinite(causal=True, last_key_nan=True)


# ----------------------------------------------------------------------------- ring attention

RING_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import flashjax
    from flashjax import reference

    implementation = {implementation!r}
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    rng = np.random.default_rng(0)  # numpy: jax.random compiles a program per shape
    q, k, v = (rng.standard_normal((1, 32, 2, 8), np.float32) for _ in range(3))
    k[0, 13, 1, 2] = np.nan
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    rows, lse_rows = P(None, "seq", None, None), P(None, None, "seq")
    for causal in (False, True):
        sharded = jax.jit(jax.shard_map(
            lambda q, k, v: flashjax.ring_attention(q, k, v, "seq", causal=causal,
                                                    return_lse=True,
                                                    implementation=implementation),
            mesh=mesh, in_specs=(rows, rows, rows), out_specs=(rows, lse_rows)))
        out, lse = sharded(q, k, v)
        want_out, want_lse = jax.jit(lambda q, k, v: reference.attention(
            q, k, v, causal=causal, return_lse=True, compute_dtype=jnp.float64))(q, k, v)
        for got, want in ((out, want_out), (lse, want_lse)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5,
                                       equal_nan=True)
        assert np.isnan(np.asarray(out)[0, 13:, 1]).all()
        assert np.isfinite(np.asarray(out)[0, :, 0]).all()
        if causal:  # head 0 and the rows before the NaN key: finite gradients
            grads = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a)[0]), argnums=(0, 1, 2)))(
                q, k, v)
            for g in grads:
                assert np.isfinite(np.asarray(g)[0, :, 0]).all()
            assert np.isfinite(np.asarray(grads[0])[0, :13, 1]).all()
    print("ok")
""")


def test_ring_attention(implementation):
    run_on_host_devices(RING_SCRIPT.format(implementation=implementation), 4)


# ----------------------------------------------------------------------------- the reference


def _loop_reference(q, k, v, mask, scale, softcap, sinks):
    """Attention of one (batch, head), as the spec states it, element by element."""
    sq, sk = mask.shape
    out = np.zeros((sq, v.shape[-1]))
    lse = np.full(sq, -np.inf)
    with np.errstate(all="ignore"):
        for i in range(sq):
            js = np.flatnonzero(mask[i])
            if len(js) == 0 and sinks is None:
                continue
            s = np.array([scale * np.dot(q[i], k[j]) for j in js])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            m = np.max(np.append(s, sinks if sinks is not None else -np.inf))  # NaN-propagating
            p = np.exp(s - m)
            total = np.sum(p) + (np.exp(sinks - m) if sinks is not None else 0.0)
            lse[i] = m + np.log(total)
            for c in range(v.shape[-1]):
                out[i, c] = np.sum([(p[n] / total) * v[j, c] for n, j in enumerate(js)])
    return out, lse


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("options", [dict(), dict(causal=True), dict(window_size=(2, 1)),
                                     dict(causal=True, softcap=5.0, sinks=True)],
                         ids=["full", "causal", "window", "causal-softcap-sinks"])
def test_reference_against_a_loop(options, value):
    sq, sk, d = 6, 8, 4
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s) for s in ((1, sq, 2, d), (1, sk, 1, d), (1, sk, 1, d)))
    x = VALUES[value]
    q[0, 3, 1, 2] = x           # a query element
    k[0, 5, 0, 1] = x           # a key element (seen by later rows only when causal)
    v[0, 6, 0, 3] = x           # a value element
    v[0, 2, 0, :] = -x if value != "nan" else x  # a whole value row, the other sign
    sinks = np.array([0.5, -1.0]) if options.get("sinks") else None
    softcap = options.get("softcap", 0.0)
    want_out, want_lse = reference.attention(q, k, v, return_lse=True, compute_dtype=jnp.float64,
                                             **{**options, "sinks": sinks})
    mask = reference.visible_mask(sq, sk, options.get("causal", False),
                                  options.get("window_size", (-1, -1)))
    for h in range(2):
        out, lse = _loop_reference(q[0, :, h], k[0, :, 0], v[0, :, 0], mask, 1 / np.sqrt(d),
                                   softcap, None if sinks is None else sinks[h])
        np.testing.assert_allclose(np.asarray(want_out)[0, :, h], out, rtol=1e-12, atol=1e-12,
                                   equal_nan=True)
        np.testing.assert_allclose(np.asarray(want_lse)[0, h], lse, rtol=1e-12, atol=1e-12,
                                   equal_nan=True)


def test_reference_gradients_of_finite_inputs_unchanged():
    """The float64 reference's gradients for finite inputs are those of the plain formula
    (the non-finite handling adds nothing to them)."""
    case = Case(batch=1, seqlen_q=9, seqlen_k=11, heads_q=2, heads_kv=1, head_dim=8, causal=True,
                sinks=True)
    q, k, v, sinks = (x.astype(jnp.float64) for x in case_inputs(case))

    def plain(q, k, v, sinks):
        k, v = (jnp.repeat(x, 2, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
        s = jnp.where(case.mask(), s, -jnp.inf)
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))],
                            axis=-1)
        p = jax.nn.softmax(s, axis=-1)[..., :-1]
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    ct = rand(5, q.shape, jnp.float64)
    # jitted: eager, each op of both gradients compiles for these new shapes
    ours = jax.jit(jax.grad(lambda *a: jnp.sum(reference.attention(
        *a[:3], sinks=a[3], causal=True, compute_dtype=jnp.float64) * ct), argnums=(0, 1, 2, 3)))
    theirs = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) * ct), argnums=(0, 1, 2, 3)))
    for a, b in zip(ours(q, k, v, sinks), theirs(q, k, v, sinks)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
