"""The call as data: every operand and static option of flashjax's FFI targets, once.

Each array a target takes or returns is an `Operand` (name, dtype, shape kind, its
dims as factors of the sharding rule in dense and packed calls, whether it is
differentiable, the has_* attribute that announces it when optional); each static
option an `Option` (the FFI attribute's name and type). A `Target` lists them in the
order the handler reads them. Everything else is derived from this table: the FFI
operands and attributes of a call (`Target.operands`, `Target.attributes`), the dims
of its `custom_partitioning` rule, the fields of `Layout` (traced integer metadata)
and `Extras` (differentiable inputs besides q, k, v: sinks, bias; their gradients are the
backward's extra results), and the checks in tests/test_ffi.py.

The C++ side of the same table is csrc/include/flashjax/operands.h (the attribute
structs, their decodings and the optional inputs' handling are generated from it);
tests/test_ffi.py checks that the two agree. A new optional input (bias, say) is one
`Operand` in `ATTENTION_OPTIONAL` (with `differentiable=True` and its gradient's
`Operand` among `BACKWARD`'s results, it is an `Extras` field), one line in
operands.h, and the kernels' support.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Optional

import numpy as np

from ._visibility import Window


@dataclasses.dataclass(frozen=True)
class Option:
    """A static option: the FFI attribute `name`, of numpy scalar `type`."""

    name: str
    type: type


@dataclasses.dataclass(frozen=True)
class Operand:
    """An array of a target.

    dtype: "float32" / "int32", or None: q's dtype (k's, v's for their kind).
    shape: its shape kind ("rows": (batch, rows, heads, dim) like q, k or v;
      "row_stats": lse-like; for optional inputs the C++ InputKind: "per_head",
      "per_kv_head", "per_sequence", "query_rows", "key_rows", "page_table",
      "scores": (batch or 1, heads_q, heads_kv or 1, seqlen_q, seqlen_k), broadcast by
      the kernels, dense layout only; "dropout": uint32 (sequences, heads_q, 4)).
    dims / packed_dims: its dims in dense / packed (varlen) calls as factors of the
      sharding rule (_partitioning: b batch, s query rows, t key rows, H query heads,
      h kv heads, d, e head dims; T, U packed query / key rows, m sequences, n =
      m + 1; j the dropout operand's 4 words; KV cache: r cache rows, w new rows, p
      pages per sequence, z workspace); None: not part of such calls.
    flag: for optional inputs, the bool attribute that announces them (a result with
      a flag is returned when that flag, or the bool option of that name, is set).
    differentiable / gradient: a differentiable input and the backward's result
      holding its gradient.
    """

    name: str
    dtype: Optional[str]
    shape: str
    dims: Optional[str]
    packed_dims: Optional[str] = None
    flag: Optional[str] = None
    differentiable: bool = False
    gradient: Optional[str] = None

    def dims_in(self, packed: bool) -> str:
        dims = self.packed_dims if packed else self.dims
        if dims is None:
            raise ValueError(f"{self.name} is not an operand of {'packed' if packed else 'dense'} "
                             "calls")
        return dims


@dataclasses.dataclass(frozen=True)
class Target:
    """An FFI target: `inputs` (required, in order), then the present ones of
    `optional` in this order (no placeholders); `results` (those with a flag only
    when it is set); `options`: its attributes besides the has_* flags. `symbol`:
    the handler's symbol in the library, before the platform's suffix."""

    name: str
    symbol: str
    inputs: tuple
    optional: tuple
    results: tuple
    options: tuple

    @property
    def flags(self) -> tuple:
        return tuple(dict.fromkeys(op.flag for op in self.optional))

    def present(self, values: Mapping) -> tuple:
        """The names of the optional inputs that `values` (name -> array or None) gives."""
        return tuple(op.name for op in self.optional if values.get(op.name) is not None)

    def operands(self, values: Mapping) -> tuple:
        """(present, operands): the call's operands from `values` (name -> array):
        the required ones, then the present optional ones."""
        present = self.present(values)
        return present, tuple(values[op.name] for op in self.inputs) + tuple(
            values[name] for name in present)

    def values(self, present: tuple, operands) -> dict:
        """The inverse of `operands`: name -> array."""
        return dict(zip([op.name for op in self.inputs] + list(present), operands))

    def operand_dims(self, present: tuple, packed: bool = False) -> tuple:
        return tuple(OPERANDS[name].dims_in(packed)
                     for name in [op.name for op in self.inputs] + list(present))

    def returned(self, present: tuple, options: Mapping = {}) -> tuple:
        """The results a call with these optional inputs (and options) returns."""
        flags = {OPERANDS[name].flag for name in present}
        return tuple(op for op in self.results
                     if op.flag is None or op.flag in flags or options.get(op.flag))

    def attributes(self, options: Mapping, present: tuple) -> dict:
        """Every attribute of a call: `options` (name -> value; extra names are
        ignored) as the attributes' types, and the has_* flags of `present`."""
        attributes = {op.name: op.type(options[op.name]) for op in self.options}
        flags = {OPERANDS[name].flag for name in present}
        attributes.update({flag: np.bool_(flag in flags) for flag in self.flags})
        return attributes


