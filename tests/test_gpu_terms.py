"""bias=, mask=, alibi_slopes= and dropout on the CUDA kernels (skipped without a GPU):
every kernel path (the default choice, Hopper wgmma on an H100; mma.sync; SIMT) against
the float64 reference on the same (rounded) inputs, forward and gradients (dbias of
owned and shared broadcast entries, the deterministic backward included), alone and
with causal, windows, softcap, sinks, GQA and seqused; ALiBi and dropout on the packed
layout too.

Shapes cross the kernels' tiles (200 queries, 333 keys); one reference compilation
serves every path of a case."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from helpers import rand, use_implementation

pytestmark = pytest.mark.gpu

PATHS = ["cuda", "cuda:mma", "cuda:simt"]
B, SQ, SK, H, HK = 2, 200, 333, 4, 2
RATE = 0.2
# Relative (Frobenius) error bounds against the float64 reference of the rounded
# inputs, and the largest elementwise error relative to the reference's largest value
# (a wrong term or keep bit on a few pairs shows there).
TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
GRAD_TOL_FACTOR = 3
MAX_FACTOR = 5


def _mask(shape, seed, p=0.7):
    m = np.random.default_rng(seed).random(shape) < p
    if m.ndim == 4:
        m[:, :, [3, 150], :] = False  # rows that see nothing
    return jnp.asarray(m)


def _slopes(shape):
    return jnp.asarray(np.random.default_rng(1).uniform(0.01, 0.3, shape).astype(np.float32))


def _structured_mask():
    """Tile-structured masks (the kernels' mask spans, MaskTiles::RowSpan): a sliding
    window aligned bottom-right (dense spans); on head 1 a gap of keys no row sees (a
    span with a hidden tile inside); on (sequence 1, head 2) a block of rows that sees
    nothing (an empty span)."""
    i = np.arange(SQ)[:, None] + (SK - SQ)
    j = np.arange(SK)[None, :]
    m = np.broadcast_to((j <= i + 20) & (j >= i - 90), (B, H, SQ, SK)).copy()
    m[:, 1, :, 128:192] = False
    m[1, 2, 64:128, :] = False
    return jnp.asarray(m)


def _block_mask(seed, rows=64, cols=64):
    """Block-sparse (the Hopper backward skips the query tiles a mask hides from all
    of a block's keys): per head, about half of the rows x cols tiles all False, the
    others random (query head 3 sees every tile: its group's other head does not)."""
    rng = np.random.default_rng(seed)
    tiles = rng.random((B, H, -(-SQ // rows), -(-SK // cols))) < 0.5
    tiles[:, 3] = True
    m = np.repeat(np.repeat(tiles, rows, 2), cols, 3)[:, :, :SQ, :SK]
    return jnp.asarray(m & (rng.random((B, H, SQ, SK)) < 0.8))


def options_of(name):
    """The call options of case `name` (arrays built here: cases stay hashable ids)."""
    return {
        "bias": dict(bias=rand(3, (B, H, SQ, SK)), causal=True),
        "bias_shared": dict(bias=rand(3, (1, 1, SQ, SK))),
        "bias_heads_kv": dict(bias=rand(3, (1, HK, SQ, SK)), window_size=(40, 7)),
        "mask": dict(mask=_mask((B, 1, SQ, SK), 4), window_size=(90, 0)),
        "mask_sinks": dict(mask=_mask((1, H, SQ, SK), 5, p=0.3), sinks=rand(9, (H,))),
        "alibi": dict(alibi_slopes=_slopes((H,)), causal=True),
        "alibi_softcap_bias": dict(alibi_slopes=_slopes((B, H)), softcap=3.0,
                                   bias=rand(6, (B, H, SQ, SK))),
        "dropout": dict(dropout_rate=RATE, dropout_key=jax.random.key(11), causal=True),
        "dropout_terms": dict(dropout_rate=RATE, dropout_key=jax.random.key(12),
                              bias=rand(7, (1, H, SQ, SK)), mask=_mask((B, H, SQ, SK), 8)),
        # ALiBi alone on uniform layouts: the kernels' ALiBi variant (TermSet::kAlibi).
        "alibi_full_sinks": dict(alibi_slopes=_slopes((B, H)), sinks=rand(9, (H,))),
        "alibi_softcap_window": dict(alibi_slopes=_slopes((H,)), softcap=3.0,
                                     window_size=(60, 20)),
        # A mask with or without ALiBi on uniform layouts: the mask variant (kMask).
        "mask_alibi": dict(mask=_mask((B, H, SQ, SK), 13), alibi_slopes=_slopes((H,)),
                           causal=True),
        "mask_structured": dict(mask=_structured_mask()),
        "mask_blocks": dict(mask=_block_mask(16)),
        "mask_blocks_wide": dict(mask=_block_mask(17, rows=128, cols=128), causal=True),
        # dropout without a bias on uniform layouts: the same variant (kMask)
        "dropout_mask_alibi": dict(dropout_rate=RATE, dropout_key=jax.random.key(14),
                                   mask=_mask((1, H, SQ, SK), 15), alibi_slopes=_slopes((H,)),
                                   window_size=(100, 30)),
        "seqused_alibi": dict(alibi_slopes=_slopes((H,)),
                              seqused_q=jnp.array([150, 200], jnp.int32),
                              seqused_k=jnp.array([333, 101], jnp.int32)),
    }[name]


CASES = [("bias", 128), ("bias_shared", 64), ("bias_heads_kv", 128), ("mask", 64),
         ("mask_sinks", 128), ("alibi", 64), ("alibi_softcap_bias", 128), ("dropout", 128),
         ("dropout_terms", 64), ("seqused_alibi", 128), ("alibi_full_sinks", 128),
         ("alibi_softcap_window", 96), ("mask_alibi", 128), ("alibi_full_sinks", 256),
         ("mask_alibi", 192), ("mask_structured", 128), ("mask_structured", 64),
         ("dropout_mask_alibi", 128), ("dropout", 64), ("mask_blocks", 128),
         ("mask_blocks", 64), ("mask_blocks_wide", 128)]


def rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    scale = max(np.linalg.norm(ref), 1e-30)
    return np.linalg.norm(x - ref) / scale, np.abs(x - ref).max() / max(np.abs(ref).max(), 1e-30)


def assert_close(x, ref, tol, name):
    assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name}: non-finite values"
    err, worst = rel(x, ref)
    assert err < tol and worst < MAX_FACTOR * tol, f"{name}: rel err {err:.3g}, max {worst:.3g}"


def _split(options):
    arrays = {n: x for n, x in options.items() if hasattr(x, "shape") and n != "dropout_key"}
    static = tuple(sorted((n, x) for n, x in options.items()
                          if n not in arrays and n != "dropout_key"))
    return arrays, static, options.get("dropout_key")


@functools.partial(jax.jit, static_argnames=("static", "fn"))
def _run(q, k, v, bias, arrays, key, ct, static, fn):
    def f(q, k, v, bias):
        extra = {} if key is None else {"dropout_key": key}
        out, lse = fn(q, k, v, bias=bias, return_lse=True, **extra, **dict(static), **arrays)
        return out, jnp.where(jnp.isfinite(lse), lse, 0)
    (out, lse), pullback = jax.vjp(f, q, k, v, bias)
    return out, lse, pullback(ct)


def _reference_fn(q, k, v, **kw):
    return reference.attention(q, k, v, compute_dtype=jnp.float64, **kw)


def inputs(dtype, d):
    q = rand(0, (B, SQ, H, d)).astype(dtype)
    k = rand(1, (B, SK, HK, d)).astype(dtype)
    v = rand(2, (B, SK, HK, d)).astype(dtype)
    ct = (rand(10, (B, SQ, H, d)).astype(dtype), rand(11, (B, H, SQ)))
    return q, k, v, ct


def check(name, d, dtype, path, monkeypatch, deterministic=False):
    options = options_of(name)
    bias = options.pop("bias", None)
    arrays, static, key = _split(options)
    q, k, v, ct = inputs(dtype, d)
    up = lambda x: x.astype(jnp.float64)
    ref = _run(up(q), up(k), up(v), None if bias is None else up(bias), arrays, key,
               (up(ct[0]), up(ct[1])), static, _reference_fn)
    use_implementation(monkeypatch, path)
    static_ours = static + ((("deterministic", True),) if deterministic else ())
    ours = _run(q, k, v, bias, arrays, key, ct, static_ours, flashjax.flash_attention)
    tol = TOL[dtype]
    assert_close(ours[0], ref[0], tol, "out")
    assert_close(ours[1], ref[1], TOL["float32"] * 10, "lse")
    for g, r, n in zip(ours[2], ref[2], ("dq", "dk", "dv", "dbias")):
        if r is not None:
            assert_close(g, r, GRAD_TOL_FACTOR * tol, n)
    return ours


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name, d", CASES, ids=[f"{n}-d{d}" for n, d in CASES])
def test_terms(name, d, path, monkeypatch, gpu_device):
    check(name, d, "bfloat16", path, monkeypatch)


@pytest.mark.parametrize("name", ["bias", "bias_shared", "dropout_terms", "alibi", "mask", "dropout",
                                  "mask_blocks"])
def test_terms_deterministic(name, monkeypatch, gpu_device):
    """Bitwise-repeatable with terms (a shared dbias entry: the exact pass, no atomics)."""
    first = check(name, 64, "float16", "cuda", monkeypatch, deterministic=True)
    second = check(name, 64, "float16", "cuda", monkeypatch, deterministic=True)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["bias_heads_kv", "mask", "dropout"])
def test_terms_float32_simt(name, monkeypatch, gpu_device):
    check(name, 48, "float32", "cuda", monkeypatch)


@pytest.mark.parametrize("path", PATHS)
def test_varlen_alibi_dropout(path, monkeypatch, gpu_device):
    """The packed layout: ALiBi and dropout against the per-sequence dense calls."""
    lens_q, lens_k = [70, 130], [200, 133]
    d = 64
    q = rand(0, (sum(lens_q), H, d)).astype(jnp.bfloat16)
    k = rand(1, (sum(lens_k), HK, d)).astype(jnp.bfloat16)
    v = rand(2, (sum(lens_k), HK, d)).astype(jnp.bfloat16)
    cu_q = jnp.array(np.cumsum([0] + lens_q), jnp.int32)
    cu_k = jnp.array(np.cumsum([0] + lens_k), jnp.int32)
    slopes = _slopes((H,))
    key = jax.random.key(5)
    use_implementation(monkeypatch, path)
    out = jax.jit(lambda q, k, v, key: flashjax.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, alibi_slopes=slopes,
        dropout_rate=RATE, dropout_key=key))(q, k, v, key)
    ref = reference.attention_varlen(
        q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64), np.asarray(cu_q),
        np.asarray(cu_k), max(lens_q), max(lens_k), causal=True, alibi_slopes=slopes,
        dropout_rate=RATE, dropout_key=key, compute_dtype=jnp.float64)
    assert_close(out, ref, TOL["bfloat16"], "out")


def test_alibi_short_gqa_queries(gpu_device):
    """A GQA group's short query rows (the forward packs such groups into one tile
    without terms; with ALiBi each row keeps its own head's slope), forward and
    gradients against the float64 reference."""
    h, hk, sq, sk, d = 8, 2, 9, 300, 128
    q = rand(0, (B, sq, h, d)).astype(jnp.bfloat16)
    k = rand(1, (B, sk, hk, d)).astype(jnp.bfloat16)
    v = rand(2, (B, sk, hk, d)).astype(jnp.bfloat16)
    slopes = _slopes((h,))
    ct = rand(10, (B, sq, h, d))

    def grads(fn, q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, causal=True, alibi_slopes=slopes),
                                q, k, v)
        return (out,) + pullback(ct.astype(out.dtype))
    up = lambda x: x.astype(jnp.float64)
    ref = jax.jit(functools.partial(grads, _reference_fn))(up(q), up(k), up(v))
    ours = jax.jit(functools.partial(grads, flashjax.flash_attention))(q, k, v)
    for x, r, n in zip(ours, ref, ("out", "dq", "dk", "dv")):
        assert_close(x, r, GRAD_TOL_FACTOR * TOL["bfloat16"], n)


def _neg_inf_bias_call(q, k, v, bias, mask, ct, implementation):
    def f(q, k, v, bias):
        return flashjax.flash_attention(q, k, v, bias=bias, mask=mask, causal=True,
                                        return_lse=True, implementation=implementation)
    (out, lse), pullback = jax.vjp(f, q, k, v, bias)
    return (out, lse) + pullback(ct)


@pytest.mark.parametrize("path", PATHS)
def test_neg_inf_bias_rows(path, gpu_device):
    """docs/api.md, "Non-finite values": a row whose visible scores are all -inf through
    the bias is NaN (out and lse; the tensor-core paths gave 0 and -inf, a masked row's
    answer), one the mask hides gives 0 and -inf, and the gradients are the CPU path's
    (the -inf pairs add nothing; dbias rows included), on every kernel path."""
    q, k, v, ct = inputs("bfloat16", 64)
    bias = np.array(rand(3, (B, H, SQ, SK)))
    bias[0, 1, 37, :] = -np.inf    # every key row 37 sees
    bias[1, 2, 120, :254] = -np.inf  # the keys it sees (causal, bottom-right: 0..253)
    mask = np.ones((B, 1, SQ, SK), bool)
    mask[1, :, 150, :] = False      # sees nothing: 0 and -inf
    bias, mask = jnp.asarray(bias), jnp.asarray(mask)
    args = (q, k, v, bias, mask, ct)
    call = jax.jit(_neg_inf_bias_call, static_argnums=6)
    ours = call(*args, path)
    cpu = jax.devices("cpu")[0]
    want = call(*jax.device_put(args, cpu), None)
    out, lse = np.asarray(ours[0], np.float32), np.asarray(ours[1])
    assert np.isnan(out[0, 37, 1]).all() and np.isnan(out[1, 120, 2]).all()
    assert np.isnan(lse[0, 1, 37]) and np.isnan(lse[1, 2, 120])
    assert (out[1, 150] == 0).all() and (lse[1, :, 150] == -np.inf).all()
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv", "dbias"), ours, want):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(y), err_msg=name)
        np.testing.assert_array_equal(np.isinf(x), np.isinf(y), err_msg=name)
        fin = np.isfinite(y)
        err = np.linalg.norm(x[fin] - y[fin]) / max(np.linalg.norm(y[fin]), 1e-30)
        assert err < GRAD_TOL_FACTOR * TOL["bfloat16"], f"{name}: rel err {err:.3g}"
