"""Shared test helpers: attention cases, random inputs, error metrics, and the
forward / gradient checks against the float64 reference.

Error metric: max |actual - expected| / max |expected| (expected: the float64
reference). Rule (FlashAttention's own): float32 inputs must be within
F32_TOL; float16/bfloat16 inputs within twice the error of a reference computed
in the input's own precision, plus LOWP_FLOOR.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference

F32_TOL = 1e-5
LOWP_FLOOR = 1e-5
DTYPES = ("float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------- devices, inputs


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def cpu():
    return jax.devices("cpu")[0]


def _seed(key):
    """An int seed, a jax PRNG key or a legacy uint32 key as numpy seed entropy."""
    if isinstance(key, (int, np.integer)):
        return int(key)
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(x) for x in np.asarray(key).ravel()]


def rand(key, shape, dtype=jnp.float32):
    """Standard normal of `dtype`, on the CPU, with no exact zeros. `key`: int seed or PRNG
    key. Drawn by numpy: jax.random would compile a program for every new shape (a
    large part of a small test's time)."""
    x = np.random.default_rng(_seed(key)).standard_normal(shape, dtype=np.float32)
    x = x.astype(jnp.dtype(dtype))
    x[x == 0] = 1
    return jax.device_put(x, cpu())


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call: shapes, dtype and options."""

    batch: int = 1
    seqlen_q: int = 64
    seqlen_k: int = 64
    heads_q: int = 2
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "float32"
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    softmax_scale: float | None = None
    q_offset: int | None = None   # positions (None: bottom-right alignment)
    kv_offset: int | None = None

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def positional(self) -> bool:
        return self.q_offset is not None or self.kv_offset is not None

    @property
    def lowp(self) -> bool:
        return jnp.dtype(self.dtype) != jnp.float32

    def options(self) -> dict:
        positions = dict(q_offset=self.q_offset, kv_offset=self.kv_offset) if self.positional else {}
        return dict(softmax_scale=self.softmax_scale, causal=self.causal,
                    window_size=self.window_size, softcap=self.softcap, **positions)

    def mask(self) -> np.ndarray:
        offset = (self.q_offset or 0) - (self.kv_offset or 0) if self.positional else None
        return reference.visible_mask(self.seqlen_q, self.seqlen_k, self.causal, self.window_size,
                                      offset)

    def __str__(self) -> str:
        s = (f"b{self.batch}-sq{self.seqlen_q}-sk{self.seqlen_k}-h{self.heads_q}/{self.heads_kv}"
             f"-d{self.head_dim}/{self.dv}-{self.dtype}")
        if self.causal:
            s += "-causal"
        if tuple(self.window_size) != (-1, -1):
            s += f"-w{self.window_size[0]}_{self.window_size[1]}"
        if self.softcap:
            s += f"-cap{self.softcap:g}"
        if self.sinks:
            s += "-sinks"
        if self.softmax_scale is not None:
            s += f"-scale{self.softmax_scale:g}"
        if self.positional:
            s += f"-at{self.q_offset or 0}_{self.kv_offset or 0}"
        return s


def case_inputs(case: Case, seed=0, device=None):
    """q, k, v in the case's dtype and float32 sinks (or None), on `device` (default CPU)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = rand(keys[0], (case.batch, case.seqlen_q, case.heads_q, case.head_dim), case.dtype)
    k = rand(keys[1], (case.batch, case.seqlen_k, case.heads_kv, case.head_dim), case.dtype)
    v = rand(keys[2], (case.batch, case.seqlen_k, case.heads_kv, case.dv), case.dtype)
    sinks = rand(keys[3], (case.heads_q,), jnp.float32) if case.sinks else None
    if device is not None:
        q, k, v, sinks = jax.device_put((q, k, v, sinks), device)
    return q, k, v, sinks


def to_cpu(x, dtype=None):
    """A (possibly device) array as a CPU jax array, optionally cast (exactly, when widening)."""
    if x is None:
        return None
    x = jax.device_put(x, cpu())
    return x if dtype is None else x.astype(dtype)


# ----------------------------------------------------------------------------- error metrics


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64, over finite expected entries."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.size == 0:
        return 0.0
    scale = max(np.abs(expected).max(), 1e-30)
    return float(np.abs(actual - expected).max() / scale)


def check_close(actual, ref_hi, ref_lo=None, *, dtype=None, name="value"):
    """Asserts `actual` is as close to the float64 reference `ref_hi` as the rule allows.

    dtype: the *input* dtype the rule is chosen by (default: actual's dtype).
    float32: rel_err < F32_TOL. float16/bfloat16: rel_err <= 2 * rel_err(ref_lo) + LOWP_FLOOR,
    where ref_lo is the same computation done by the reference in the input's precision.
    Returns (err, tol).
    """
    dtype = jnp.dtype(actual.dtype if dtype is None else dtype)
    values = np.asarray(actual, np.float64)
    assert np.isfinite(values).all(), f"{name}: {np.count_nonzero(~np.isfinite(values))} non-finite"
    err = rel_err(values, ref_hi)
    if dtype in (jnp.float32, jnp.float64):
        tol = F32_TOL
        assert err < tol, f"{name}: rel err {err:.3g} >= {tol:.3g} ({dtype})"
    else:
        assert ref_lo is not None, f"{name}: {dtype} needs a same-precision reference"
        tol = 2 * rel_err(ref_lo, ref_hi) + LOWP_FLOOR
        assert err <= tol, f"{name}: rel err {err:.3g} > {tol:.3g} = 2 * same-precision err + floor ({dtype})"
    return err, tol


def check_lse(lse, ref_lse, case: Case, sinks=None, name="lse"):
    """lse: float32, -inf exactly where the reference is -inf, no NaN, close elsewhere.

    The lse is a float32 accumulation of exact products for every input dtype
    (bf16/fp16 products are exact in float32), so it gets the float32 rule.
    """
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert lse.dtype == np.float32, f"{name} dtype {lse.dtype}"
    assert lse.shape == (case.batch, case.heads_q, case.seqlen_q), f"{name} shape {lse.shape}"
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), f"{name} has NaN/+inf"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg=f"{name}: -inf rows")
    finite = np.isfinite(ref_lse)
    if finite.any():
        check_close(lse[finite], ref_lse[finite], dtype=jnp.float32, name=name)
    # Rows that see no key: -inf, or exactly... the sink logit when sinks are given.
    empty = ~case.mask().any(axis=1)
    if empty.any():
        if sinks is None:
            assert np.isneginf(lse[:, :, empty]).all(), f"{name}: empty rows must be -inf"
        else:
            want = np.broadcast_to(np.asarray(sinks)[None, :, None], lse[:, :, empty].shape)
            np.testing.assert_allclose(lse[:, :, empty], want, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name}: empty rows must equal the sink")


