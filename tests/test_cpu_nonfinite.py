"""Non-finite inputs on the CPU kernels (issue 15, item 1): the C++ CPU path against a
float64 numpy evaluation of /work/notes/nonfinite_spec.md written here, independent of
flashjax.reference. Row i's out / lse are the IEEE evaluation of attention over the keys
row i sees; keys it does not see never reach it; nothing crosses batch entries, heads,
packed sequences or segments (forward and backward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SQ = SK = 200  # two 128-row tiles, the second partial
HQ, HK, D = 4, 2, 32
I0, J0, C0 = 150, 90, 5  # where the bad value goes: row, key, column


def visibility(sq, sk, causal, window=(-1, -1), q_seg=None, k_seg=None):
    """visible[i, j] (bottom-right aligned causal / window, segment ids)."""
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    left, right = window
    if causal:
        right = 0
    vis = np.ones((sq, sk), bool)
    if right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    if q_seg is not None:
        vis &= q_seg[:, None] == k_seg[None, :]
    return vis


def spec_attention(q, k, v, vis, scale):
    """One sequence: q (sq, hq, d), k / v (sk, hk, d), vis (sq, sk). float64 IEEE."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    sq, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros((sq, hq, v.shape[-1]))
    lse = np.full((hq, sq), -np.inf)
    with np.errstate(all="ignore"):
        for h in range(hq):
            for i in range(sq):
                keys = np.flatnonzero(vis[i])
                if keys.size == 0:
                    continue
                s = scale * (k[keys, h // group] * q[i, h]).sum(-1)  # elementwise: inf * 0 = NaN
                m = s.max()  # propagates NaN
                p = np.exp(s - m)
                l = p.sum()
                out[i, h] = (p[:, None] * v[keys, h // group]).sum(0) / l
                lse[h, i] = m + np.log(l)
    return out, lse


def inputs(batch=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, SQ, HQ, D)).astype(np.float32)
    k = rng.standard_normal((batch, SK, HK, D)).astype(np.float32)
    v = rng.standard_normal((batch, SK, HK, D)).astype(np.float32)
    return q, k, v


def place(q, k, v, where, value, b=0, head=0):
    q, k, v = q.copy(), k.copy(), v.copy()
    if where == "q":
        q[b, I0, head, C0] = value
    elif where == "k":
        k[b, J0, head, C0] = value
    else:
        v[b, J0, head, C0] = value
    return q, k, v


def check(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5,
                               equal_nan=True)


LAYOUTS = {
    "full": dict(causal=False),
    "causal": dict(causal=True),
    "window": dict(causal=False, window_size=(40, 10)),
    "segments": dict(causal=True, segments=True),
}


def segment_ids(batch):
    ids = np.zeros((batch, SQ), np.int32)
    ids[:, 60:] = 1
    ids[:, 130:] = 2  # row I0 = 150 and key J0 = 90 sit in different segments
    return ids


@pytest.mark.parametrize("keys", ["converted", "per-tile"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_forward_follows_spec(monkeypatch, layout, where, value, keys):
    # keys: the forward's K / V converted once per call, or per key tile (large calls)
    monkeypatch.setenv("FLASHJAX_CPU_FORWARD_KEYS", keys)
    opts = dict(LAYOUTS[layout])
    use_segments = opts.pop("segments", False)
    q, k, v = place(*inputs(), where, value)
    kwargs = dict(opts)
    seg = None
    if use_segments:
        seg = segment_ids(q.shape[0])
        kwargs.update(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
    out, lse = flashjax.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        return_lse=True, implementation="cpu", **kwargs)
    scale = D ** -0.5
    for b in range(q.shape[0]):
        vis = visibility(SQ, SK, opts.get("causal", False), opts.get("window_size", (-1, -1)),
                         *((seg[b], seg[b]) if seg is not None else ()))
        want_out, want_lse = spec_attention(q[b], k[b], v[b], vis, scale)
        check(out[b], want_out)
        check(lse[b], want_lse)
    # the bad value is reached by some rows and not others in every layout
    assert np.isnan(np.asarray(out[0])).any() or np.isinf(np.asarray(out[0])).any()
    assert np.isfinite(np.asarray(out[1])).all()


@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_varlen_follows_spec(where):
    cu = np.array([0, 70, 200, 333], np.int32)
    total = int(cu[-1])
    rng = np.random.default_rng(1)
    q = rng.standard_normal((total, HQ, D)).astype(np.float32)
    k = rng.standard_normal((total, HK, D)).astype(np.float32)
    v = rng.standard_normal((total, HK, D)).astype(np.float32)
    bad = 70 + 100  # inside sequence 1
    {"q": q, "k": k, "v": v}[where][bad, 0, C0] = np.nan
    out, lse = flashjax.flash_attention_varlen(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu), jnp.asarray(cu),
        int(np.diff(cu).max()), int(np.diff(cu).max()), causal=True, return_lse=True,
        implementation="cpu")
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        want_out, want_lse = spec_attention(q[lo:hi], k[lo:hi], v[lo:hi],
                                            visibility(hi - lo, hi - lo, True), D ** -0.5)
        check(out[lo:hi], want_out)
        check(lse[:, lo:hi], want_lse)
        assert np.isfinite(np.asarray(out[lo:hi])).all() == (s != 1)


def grads(q, k, v, **kwargs):
    dout = jnp.asarray(np.random.default_rng(2).standard_normal(q.shape[:-1] + (D,)),
                       jnp.float32)

    def loss(q, k, v):
        return jnp.sum(flashjax.flash_attention(q, k, v, implementation="cpu", **kwargs) * dout)

    out = flashjax.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                   implementation="cpu", return_lse=True, **kwargs)
    dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k),
                                                   jnp.asarray(v))
    return [np.asarray(x) for x in (*out, dq, dk, dv)]


@pytest.mark.parametrize("backward", ["one-pass", "two-pass"])
@pytest.mark.parametrize("layout", ["full", "causal", "window", "segments"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_backward_does_not_leak(monkeypatch, backward, layout, where):
    """Gradients of rows / keys the NaN cannot reach match the clean run's."""
    monkeypatch.setenv("FLASHJAX_CPU_BACKWARD", backward)
    opts = dict(LAYOUTS[layout])
    kwargs = {k: v for k, v in opts.items() if k != "segments"}
    seg = None
    if opts.get("segments"):
        seg = segment_ids(2)
        kwargs.update(q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg))
    clean = inputs()
    bad = place(*clean, where, np.nan)
    _, _, dq0, dk0, dv0 = grads(*clean, **kwargs)
    _, _, dq, dk, dv = grads(*bad, **kwargs)
    vis = visibility(SQ, SK, opts.get("causal", False), opts.get("window_size", (-1, -1)),
                     *((seg[0], seg[0]) if seg is not None else ()))
    # rows reached: row I0 (q), or the rows that see key J0 (k, v); keys reached: those
    # the reached rows see (and J0 itself).
    rows = np.zeros(SQ, bool)
    if where == "q":
        rows[I0] = vis[I0].any()
    else:
        rows |= vis[:, J0]
    keys = vis[rows].any(0)
    if where != "q":
        keys[J0] = True
    group = HQ // HK
    heads_q = [0] if where == "q" else [h for h in range(HQ) if h // group == 0]
    for h in range(HQ):
        reached = rows if h in heads_q else np.zeros(SQ, bool)
        np.testing.assert_allclose(dq[0, ~reached, h], dq0[0, ~reached, h], rtol=1e-4,
                                   atol=1e-4)
        assert np.isnan(dq[0, reached, h]).any(axis=-1).all() or where == "v"
    np.testing.assert_allclose(dk[0, ~keys], dk0[0, ~keys], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dv[0, ~keys], dv0[0, ~keys], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dk[0, :, 1:], dk0[0, :, 1:], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(dq[1], dq0[1])  # the other batch entry: bit for bit
    np.testing.assert_array_equal(dk[1], dk0[1])
    np.testing.assert_array_equal(dv[1], dv0[1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_other_batch_entries_and_heads_bit_identical(causal, where):
    clean = inputs()
    bad = place(*clean, where, np.nan, b=1, head=1)
    want = grads(*clean, causal=causal)
    got = grads(*bad, causal=causal)
    names = ["out", "lse", "dq", "dk", "dv"]
    for name, g, w in zip(names, got, want):
        np.testing.assert_array_equal(g[0], w[0], err_msg=f"{name}: batch entry 0 changed")
    # heads: q head 1 holds the NaN (where == "q"), else kv head 1 (q heads 2, 3)
    untouched_q = [0, 2, 3] if where == "q" else [0, 1]
    np.testing.assert_array_equal(got[0][1][:, untouched_q], want[0][1][:, untouched_q])
    np.testing.assert_array_equal(got[1][1][untouched_q], want[1][1][untouched_q])
    np.testing.assert_array_equal(got[2][1][:, untouched_q], want[2][1][:, untouched_q])
    untouched_kv = 1 if where == "q" else 0
    np.testing.assert_array_equal(got[3][1][:, untouched_kv], want[3][1][:, untouched_kv])
    np.testing.assert_array_equal(got[4][1][:, untouched_kv], want[4][1][:, untouched_kv])
