"""Sequence-parallel attention on the local FFI calls (_ffi_calls): the engine behind
flashjax.ring_attention and behind flash_attention's calls on sequence-sharded arrays
under jax.jit (_partitioning's ring_impl).

Each device holds one chunk of the sequence's queries and keys (or, with
layout="zigzag", chunks i and 2n-1-i of 2n: causal work balanced over the ring, see
`zigzag` / `unzigzag`). Two strategies:

- "ring": the K/V chunks travel around the ring (`ppermute`, one dtype per transfer),
  each step attends the local queries to the chunk held, and the partial results merge
  through their log-sum-exp; in the backward, dK/dV accumulate with the chunk they
  belong to and travel back home with it.
- "all_gather" (Llama-3 style context parallelism): K/V are all-gathered once, the
  local queries attend to the whole sequence in one call per local chunk, and the
  backward reduce-scatters dK/dV. Queries are never gathered.

Either way every kernel call is told where its query and key rows sit in the whole
sequence (the kernels' diagonal offset = query position - key position), so causal
masks, sliding windows, seqused and segment ids stay exact. A block (query chunk, key
chunk) of a masked call is skipped when no query sees a key, run unmasked when every
query sees every key, masked otherwise: a `lax.switch` on the traced ring positions.
Sinks join each row's softmax once: in the ring, only the blocks of a chunk against
itself at the first step pass them.

The extras (sinks) come and go as the FFI's rows (_ffi_calls.extra_rows).
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp

from . import _ffi_calls, xla_attention
from ._spec import FORWARD, BACKWARD, Config, Extras, Layout
from ._visibility import diagonal_offset, used_rows
from ._vma import varying_axes, vary_over

__all__ = ["GATHER_MIN_GROUP", "Plan", "choose_strategy", "zigzag", "unzigzag", "ENGINES",
           "sharded_forward", "sharded_backward", "gathered_in_jax"]

# "auto" all-gathers K/V when they are small next to Q: at least this many query heads
# per kv head (GQA), and no sliding window (a window needs few of the keys, which the
# ring's skipped blocks never move or compute).
GATHER_MIN_GROUP = 4


def choose_strategy(strategy: str, group: int, cfg: Config) -> str:
    """The documented rule behind strategy="auto" (docs/sharding.md)."""
    if strategy != "auto":
        return strategy
    return "all_gather" if group >= GATHER_MIN_GROUP and not cfg.window.sliding else "ring"


def zigzag(x, parts: int, axis: int = 1):
    """Reorders a sequence (along `axis`) so that sharding it contiguously over
    `parts` devices gives device i chunks i and 2*parts-1-i of 2*parts: the order
    ring_attention(layout="zigzag") expects. The length must divide by 2*parts."""
    chunks = jnp.split(x, 2 * parts, axis=axis)
    return jnp.concatenate([chunks[c] for c in _zigzag_order(parts)], axis=axis)


def unzigzag(x, parts: int, axis: int = 1):
    """The inverse of zigzag: the sequence back in its own order."""
    chunks = jnp.split(x, 2 * parts, axis=axis)
    restored = [None] * (2 * parts)
    for position, c in enumerate(_zigzag_order(parts)):
        restored[c] = chunks[position]
    return jnp.concatenate(restored, axis=axis)


def _zigzag_order(parts: int) -> list:
    return [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]


def _vary_like(x, like):
    """x, declared to vary over the mesh axes `like` varies over (both branches of a
    switch must agree)."""
    return vary_over(x, varying_axes(like))


def _split(x, parts: int, axis: int = 1):
    return jnp.split(x, parts, axis=axis)


def _join(parts: list, axis: int = 1):
    return jnp.concatenate(parts, axis=axis)


def _ring_permute(x, axis_name, n: int):
    return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sequence-sharded call, static: the call's config (causal folded into the
    window), the chunk order and the strategy ("ring" or "all_gather")."""

    cfg: Config
    layout: str
    strategy: str

    @property
    def parts(self) -> int:
        return 1 if self.layout == "contiguous" else 2