# ----------------------------------------------------------------------------- the checks


def flash(case: Case, *, return_lse=True, deterministic=False):
    """flashjax.flash_attention with the case's options, as f(q, k, v, sinks)."""
    def f(q, k, v, sinks):
        return flashjax.flash_attention(q, k, v, sinks=sinks, return_lse=return_lse,
                                        deterministic=deterministic, **case.options())
    return f


def ref(case: Case, compute_dtype, *, return_lse=True):
    """reference.attention with the case's options, as f(q, k, v, sinks)."""
    def f(q, k, v, sinks):
        return reference.attention(q, k, v, sinks=sinks, return_lse=return_lse,
                                   compute_dtype=compute_dtype, **case.options())
    return f


# reference.attention as one jitted program per shape and static options: for shapes a
# process sees once, much faster than its eager ops (each compiled per new shape).
jitted_reference = jax.jit(reference.attention, static_argnames=(
    "softmax_scale", "causal", "window_size", "softcap", "return_lse", "compute_dtype"))


def _hi(arrays):
    return [to_cpu(x, jnp.float64) for x in arrays]


@functools.lru_cache(maxsize=8)
def _forward_references(case: Case, seed, compiled=False):
    """(float64 out, float64 lse, same-precision out or None) as numpy; cached because the
    GPU tests check several kernel paths against the same references. `compiled`: each
    reference as one jitted program (see _compiled_references for when that pays)."""
    q, k, v, sinks = case_inputs(case, seed)
    run = jax.jit if compiled else (lambda f: f)
    ref_out, ref_lse = run(ref(case, jnp.float64))(*_hi((q, k, v, sinks)))
    ref_lo = None
    if case.lowp:
        lo = run(ref(case, case.dtype, return_lse=False))(q, k, v, sinks)
        ref_lo = np.asarray(lo.astype(jnp.float32))
    return np.asarray(ref_out), np.asarray(ref_lse), ref_lo


