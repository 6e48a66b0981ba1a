"""How the FFI calls are sharded under jax.jit: batch, heads, sequence.

An FFI call is opaque to XLA's partitioner, which would gather every operand onto
every device. `partitioned(spec)` wraps a call in JAX's `custom_partitioning` with a
Shardy sharding rule: batch and (kv-head-group-consistent) heads shard, each device
runs the kernel on its own shard with no collective, and the outputs keep the
inputs' sharding. A sequence sharded along one mesh axis runs the call's ring
version (`spec.ring_impl`, flashjax.ring: K/V passed around with ppermute) when it
has one; head dims, and sequences it cannot ring, are kept whole (gathered first).
Packed (varlen) calls shard along heads only. The KV-cache call shards along heads,
and along batch when each sequence owns its cache entry (a shared pool of pages or
entries that the call writes stays whole along batch: every device would write its own
copy).

custom_partitioning has no batching rule, so the wrapped call is also a
`custom_vmap` whose rule folds the vmapped axis into batch (what the dense FFI call's
vmap_method="broadcast_all" did) or, for packed and KV-cache calls, maps over it one
entry after the other (their vmap_method="sequential"); inside a fully manual `shard_map` the
call lowers to the plain FFI call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# Operands and results are described by their dims (_spec.Operand.dims: factors of the
# Shardy rule), e.g. "b s H d" for q: b batch, s query rows, t key rows, H query heads
# (h kv heads x g heads per group), h kv heads, d q/k head dim, e v head dim; packed
# calls: T query tokens, U key tokens, m sequences, n = m + 1 (cu_seqlens); KV-cache
# calls: r cache rows, c cache entries or pages (a pool shared by the sequences), w new
# rows, p pages per sequence, z workspace; j the dropout operand's words; u the float8
# forward's V^T keys (padded to whole blocks).
# Never sharded by the rule (s, t: unless a ring).
# x, y: a score array's broadcast (size-1) batch and heads (score_dims).
KEPT_WHOLE = ("s", "t", "d", "e", "g", "T", "U", "m", "n", "r", "c", "w", "p", "z", "x", "y",
              "j", "u")


def score_dims(shape, batch: int, heads_q: int, heads_kv: int) -> str:
    """The dims of a score array (bias, mask: (1 or batch, 1 or heads_kv or heads_q,
    seqlen_q, seqlen_k)): batch and heads shard with q's where they are q's."""
    b = "b" if shape[0] == batch else "x"
    h = "H" if shape[1] == heads_q else "h" if shape[1] == heads_kv else "y"
    return f"{b} {h} s t"


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """A call's static description: `impl(*static, *operands) -> results` runs it on
    local arrays (impl a module-level function and static hashable values, so that
    equal calls share one wrapper); `operands` / `results`: each one's dims (the first
    two operands are q and k); `group` is heads_q // heads_kv;
    `ring_impl(*static, axis_name, *operands)`, if any, runs it on sequence shards
    along axis_name; `fold_vmap`: every operand leads with the batch (a vmapped axis
    folds into it; else vmap maps); `batch_shards`: whether batch may shard."""

    name: str  # the FFI target, for errors
    impl: Callable
    static: tuple
    operands: tuple
    results: tuple
    group: int
    heads_kv: int
    ring_impl: Callable | None = None
    fold_vmap: bool = True
    batch_shards: bool = True



def _rule(spec: CallSpec, _mesh, _operand_types, _result_types):
    # q heads are (kv heads x group) when both exceed 1 (Shardy has no compound
    # factor of size 1); one kv head: q heads are the group alone, kept whole.
    heads = "(h g)" if spec.group > 1 and spec.heads_kv > 1 else "g" if spec.group > 1 else "h"
    side = lambda dims: ", ".join(d.replace("H", heads) for d in dims)
    rule = f"{side(spec.operands)} -> {side(spec.results)}"
    factors = {"g": spec.group} if "(h g)" in rule else {}
    # (Shardy wants the special factors in the order they first appear.)
    order = [c for c in rule if c.isalpha()]
    shardable = ("s", "t") if spec.ring_impl is not None else ()
    kept = sorted((f for f in KEPT_WHOLE if f in order and f not in shardable), key=order.index)
    return rule, dict(factors, need_replication_factors=tuple(kept))


def _axes_size(mesh, axes) -> int:
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def _ring_axis(spec: CallSpec, mesh, q, k, seq_axes):
    """The one mesh axis q's rows are sharded along, if the call can ring over it."""
    if spec.ring_impl is None or seq_axes is None:
        return None
    axes = seq_axes if isinstance(seq_axes, tuple) else (seq_axes,)
    if len(axes) != 1 or q.shape[1] != k.shape[1] or q.shape[1] % mesh.shape[axes[0]]:
        return None
    return axes[0]


