"""Trace-time argument checks shared by the public functions: mistakes surface
as ValueError/TypeError naming the argument before anything runs."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from ._route import implementation_fields
from ._spec import Config
from ._visibility import Window

MAX_HEAD_DIM = 256
DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def shape_of(name, x) -> tuple:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_qkv(q, k, v, rank: int, dims: tuple, key_rows: str,
              names: tuple = ("q", "k", "v")) -> None:
    """Ranks, one dtype, matching head dims and k/v heads; `dims` names the axes,
    `key_rows` k's row axis, `names` the arguments (as the caller calls them)."""
    nq, nk, nv = names
    qs, ks, vs = shape_of(nq, q), shape_of(nk, k), shape_of(nv, v)
    for name, s, axes in zip(names, (qs, ks, vs), dims):
        if len(s) != rank:
            raise ValueError(f"{name} must have rank {rank} {axes}, got shape {s}")
    if q.dtype not in DTYPES:
        raise TypeError(f"{nq} dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{nq}, {nk}, {nv} must share one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    heads_q, head_dim, heads_kv = qs[-2], qs[-1], ks[-2]
    if ks[-1] != head_dim:
        raise ValueError(f"head_dim of {nk} must equal {nq}'s ({head_dim}), got {nk} shape {ks}")
    if vs[-3] != ks[-3] or vs[-2] != heads_kv:
        raise ValueError(
            f"{nv} must have {nk}'s {key_rows} and heads_kv {ks[-3:-1]}, got {nv} shape {vs}")
    for name, n in (("heads_q", heads_q), ("heads_kv", heads_kv)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n} ({nq} {qs}, {nk} {ks})")
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for MQA/GQA")
    for name, d in (("head_dim", head_dim), ("head_dim_v", vs[-1])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}], got {d}")


def check_sinks(sinks, heads_q: int) -> None:
    if sinks is None:
        return
    if shape_of("sinks", sinks) != (heads_q,):
        raise ValueError(f"sinks must have shape (heads_q,) = ({heads_q},), got {sinks.shape}")
    if sinks.dtype != jnp.float32:
        raise TypeError(f"sinks must be float32, got {sinks.dtype}")


def check_scores(name: str, x, batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                 seqlen_k: int, keys: str = "seqlen_k"):
    """A bias (float) or mask (bool) of shape (1 or batch, 1 or heads_q or heads_kv,
    seqlen_q, seqlen_k): the bias as float32, the mask as it is (None stays None).
    `keys`: what the last dim is called in the error message."""
    if x is None:
        return None
    s = shape_of(name, x)
    expected = (f"(1 or batch, 1 or heads_q or heads_kv, seqlen_q, {keys}) = "
                f"({{1, {batch}}}, {{1, {heads_q}, {heads_kv}}}, {seqlen_q}, {seqlen_k})")
    if name == "mask" and x.dtype != jnp.bool_:
        raise TypeError(f"mask must be a bool array (True: may attend), got dtype {x.dtype}")
    if name != "mask" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a float array, got dtype {x.dtype}")
    if (len(s) != 4 or s[0] not in (1, batch) or s[1] not in (1, heads_q, heads_kv)
            or s[2:] != (seqlen_q, seqlen_k)):
        raise ValueError(f"{name} must have shape {expected}, got {s}")
    return x if name == "mask" else jnp.asarray(x, jnp.float32)


def check_alibi_slopes(slopes, batch: int, heads_q: int, batch_name: str = "batch"):
    """float32 ALiBi slopes of shape (heads_q,) or (batch, heads_q), as (batch, heads_q)
    (None stays None); `batch_name` names the batch dim in errors (num_seqs: packed)."""
    if slopes is None:
        return None
    s = shape_of("alibi_slopes", slopes)
    if slopes.dtype != jnp.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if s not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape (heads_q,) = ({heads_q},) or "
                         f"({batch_name}, heads_q) = ({batch}, {heads_q}), got {s}")
    return jnp.broadcast_to(slopes, (batch, heads_q))


