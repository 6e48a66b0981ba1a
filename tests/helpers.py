"""Test helpers: attention cases, random inputs, and comparisons against the
float64 reference (forward and gradients)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import flashjax
from flashjax import reference


@dataclasses.dataclass(frozen=True)
class Case:
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

    @property
    def dv(self):
        return self.head_dim_v or self.head_dim

    def options(self):
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap)

    def __str__(self):
        return (f"b{self.batch}-sq{self.seqlen_q}-sk{self.seqlen_k}-h{self.heads_q}/{self.heads_kv}"
                f"-d{self.head_dim}/{self.dv}-{self.dtype}-c{int(self.causal)}"
                f"-w{self.window_size[0]}_{self.window_size[1]}-cap{self.softcap}-s{int(self.sinks)}")


def inputs(case: Case, seed=0, device=None):
    """Random q, k, v in the case's dtype and float32 sinks (never zeros)."""
    rng = np.random.default_rng(seed)
    shapes = [(case.batch, case.seqlen_q, case.heads_q, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
              (case.batch, case.seqlen_k, case.heads_kv, case.dv)]
    q, k, v = (jnp.asarray(rng.standard_normal(s), case.dtype) for s in shapes)
    sinks = jnp.asarray(rng.standard_normal(case.heads_q), jnp.float32) if case.sinks else None
    if device is not None:
        q, k, v, sinks = jax.device_put((q, k, v, sinks), device)
    return q, k, v, sinks


def rel_err(actual, expected):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    scale = max(np.abs(expected).max(), 1e-30)
    return np.abs(actual - expected).max() / scale


def tolerance(dtype, lowp_err):
    """float32: 1e-5 relative; fp16/bf16: twice the error of a same-precision
    reference (FlashAttention's rule) plus a small floor."""
    if jnp.dtype(dtype) == jnp.float32:
        return 1e-5
    return 2 * lowp_err + 1e-4


def _hi(x):
    return None if x is None else jax.device_put(jnp.asarray(x, jnp.float64), jax.devices("cpu")[0])


def check_forward(case: Case, device=None, seed=0):
    q, k, v, sinks = inputs(case, seed, device)
    out, lse = jax.jit(lambda q, k, v, s: flashjax.flash_attention(
        q, k, v, sinks=s, return_lse=True, **case.options()))(q, k, v, sinks)
    out, lse = np.asarray(out, np.float64), np.asarray(lse)
    assert out.shape == (case.batch, case.seqlen_q, case.heads_q, case.dv)
    assert lse.shape == (case.batch, case.heads_q, case.seqlen_q) and lse.dtype == np.float32
    assert not np.isnan(out).any() and not np.isnan(lse).any()

    ref_out, ref_lse = reference.attention(*map(_hi, (q, k, v)), sinks=_hi(sinks), return_lse=True,
                                           compute_dtype=jnp.float64, **case.options())
    cpu = jax.devices("cpu")[0]
    lowp_out = reference.attention(*jax.device_put((q, k, v), cpu),
                                   sinks=None if sinks is None else jax.device_put(sinks, cpu),
                                   compute_dtype=case.dtype, **case.options())
    ref_out, ref_lse = np.asarray(ref_out), np.asarray(ref_lse)
    err = rel_err(out, ref_out)
    tol = tolerance(case.dtype, rel_err(lowp_out, ref_out))
    assert err <= tol, f"{case}: out rel err {err:.3g} > {tol:.3g}"

    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite, err_msg=f"{case}: lse -inf rows")
    if finite.any():
        lse_err = np.abs(lse[finite] - ref_lse[finite]).max()
        assert lse_err <= (1e-5 if case.dtype == "float32" else 1e-2) * max(1, np.abs(ref_lse[finite]).max())
    return out, lse


def _loss(fn, q, k, v, sinks, ct_out, ct_lse, dtype):
    out, lse = fn(q, k, v, sinks)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(dtype) * ct_out.astype(dtype)) + jnp.sum(lse.astype(dtype) * ct_lse.astype(dtype))


def check_gradients(case: Case, device=None, seed=0, deterministic=False):
    """Gradients of q, k, v (and sinks) of a loss on out and lse, against float64."""
    q, k, v, sinks = inputs(case, seed, device)
    rng = np.random.default_rng(seed + 1)
    ct_out = jnp.asarray(rng.standard_normal((case.batch, case.seqlen_q, case.heads_q, case.dv)))
    ct_lse = jnp.asarray(rng.standard_normal((case.batch, case.heads_q, case.seqlen_q)))
    has_sinks = sinks is not None
    argnums = (0, 1, 2, 3) if has_sinks else (0, 1, 2)

    def ours(q, k, v, s):
        return flashjax.flash_attention(q, k, v, sinks=s, return_lse=True,
                                        deterministic=deterministic, **case.options())

    def ref(q, k, v, s):
        return reference.attention(q, k, v, sinks=s, return_lse=True, compute_dtype=jnp.float64,
                                   **case.options())

    ct = jax.device_put((ct_out, ct_lse), device) if device is not None else (ct_out, ct_lse)
    grads = jax.jit(jax.grad(lambda *a: _loss(ours, *a, *ct, jnp.float32), argnums))(q, k, v, sinks)
    ref_grads = jax.grad(lambda *a: _loss(ref, *a, ct_out, ct_lse, jnp.float64), argnums)(
        *map(_hi, (q, k, v, sinks)))
    cpu = jax.devices("cpu")[0]
    lowp = jax.grad(lambda *a: _loss(lambda q, k, v, s: reference.attention(
        q, k, v, sinks=s, return_lse=True, compute_dtype=case.dtype, **case.options()),
        *a, ct_out, ct_lse, jnp.float32), argnums)(*jax.device_put((q, k, v, sinks), cpu))
    for name, g, r, lo in zip("qkvs", grads, ref_grads, lowp):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all(), f"{case}: d{name} not finite"
        err = rel_err(g, r)
        tol = 1e-4 if case.dtype == "float32" else 2 * rel_err(lo, r) + 1e-3
        assert err <= tol, f"{case}: d{name} rel err {err:.3g} > {tol:.3g}"
    return grads
