"""flashjax.ring_attention: attention over a sequence sharded along a mesh axis, for
code inside `jax.shard_map`.

Each device holds one chunk of the sequence's queries and keys (or, with
layout="zigzag", chunks i and 2n-1-i of 2n: causal work balanced over the ring, see
`zigzag` / `unzigzag`). The K/V chunks travel around the ring (`ppermute`), each step
attends the local queries to the chunk held, and the partial results merge through
their log-sum-exp. In the backward, dK/dV accumulate with the chunk they belong to
and travel back home with it.

A block (query chunk, key chunk) of a causal call is either all visible (keys before
the queries: a non-causal kernel call), the diagonal (a causal call: equal chunks
align bottom-right = top-left), or invisible (skipped): which one depends on the
devices' ring positions, a traced value, so each block is a `lax.switch`. Sinks join
the softmax once: only the diagonal blocks of the first step pass them. Sliding
windows need the kernels' position offset (not yet): ring_attention raises for them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import _calls, _checks, _ffi
from ._calls import Layout

SKIP, DIAGONAL, VISIBLE = 0, 1, 2
LAYOUTS = ("contiguous", "zigzag")


def zigzag(x, parts: int, axis: int = 1):
    """Reorders a sequence (along `axis`) so that sharding it contiguously over
    `parts` devices gives device i chunks i and 2*parts-1-i of 2*parts: the order
    ring_attention(layout="zigzag") expects. The length must divide by 2*parts."""
    chunks = jnp.split(x, 2 * parts, axis=axis)
    order = [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]
    return jnp.concatenate([chunks[c] for c in order], axis=axis)


def unzigzag(x, parts: int, axis: int = 1):
    """The inverse of zigzag: the sequence back in its own order."""
    chunks = jnp.split(x, 2 * parts, axis=axis)
    order = [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]
    restored = [None] * (2 * parts)
    for position, c in enumerate(order):
        restored[c] = chunks[position]
    return jnp.concatenate(restored, axis=axis)


def _vary_like(x, like):
    """x, declared to vary over the mesh axes `like` varies over (shard_map's vma:
    both branches of a switch must agree)."""
    extra = _calls._varying_axes(like) - _calls._varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(extra)), to="varying") if extra else x


def _chunk_ids(me, n: int, layout: str):
    """The global chunk indices of the local parts (one part, or two for zigzag)."""
    return (me,) if layout == "contiguous" else (me, 2 * n - 1 - me)


def _block_kind(q_chunk, k_chunk, causal: bool):
    if not causal:
        return jnp.int32(VISIBLE)
    return jnp.where(k_chunk > q_chunk, SKIP, jnp.where(k_chunk == q_chunk, DIAGONAL, VISIBLE))


def _split(x, parts: int, axis: int = 1):
    return jnp.split(x, parts, axis=axis)


def _join(parts: list, axis: int = 1):
    return jnp.concatenate(parts, axis=axis)


def _ring_permute(x, axis_name, n: int):
    return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


def _configs(cfg: _calls.Config):
    """(visible, diagonal) configs of the blocks, each with and without sinks."""
    block = lambda right, sinks: dataclasses.replace(cfg, window_left=-1, window_right=right,
                                                     has_sinks=sinks)
    return {sinks: (block(-1, sinks), block(0, sinks)) for sinks in (False, True)}


def _block_forward(q, k, v, sinks_rows, kind, cfgs):
    """(out float32, lse) of q's rows over one key block of the given kind."""
    visible, diagonal = cfgs

    def skip(q, k, v, s):
        out, lse = jax.eval_shape(lambda: _calls._forward_ffi(q, k, v, s, Layout(), visible))
        return (_vary_like(jnp.zeros(out.shape, jnp.float32), q),
                _vary_like(jnp.full(lse.shape, -jnp.inf, jnp.float32), q))

    def attend(cfg):
        def run(q, k, v, s):
            out, lse = _calls._forward_ffi(q, k, v, s, Layout(), cfg)
            return out.astype(jnp.float32), lse
        return run
    return jax.lax.switch(kind, (skip, attend(diagonal), attend(visible)), q, k, v, sinks_rows)