def check_int_array(name: str, x, shape: tuple, meaning: str) -> None:
    """An int32 array of exactly `shape` (traced values are fine)."""
    if x is None:
        return
    s = shape_of(name, x)
    if x.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if s != tuple(shape):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(shape)}, got {s}")


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def int_metadata(name: str, x, shape: tuple, meaning: str):
    """x (None, or an array of any integer dtype and exactly `shape`) as int32, values
    outside int32 saturated (they stay out of range, and are clamped or dropped as
    inconsistent metadata is, rather than wrapping into range)."""
    if x is None:
        return None
    s = shape_of(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
    if s != tuple(shape):
        raise ValueError(f"{name} must have shape {meaning} = {tuple(shape)}, got {s}")
    if x.dtype == jnp.int32:
        return x
    info = jnp.iinfo(x.dtype)
    if info.min < INT32_MIN or info.max > INT32_MAX:
        x = jnp.clip(x, max(info.min, INT32_MIN), min(info.max, INT32_MAX))
    return x.astype(jnp.int32)


def _position(name: str, x, sequences: int, meaning: str):
    """An int32 (sequences,) array from an int or an integer array of shape () or
    (sequences,) (traced values are fine)."""
    if is_int(x):
        if not INT32_MIN <= x <= INT32_MAX:
            raise ValueError(f"{name} must fit in int32, got {x}")
        return jnp.full((sequences,), x, jnp.int32)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an int or an integer array, got {type(x).__name__}")
    s = tuple(x.shape)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int or an integer array, got dtype {x.dtype}")
    if s not in ((), (sequences,)):
        raise ValueError(f"{name} must be an int or have shape () or {meaning} = "
                         f"({sequences},), got {s}")
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (sequences,))


def diagonal_offset(q_offset, kv_offset, sequences: int, meaning: str):
    """The kernels' per-sequence diagonal offset (query row i's diagonal is key
    i + offset) from the positions of the first query and key rows, or None (both
    None: bottom-right alignment)."""
    if q_offset is None and kv_offset is None:
        return None
    q = _position("q_offset", 0 if q_offset is None else q_offset, sequences, meaning)
    k = _position("kv_offset", 0 if kv_offset is None else kv_offset, sequences, meaning)
    return q - k


def check_static_length(name: str, n) -> int:
    """A static, non-negative Python int (not a traced value)."""
    if isinstance(n, jax.core.Tracer) or (hasattr(n, "shape") and not isinstance(n, np.integer)):
        raise TypeError(f"{name} must be a static Python int (an upper bound of the lengths), "
                        f"got a traced or array value {n!r}")
    if not is_int(n):
        raise TypeError(f"{name} must be a Python int, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return int(n)


def _concrete_scalar(name: str, x, what: str):
    """x as a Python/NumPy scalar: Python and NumPy scalars as they are, concrete 0-d
    JAX/NumPy arrays unwrapped; a traced value is a TypeError (it would need a
    recompile per value: these options are static)."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be a static {what} (a Python/NumPy scalar or a concrete "
                        f"array of shape ()), not a traced value: {x!r}")
    if isinstance(x, (np.ndarray, jax.Array)) and np.shape(x) == ():
        return np.asarray(x)[()]
    return x


def static_real(name: str, x) -> float:
    x = _concrete_scalar(name, x, "real number")
    if not is_real(x):
        raise TypeError(f"{name} must be a real number (a static value), got {x!r}")
    return float(x)


def static_int(name: str, x) -> int:
    x = _concrete_scalar(name, x, "int")
    if not is_int(x):
        raise TypeError(f"{name} must be an int (a static value), got {x!r}")
    return int(x)


def static_flag(name: str, x) -> bool:
    x = _concrete_scalar(name, x, "bool")
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {x!r}")
    return bool(x)


def make_config(head_dim, softmax_scale, causal, window_size, softcap, deterministic,
                implementation=None, return_lse=False, **layout) -> Config:
    """The call's static Config; every static option is checked here (concrete JAX/NumPy
    scalars are accepted where a number or flag is)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    softmax_scale = static_real("softmax_scale", softmax_scale)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    causal = static_flag("causal", causal)
    deterministic = static_flag("deterministic", deterministic)
    static_flag("return_lse", return_lse)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (static_int(f"window_size[{i}]", w) for i, w in enumerate(window_size))
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {window_size}")
    softcap = static_real("softcap", softcap)
    if not (softcap >= 0.0) or not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite real >= 0 (0 = off), got {softcap!r}")
    window = Window.of(causal, (left, right))
    return Config(softmax_scale, window.left, window.right, softcap, deterministic,
                  **layout, **implementation_fields(implementation))
