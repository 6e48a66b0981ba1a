"""float8 inputs of flash_attention (FlashAttention 3's fp8 forward): q, k, v in
float8_e4m3fn or float8_e5m2 with descale factors per (batch, kv head), the output in
bf16 by default (`out_dtype=`), forward only.

On Hopper GPUs, calls the float8 kernel takes (`native_candidate`, then
`_introspection.float8_kernel_runs` per device: e4m3, bfloat16 out, head dims 128 or
256, dense without score terms or metadata beyond sinks, windows and softcap) read the
float8 values themselves: S = Q K^T and O = P V in 8-bit wgmma, P rounded to e4m3 as
FlashAttention 3 does (`native_operands` gives them V^T and the descales). Every other
call runs the exact fallback: the inputs are dequantised (x * descale, in float32),
rounded to out_dtype and attended by the kernels of that dtype. Rounding an e4m3 / e5m2
value to bfloat16 is exact, so the result is the bf16 kernel's on the dequantised inputs
(issue 28's accuracy bound: within 1.5x of that kernel's error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# The C++ side's CacheElement codes of the float8 dtypes (flashjax/params.h).
ELEMENT_CODES = {jnp.dtype(jnp.float8_e4m3fn): 1, jnp.dtype(jnp.float8_e5m2): 2}
# out dtypes of the float8 kernel (float32 out: dequantised onto the float32 paths).
NATIVE_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
DESCALES = ("q_descale", "k_descale", "v_descale")


def is_fp8(x) -> bool:
    return getattr(x, "dtype", None) in FP8_DTYPES


def check_no_fp8_options(q, out_dtype, descales: dict) -> None:
    """A call whose inputs are not float8 takes no descales and no other out_dtype."""
    for name, value in descales.items():
        if value is not None:
            raise ValueError(f"{name} is for float8 q, k, v; got {q.dtype} inputs")
    if out_dtype is not None and jnp.dtype(out_dtype) != q.dtype:
        raise ValueError(f"out_dtype is for float8 q, k, v (the output of {q.dtype} inputs is "
                         f"{q.dtype}); got out_dtype={jnp.dtype(out_dtype)}")


def out_dtype_of(out_dtype):
    dtype = jnp.dtype(jnp.bfloat16 if out_dtype is None else out_dtype)
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def check_inputs(q, k, v) -> None:
    if not (is_fp8(k) and is_fp8(v) and k.dtype == q.dtype and v.dtype == q.dtype):
        raise TypeError("float8 attention needs q, k, v of one float8 dtype (float8_e4m3fn "
                        f"or float8_e5m2), got {q.dtype}, {k.dtype}, {v.dtype}")


def descale_of(name: str, value, batch: int, heads_kv: int):
    """The float32 (batch, heads_kv) descale of `value`: None (1.0, as FlashAttention
    3), or float32 of shape (), (1, 1), (batch, 1), (1, heads_kv), (batch, heads_kv)."""
    if value is None:
        return jnp.ones((batch, heads_kv), jnp.float32)
    value = jnp.asarray(value)
    if value.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {value.dtype}")
    shape = tuple(value.shape)
    if not (shape == () or (len(shape) == 2 and shape[0] in (1, batch)
                            and shape[1] in (1, heads_kv))):
        raise ValueError(f"{name} must have shape (), (1, 1), (batch, 1), (1, heads_kv) or "
                         f"(batch, heads_kv) = {(batch, heads_kv)}, got {shape}")
    return jnp.broadcast_to(value, (batch, heads_kv))


def per_row(descale, rows_per_head: int = 1, row_batch=None):
    """descale (batch, heads_kv) broadcast against x: (batch, 1, heads, 1) for x (batch,
    seqlen, heads, dim) (row_batch None), or (tokens, heads, 1) for packed x (tokens,
    heads, dim) with row_batch[t] the sequence of token t; rows_per_head: x's heads per
    kv head (q: the GQA group, k and v: 1)."""
    scale = jnp.repeat(descale, rows_per_head, axis=1)  # (batch, heads of x)
    return scale[:, None, :, None] if row_batch is None else scale[row_batch][:, :, None]


def dequantize(x, descale, compute_dtype, rows_per_head: int = 1, row_batch=None):
    """x * descale in float32, rounded to compute_dtype (x, descale, rows_per_head,
    row_batch: as per_row takes them)."""
    return (x.astype(jnp.float32) * per_row(descale, rows_per_head, row_batch)).astype(
        compute_dtype)


def dequantize_query(q, q_descale, batch: int, heads_kv: int, compute_dtype, row_batch=None):
    """A float8 q (heads on axis -2) dequantised at q_descale (checked and broadcast to
    (batch, heads_kv); its heads use their kv head's), with a derivative that raises."""
    heads_q = q.shape[-2]
    if heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) "
                         "for MQA/GQA")
    scale = descale_of("q_descale", q_descale, batch, heads_kv)
    return dequantize(forward_only(q), scale, compute_dtype, heads_q // heads_kv, row_batch)


@jax.custom_jvp
def forward_only(x):
    """x, with a derivative that raises: float8 attention is forward only."""
    return x


@forward_only.defjvp
def _forward_only_jvp(primals, tangents):
    raise TypeError(f"flash_attention with {primals[0].dtype} inputs is forward only: q, k, v "
                    "have no gradient (differentiate a bfloat16 / float16 call instead)")


# The float8 kernel (csrc/cuda/sm90, Float8Inputs in params.h): its head dims, and V^T's
# key blocks: slot j of each block of FLOAT8_KEY_BLOCK keys holds key PERMUTED_KEYS[j]
# (slots 4t..4t+3 of each 16: keys 2t, 2t+1, 2t+8, 2t+9), the order in which a thread's
# accumulators of P pack into the 8-bit wgmma A operand.
NATIVE_HEAD_DIMS = (128, 256)
FLOAT8_KEY_BLOCK = 32
PERMUTED_KEYS = np.array([16 * (j // 16) + 2 * ((j % 16) // 4) + (j % 2) + 8 * ((j % 4) // 2)
                          for j in range(FLOAT8_KEY_BLOCK)])
# flash_attention options the float8 kernel takes as the bf16 one does; the others must
# be off (None, 0) for it: the call then dequantises.
NATIVE_OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "sinks", "return_lse",
                  "deterministic", "implementation", "dropout_key")


def native_candidate(q, k, v, out_dtype, options: dict) -> bool:
    """Whether a float8 call is one the Hopper float8 kernel takes (the devices decide
    the rest: _introspection.float8_kernel_runs)."""
    return (q.dtype in FP8_DTYPES and jnp.dtype(out_dtype) in NATIVE_OUT_DTYPES
            and q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] in NATIVE_HEAD_DIMS
            and min(q.shape[0], q.shape[1], k.shape[1]) > 0
            and options["implementation"] in (None, "cuda")
            and all(not _is_set(value) for name, value in options.items()
                    if name not in NATIVE_OPTIONS))


