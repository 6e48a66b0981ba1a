"""The differentiation every attention core shares (the kernels' `_core.attention_core`,
the pure-JAX `xla_attention.attention_core`, ring_attention's): one jax.custom_vjp
around a forward and a backward of the same signature."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from ._spec import Extras, Layout
from ._vma import sum_to_varying

__all__ = ["differentiable"]


def _no_cotangent(x):
    """Layout fields take no gradient: float0 zeros for integer and bool metadata, None
    (a zero) for float ones (alibi_slopes)."""
    if x is None or jnp.issubdtype(x.dtype, jnp.floating):
        return None
    return np.zeros(x.shape, jax.dtypes.float0)


def _instantiate(x):
    return jnp.zeros(x.shape, x.dtype) if isinstance(x, SymbolicZero) else x


@jax.tree_util.register_static
class _Needed(tuple):
    """Which extras' gradients are wanted (static: carried in the residuals)."""


def differentiable(forward: Callable, backward: Callable):
    """core(q, k, v, extras, layout, static) -> (out, lse): forward's result, as a
    jax.custom_vjp whose backward is backward(q, k, v, out, dout, lse, dlse, extras,
    layout, static, needed) -> (dq, dk, dv, d_extras) (d_extras: an Extras like extras;
    `needed`: an Extras of bools, whether each extra is perturbed (custom_vjp's symbolic
    zeros): an extra not needed may get None, so that e.g. a constant bias costs no
    gradient). `static` is hashable and not differentiated; the layout's metadata gets
    no cotangent; a gradient varying over more mesh axes than its input is summed over
    them (shard_map)."""
    core = jax.custom_vjp(forward, nondiff_argnums=(5,))

    def core_fwd(q, k, v, extras, layout, static):
        needed = _Needed(x is not None and x.perturbed for x in extras)
        q, k, v, extras, layout = jax.tree.map(lambda x: x.value, (q, k, v, extras, layout))
        out, lse = forward(q, k, v, extras, layout, static)
        return (out, lse), (q, k, v, extras, layout, out, lse, needed)

    def core_bwd(static, residuals, cotangents):
        q, k, v, extras, layout, out, lse, needed = residuals
        dout, dlse = (_instantiate(x) for x in cotangents)
        grads = backward(q, k, v, out, dout, lse, dlse, extras, layout, static,
                         Extras(*needed))
        grads = jax.tree.map(lambda g, x: None if g is None else sum_to_varying(g, x),
                             tuple(grads), (q, k, v, extras), is_leaf=lambda g: g is None)
        return grads + (Layout(*map(_no_cotangent, layout)),)

    core.defvjp(core_fwd, core_bwd, symbolic_zeros=True)
    return core