def _merge(acc, part):
    """Two (out float32 (b, s, h, d), lse (b, h, s)) partial results of the same rows."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w1 = jnp.swapaxes(jnp.exp(l1 - safe), 1, 2)[..., None]
    w2 = jnp.swapaxes(jnp.exp(l2 - safe), 1, 2)[..., None]
    return o1 * w1 + o2 * w2, lse


def ring_forward(q, k, v, sinks_rows, axis_name, causal, layout, cfg):
    """(out, lse) of the local rows; sinks_rows (batch, heads_q) (unused without
    cfg.has_sinks). Also the sequence-sharded lowering of flash_attention under jit."""
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    parts = 1 if layout == "contiguous" else 2
    q_ids = _chunk_ids(me, n, layout)
    q_parts = _split(q, parts)
    cfgs = _configs(cfg)
    acc = [None] * parts
    for step in range(n):
        k_blocks = list(zip(_split(k, parts), _split(v, parts), _chunk_ids((me - step) % n, n,
                                                                           layout)))
        for i, (qi, q_id) in enumerate(zip(q_parts, q_ids)):
            for j, (kj, vj, k_id) in enumerate(k_blocks):
                sinks_here = cfg.has_sinks and step == 0 and i == j
                part = _block_forward(qi, kj, vj, sinks_rows, _block_kind(q_id, k_id, causal),
                                      cfgs[sinks_here])
                acc[i] = part if acc[i] is None else _merge(acc[i], part)
        if step + 1 < n:
            k, v = _ring_permute(k, axis_name, n), _ring_permute(v, axis_name, n)
    return _join([o for o, _ in acc]).astype(q.dtype), _join([l for _, l in acc], axis=2)


def _block_backward(q, k, v, out, dout, lse, dlse, sinks_rows, kind, cfgs):
    visible, diagonal = cfgs

    def skip(q, k, v, out, dout, lse, dlse, s):
        return tuple(_vary_like(jnp.zeros(x.shape, jnp.float32), q) for x in (q, k, v, s))

    def attend(cfg):
        def run(*args):
            grads = _calls._backward_ffi(*args, Layout(), cfg)
            return tuple(g.astype(jnp.float32) for g in grads)
        return run
    return jax.lax.switch(kind, (skip, attend(diagonal), attend(visible)),
                          q, k, v, out, dout, lse, dlse, sinks_rows)


def ring_backward(q, k, v, out, dout, lse, dlse, sinks_rows, axis_name, causal, layout, cfg):
    """(dq, dk, dv, dsinks_rows) of ring_forward's call (dsinks_rows (batch, heads_q))."""
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    parts = 1 if layout == "contiguous" else 2
    q_ids = _chunk_ids(me, n, layout)
    q_parts, out_parts, dout_parts = (_split(x, parts) for x in (q, out, dout))
    lse_parts, dlse_parts = (_split(x, parts, axis=2) for x in (lse, dlse))
    cfgs = _configs(cfg)
    dq = [jnp.zeros(x.shape, jnp.float32) for x in q_parts]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    dsinks = jnp.zeros(sinks_rows.shape, jnp.float32)
    for step in range(n):
        k_blocks = list(zip(_split(k, parts), _split(v, parts), _chunk_ids((me - step) % n, n,
                                                                           layout)))
        dk_parts, dv_parts = _split(dk, parts), _split(dv, parts)
        for i in range(parts):
            for j, (kj, vj, k_id) in enumerate(k_blocks):
                sinks_here = cfg.has_sinks and step == 0 and i == j
                g_q, g_k, g_v, g_s = _block_backward(
                    q_parts[i], kj, vj, out_parts[i], dout_parts[i], lse_parts[i],
                    dlse_parts[i], sinks_rows, _block_kind(q_ids[i], k_id, causal),
                    cfgs[sinks_here])
                dq[i] = dq[i] + g_q
                dk_parts[j] = dk_parts[j] + g_k
                dv_parts[j] = dv_parts[j] + g_v
                if sinks_here:
                    dsinks = dsinks + g_s
        dk, dv = _join(dk_parts), _join(dv_parts)
        # The chunk and its gradients move on together; after the last step the
        # gradients take one more hop, home.
        dk, dv = _ring_permute(dk, axis_name, n), _ring_permute(dv, axis_name, n)
        if step + 1 < n:
            k, v = _ring_permute(k, axis_name, n), _ring_permute(v, axis_name, n)
    return _join(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks


# flash_attention's calls on sequence shards under jax.jit (_partitioning's ring_impl):
# plain chunk order, causal when the call's window is (-1, 0).
def sharded_forward(cfg, _present, axis_name, q, k, v, sinks_rows):
    return ring_forward(q, k, v, sinks_rows, axis_name, cfg.window_right == 0, "contiguous", cfg)


def sharded_backward(cfg, _present, axis_name, q, k, v, out, dout, lse, dlse, sinks_rows):
    dq, dk, dv, dsink_rows = ring_backward(q, k, v, out, dout, lse, dlse, sinks_rows, axis_name,
                                           cfg.window_right == 0, "contiguous", cfg)
    # (each device's rows' share of a sink's gradient; the result is per batch, not per row)
    return dq, dk, dv, jax.lax.psum(dsink_rows, axis_name) if cfg.has_sinks else dsink_rows


def rings(cfg: _calls.Config, present: tuple) -> bool:
    """Whether a flash_attention call can run as a ring: no windows (the kernels take
    no position offset yet) and no seqused / segment ids."""
    return not present and cfg.window_left == -1 and cfg.window_right in (-1, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q, k, v, sinks, axis_name, causal, layout, cfg):
    return ring_forward(q, k, v, _calls._sink_rows(q, sinks, Layout(), cfg), axis_name, causal,
                        layout, cfg)


def _ring_fwd(q, k, v, sinks, axis_name, causal, layout, cfg):
    out, lse = ring_forward(q, k, v, _calls._sink_rows(q, sinks, Layout(), cfg), axis_name,
                            causal, layout, cfg)
    return (out, lse), (q, k, v, sinks, out, lse)


def _ring_bwd(axis_name, causal, layout, cfg, residuals, cotangents):
    q, k, v, sinks, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dsink_rows = ring_backward(
        q, k, v, out, dout.astype(out.dtype), lse, dlse.astype(jnp.float32),
        _calls._sink_rows(q, sinks, Layout(), cfg), axis_name, causal, layout, cfg)
    dsinks = jnp.sum(dsink_rows, axis=0).astype(sinks.dtype)
    return dq, dk, dv, _calls._sum_to_varying(dsinks, sinks)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, axis_name, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                   softcap=0.0, sinks=None, return_lse=False, deterministic=False,
                   layout="contiguous"):
    """flash_attention over a sequence sharded along `axis_name`, inside jax.shard_map.

    q, k, v: this device's rows, (batch, rows, heads, head_dim) as in flash_attention,
      the same number of query and key rows per device. With layout="contiguous"
      device i holds chunk i of the sequence; with "zigzag", chunks i and 2n-1-i of 2n
      (`flashjax.ring.zigzag` reorders a sequence so; it balances causal work).
    Other arguments as flash_attention's; causal is global (query p sees keys <= p).
    window_size must be (-1, -1): sliding windows need per-block position offsets,
    which the kernels do not take yet.

    Returns out (and lse (batch, heads, rows)) for this device's rows. Differentiable
    (reverse mode): dK/dV travel back around the ring.
    """
    _checks.check_qkv(q, k, v, 4, ("(batch, rows, heads_q, head_dim)",
                                   "(batch, rows, heads_kv, head_dim)",
                                   "(batch, rows, heads_kv, head_dim_v)"), "rows")
    if q.shape[1] != k.shape[1] or q.shape[0] != k.shape[0]:
        raise ValueError("ring_attention needs as many local query rows as key rows and one "
                         f"batch; got q {q.shape}, k {k.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout='zigzag' needs an even number of local rows, got {q.shape[1]}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("ring_attention does not take sliding windows yet (the "
                                  "kernels need a query/key position offset)")
    _checks.check_sinks(sinks, q.shape[2])
    cfg = _checks.make_config(q.shape[-1], softmax_scale, False, (-1, -1), softcap,
                              sinks is not None, deterministic)
    _ffi.load()
    if sinks is None:
        sinks = jnp.zeros((q.shape[2],), jnp.float32)
    out, lse = _ring(q, k, v, sinks, axis_name, bool(causal), layout, cfg)
    return (out, lse) if return_lse else out
