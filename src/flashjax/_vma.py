"""Mesh axes that values vary over inside `jax.shard_map` (its "vma" type system).

Inside shard_map, arrays carry the mesh axes they vary over. An FFI call's results
must be declared with them (the union over its operands), loop carries and `lax.switch`
branches must agree on them, and a cotangent must vary over no more axes than its
primal: the rest is a sum over shards (e.g. dk for a k replicated across a
query-sharded axis). Outside shard_map every set here is empty and nothing changes.
"""

from __future__ import annotations

import jax

__all__ = ["varying_axes", "result_types", "sum_to_varying", "vary_over"]


def varying_axes(*xs) -> frozenset:
    """The mesh axes any leaf of xs varies over."""
    axes = frozenset()
    for x in jax.tree.leaves(xs):
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return axes


def result_types(like, varying: frozenset, *shape_dtypes):
    """ShapeDtypeStructs for an FFI call's results, varying over `varying` (the mesh
    is taken from the operand `like`)."""
    if not varying:
        return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shape_dtypes)
    if not hasattr(jax.sharding, "ManualAxisType"):  # jax < 0.10
        return tuple(jax.ShapeDtypeStruct(shape, dtype, vma=varying)
                     for shape, dtype in shape_dtypes)
    mesh = jax.typeof(like).sharding.mesh
    manual = jax.sharding.ManualAxisType(varying=varying)
    return tuple(
        jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        for shape, dtype in shape_dtypes)


def sum_to_varying(cotangent, primal):
    """The cotangent summed over the axes it varies over and its primal does not."""
    extra = varying_axes(cotangent) - varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def vary_over(x, axes: frozenset):
    """x, declared to vary over `axes` too (loop carries and switch branches must vary
    over the axes of what they are combined with)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # jax < 0.10
