"""The FFI calls behind the public functions and their jax.custom_vjp.

Both public functions (`flash_attention`, `flash_attention_varlen`) end here:
one differentiable core, `attention_core(q, k, v, sinks, layout, cfg)`, whose
forward and backward are `jax.ffi.ffi_call`s. `layout` carries the traced
integer metadata (cu_seqlens, seqused, segment ids, diagonal offset; absent ones
are None) and gets no cotangent; `cfg` is the static description of the call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, _partitioning


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) description of one call; mirrors the FFI Options struct."""

    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    has_sinks: bool
    deterministic: bool
    packed: bool = False      # flash_attention_varlen
    max_seqlen_q: int = 0     # packed only
    max_seqlen_k: int = 0
    implementation: str = "auto"  # "auto", "cuda", "cpu" or "xla" (_checks.IMPLEMENTATIONS)
    kernel_cap: int = 0       # the CUDA kernels allowed: 0 any, 1 mma.sync, 2 SIMT

    def attributes(self, layout: "Layout") -> dict:
        return dict(
            softmax_scale=np.float32(self.softmax_scale),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            softcap=np.float32(self.softcap),
            max_seqlen_q=np.int64(self.max_seqlen_q),
            max_seqlen_k=np.int64(self.max_seqlen_k),
            has_sinks=np.bool_(self.has_sinks),
            has_seqused_q=np.bool_(layout.seqused_q is not None),
            has_seqused_k=np.bool_(layout.seqused_k is not None),
            has_segment_ids=np.bool_(layout.q_segment_ids is not None),
            has_diagonal_offset=np.bool_(layout.diagonal_offset is not None),
            deterministic=np.bool_(self.deterministic),
            kernel_cap=np.int64(self.kernel_cap),
        )


class Layout(NamedTuple):
    """Traced int32 metadata of where sequences are (None: absent)."""

    cu_seqlens_q: Optional[jax.Array] = None
    cu_seqlens_k: Optional[jax.Array] = None
    seqused_q: Optional[jax.Array] = None
    seqused_k: Optional[jax.Array] = None
    q_segment_ids: Optional[jax.Array] = None
    kv_segment_ids: Optional[jax.Array] = None
    diagonal_offset: Optional[jax.Array] = None  # (sequences,): q position - k position

    def optional_inputs(self) -> list:
        """The FFI's optional inputs after sinks, present ones only, in its order."""
        return [x for x in (self.seqused_q, self.seqused_k, self.q_segment_ids,
                            self.kv_segment_ids, self.diagonal_offset) if x is not None]


# Inside jax.shard_map, arrays carry the mesh axes they vary over. An FFI call's
# results must be declared with them (the union over its operands), and a
# cotangent must vary over no more axes than its primal: the rest is a sum over
# shards (e.g. dk for a k replicated across a query-sharded axis).
def _varying_axes(*xs) -> frozenset:
    axes = frozenset()
    for x in jax.tree.leaves(xs):
        aval = jax.typeof(x)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= manual.varying if manual is not None else getattr(aval, "vma", frozenset())
    return axes


def _result_types(like, varying: frozenset, *shape_dtypes):
    """ShapeDtypeStructs for an FFI call's results, varying over `varying` (the mesh
    is taken from the operand `like`)."""
    if not varying:
        return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shape_dtypes)
    if not hasattr(jax.sharding, "ManualAxisType"):  # jax < 0.10
        return tuple(jax.ShapeDtypeStruct(shape, dtype, vma=varying) for shape, dtype in shape_dtypes)
    mesh = jax.typeof(like).sharding.mesh
    manual = jax.sharding.ManualAxisType(varying=varying)
    return tuple(
        jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        for shape, dtype in shape_dtypes)


def _sum_to_varying(cotangent, primal):
    extra = _varying_axes(cotangent) - _varying_axes(primal)
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def _lse_shape(q, cfg: Config) -> tuple:
    if cfg.packed:  # (heads_q, total_q)
        return (q.shape[-2], q.shape[-3])
    return q.shape[:-3] + (q.shape[-2], q.shape[-3])


def _ffi_call(target, like, varying_over, out_shapes, cfg: Config):
    # Dense calls vmap by folding vmapped dims into batch; packed ones have no
    # batch dim to fold into, so vmap runs them one after the other.
    vmap_method = "sequential" if cfg.packed else "broadcast_all"
    return jax.ffi.ffi_call(target, _result_types(like, _varying_axes(*varying_over), *out_shapes),
                            vmap_method=vmap_method)


def _required(q, k, v, layout: Layout, cfg: Config) -> tuple:
    return (q, k, v) + ((layout.cu_seqlens_q, layout.cu_seqlens_k) if cfg.packed else ())


def _optional(sinks_rows, layout: Layout, cfg: Config) -> list:
    return ([sinks_rows] if cfg.has_sinks else []) + layout.optional_inputs()


def _forward_ffi(q, k, v, sinks_rows, layout: Layout, cfg: Config):
    target = _ffi.VARLEN_FORWARD_TARGET if cfg.packed else _ffi.FORWARD_TARGET
    args = _required(q, k, v, layout, cfg) + tuple(_optional(sinks_rows, layout, cfg))
    call = _ffi_call(target, q, args, ((q.shape[:-1] + (v.shape[-1],), q.dtype),
                                       (_lse_shape(q, cfg), jnp.float32)), cfg)
    return call(*args, **cfg.attributes(layout))