def _partition(spec: CallSpec, mesh, arg_shapes, _result_shapes):
    """Shard batch and heads as q is (where they divide evenly), the sequence too when
    the call can ring over q's sequence axis; nothing else."""
    q, k = arg_shapes[0], arg_shapes[1]
    q_dims, k_dims = spec.operands[0].split(), spec.operands[1].split()
    mesh_axes = dict.fromkeys(q_dims)
    if isinstance(q.sharding, NamedSharding):
        mesh_axes.update(zip(q_dims, q.sharding.spec))
    batch_axes, seq_axes, head_axes = (mesh_axes.get(d) for d in ("b", "s", "H"))
    if not spec.batch_shards or (
            batch_axes is not None and q.shape[q_dims.index("b")] % _axes_size(mesh, batch_axes)):
        batch_axes = None
    if k.shape[k_dims.index("h")] % _axes_size(mesh, head_axes):  # whole q-head groups
        head_axes = None
    ring_axis = _ring_axis(spec, mesh, q, k, seq_axes)
    axes = {"b": batch_axes, "H": head_axes, "h": head_axes, "s": ring_axis, "t": ring_axis}
    impl = (functools.partial(spec.ring_impl, *spec.static, ring_axis) if ring_axis
            else functools.partial(spec.impl, *spec.static))

    def sharding(dims):
        return NamedSharding(mesh, PartitionSpec(*(axes.get(d) for d in dims.split())))
    return (mesh, impl, tuple(sharding(dims) for dims in spec.results),
            tuple(sharding(dims) for dims in spec.operands))


def _batchable(call, fold: bool):
    """call(*operands) -> results under vmap: with `fold` (every array's first dim is
    its batch) a vmapped axis becomes part of that batch dim, else the call maps
    over it one entry after the other."""

    @jax.custom_batching.custom_vmap
    def batchable(*operands):
        return call(*operands)

    @batchable.def_vmap
    def _rule(axis_size, in_batched, *operands):
        operands = [x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
                    for x, batched in zip(operands, in_batched)]
        if not fold:
            results = jax.lax.map(lambda entry: batchable(*entry), operands)
            return tuple(results), (True,) * len(results)
        # every operand's and result's first dim (batch, or 1 for a broadcast bias)
        results = batchable(*(x.reshape((axis_size * x.shape[1],) + x.shape[2:])
                              for x in operands))
        batch = lambda r: r.shape[0] // axis_size if axis_size else operands[0].shape[1]
        return (tuple(r.reshape((axis_size, batch(r)) + r.shape[1:]) for r in results),
                (True,) * len(results))
    return batchable


def _not_differentiable(name: str, call):
    """call, whose derivative is an error naming the target (the kernels have none;
    gradients come from the custom_vjp around the calls)."""
    wrapped = jax.custom_jvp(call)

    @wrapped.defjvp
    def _jvp(primals, tangents):
        raise ValueError(f"The FFI call to `{name}` cannot be differentiated (a gradient of "
                         "a gradient, or forward mode): use flashjax.reference.attention")
    return wrapped


@functools.lru_cache(maxsize=None)
def partitioned(spec: CallSpec):
    """spec.impl as a call that jax.jit shards along batch and heads."""
    call = custom_partitioning(functools.partial(spec.impl, *spec.static))
    call.def_partition(partition=functools.partial(_partition, spec),
                       sharding_rule=functools.partial(_rule, spec))
    return _not_differentiable(spec.name, _batchable(call, fold=spec.fold_vmap))
