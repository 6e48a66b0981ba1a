"""flashjax.ring_attention: attention over a sequence sharded along a mesh axis, for
code inside `jax.shard_map`.

Each device holds one chunk of the sequence's queries and keys (or, with
layout="zigzag", chunks i and 2n-1-i of 2n: causal work balanced over the ring, see
`zigzag` / `unzigzag`). Strategy "ring" passes the K/V chunks around the ring,
"all_gather" gathers them once (Llama-3 style); the queries are never gathered. The
engine is flashjax._sharded, which also runs `jax.jit` of a sequence-sharded
flash_attention; here it gets its own jax.custom_vjp (_autodiff).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _checks, _ffi, _ffi_calls, _route
from ._autodiff import differentiable
from ._sharded import (ENGINES, GATHER_MIN_GROUP, Plan, choose_strategy, gathered_in_jax,
                       unzigzag, zigzag)
from ._spec import Extras, Layout

__all__ = ["ring_attention", "zigzag", "unzigzag", "choose_strategy", "GATHER_MIN_GROUP",
           "LAYOUTS", "STRATEGIES"]

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("auto", "ring", "all_gather")


def _ring_forward(q, k, v, extras: Extras, layout: Layout, static):
    axis_name, plan = static
    forward, _ = ENGINES[plan.strategy]
    return forward(q, k, v, _ffi_calls.extra_rows(q, extras, layout, plan.cfg), layout,
                   axis_name, plan)


def _ring_backward(q, k, v, out, dout, lse, dlse, extras: Extras, layout: Layout, static,
                   _needed):
    axis_name, plan = static
    _, backward = ENGINES[plan.strategy]
    dq, dk, dv, d_rows = backward(
        q, k, v, out, dout.astype(out.dtype), lse, dlse.astype(jnp.float32),
        _ffi_calls.extra_rows(q, extras, layout, plan.cfg), layout, axis_name, plan)
    return dq, dk, dv, _ffi_calls.from_rows(d_rows, extras)


# static: (axis_name, plan); the layout is always empty (ring_attention takes no metadata).
_ring_core = differentiable(_ring_forward, _ring_backward)


def ring_attention(q, k, v, axis_name, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, sinks=None, return_lse=False, deterministic=False,
                   layout="contiguous", strategy="auto", implementation=None):
    """flash_attention over a sequence sharded along `axis_name`, inside jax.shard_map.

    q, k, v: this device's rows, (batch, rows, heads, head_dim) as in flash_attention,
      the same number of query and key rows per device. With layout="contiguous"
      device i holds chunk i of the sequence; with "zigzag", chunks i and 2n-1-i of 2n
      (`flashjax.ring.zigzag` reorders a sequence so; it balances causal work).
    Other arguments as flash_attention's, for the whole sequence: causal and windows
      compare global positions (query p sees keys <= p when causal).
    strategy: "ring" (K/V passed around the ring while each block computes), or
      "all_gather" (K/V gathered once, dK/dV reduce-scattered: cheaper when K/V are
      small, GQA), or "auto": "all_gather" when heads_q >= 4 * heads_kv and there is
      no sliding window, "ring" otherwise. Queries are never gathered.
    implementation: as in flash_attention ("xla", and platforms without flashjax's
      kernels: K/V all-gathered, the pure-JAX blockwise attention per local chunk).

    Returns out (and lse (batch, heads, rows)) for this device's rows. Differentiable
    (reverse mode): dK/dV travel back around the ring (or are reduce-scattered).
    """
    _checks.check_qkv(q, k, v, 4, ("(batch, rows, heads_q, head_dim)",
                                   "(batch, rows, heads_kv, head_dim)",
                                   "(batch, rows, heads_kv, head_dim_v)"), "rows")
    if q.shape[1] != k.shape[1] or q.shape[0] != k.shape[0]:
        raise ValueError("ring_attention needs as many local query rows as key rows and one "
                         f"batch; got q {q.shape}, k {k.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even number of local rows, got {q.shape[1]}")
    _checks.check_sinks(sinks, q.shape[2])
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              deterministic, implementation, return_lse)
    plan = Plan(cfg, layout, choose_strategy(strategy, q.shape[2] // k.shape[2], cfg))
    _ffi.load()
    kernels = lambda q, k, v, extras: _ring_core(q, k, v, extras, Layout(), (axis_name, plan))
    in_jax = lambda q, k, v, extras: gathered_in_jax(q, k, v, extras, axis_name, plan)
    out, lse = _route.run(cfg, (q, k, v, Extras(sinks=sinks)), cuda=kernels, cpu=kernels,
                          xla=in_jax, arrays=(q,))
    return (out, lse) if return_lse else out