F32, F64, I64, BOOL = np.float32, np.float64, np.int64, np.bool_

# Every target has these (copied into the AttentionParams fields of the same name).
SHARED_OPTIONS = (Option("softmax_scale", F32), Option("window_left", I64),
                  Option("window_right", I64), Option("softcap", F32),
                  Option("kernel_cap", I64))
ATTENTION_OPTIONS = SHARED_OPTIONS + (
    Option("max_seqlen_q", I64), Option("max_seqlen_k", I64),  # packed calls' slot bounds
    Option("deterministic", BOOL),
    Option("bias_gradient", BOOL),  # the backward also returns dbias
    Option("dropout_rate", F64))  # with the dropout operand: its rate, in [0, 1)
KVCACHE_OPTIONS = SHARED_OPTIONS + (Option("num_splits", I64),)

Q = Operand("q", None, "rows", "b s H d", "T H d", differentiable=True, gradient="dq")
K = Operand("k", None, "rows", "b t h d", "U h d", differentiable=True, gradient="dk")
V = Operand("v", None, "rows", "b t h e", "U h e", differentiable=True, gradient="dv")
CU_SEQLENS_Q = Operand("cu_seqlens_q", "int32", "cu_seqlens", None, "n")
CU_SEQLENS_K = Operand("cu_seqlens_k", "int32", "cu_seqlens", None, "n")
OUT = Operand("out", None, "rows", "b s H e", "T H e")
DOUT = Operand("dout", None, "rows", "b s H e", "T H e")
LSE = Operand("lse", "float32", "row_stats", "b H s", "H T")
DLSE = Operand("dlse", "float32", "row_stats", "b H s", "H T")
DQ = Operand("dq", None, "rows", "b s H d", "T H d")
DK = Operand("dk", None, "rows", "b t h d", "U h d")
DV = Operand("dv", None, "rows", "b t h e", "U h e")
# Sinks go to the FFI as one row per sequence (batch, heads_q), so that vmap folds them
# into batch like q; dsinks comes back per sequence (always: the kernels write zeros
# without sinks) and is summed in Python.
SINKS = Operand("sinks", "float32", "per_head", "b H", "m H", flag="has_sinks",
                differentiable=True, gradient="dsinks")
DSINKS = Operand("dsinks", "float32", "per_head", "b H", "m H")
# Bias and mask go to the FFI in their own (broadcasting) shape: the kernels read entry
# (b // (batch / entries), h // (heads_q / heads)); dims "b H s t" are those of a
# full-size one (_partitioning.score_dims gives a broadcast one's). dbias comes back in
# bias's shape, summed over what it broadcasts, only when the backward's bias_gradient
# option is set (custom_vjp's symbolic zeros tell when bias is perturbed).
BIAS = Operand("bias", "float32", "scores", "b H s t", flag="has_bias", differentiable=True,
               gradient="dbias")
DBIAS = Operand("dbias", "float32", "scores", "b H s t", flag="bias_gradient")