def _backward_ffi(q, k, v, out, dout, lse, dlse, sinks_rows, layout: Layout, cfg: Config):
    target = _ffi.VARLEN_BACKWARD_TARGET if cfg.packed else _ffi.BACKWARD_TARGET
    args = (_required(q, k, v, layout, cfg) + (out, dout, lse, dlse)
            + tuple(_optional(sinks_rows, layout, cfg)))
    call = _ffi_call(target, q, args, ((q.shape, q.dtype), (k.shape, k.dtype),
                                       (v.shape, v.dtype), (sinks_rows.shape, jnp.float32)), cfg)
    return call(*args, **cfg.attributes(layout))


# Every call goes through _partitioning (sharded along batch, heads, sequence under
# jax.jit; packed calls along heads), as a flat operand list: the fixed ones, then the
# layout's present fields; each operand and result named by its kind (_partitioning.DIMS).
FORWARD_OPERANDS = ("q", "k", "v", "sinks")
BACKWARD_OPERANDS = ("q", "k", "v", "out", "out", "lse", "lse", "sinks")
FORWARD_RESULTS = ("out", "lse")
BACKWARD_RESULTS = ("dq", "dk", "dv", "sinks")
PACKED_FIELDS = {"cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens",
                 "seqused_q": "packed_seqused", "seqused_k": "packed_seqused",
                 "diagonal_offset": "packed_seqused"}


def _present(layout: Layout) -> tuple:
    return tuple(name for name, x in layout._asdict().items() if x is not None)


def _kinds(names: tuple, present: tuple, cfg: Config) -> tuple:
    if not cfg.packed:
        return names + present
    return tuple(f"packed_{n}" for n in names) + tuple(PACKED_FIELDS[n] for n in present)


def _local_forward(cfg: Config, present: tuple, q, k, v, sinks_rows, *fields):
    return _forward_ffi(q, k, v, sinks_rows, Layout(**dict(zip(present, fields))), cfg)


def _local_backward(cfg: Config, present: tuple, q, k, v, out, dout, lse, dlse, sinks_rows,
                    *fields):
    return _backward_ffi(q, k, v, out, dout, lse, dlse, sinks_rows,
                         Layout(**dict(zip(present, fields))), cfg)


def _spec(target, impl, ring_impl, names, results, q, k, layout: Layout, cfg: Config):
    from . import ring  # (ring builds on this module)

    present = _present(layout)
    return _partitioning.CallSpec(target, impl, (cfg, present), _kinds(names, present, cfg),
                                  _kinds(results, (), cfg), q.shape[-2] // k.shape[-2],
                                  k.shape[-2], None if cfg.packed else getattr(ring, ring_impl),
                                  fold_vmap=not cfg.packed)


def _forward_call(q, k, v, sinks_rows, layout: Layout, cfg: Config):
    target = _ffi.VARLEN_FORWARD_TARGET if cfg.packed else _ffi.FORWARD_TARGET
    spec = _spec(target, _local_forward, "sharded_forward", FORWARD_OPERANDS, FORWARD_RESULTS,
                 q, k, layout, cfg)
    return _partitioning.partitioned(spec)(q, k, v, sinks_rows,
                                           *(getattr(layout, n) for n in spec.static[1]))


def _backward_call(q, k, v, out, dout, lse, dlse, sinks_rows, layout: Layout, cfg: Config):
    target = _ffi.VARLEN_BACKWARD_TARGET if cfg.packed else _ffi.BACKWARD_TARGET
    spec = _spec(target, _local_backward, "sharded_backward", BACKWARD_OPERANDS,
                 BACKWARD_RESULTS, q, k, layout, cfg)
    return _partitioning.partitioned(spec)(q, k, v, out, dout, lse, dlse, sinks_rows,
                                           *(getattr(layout, n) for n in spec.static[1]))


def _sink_rows(q, sinks, layout: Layout, cfg: Config):
    # One sink vector per sequence (so that vmap can batch sinks like q).
    if cfg.packed:
        sequences = (layout.cu_seqlens_q.shape[-1] - 1,)
        return jnp.broadcast_to(sinks, sinks.shape[:-1] + sequences + sinks.shape[-1:])
    return jnp.broadcast_to(sinks, q.shape[:-4] + (q.shape[-4], q.shape[-2]))


def _no_cotangent(x):
    return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def attention_core(q, k, v, sinks, layout: Layout, cfg: Config):
    """(out, lse) of one call; differentiable in q, k, v and sinks."""
    return _forward_call(q, k, v, _sink_rows(q, sinks, layout, cfg), layout, cfg)


def _core_fwd(q, k, v, sinks, layout: Layout, cfg: Config):
    out, lse = _forward_call(q, k, v, _sink_rows(q, sinks, layout, cfg), layout, cfg)
    return (out, lse), (q, k, v, sinks, layout, out, lse)


def _core_bwd(cfg: Config, residuals, cotangents):
    q, k, v, sinks, layout, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dsink_rows = _backward_call(
        q, k, v, out, dout.astype(out.dtype), lse, dlse.astype(jnp.float32),
        _sink_rows(q, sinks, layout, cfg), layout, cfg)
    dsinks = jnp.sum(dsink_rows, axis=tuple(range(dsink_rows.ndim - 1))).astype(sinks.dtype)
    grads = tuple(_sum_to_varying(ct, primal)
                  for ct, primal in zip((dq, dk, dv, dsinks), (q, k, v, sinks)))
    return grads + (Layout(*map(_no_cotangent, layout)),)


attention_core.defvjp(_core_fwd, _core_bwd)
