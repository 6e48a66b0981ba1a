"""flashjax.ring_attention: attention over a sequence sharded along a mesh axis, for
code inside `jax.shard_map` (and, through _partitioning, `jax.jit` of a sequence-sharded
flash_attention).

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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import _calls, _checks, _ffi, _implementation, xla_attention
from ._calls import Layout

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("auto", "ring", "all_gather")
# "auto" all-gathers K/V when they are small next to Q: at least this many query heads
# per kv head (GQA), and no sliding window (a window needs few of the keys, which the
# ring's skipped blocks never move or compute).
GATHER_MIN_GROUP = 4


def choose_strategy(strategy: str, group: int, cfg: _calls.Config) -> str:
    """The documented rule behind strategy="auto" (docs/sharding.md)."""
    if strategy != "auto":
        return strategy
    windowed = cfg.window_left >= 0 or cfg.window_right > 0
    return "all_gather" if group >= GATHER_MIN_GROUP and not windowed else "ring"


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
    """x, declared to vary over the mesh axes `like` varies over (shard_map's vma:
    both branches of a switch must agree)."""
    extra = _calls._varying_axes(like) - _calls._varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(extra)), to="varying") if extra else x


def _split(x, parts: int, axis: int = 1):
    return jnp.split(x, parts, axis=axis)


def _join(parts: list, axis: int = 1):
    return jnp.concatenate(parts, axis=axis)


def _ring_permute(x, axis_name, n: int):
    return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


def _masked(cfg: _calls.Config) -> bool:
    return cfg.window_left >= 0 or cfg.window_right >= 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """A sequence-sharded call, static: the call's config (causal folded into the
    window), the chunk order and the strategy ("ring" or "all_gather")."""

    cfg: _calls.Config
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
    if meta.diagonal_offset is not None:
        return meta.diagonal_offset
    used = lambda x: jnp.zeros((batch,), jnp.int32) + (total if x is None
                                                         else jnp.clip(x, 0, total))
    return used(meta.seqused_k) - used(meta.seqused_q)


def _block_layout(meta: Layout, base, q_start, k_start, q_rows: int, k_rows: int,
                  q_ids, kv_ids, cfg: _calls.Config) -> Layout:
    """The Layout of one kernel call: query rows [q_start, +q_rows) of the sequence
    against key rows [k_start, +k_rows) (traced starts); q_ids / kv_ids their segment
    ids (or None)."""
    clip_used = lambda used, start, rows: (None if used is None
                                           else jnp.clip(used - start, 0, rows).astype(jnp.int32))
    return Layout(seqused_q=clip_used(meta.seqused_q, q_start, q_rows),
                  seqused_k=clip_used(meta.seqused_k, k_start, k_rows),
                  q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                  diagonal_offset=(base + q_start - k_start).astype(jnp.int32)
                  if _masked(cfg) else None)


SKIP, PARTIAL, FULL = 0, 1, 2  # what a block of the ring is: lax.switch branch indices


def _block_kind(layout: Layout, rows: int, cfg: _calls.Config, skippable: bool):
    """SKIP (no query of a rows x rows block sees a key), FULL (every query sees every
    key: an unmasked call, the kernels' uniform path when there is no other metadata)
    or PARTIAL, for every batch entry (traced)."""
    d, left, right = layout.diagonal_offset, cfg.window_left, cfg.window_right
    reach, full = jnp.ones(d.shape, bool), jnp.ones(d.shape, bool)
    if right >= 0:
        reach, full = reach & (d + right >= 1 - rows), full & (d + right >= rows - 1)
    if left >= 0:
        reach, full = reach & (d - left <= rows - 1), full & (d - left <= 1 - rows)
    partial_or_skip = jnp.where(jnp.any(reach) | (not skippable), PARTIAL, SKIP)
    return jnp.where(jnp.all(full), FULL, partial_or_skip).astype(jnp.int32)


def _unmasked(layout: Layout, cfg: _calls.Config):
    return (layout._replace(diagonal_offset=None),
            dataclasses.replace(cfg, window_left=-1, window_right=-1))


def _block_forward(q, k, v, sinks_rows, layout: Layout, cfg: _calls.Config, kind):
    """(out float32, lse) of q's rows over one key block (kind: a _block_kind, or None:
    run the masked call)."""
    def attend(cfg):
        def run(q, k, v, s, layout):
            out, lse = _calls._forward_ffi(q, k, v, s, layout, cfg)
            return out.astype(jnp.float32), lse
        return run

    if kind is None:
        return attend(cfg)(q, k, v, sinks_rows, layout)

    def skip(q, k, v, s, layout):
        out, lse = jax.eval_shape(lambda: _calls._forward_ffi(q, k, v, s, layout, cfg))
        return (_vary_like(jnp.zeros(out.shape, jnp.float32), q),
                _vary_like(jnp.full(lse.shape, -jnp.inf, jnp.float32), q))

    full_layout, full_cfg = _unmasked(layout, cfg)
    full = lambda q, k, v, s, _: attend(full_cfg)(q, k, v, s, full_layout)
    return jax.lax.switch(kind, (skip, attend(cfg), full), q, k, v, sinks_rows, layout)


def _block_backward(q, k, v, out, dout, lse, dlse, sinks_rows, layout: Layout,
                    cfg: _calls.Config, kind):
    """(dq, dk, dv, dsinks_rows), float32, of one key block."""
    def attend(cfg):
        def run(q, k, v, out, dout, lse, dlse, s, layout):
            grads = _calls._backward_ffi(q, k, v, out, dout, lse, dlse, s, layout, cfg)
            return tuple(g.astype(jnp.float32) for g in grads)
        return run

    args = (q, k, v, out, dout, lse, dlse, sinks_rows)
    if kind is None:
        return attend(cfg)(*args, layout)

    def skip(q, k, v, out, dout, lse, dlse, s, layout):
        return tuple(_vary_like(jnp.zeros(x.shape, jnp.float32), q) for x in (q, k, v, s))

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
    at `step` (the K/V held then came from device me - step) with its Layout, sinks
    config and kind (skipped, masked, unmasked)."""

    def __init__(self, shard: Shard, meta: Layout, batch: int):
        self.shard, self.meta = shard, meta
        self.base = _base_offset(meta, batch, shard.total)
        self.q_starts = shard.starts(shard.me)
        self.q_ids = (None if meta.q_segment_ids is None
                      else _split(meta.q_segment_ids, shard.plan.parts))

    def at(self, step, i, j, kv_ids):
        """(Layout, config, kind or None, whether the block passes the sinks)."""
        shard, cfg = self.shard, self.shard.plan.cfg
        k_start = shard.starts((shard.me - step) % shard.n)[j]
        layout = _block_layout(self.meta, self.base, self.q_starts[i], k_start, shard.rows,
                               shard.rows, None if kv_ids is None else self.q_ids[i],
                               None if kv_ids is None else kv_ids[j], cfg)
        # A chunk against itself (step 0): sinks join there (never skipped), and with
        # no positions or lengths given it is square and aligned (no offset needed).
        diagonal = step == 0 and i == j
        sinks_here = cfg.has_sinks and diagonal
        block_cfg = dataclasses.replace(cfg, has_sinks=sinks_here)
        if not _masked(cfg):
            return layout, block_cfg, None, sinks_here
        if diagonal and all(x is None for x in (self.meta.diagonal_offset,
                                                self.meta.seqused_q, self.meta.seqused_k)):
            return layout._replace(diagonal_offset=None), block_cfg, None, sinks_here
        return (layout, block_cfg, _block_kind(layout, shard.rows, cfg, not sinks_here),
                sinks_here)