# The optional inputs of the attention targets, in the order the handlers take them.
ATTENTION_OPTIONAL = (
    SINKS,
    Operand("seqused_q", "int32", "per_sequence", "b", "m", flag="has_seqused_q"),
    Operand("seqused_k", "int32", "per_sequence", "b", "m", flag="has_seqused_k"),
    Operand("q_segment_ids", "int32", "query_rows", "b s", flag="has_segment_ids"),
    Operand("kv_segment_ids", "int32", "key_rows", "b t", flag="has_segment_ids"),
    # (sequences,): query row i's diagonal is key i + offset (q position - k position)
    Operand("diagonal_offset", "int32", "per_sequence", "b", "m", flag="has_diagonal_offset"),
    BIAS,
    Operand("mask", "bool", "scores", "b H s t", flag="has_mask"),  # True: may attend
    # (sequences, heads_q): ALiBi, -slope * |i + diagonal - j| added to the scores
    Operand("alibi_slopes", "float32", "per_head", "b H", "m H", flag="has_alibi_slopes"),
    # Attention dropout (present when the rate is > 0; the rate is the dropout_rate
    # option): per (sequence, query head) the key words (k0, k1) and the (b, h) of the
    # mask element that sequence and head use (dropout.h), so that a vmapped axis folded
    # into batch and a batch- or head-sharded call keep each instance's own key and the
    # unbatched, unsharded call's indices (j: the 4 words).
    Operand("dropout", "uint32", "dropout", "b H j", "m H j", flag="has_dropout"),
)

FORWARD = Target("flashjax_fwd", "FlashjaxForward", (Q, K, V), ATTENTION_OPTIONAL, (OUT, LSE),
                 ATTENTION_OPTIONS)
BACKWARD = Target("flashjax_bwd", "FlashjaxBackward", (Q, K, V, OUT, DOUT, LSE, DLSE),
                  ATTENTION_OPTIONAL, (DQ, DK, DV, DSINKS, DBIAS), ATTENTION_OPTIONS)
VARLEN_FORWARD = dataclasses.replace(FORWARD, name="flashjax_varlen_fwd",
                                     symbol="FlashjaxVarlenForward",
                                     inputs=(Q, K, V, CU_SEQLENS_Q, CU_SEQLENS_K))
VARLEN_BACKWARD = dataclasses.replace(
    BACKWARD, name="flashjax_varlen_bwd", symbol="FlashjaxVarlenBackward",
    inputs=(Q, K, V, CU_SEQLENS_Q, CU_SEQLENS_K, OUT, DOUT, LSE, DLSE))

# float8 q, k, v (flash_attention's fp8 forward on the Hopper kernel; every other path
# dequantises them in JAX): V transposed with each 32-key block's keys permuted
# (_fp8.permuted_transpose; u: its keys, padded to whole blocks), the descale of q.k
# (q_descale * k_descale, >= 0: q's sign flipped where it is negative) and of V per
# (sequence, kv head). Sharded along batch and heads as the bf16 forward (_core); a
# sequence-sharded call is gathered (no ring).
# (v_descale: the KV-cache target's too, where it is optional, announced by has_descales)
K_DESCALE = Operand("k_descale", "float32", "per_kv_head", "b h", flag="has_descales")
V_DESCALE = Operand("v_descale", "float32", "per_kv_head", "b h", flag="has_descales")
FLOAT8_FORWARD = Target(
    "flashjax_fp8_fwd", "FlashjaxFloat8Forward",
    (Q, K, V, Operand("vt", None, "transposed_values", "b h e u"),
     Operand("score_descale", "float32", "per_kv_head", "b h"), V_DESCALE),
    ATTENTION_OPTIONAL, (OUT, LSE), ATTENTION_OPTIONS)