def check_empty_vmap(case: Case, device=None):
    """vmap over an empty leading axis, forward and gradients: empty results of the
    right shapes (the handlers return at once; a GPU kernel cannot run with no blocks)."""
    q, k, v, sinks = case_inputs(case, device=device)
    args = [jnp.zeros((0,) + x.shape, x.dtype) for x in (q, k, v, sinks)]
    attn = flash(case, return_lse=False)
    grad = jax.grad(lambda *a: jnp.sum(attn(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))
    out = jax.vmap(attn)(*args)
    grads = jax.jit(jax.vmap(grad))(*args)
    assert out.shape == (0,) + q.shape
    assert [g.shape for g in grads] == [(0,) + x.shape for x in (q, k, v, sinks)]


def check_forward(case: Case, device=None, seed=0, *, new_shape=False):
    """flashjax.flash_attention (out and lse) against the float64 reference; returns numpy
    (out, lse). new_shape: the case lists' shapes are new to the process at each case
    (head dims, lengths): the references run jitted."""
    q, k, v, sinks = case_inputs(case, seed, device)
    out, lse = jax.jit(flash(case))(q, k, v, sinks)
    references = _forward_references(case, seed, compiled=new_shape)
    return check_forward_values(case, out, lse, device, seed, references)


def check_forward_values(case: Case, out, lse, device=None, seed=0, references=None):
    """out and lse (None: not returned) of the case's inputs, computed by the caller, against
    the float64 reference (`references`: _forward_references' value, computed by the
    caller): shapes, dtypes, device, values, rows with no key exactly 0.
    Returns numpy (out, lse)."""
    assert out.shape == (case.batch, case.seqlen_q, case.heads_q, case.dv), out.shape
    assert out.dtype == jnp.dtype(case.dtype), out.dtype
    if device is not None:
        assert out.devices() == {device} and (lse is None or lse.devices() == {device})
    out = np.asarray(out.astype(jnp.float32))

    ref_out, ref_lse, ref_lo = references or _forward_references(case, seed)
    check_close(out, ref_out, ref_lo, dtype=case.dtype, name=f"{case}: out")
    if lse is not None:
        lse = np.asarray(lse)
        check_lse(lse, ref_lse, case, case_inputs(case, seed)[3], name=f"{case}: lse")

    empty = ~case.mask().any(axis=1)
    np.testing.assert_array_equal(out[:, empty], 0.0, err_msg=f"{case}: rows with no key must be 0")
    return out, lse


def _cotangents(case: Case, seed):
    """Random cotangents of (out, lse), exactly representable in the case's dtype."""
    keys = jax.random.split(jax.random.key(seed + 1000), 2)
    d_out = rand(keys[0], (case.batch, case.seqlen_q, case.heads_q, case.dv), case.dtype)
    d_lse = rand(keys[1], (case.batch, case.heads_q, case.seqlen_q), jnp.float32)
    return d_out, d_lse


def value_and_vjp(fn, args, ct):
    """(fn(*args), its pullback on ct): fn(q, k, v, sinks) at args (3 or 4 of them;
    missing sinks = None)."""
    value, pull = jax.vjp(lambda *diff: fn(*diff, *([None] * (4 - len(diff)))), *args)
    return value, pull(ct)


def vjp(fn, args, ct):
    """Pullback of fn(q, k, v, sinks) at args (3 or 4 of them; missing sinks = None) on ct."""
    return value_and_vjp(fn, args, ct)[1]


def _cotangent(d_out, d_lse, dtype, return_lse):
    d_out = d_out.astype(dtype)
    if not return_lse:
        return d_out
    return d_out, d_lse.astype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def _args(case, q, k, v, sinks):
    return (q, k, v, sinks) if case.sinks else (q, k, v)


@functools.lru_cache(maxsize=8)
def _gradient_references(case: Case, seed, return_lse):
    """Reference gradients (float64, and same-precision or Nones) as numpy; cached."""
    args = _args(case, *case_inputs(case, seed))
    d_out, d_lse = _cotangents(case, seed)
    hi = vjp(ref(case, jnp.float64, return_lse=return_lse), _hi(args),
             _cotangent(d_out, d_lse, jnp.float64, return_lse))
    lo = [None] * len(args)
    if case.lowp:
        lo = vjp(ref(case, case.dtype, return_lse=return_lse), args,
                 _cotangent(d_out, d_lse, case.dtype, return_lse))
        lo = [np.asarray(x.astype(jnp.float32)) for x in lo]
    return [np.asarray(x) for x in hi], lo


def gradient_inputs(case: Case, device=None, seed=0, return_lse=True):
    """(args, cotangent) of the gradient checks: (q, k, v[, sinks]) and the cotangent of
    out (and lse), on `device` (default CPU)."""
    q, k, v, sinks = case_inputs(case, seed, device)
    d_out, d_lse = _cotangents(case, seed)
    ct = _cotangent(*jax.device_put((d_out, d_lse), device or cpu()), case.dtype, return_lse)
    return _args(case, q, k, v, sinks), ct


def check_gradients(case: Case, device=None, seed=0, *, return_lse=True, deterministic=False,
                    new_shape=False):
    """dq, dk, dv (and dsinks) of flash_attention via jax.vjp with a random cotangent on
    out (and lse, including rows where it is -inf), against the float64 reference
    (check_gradient_values). new_shape: as in check_forward. Returns the gradients as
    numpy arrays."""
    args, ct = gradient_inputs(case, device, seed, return_lse)
    grads = _flash_vjp(flashjax.flash_attention, case, return_lse, deterministic)(args, ct)
    references = _compiled_references(case, seed, return_lse)[1] if new_shape else None
    return check_gradient_values(case, grads, seed, return_lse=return_lse, references=references)


@functools.lru_cache(maxsize=16)
def _flash_vjp(entry, case: Case, return_lse, deterministic):
    """jit(vjp) of flash(case), f(args, ct). Cached so that a case's runs on both CPU
    backward paths share one compilation (the kernels read FLASHJAX_CPU_BACKWARD at
    each run); `entry`, what flashjax.flash_attention is bound to (use_implementation),
    keys the cache so that a program never outlives its binding."""
    return jax.jit(functools.partial(
        vjp, flash(case, return_lse=return_lse, deterministic=deterministic)))


def check_gradient_values(case: Case, grads, seed=0, *, return_lse=True, references=None):
    """Gradients of gradient_inputs(case, seed=seed), computed by the caller, against the
    float64 reference (`references`: _gradient_references' value, computed by the caller);
    also checks exact zeros: dq of rows that see no key, dk/dv of keys no row sees.
    Returns the gradients as numpy arrays."""
    args, _ = gradient_inputs(case, seed=seed, return_lse=return_lse)
    hi, lo = references or _gradient_references(case, seed, return_lse)

    result = []
    for name, g, x, r, l in zip(("dq", "dk", "dv", "dsinks"), grads, args, hi, lo):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{case}: {name} {g.shape} {g.dtype}"
        g = np.asarray(g.astype(jnp.float32))
        check_close(g, r, l, dtype=case.dtype, name=f"{case}: {name}")
        result.append(g)

    mask = case.mask()
    rows, keys = ~mask.any(axis=1), ~mask.any(axis=0)
    np.testing.assert_array_equal(result[0][:, rows], 0.0, err_msg=f"{case}: dq of rows with no key")
    for name, g in zip(("dk", "dv"), result[1:3]):
        np.testing.assert_array_equal(g[:, keys], 0.0, err_msg=f"{case}: {name} of keys no row sees")
    return result


@functools.lru_cache(maxsize=32)
def _reference_program(case: Case, compute_dtype):
    """jit(value_and_vjp) of the reference for `case` (positions cleared) at compute_dtype,
    f(args, ct, q_offset, kv_offset), the positions traced (None: no positions): one
    compilation serves every start of a case."""
    def run(args, ct, q_offset, kv_offset):
        positions = {} if q_offset is None else dict(q_offset=q_offset, kv_offset=kv_offset)
        attention = lambda q, k, v, sinks: reference.attention(
            q, k, v, sinks=sinks, return_lse=True, compute_dtype=compute_dtype,
            **case.options(), **positions)
        return value_and_vjp(attention, args, ct)
    return jax.jit(run)


@functools.lru_cache(maxsize=8)
def _compiled_references(case: Case, seed, return_lse):
    """(_forward_references, _gradient_references) values from one jitted program per
    precision (shared by the cases that differ in positions only): for a shape the
    process has not seen, several times faster than the eager references (which compile
    each of their ops for every new shape)."""
    args = _args(case, *case_inputs(case, seed))
    d_out, d_lse = _cotangents(case, seed)
    if not return_lse:  # (the lse cotangent is zero then)
        d_lse = jnp.zeros_like(d_lse)
    # positions as int64 (jax_enable_x64): starts near the int32 limits stay exact
    positions = ((np.int64(case.q_offset or 0), np.int64(case.kv_offset or 0))
                 if case.positional else (None, None))
    base = dataclasses.replace(case, q_offset=None, kv_offset=None)

    def run(compute_dtype, args):
        ct = _cotangent(d_out, d_lse, compute_dtype, True)
        return _reference_program(base, compute_dtype)(args, ct, *positions)
    (out, lse), hi = run(jnp.float64, _hi(args))
    lo_out, lo = None, [None] * len(args)
    if case.lowp:
        (lo_out, _), lo = run(jnp.dtype(case.dtype), args)
        lo_out = np.asarray(lo_out.astype(jnp.float32))
        lo = [np.asarray(x.astype(jnp.float32)) for x in lo]
    return (np.asarray(out), np.asarray(lse), lo_out), ([np.asarray(x) for x in hi], lo)


def compiled_references(case: Case, seed=0, return_lse=True):
    """(forward, gradient) references of the case for check_forward_values /
    check_gradient_values, from jitted programs shared across positions."""
    return _compiled_references(case, seed, return_lse)


def check_forward_and_gradients(case: Case, seed=0, *, return_lse=True):
    """check_forward and check_gradients, each side from one compiled program (the vjp
    computes the forward; _compiled_references): for implementations whose compilation
    dominates the test time (implementation="xla"), on shapes seen once.
    Returns numpy (out, lse or None, gradients)."""
    args, ct = gradient_inputs(case, seed=seed, return_lse=return_lse)
    value, grads = jax.jit(functools.partial(value_and_vjp, flash(case, return_lse=return_lse)))(
        args, ct)
    out, lse = value if return_lse else (value, None)
    forward_refs, gradient_refs = _compiled_references(case, seed, return_lse)
    out, lse = check_forward_values(case, out, lse, seed=seed, references=forward_refs)
    return out, lse, check_gradient_values(case, grads, seed, return_lse=return_lse,
                                           references=gradient_refs)


# ----------------------------------------------------------------------------- shared case lists
# Used by test_forward.py / test_backward.py on the default (CPU) device and by
# test_gpu.py on the GPU.

HEAD_DIMS = [(1, 1), (8, 8), (64, 64), (72, 72), (96, 96), (128, 128), (200, 200), (256, 256),
             (64, 32), (40, 72), (256, 1), (1, 256)]
SEQLENS = [(1, 1), (1, 17), (17, 1), (17, 17), (128, 128), (1000, 1000), (17, 128), (128, 17),
           (300, 1000), (1000, 300)]
WINDOWS = [(-1, -1), (16, -1), (-1, 8), (10, 5), (0, 0), (3, 200)]


def head_dim_cases(dtypes=DTYPES, seqlen=80, lowp_in_turn=False):
    """Each HEAD_DIMS pair in each dtype; lowp_in_turn: float32 at every pair, then one
    low-precision case per pair (bfloat16 for pairs 0, 1, 4, 5, ..., float16 for the
    others), for kernels that convert every dtype the same way whatever the head dim."""
    case = lambda dims, dt: Case(seqlen_q=seqlen, seqlen_k=seqlen, head_dim=dims[0],
                                 head_dim_v=dims[1], dtype=dt, causal=True)
    if lowp_in_turn:
        return ([case(dims, "float32") for dims in HEAD_DIMS]
                + [case(dims, "bfloat16" if i % 4 < 2 else "float16")
                   for i, dims in enumerate(HEAD_DIMS)])
    return [case(dims, dt) for dt in dtypes for dims in HEAD_DIMS]


def seqlen_cases(seqlens=SEQLENS, head_dim=24):
    return [Case(seqlen_q=sq, seqlen_k=sk, head_dim=head_dim, causal=c)
            for sq, sk in seqlens for c in (False, True)]


def gqa_cases(dtypes=DTYPES):
    return [Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=hq, heads_kv=hk, head_dim=32, dtype=dt)
            for hq, hk in [(4, 2), (4, 1), (6, 3), (8, 1)] for dt in dtypes]


