"""The differentiation every attention core shares (the kernels' `_core.attention_core`,
the pure-JAX `xla_attention.attention_core`, ring_attention's): one jax.custom_vjp
around a forward and a backward of the same signature."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from ._spec import Layout
from ._vma import sum_to_varying

__all__ = ["differentiable"]


def _no_cotangent(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def differentiable(forward: Callable, backward: Callable):
    """core(q, k, v, extras, layout, static) -> (out, lse): forward's result, as a
    jax.custom_vjp whose backward is backward(q, k, v, out, dout, lse, dlse, extras,
    layout, static) -> (dq, dk, dv, d_extras) (d_extras: an Extras like extras).
    `static` is hashable and not differentiated; the layout's metadata gets float0
    cotangents; a gradient varying over more mesh axes than its input is summed over
    them (shard_map)."""
    core = jax.custom_vjp(forward, nondiff_argnums=(5,))

    def core_fwd(q, k, v, extras, layout, static):
        out, lse = forward(q, k, v, extras, layout, static)
        return (out, lse), (q, k, v, extras, layout, out, lse)

    def core_bwd(static, residuals, cotangents):
        q, k, v, extras, layout, out, lse = residuals
        dout, dlse = cotangents
        grads = backward(q, k, v, out, dout, lse, dlse, extras, layout, static)
        grads = jax.tree.map(sum_to_varying, tuple(grads), (q, k, v, extras))
        return grads + (Layout(*map(_no_cotangent, layout)),)

    core.defvjp(core_fwd, core_bwd)
    return core