# The KV-cache target. A cache with one entry per sequence has dims "b r h .."; a pool
# of entries or pages shared by the sequences has its own leading dim (kvcache.py).
KVCACHE = Target(
    "flashjax_kvcache", "FlashjaxKvcache",
    (Q, Operand("k_cache", None, "rows", "b r h d"), Operand("v_cache", None, "rows", "b r h e"),
     Operand("k_new", None, "rows", "b w h d"), Operand("v_new", None, "rows", "b w h e"),
     Operand("cache_seqlens", "int32", "per_sequence", "b")),
    (Operand("cache_leftpad", "int32", "per_sequence", "b", flag="has_leftpad"),
     Operand("cache_batch_idx", "int32", "per_sequence", "b", flag="has_batch_idx"),
     Operand("page_table", "int32", "page_table", "b p", flag="has_page_table"),
     SINKS,
     # float8 caches: element x of sequence b, kv head h stands for x * descale[b, h]
     K_DESCALE, V_DESCALE),
    # the workspace holds the split-KV partials, per (sequence, head) so that it shards
    # like q; when new rows are appended the caches follow (aliased to inputs 1 and 2)
    (OUT, LSE, Operand("workspace", "float32", "workspace", "b H z")),
    KVCACHE_OPTIONS)

TARGETS = (FORWARD, BACKWARD, VARLEN_FORWARD, VARLEN_BACKWARD, FLOAT8_FORWARD, KVCACHE)
OPERANDS = {op.name: op for target in TARGETS
            for op in target.inputs + target.optional + target.results}


def attention_targets(packed: bool) -> tuple:
    """(forward, backward) targets of a dense or packed call."""
    return (VARLEN_FORWARD, VARLEN_BACKWARD) if packed else (FORWARD, BACKWARD)


# attention_core's arguments besides q, k, v: the differentiable extras, and the
# layout (traced metadata: where sequences are, the mask, the ALiBi slopes, the
# dropout key; no cotangents).
EXTRA_OPERANDS = tuple(op for op in ATTENTION_OPTIONAL if op.differentiable)
LAYOUT_OPERANDS = (CU_SEQLENS_Q, CU_SEQLENS_K) + tuple(
    op for op in ATTENTION_OPTIONAL if not op.differentiable)


def _fields(operands) -> dict:
    names = [op.name for op in operands]
    return dict(field_names=names, defaults=(None,) * len(names))


class _Fields:
    """What Extras and Layout share: tuples of optional arrays named by the table."""

    __slots__ = ()

    @classmethod
    def of(cls, values: Mapping):
        """The fields found in `values` (name -> array)."""
        return cls(**{name: values.get(name) for name in cls._fields})

    def given(self) -> tuple:
        """The present fields' values, in order."""
        return tuple(x for x in self if x is not None)

    def with_given(self, values):
        """The same fields present, holding `values` (as `given` orders them)."""
        values = iter(values)
        return type(self)(*(None if x is None else next(values) for x in self))


class Extras(_Fields, collections.namedtuple("Extras", **_fields(EXTRA_OPERANDS))):
    """The differentiable inputs of a call besides q, k, v (None: absent); a pytree,
    whose gradients come back in the same shape."""

    __slots__ = ()


class Layout(_Fields, collections.namedtuple("Layout", **_fields(LAYOUT_OPERANDS))):
    """Traced metadata (None: absent): where sequences are (int32), the score terms
    that take no gradient (mask, alibi_slopes) and dropout's key words (uint32)."""

    __slots__ = ()


def gradients(extras: Extras, cfg: "Config") -> tuple:
    """The backward's results that hold the present extras' gradients (dbias only
    when cfg.bias_gradient)."""
    return tuple(OPERANDS[op.gradient] for op, x in zip(EXTRA_OPERANDS, extras)
                 if x is not None and (op.gradient != "dbias" or cfg.bias_gradient))


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) description of one call: the attention targets' options
    (ATTENTION_OPTIONS, by name) and how it runs."""

    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    deterministic: bool
    packed: bool = False      # flash_attention_varlen
    max_seqlen_q: int = 0     # packed only
    max_seqlen_k: int = 0
    implementation: str = "auto"  # "auto", "cuda", "cpu" or "xla" (_route.IMPLEMENTATIONS)
    kernel_cap: int = 0       # the CUDA kernels allowed: 0 any, 1 mma.sync, 2 SIMT
    bias_gradient: bool = False  # backward: dbias wanted (set by _core from symbolic zeros)
    dropout_rate: float = 0.0  # > 0: the layout's dropout operand is present

    @property
    def window(self) -> Window:
        return Window(self.window_left, self.window_right)

    def options(self, **more) -> dict:
        """The option values by name (for Target.attributes), plus `more`."""
        return dict(dataclasses.asdict(self), **more)