def option_cases(dtypes=("float32",), seqlens=((90, 130), (130, 90)), windows=WINDOWS,
                 softcaps=(0.0, 5.0), head_dim=16):
    """causal x window x softcap x sinks (x dtype x seqlens), GQA 4/2."""
    return [Case(seqlen_q=sq, seqlen_k=sk, heads_q=4, heads_kv=2, head_dim=head_dim, dtype=dt,
                 causal=c, window_size=w, softcap=cap, sinks=s)
            for dt, (sq, sk), c, w, cap, s in itertools.product(
                dtypes, seqlens, (False, True), windows, softcaps, (False, True))]


def empty_row_cases():
    """Cases where some query rows see no key (sq > sk with a bounded right edge)."""
    return [Case(seqlen_q=64, seqlen_k=16, head_dim=8, causal=True),
            Case(seqlen_q=64, seqlen_k=16, head_dim=8, causal=True, sinks=True),
            Case(seqlen_q=50, seqlen_k=20, head_dim=8, causal=True, window_size=(3, -1)),
            Case(seqlen_q=40, seqlen_k=30, heads_q=4, heads_kv=1, head_dim=8, window_size=(2, 1),
                 sinks=True, softcap=3.0),
            Case(seqlen_q=64, seqlen_k=16, head_dim=40, dtype="bfloat16", causal=True, sinks=True),
            Case(seqlen_q=64, seqlen_k=16, head_dim=40, dtype="float16", causal=True)]