def ring_forward(q, k, v, sinks_rows, meta: Layout, axis_name, plan: Plan):
    """(out, lse) of the local rows by strategy "ring"; sinks_rows (batch, heads_q)
    (unused without cfg.has_sinks); meta: seqused / diagonal offset of the whole
    sequence, segment ids of the local rows (or none)."""
    shard = Shard(axis_name, plan, q.shape[1])
    blocks = _Blocks(shard, meta, q.shape[0])
    q_parts = _split(q, plan.parts)
    kv_ids = meta.kv_segment_ids
    acc = [None] * plan.parts
    for step in range(shard.n):
        k_parts, v_parts = _split(k, plan.parts), _split(v, plan.parts)
        id_parts = None if kv_ids is None else _split(kv_ids, plan.parts)
        for i in range(plan.parts):
            for j in range(plan.parts):
                layout, cfg, kind, _ = blocks.at(step, i, j, id_parts)
                part = _block_forward(q_parts[i], k_parts[j], v_parts[j], sinks_rows, layout,
                                      cfg, kind)
                acc[i] = part if acc[i] is None else _merge(acc[i], part)
        if step + 1 < shard.n:
            k, v = _ring_permute(k, axis_name, shard.n), _ring_permute(v, axis_name, shard.n)
            if kv_ids is not None:
                kv_ids = _ring_permute(kv_ids, axis_name, shard.n)
    return _join([o for o, _ in acc]).astype(q.dtype), _join([l for _, l in acc], axis=2)