class Shard:
    """This device's place in the sequence: `parts` chunks of `rows` rows each, the
    first rows of chunk c at global row c * rows."""

    def __init__(self, axis_name, plan: Plan, local_rows: int):
        self.axis_name = axis_name
        self.n = jax.lax.axis_size(axis_name)
        self.me = jax.lax.axis_index(axis_name)
        self.plan = plan
        self.rows = local_rows // plan.parts
        self.total = local_rows * self.n

    def chunks(self, holder):
        """Global chunk indices of the parts `holder` (a device index) holds."""
        if self.plan.layout == "contiguous":
            return (holder,)
        return (holder, 2 * self.n - 1 - holder)

    def starts(self, holder) -> list:
        return [c * self.rows for c in self.chunks(holder)]


def _base_offset(meta: Layout, batch: int, total: int):
    """Query position - key position of global row 0 (batch,): the caller's diagonal
    offset, else bottom-right alignment on the used lengths."""
    used = lambda x: jnp.zeros((batch,), jnp.int32) + used_rows(x, total)
    return diagonal_offset(used(meta.seqused_q), used(meta.seqused_k), meta.diagonal_offset)


def _block_layout(meta: Layout, base, q_start, k_start, q_rows: int, k_rows: int,
                  q_ids, kv_ids, cfg: Config) -> Layout:
    """The Layout of one kernel call: query rows [q_start, +q_rows) of the sequence
    against key rows [k_start, +k_rows) (traced starts); q_ids / kv_ids their segment
    ids (or None)."""
    clip_used = lambda used, start, rows: (None if used is None
                                           else jnp.clip(used - start, 0, rows).astype(jnp.int32))
    return Layout(seqused_q=clip_used(meta.seqused_q, q_start, q_rows),
                  seqused_k=clip_used(meta.seqused_k, k_start, k_rows),
                  q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                  diagonal_offset=(base + q_start - k_start).astype(jnp.int32)
                  if cfg.window.masked else None)


SKIP, PARTIAL, FULL = 0, 1, 2  # what a block of the ring is: lax.switch branch indices


def _block_kind(layout: Layout, rows: int, cfg: Config, skippable: bool):
    """SKIP (no query of a rows x rows block sees a key), FULL (every query sees every
    key: an unmasked call, the kernels' uniform path when there is no other metadata)
    or PARTIAL, for every batch entry (traced)."""
    reach, full = cfg.window.block(layout.diagonal_offset, rows)
    partial_or_skip = jnp.where(jnp.any(reach) | (not skippable), PARTIAL, SKIP)
    return jnp.where(jnp.all(full), FULL, partial_or_skip).astype(jnp.int32)


def _unmasked(layout: Layout, cfg: Config):
    return (layout._replace(diagonal_offset=None),
            dataclasses.replace(cfg, window_left=-1, window_right=-1))


def _block_forward(q, k, v, rows: Extras, layout: Layout, cfg: Config, kind):
    """(out float32, lse) of q's rows over one key block (kind: a _block_kind, or None:
    run the masked call)."""
    def attend(cfg):
        def run(q, k, v, rows, layout):
            out, lse = _ffi_calls.forward(q, k, v, rows, layout, cfg)
            return out.astype(jnp.float32), lse
        return run

    if kind is None:
        return attend(cfg)(q, k, v, rows, layout)

    def skip(q, k, v, rows, layout):
        out, lse = jax.eval_shape(lambda: _ffi_calls.forward(q, k, v, rows, layout, cfg))
        return (_vary_like(jnp.zeros(out.shape, jnp.float32), q),
                _vary_like(jnp.full(lse.shape, -jnp.inf, jnp.float32), q))

    full_layout, full_cfg = _unmasked(layout, cfg)
    full = lambda q, k, v, s, _: attend(full_cfg)(q, k, v, s, full_layout)
    return jax.lax.switch(kind, (skip, attend(cfg), full), q, k, v, rows, layout)