# (q_offset, kv_offset) of position_cases: query rows after the keys, keys after the
# queries (rows with no key), equal starts (top-left), far apart (nothing visible).
POSITION_STARTS = [(64, 0), (0, 50), (40, 40), (300, 100), (-20, 0), (0, 100_000)]


def position_cases(dtypes=("float32",), head_dim=16):
    """q_offset / kv_offset (rows of a longer sequence, e.g. a shard): query rows after
    the keys, keys after the queries (rows with no key), equal starts (top-left), far
    apart (nothing visible); causal, windows, sinks, GQA."""
    masks = [(True, (-1, -1)), (False, (16, 4)), (True, (8, -1)), (False, (-1, 0)),
             (False, (-1, -1))]
    return [Case(batch=2, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=head_dim,
                 dtype=dt, causal=c, window_size=w, sinks=(i % 3 == 1), q_offset=qo,
                 kv_offset=ko)
            for dt in dtypes
            for i, ((qo, ko), (c, w)) in enumerate(itertools.product(POSITION_STARTS, masks))
            if not (c is False and w == (-1, -1) and i % 2)]


_ENTRY_POINTS = {name: getattr(flashjax, name) for name in
                 ("flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache")}


@functools.lru_cache(maxsize=None)
def _with_implementation(name, implementation):
    # One object per (entry point, implementation): checks that cache their compiled
    # programs by the function they call then share them across tests.
    return functools.partial(_ENTRY_POINTS[name], implementation=implementation)