def ring_backward(q, k, v, out, dout, lse, dlse, sinks_rows, meta: Layout, axis_name,
                  plan: Plan):
    """(dq, dk, dv, dsinks_rows) of ring_forward's call (dsinks_rows (batch, heads_q))."""
    shard = Shard(axis_name, plan, q.shape[1])
    blocks = _Blocks(shard, meta, q.shape[0])
    n, parts = shard.n, plan.parts
    q_parts, out_parts, dout_parts = (_split(x, parts) for x in (q, out, dout))
    lse_parts, dlse_parts = (_split(x, parts, axis=2) for x in (lse, dlse))
    kv_ids = meta.kv_segment_ids
    dq = [jnp.zeros(x.shape, jnp.float32) for x in q_parts]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    dsinks = jnp.zeros(sinks_rows.shape, jnp.float32)
    for step in range(n):
        k_parts, v_parts = _split(k, parts), _split(v, parts)
        id_parts = None if kv_ids is None else _split(kv_ids, parts)
        dk_parts, dv_parts = _split(dk, parts), _split(dv, parts)
        for i in range(parts):
            for j in range(parts):
                layout, cfg, kind, sinks_here = blocks.at(step, i, j, id_parts)
                g_q, g_k, g_v, g_s = _block_backward(
                    q_parts[i], k_parts[j], v_parts[j], out_parts[i], dout_parts[i],
                    lse_parts[i], dlse_parts[i], sinks_rows, layout, cfg, kind)
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
            if kv_ids is not None:
                kv_ids = _ring_permute(kv_ids, axis_name, n)
    return _join(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks


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


def gather_forward(q, k, v, sinks_rows, meta: Layout, axis_name, plan: Plan):
    """ring_forward's result by strategy "all_gather"."""
    shard = Shard(axis_name, plan, q.shape[1])
    k_all, v_all = _gather_keys(k, shard), _gather_keys(v, shard)
    kv_ids = None if meta.kv_segment_ids is None else _gather_keys(meta.kv_segment_ids, shard)
    results = [_calls._forward_ffi(qi, k_all, v_all, sinks_rows, layout, plan.cfg)
               for qi, layout in zip(_split(q, plan.parts),
                                     _gathered_layouts(shard, meta, q.shape[0], kv_ids))]
    return _join([o for o, _ in results]), _join([l for _, l in results], axis=2)


def gather_backward(q, k, v, out, dout, lse, dlse, sinks_rows, meta: Layout, axis_name,
                    plan: Plan):
    """ring_backward's result by strategy "all_gather" (dK/dV reduce-scattered)."""
    shard = Shard(axis_name, plan, q.shape[1])
    k_all, v_all = _gather_keys(k, shard), _gather_keys(v, shard)
    kv_ids = None if meta.kv_segment_ids is None else _gather_keys(meta.kv_segment_ids, shard)
    row_parts = [_split(x, plan.parts) for x in (q, out, dout)]
    stat_parts = [_split(x, plan.parts, axis=2) for x in (lse, dlse)]
    dq, dk, dv, dsinks = [], 0.0, 0.0, 0.0
    for i, layout in enumerate(_gathered_layouts(shard, meta, q.shape[0], kv_ids)):
        qi, oi, doi = (x[i] for x in row_parts)
        li, dli = (x[i] for x in stat_parts)
        g_q, g_k, g_v, g_s = _calls._backward_ffi(qi, k_all, v_all, oi, doi, li, dli,
                                                  sinks_rows, layout, plan.cfg)
        dq.append(g_q)
        dk, dv, dsinks = dk + g_k.astype(jnp.float32), dv + g_v.astype(jnp.float32), dsinks + g_s
    return (_join(dq), _scatter_keys(dk, shard).astype(k.dtype),
            _scatter_keys(dv, shard).astype(v.dtype), dsinks)


IMPLEMENTATIONS = {"ring": (ring_forward, ring_backward),
                   "all_gather": (gather_forward, gather_backward)}


# flash_attention's calls on sequence shards under jax.jit (_partitioning's ring_impl):
# plain chunk order, the strategy by choose_strategy's rule.
def _jit_plan(cfg, q, k) -> Plan:
    return Plan(cfg, "contiguous", choose_strategy("auto", q.shape[2] // k.shape[2], cfg))


def sharded_forward(cfg, present, axis_name, q, k, v, sinks_rows, *fields):
    plan = _jit_plan(cfg, q, k)
    forward, _ = IMPLEMENTATIONS[plan.strategy]
    return forward(q, k, v, sinks_rows, Layout(**dict(zip(present, fields))), axis_name, plan)


def sharded_backward(cfg, present, axis_name, q, k, v, out, dout, lse, dlse, sinks_rows,
                     *fields):
    plan = _jit_plan(cfg, q, k)
    _, backward = IMPLEMENTATIONS[plan.strategy]
    dq, dk, dv, dsink_rows = backward(q, k, v, out, dout, lse, dlse, sinks_rows,
                                      Layout(**dict(zip(present, fields))), axis_name, plan)
    # (each device's rows' share of a sink's gradient; the result is per batch, not per row)
    return dq, dk, dv, jax.lax.psum(dsink_rows, axis_name) if cfg.has_sinks else dsink_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _sharded(q, k, v, sinks, axis_name, plan: Plan):
    forward, _ = IMPLEMENTATIONS[plan.strategy]
    return forward(q, k, v, _calls._sink_rows(q, sinks, Layout(), plan.cfg), Layout(), axis_name,
                   plan)


def _sharded_fwd(q, k, v, sinks, axis_name, plan: Plan):
    out, lse = _sharded(q, k, v, sinks, axis_name, plan)
    return (out, lse), (q, k, v, sinks, out, lse)


def _sharded_bwd(axis_name, plan: Plan, residuals, cotangents):
    q, k, v, sinks, out, lse = residuals
    dout, dlse = cotangents
    _, backward = IMPLEMENTATIONS[plan.strategy]
    dq, dk, dv, dsink_rows = backward(
        q, k, v, out, dout.astype(out.dtype), lse, dlse.astype(jnp.float32),
        _calls._sink_rows(q, sinks, Layout(), plan.cfg), Layout(), axis_name, plan)
    dsinks = jnp.sum(dsink_rows, axis=0).astype(sinks.dtype)
    return dq, dk, dv, _calls._sum_to_varying(dsinks, sinks)


_sharded.defvjp(_sharded_fwd, _sharded_bwd)


def _gathered_in_jax(q, k, v, sinks, axis_name, plan: Plan):
    """The pure-JAX version (implementation="xla", and platforms without flashjax's
    kernels): K/V all-gathered, each local chunk attends at its position; JAX
    differentiates it (the gathers' transpose reduce-scatters dK/dV)."""
    shard = Shard(axis_name, plan, q.shape[1])
    k_all, v_all = _gather_keys(k, shard), _gather_keys(v, shard)
    results = [xla_attention.attention_core(
                   qi, k_all, v_all, sinks,
                   Layout(diagonal_offset=jnp.full((q.shape[0],), start, jnp.int32)), plan.cfg)
               for qi, start in zip(_split(q, plan.parts), shard.starts(shard.me))]
    return _join([o for o, _ in results]), _join([l for _, l in results], axis=2)


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
                              sinks is not None, deterministic, implementation, return_lse)
    plan = Plan(cfg, layout, choose_strategy(strategy, q.shape[2] // k.shape[2], cfg))
    _ffi.load()
    if sinks is None:
        sinks = jnp.zeros((q.shape[2],), jnp.float32)
    kernels = lambda *a: _sharded(*a, axis_name, plan)
    in_jax = lambda *a: _gathered_in_jax(*a, axis_name, plan)
    if cfg.implementation == "xla":
        out, lse = in_jax(q, k, v, sinks)
    elif cfg.implementation != "auto":
        _implementation.check_platform(cfg, q)
        out, lse = kernels(q, k, v, sinks)
    else:
        out, lse = jax.lax.platform_dependent(q, k, v, sinks, cuda=kernels, cpu=kernels,
                                              default=in_jax)
    return (out, lse) if return_lse else out
