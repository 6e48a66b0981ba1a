"""The IEEE-exact masked weighted sum that keeps non-finite values where they belong.

docs/api.md ("Non-finite values"): row i's result is the IEEE evaluation of attention
over the keys it sees. A matrix product of weights with a masked entry set to 0 is not
that: 0 * NaN = NaN (and 0 * inf = NaN) lets a NaN in a row of x reach rows whose mask
hides it. `masked_sum` computes sum_j w_ij x_jc over the visible (i, j) only, as IEEE
would: the finite part by one product with the non-finite entries of x zeroed, the
non-finite contributions from products of indicator matrices, counted per (i, c).

Used by the float64 reference (reference.py) and by the masked blocks of the pure-JAX
path (xla_attention.py); the GPU kernels do the same in their masked tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["any_nonfinite", "masked_sum"]


def masked_sum(w, visible, x, dot, signed=False):
    """sum over visible j of w_ij * x_jc, IEEE-exact for non-finite x.

    w: weights (..., m, n), 0 at the masked (i, j); visible: bool, broadcastable to w;
    x: the rows (in the layout `dot` expects); dot(a, b): the contraction of a (w's
    shape) with b (x's shape) over n. signed: w may be negative (else w >= 0 or NaN).
    The gradient is that of dot(w, x) for finite x (the correction is a constant 0).
    """
    finite = jnp.isfinite(x)
    part = dot(w, jnp.where(finite, x, jnp.zeros((), x.dtype)))
    visible = jnp.broadcast_to(visible, w.shape)
    # True where some visible j pairs an indicator a_ij with an indicator b_jc.
    meet = lambda a, b: dot(a.astype(w.dtype), b.astype(w.dtype)) > 0
    positive = visible & (w > 0)
    zero = visible & (w == 0)  # 0 * inf = NaN (a NaN weight already made `part` NaN)
    plus = meet(positive, x == jnp.inf)
    minus = meet(positive, x == -jnp.inf)
    if signed:
        negative = visible & (w < 0)
        plus = plus | meet(negative, x == -jnp.inf)
        minus = minus | meet(negative, x == jnp.inf)
    nan = meet(visible, jnp.isnan(x)) | meet(zero, jnp.isinf(x)) | (plus & minus)
    extra = jnp.where(nan, jnp.nan, jnp.where(plus, jnp.inf, jnp.where(minus, -jnp.inf, 0)))
    return part + jax.lax.stop_gradient(extra.astype(part.dtype))


def any_nonfinite(x):
    """Scalar bool: x holds a NaN or an inf."""
    return ~jnp.all(jnp.isfinite(x))