def _is_set(value) -> bool:
    return value is not None and not (isinstance(value, (int, float)) and value == 0)


def permuted_transpose(v):
    """V (batch, seqlen_k, heads_kv, head_dim_v) as the float8 kernel reads it: (batch,
    heads_kv, head_dim_v, keys), keys zero-padded to a multiple of FLOAT8_KEY_BLOCK and
    permuted within each block (PERMUTED_KEYS). One XLA fusion, reading and writing V once."""
    batch, seqlen_k, heads_kv, dim = v.shape
    keys = -(-seqlen_k // FLOAT8_KEY_BLOCK) * FLOAT8_KEY_BLOCK
    v = jnp.pad(v, ((0, 0), (0, keys - seqlen_k), (0, 0), (0, 0)))
    blocks = v.reshape(batch, keys // FLOAT8_KEY_BLOCK, FLOAT8_KEY_BLOCK, heads_kv, dim)
    blocks = blocks[:, :, PERMUTED_KEYS]
    return blocks.transpose(0, 3, 4, 1, 2).reshape(batch, heads_kv, dim, keys)


def native_operands(q, q_descale, k_descale, may_be_negative: bool = True):
    """(q, score_descale) for the float8 kernel: the descale of q.k per (batch, kv head),
    q_descale * k_descale, made >= 0 by flipping the sign of q's rows where it is
    negative (a float8 sign bit), so that the kernel's row maxima of the raw products
    stay the maxima of the scores. may_be_negative False (both descales omitted: 1):
    q as it is."""
    score_descale = q_descale * k_descale
    if not may_be_negative:
        return q, score_descale
    group = q.shape[-2] // q_descale.shape[-1]
    negative = per_row(score_descale < 0, group)  # (batch, 1, heads_q, 1)
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
    flipped = jax.lax.bitcast_convert_type(bits ^ jnp.uint8(0x80), q.dtype)
    return jnp.where(negative, flipped, q), jnp.abs(score_descale)