def use_implementation(monkeypatch, implementation):
    """Every flashjax entry point a test calls runs with `implementation` (the GPU tests
    run each kernel path: "cuda", "cuda:mma", "cuda:simt")."""
    for name in _ENTRY_POINTS:
        monkeypatch.setattr(flashjax, name, _with_implementation(name, implementation))


def counting_jit(fn, **jit_options):
    """(jax.jit(fn), traces): traces grows by one each time fn is traced, i.e. at each
    compilation (robust where `_cache_size()` is not: the process-wide jit cache may
    evict entries when a worker has run many tests)."""
    traces = []

    def traced(*args, **kwargs):
        traces.append(None)
        return fn(*args, **kwargs)
    return jax.jit(traced, **jit_options), traces


def both_paths(cases, two_pass):
    """(path, case) parameters of the CPU backward paths (FLASHJAX_CPU_BACKWARD): every case one-pass, the `two_pass` ones two-pass too,
    right after (so that a worker's cached references serve both)."""
    return [pytest.param(path, c, id=f"{path}-{c}")
            for c in cases for path in ("one-pass", "two-pass")
            if path == "one-pass" or c in two_pass]


def ids(cases):
    return [str(c) for c in cases]


def run_on_host_devices(script: str, devices: int, timeout: int = 900) -> None:
    """Runs a Python script on `devices` host CPU devices (a subprocess: the device
    count is fixed when jax starts); it must exit 0 and print "ok" last."""
    import os
    import subprocess
    import sys

    # (conftest.py's XLA_FLAGS, and the device count)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
