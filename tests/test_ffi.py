"""The FFI handlers re-check what Python already checked: a direct ffi_call with
inconsistent buffers or attributes is an error naming the problem, never a crash."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import _ffi, _spec

FORWARD, VARLEN_FORWARD = _spec.FORWARD.name, _spec.VARLEN_FORWARD.name


def attributes(**overrides):
    """Every attribute of a plain call (the table's options and flags), overridden."""
    config = _spec.Config(0.25, -1, -1, 0.0, False, max_seqlen_q=8, max_seqlen_k=8)
    attrs = _spec.FORWARD.attributes(config.options(), ())
    attrs.update({k: type(attrs[k])(v) for k, v in overrides.items()})
    return attrs


def call(target, args, out_shapes, **overrides):
    _ffi.load()
    types = [jax.ShapeDtypeStruct(s, d) for s, d in out_shapes]
    return jax.block_until_ready(jax.ffi.ffi_call(target, types)(*args, **attributes(**overrides)))


def dense_args(b=1, s=8, h=2, d=16):
    x = jnp.ones((b, s, h, d), jnp.float32)
    return [x, x, x], [((b, s, h, d), jnp.float32), ((b, h, s), jnp.float32)]


def varlen_args(total=16, h=2, d=16, cu=(0, 8, 16)):
    x = jnp.ones((total, h, d), jnp.float32)
    cu = jnp.asarray(cu, jnp.int32)
    return [x, x, x, cu, cu], [((total, h, d), jnp.float32), ((h, total), jnp.float32)]


def test_consistent_calls_run():
    args, outs = dense_args()
    call(FORWARD, args, outs)
    args, outs = varlen_args()
    call(VARLEN_FORWARD, args, outs)


BAD_CALLS = {
    "announced_sinks_missing": lambda: call(FORWARD, *dense_args(), has_sinks=True),
    "unannounced_extra_input": lambda: call(
        FORWARD, dense_args()[0] + [jnp.zeros((1, 2), jnp.float32)], dense_args()[1]),
    "seqused_wrong_shape": lambda: call(
        FORWARD, dense_args()[0] + [jnp.zeros((3,), jnp.int32)], dense_args()[1],
        has_seqused_q=True),
    "seqused_wrong_dtype": lambda: call(
        FORWARD, dense_args()[0] + [jnp.zeros((1,), jnp.float32)], dense_args()[1],
        has_seqused_k=True),
    "segments_on_packed": lambda: call(
        VARLEN_FORWARD,
        varlen_args()[0] + [jnp.zeros((2, 8), jnp.int32)] * 2, varlen_args()[1],
        has_segment_ids=True),
    "cu_seqlens_float": lambda: call(
        VARLEN_FORWARD,
        varlen_args()[0][:3] + [jnp.zeros((3,), jnp.float32)] * 2, varlen_args()[1]),
    "cu_seqlens_lengths_differ": lambda: call(
        VARLEN_FORWARD,
        varlen_args()[0][:4] + [jnp.zeros((4,), jnp.int32)], varlen_args()[1]),
    "packed_rank_4": lambda: call(
        VARLEN_FORWARD,
        [jnp.ones((1, 16, 2, 16))] * 3 + varlen_args()[0][3:], dense_args(s=16)[1]),
    "lse_wrong_layout": lambda: call(
        VARLEN_FORWARD, varlen_args()[0],
        [varlen_args()[1][0], ((16, 2), jnp.float32)]),
    "negative_max_seqlen": lambda: call(VARLEN_FORWARD, *varlen_args(),
                                        max_seqlen_q=-1),
    "dropout_rate_without_input": lambda: call(FORWARD, *dense_args(), dropout_rate=0.5),
    "dropout_rate_one": lambda: call(
        FORWARD, dense_args()[0] + [jnp.zeros((1, 2, 4), jnp.uint32)], dense_args()[1],
        has_dropout=True, dropout_rate=1.0),
    "dropout_wrong_shape": lambda: call(
        FORWARD, dense_args()[0] + [jnp.zeros((1, 2, 2), jnp.uint32)], dense_args()[1],
        has_dropout=True, dropout_rate=0.5),
}


@pytest.mark.parametrize("bad", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_inconsistent_calls_are_errors(bad):
    with pytest.raises(Exception, match="flashjax"):
        bad()


def _cxx_table() -> dict:
    """The C++ operand lists (csrc/include/flashjax/operands.h) as the library reports
    them: {"attention.options": [(name, type)], "attention.inputs": [(name, flag)], ...}."""
    lib = _ffi.library()
    lib.FlashjaxOperands.restype = ctypes.c_char_p
    return {key: [tuple(item.split(":")) for item in value.split(",") if item]
            for key, value in (part.split("=") for part in
                               lib.FlashjaxOperands().decode().split(";"))}


TYPE_NAMES = {np.float32: "f32", np.float64: "f64", np.int64: "i64", np.bool_: "bool"}


@pytest.mark.parametrize("name, target", [("attention", _spec.FORWARD),
                                          ("kvcache", _spec.KVCACHE)])
def test_python_and_cxx_tables_agree(name, target):
    """_spec.py and operands.h list the same options (names, types) and optional inputs
    (names, flags, order); every attention target shares the options and inputs."""
    table = _cxx_table()
    assert sorted(table[f"{name}.options"]) == sorted(
        (o.name, TYPE_NAMES[o.type]) for o in target.options)
    assert table[f"{name}.inputs"] == [(op.name, op.flag) for op in target.optional]
    if name == "attention":
        for other in (_spec.BACKWARD, _spec.VARLEN_FORWARD, _spec.VARLEN_BACKWARD,
                      _spec.FLOAT8_FORWARD):
            assert (other.options, other.optional) == (target.options, target.optional)