def _block_backward(q, k, v, out, dout, lse, dlse, rows: Extras, layout: Layout,
                    cfg: Config, kind):
    """(dq, dk, dv, gradients of rows), float32, of one key block."""
    def attend(cfg):
        def run(q, k, v, out, dout, lse, dlse, rows, layout):
            grads = _ffi_calls.backward(q, k, v, out, dout, lse, dlse, rows, layout, cfg)
            return jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return run

    args = (q, k, v, out, dout, lse, dlse, rows)
    if kind is None:
        return attend(cfg)(*args, layout)

    def skip(q, k, v, out, dout, lse, dlse, rows, layout):
        return jax.tree.map(lambda x: _vary_like(jnp.zeros(x.shape, jnp.float32), q),
                            (q, k, v, rows))

    full_layout, full_cfg = _unmasked(layout, cfg)
    full = lambda *a: attend(full_cfg)(*a[:-1], full_layout)
    return jax.lax.switch(kind, (skip, attend(cfg), full), *args, layout)


def _merge(acc, part):
    """Two (out float32 (b, s, h, d), lse (b, h, s)) partial results of the same rows."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    w1 = jnp.swapaxes(jnp.exp(l1 - safe), 1, 2)[..., None]
    w2 = jnp.swapaxes(jnp.exp(l2 - safe), 1, 2)[..., None]
    return o1 * w1 + o2 * w2, lse


class _Blocks:
    """The kernel calls of the ring, step by step: block (local part i, held part j)
    at `step` (the K/V held then came from device me - step) with its Layout, extras
    and kind (skipped, masked, unmasked)."""

    def __init__(self, shard: Shard, meta: Layout, rows: Extras, batch: int):
        self.shard, self.meta, self.rows = shard, meta, rows
        self.base = _base_offset(meta, batch, shard.total)
        self.q_starts = shard.starts(shard.me)
        self.q_ids = (None if meta.q_segment_ids is None
                      else _split(meta.q_segment_ids, shard.plan.parts))

    def at(self, step, i, j, kv_ids):
        """(Layout, the extras' rows it passes, kind or None, whether it passes them)."""
        shard, cfg = self.shard, self.shard.plan.cfg
        k_start = shard.starts((shard.me - step) % shard.n)[j]
        layout = _block_layout(self.meta, self.base, self.q_starts[i], k_start, shard.rows,
                               shard.rows, None if kv_ids is None else self.q_ids[i],
                               None if kv_ids is None else kv_ids[j], cfg)
        # A chunk against itself (step 0): sinks join there (never skipped), and with
        # no positions or lengths given it is square and aligned (no offset needed).
        diagonal = step == 0 and i == j
        rows = self.rows if diagonal else Extras()
        sinks_here = rows.sinks is not None
        if not cfg.window.masked:
            return layout, rows, None, diagonal
        if diagonal and all(x is None for x in (self.meta.diagonal_offset,
                                                self.meta.seqused_q, self.meta.seqused_k)):
            return layout._replace(diagonal_offset=None), rows, None, diagonal
        return layout, rows, _block_kind(layout, shard.rows, cfg, not sinks_here), diagonal


def ring_forward(q, k, v, rows: Extras, meta: Layout, axis_name, plan: Plan):
    """(out, lse) of the local rows by strategy "ring"; rows: the extras' rows; meta:
    seqused / diagonal offset of the whole sequence, segment ids of the local rows (or
    none)."""
    shard = Shard(axis_name, plan, q.shape[1])
    blocks = _Blocks(shard, meta, rows, q.shape[0])
    q_parts = _split(q, plan.parts)
    kv_ids = meta.kv_segment_ids
    acc = [None] * plan.parts
    for step in range(shard.n):
        k_parts, v_parts = _split(k, plan.parts), _split(v, plan.parts)
        id_parts = None if kv_ids is None else _split(kv_ids, plan.parts)
        for i in range(plan.parts):
            for j in range(plan.parts):
                layout, block_rows, kind, _ = blocks.at(step, i, j, id_parts)
                part = _block_forward(q_parts[i], k_parts[j], v_parts[j], block_rows, layout,
                                      plan.cfg, kind)
                acc[i] = part if acc[i] is None else _merge(acc[i], part)
        if step + 1 < shard.n:
            k, v = _ring_permute(k, axis_name, shard.n), _ring_permute(v, axis_name, shard.n)
            if kv_ids is not None:
                kv_ids = _ring_permute(kv_ids, axis_name, shard.n)
    return _join([o for o, _ in acc]).astype(q.dtype), _join([l for _, l in acc], axis=2)


def ring_backward(q, k, v, out, dout, lse, dlse, rows: Extras, meta: Layout, axis_name,
                  plan: Plan):
    """(dq, dk, dv, gradients of rows) of ring_forward's call."""
    shard = Shard(axis_name, plan, q.shape[1])
    blocks = _Blocks(shard, meta, rows, q.shape[0])
    n, parts = shard.n, plan.parts
    q_parts, out_parts, dout_parts = (_split(x, parts) for x in (q, out, dout))
    lse_parts, dlse_parts = (_split(x, parts, axis=2) for x in (lse, dlse))
    kv_ids = meta.kv_segment_ids
    dq = [jnp.zeros(x.shape, jnp.float32) for x in q_parts]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    d_rows = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), rows)
    for step in range(n):
        k_parts, v_parts = _split(k, parts), _split(v, parts)
        id_parts = None if kv_ids is None else _split(kv_ids, parts)
        dk_parts, dv_parts = _split(dk, parts), _split(dv, parts)
        for i in range(parts):
            for j in range(parts):
                layout, block_rows, kind, passes_rows = blocks.at(step, i, j, id_parts)
                g_q, g_k, g_v, g_rows = _block_backward(
                    q_parts[i], k_parts[j], v_parts[j], out_parts[i], dout_parts[i],
                    lse_parts[i], dlse_parts[i], block_rows, layout, plan.cfg, kind)
                dq[i] = dq[i] + g_q
                dk_parts[j] = dk_parts[j] + g_k
                dv_parts[j] = dv_parts[j] + g_v
                if passes_rows:
                    d_rows = jax.tree.map(operator.add, d_rows, g_rows)
        dk, dv = _join(dk_parts), _join(dv_parts)
        # The chunk and its gradients move on together; after the last step the
        # gradients take one more hop, home.
        dk, dv = _ring_permute(dk, axis_name, n), _ring_permute(dv, axis_name, n)
        if step + 1 < n:
            k, v = _ring_permute(k, axis_name, n), _ring_permute(v, axis_name, n)
            if kv_ids is not None:
                kv_ids = _ring_permute(kv_ids, axis_name, n)
    return _join(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_rows


def _gather_keys(x, shard: Shard):
    """The whole sequence's rows of a key-side array, in sequence order."""
    whole = jax.lax.all_gather(x, shard.axis_name, axis=1, tiled=True)
    return unzigzag(whole, shard.n) if shard.plan.layout == "zigzag" else whole


def _scatter_keys(x, shard: Shard):
    """The transpose of _gather_keys: each device's rows of the sum over devices."""
    if shard.plan.layout == "zigzag":
        x = zigzag(x, shard.n)
    return jax.lax.psum_scatter(x, shard.axis_name, scatter_dimension=1, tiled=True)


def _gathered_layouts(shard: Shard, meta: Layout, batch: int, kv_ids) -> list:
    """The Layout of each local part's call against the whole sequence's keys."""
    base = _base_offset(meta, batch, shard.total)
    q_ids = None if kv_ids is None else _split(meta.q_segment_ids, shard.plan.parts)
    return [_block_layout(meta, base, start, 0, shard.rows, shard.total,
                          None if kv_ids is None else q_ids[i], kv_ids, shard.plan.cfg)
            for i, start in enumerate(shard.starts(shard.me))]


def gather_forward(q, k, v, rows: Extras, meta: Layout, axis_name, plan: Plan):
    """ring_forward's result by strategy "all_gather"."""
    shard = Shard(axis_name, plan, q.shape[1])
    k_all, v_all = _gather_keys(k, shard), _gather_keys(v, shard)
    kv_ids = None if meta.kv_segment_ids is None else _gather_keys(meta.kv_segment_ids, shard)
    results = [_ffi_calls.forward(qi, k_all, v_all, rows, layout, plan.cfg)
               for qi, layout in zip(_split(q, plan.parts),
                                     _gathered_layouts(shard, meta, q.shape[0], kv_ids))]
    return _join([o for o, _ in results]), _join([l for _, l in results], axis=2)


def gather_backward(q, k, v, out, dout, lse, dlse, rows: Extras, meta: Layout, axis_name,
                    plan: Plan):
    """ring_backward's result by strategy "all_gather" (dK/dV reduce-scattered)."""
    shard = Shard(axis_name, plan, q.shape[1])
    k_all, v_all = _gather_keys(k, shard), _gather_keys(v, shard)
    kv_ids = None if meta.kv_segment_ids is None else _gather_keys(meta.kv_segment_ids, shard)
    row_parts = [_split(x, plan.parts) for x in (q, out, dout)]
    stat_parts = [_split(x, plan.parts, axis=2) for x in (lse, dlse)]
    dq, dk, dv = [], 0.0, 0.0
    d_rows = jax.tree.map(lambda x: 0.0, rows)
    for i, layout in enumerate(_gathered_layouts(shard, meta, q.shape[0], kv_ids)):
        qi, oi, doi = (x[i] for x in row_parts)
        li, dli = (x[i] for x in stat_parts)
        g_q, g_k, g_v, g_rows = _ffi_calls.backward(qi, k_all, v_all, oi, doi, li, dli, rows,
                                                    layout, plan.cfg)
        dq.append(g_q)
        dk, dv = dk + g_k.astype(jnp.float32), dv + g_v.astype(jnp.float32)
        d_rows = jax.tree.map(operator.add, d_rows, g_rows)
    return (_join(dq), _scatter_keys(dk, shard).astype(k.dtype),
            _scatter_keys(dv, shard).astype(v.dtype), d_rows)


# (forward, backward) by strategy.
ENGINES = {"ring": (ring_forward, ring_backward), "all_gather": (gather_forward, gather_backward)}


# flash_attention's calls on sequence shards under jax.jit (_partitioning's ring_impl):
# plain chunk order, the strategy by choose_strategy's rule.
def _jit_plan(cfg, q, k) -> Plan:
    return Plan(cfg, "contiguous", choose_strategy("auto", q.shape[2] // k.shape[2], cfg))


def sharded_forward(cfg, present, axis_name, *operands):
    """_core's forward call (its flat FFI operands) on sequence shards along axis_name."""
    values = FORWARD.values(present, operands)
    q, k, v = values["q"], values["k"], values["v"]
    plan = _jit_plan(cfg, q, k)
    forward, _ = ENGINES[plan.strategy]
    return forward(q, k, v, Extras.of(values), Layout.of(values), axis_name, plan)


def sharded_backward(cfg, present, axis_name, *operands):
    """_core's backward call on sequence shards: (dq, dk, dv, *present extras' rows'
    gradients)."""
    values = BACKWARD.values(present, operands)
    q, k = values["q"], values["k"]
    plan = _jit_plan(cfg, q, k)
    _, backward = ENGINES[plan.strategy]
    dq, dk, dv, d_rows = backward(
        *(values[n] for n in ("q", "k", "v", "out", "dout", "lse", "dlse")), Extras.of(values),
        Layout.of(values), axis_name, plan)
    # (each device's rows' share of a sink's gradient; the result is per batch, not per row)
    return (dq, dk, dv, *(jax.lax.psum(g, axis_name) for g in d_rows.given()))


def gathered_in_jax(q, k, v, extras: Extras, axis_name, plan: Plan):
    """The pure-JAX version (implementation="xla", and platforms without flashjax's
    kernels): K/V all-gathered, each local chunk attends at its position; JAX
    differentiates it (the gathers' transpose reduce-scatters dK/dV)."""
    shard = Shard(axis_name, plan, q.shape[1])
    k_all, v_all = _gather_keys(k, shard), _gather_keys(v, shard)
    results = [xla_attention.attention_core(
                   qi, k_all, v_all, extras,
                   Layout(diagonal_offset=jnp.full((q.shape[0],), start, jnp.int32)), plan.cfg)
               for qi, start in zip(_split(q, plan.parts), shard.starts(shard.me))]
    return _join([o for o, _ in results]), _join([l for _, l in results], axis=2)
