"""The FFI handlers re-check what Python already checked: a direct ffi_call with
inconsistent buffers or attributes is an error naming the problem, never a crash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import _ffi


def attributes(**overrides):
    attrs = dict(softmax_scale=np.float32(0.25), window_left=np.int64(-1),
                 window_right=np.int64(-1), softcap=np.float32(0.0), max_seqlen_q=np.int64(8),
                 max_seqlen_k=np.int64(8), has_sinks=np.bool_(False),
                 has_seqused_q=np.bool_(False), has_seqused_k=np.bool_(False),
                 has_segment_ids=np.bool_(False), has_diagonal_offset=np.bool_(False),
                 deterministic=np.bool_(False), kernel_cap=np.int64(0))
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
    call(_ffi.FORWARD_TARGET, args, outs)
    args, outs = varlen_args()
    call(_ffi.VARLEN_FORWARD_TARGET, args, outs)


BAD_CALLS = {
    "announced_sinks_missing": lambda: call(_ffi.FORWARD_TARGET, *dense_args(), has_sinks=True),
    "unannounced_extra_input": lambda: call(
        _ffi.FORWARD_TARGET, dense_args()[0] + [jnp.zeros((1, 2), jnp.float32)], dense_args()[1]),
    "seqused_wrong_shape": lambda: call(
        _ffi.FORWARD_TARGET, dense_args()[0] + [jnp.zeros((3,), jnp.int32)], dense_args()[1],
        has_seqused_q=True),
    "seqused_wrong_dtype": lambda: call(
        _ffi.FORWARD_TARGET, dense_args()[0] + [jnp.zeros((1,), jnp.float32)], dense_args()[1],
        has_seqused_k=True),
    "segments_on_packed": lambda: call(
        _ffi.VARLEN_FORWARD_TARGET,
        varlen_args()[0] + [jnp.zeros((2, 8), jnp.int32)] * 2, varlen_args()[1],
        has_segment_ids=True),
    "cu_seqlens_float": lambda: call(
        _ffi.VARLEN_FORWARD_TARGET,
        varlen_args()[0][:3] + [jnp.zeros((3,), jnp.float32)] * 2, varlen_args()[1]),
    "cu_seqlens_lengths_differ": lambda: call(
        _ffi.VARLEN_FORWARD_TARGET,
        varlen_args()[0][:4] + [jnp.zeros((4,), jnp.int32)], varlen_args()[1]),
    "packed_rank_4": lambda: call(
        _ffi.VARLEN_FORWARD_TARGET,
        [jnp.ones((1, 16, 2, 16))] * 3 + varlen_args()[0][3:], dense_args(s=16)[1]),
    "lse_wrong_layout": lambda: call(
        _ffi.VARLEN_FORWARD_TARGET, varlen_args()[0],
        [varlen_args()[1][0], ((16, 2), jnp.float32)]),
    "negative_max_seqlen": lambda: call(_ffi.VARLEN_FORWARD_TARGET, *varlen_args(),
                                        max_seqlen_q=-1),
}


@pytest.mark.parametrize("bad", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_inconsistent_calls_are_errors(bad):
    with pytest.raises(Exception, match="flashjax"):
        bad()
