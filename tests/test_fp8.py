"""float8 q, k, v on flash_attention (issue 28 section 1, the exact fallback every
platform runs today): q_descale / k_descale / v_descale per (batch, kv head) and their
broadcast shapes, out_dtype, the accuracy bound against the float64 reference of the
dequantised inputs (within 1.5x of the bf16 kernel's error on the same inputs), lse,
jit with traced descales, forward only (a gradient raises), validation errors.

One small GQA shape (seqlen_q != seqlen_k, causal) serves every case."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import _fp8, reference

B, SQ, SK, H, HK, D = 2, 40, 47, 4, 2, 32
GROUP = H // HK
RNG = np.random.default_rng(0)
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def quantised(shape, dtype, spread=2.0):
    return jnp.asarray(RNG.normal(size=shape) * spread, jnp.float32).astype(dtype)


def inputs(dtype):
    return (quantised((B, SQ, H, D), dtype), quantised((B, SK, HK, D), dtype),
            quantised((B, SK, HK, D), dtype))


DESCALES = dict(q_descale=jnp.asarray(RNG.uniform(0.1, 0.5, (B, HK)), jnp.float32),
                k_descale=jnp.asarray(RNG.uniform(0.1, 0.5, (1, HK)), jnp.float32),
                v_descale=jnp.float32(0.7))


def dequantised(q, k, v, descales, dtype=jnp.float64):
    def deq(x, name, group):
        s = jnp.broadcast_to(jnp.asarray(descales.get(name, 1.0), jnp.float32), (B, HK))
        return (x.astype(jnp.float64) * jnp.repeat(s, group, axis=1)[:, None, :, None]).astype(dtype)
    return deq(q, "q_descale", GROUP), deq(k, "k_descale", 1), deq(v, "v_descale", 1)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("implementation", ["cpu", "xla"])
def test_accuracy_against_the_dequantised_reference(dtype, implementation):
    q, k, v = inputs(dtype)
    out, lse = flashjax.flash_attention(q, k, v, causal=True, return_lse=True,
                                        implementation=implementation, **DESCALES)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, SQ, H, D)
    ref_out, ref_lse = reference.attention(*dequantised(q, k, v, DESCALES), causal=True,
                                           return_lse=True, compute_dtype=jnp.float64)
    bf16, bf16_lse = flashjax.flash_attention(*dequantised(q, k, v, DESCALES, jnp.bfloat16),
                                              causal=True, return_lse=True,
                                              implementation=implementation)
    assert rel_err(out, ref_out) <= 1.5 * rel_err(bf16, ref_out) + 1e-6
    # (lse: the bf16 kernel's on the same inputs; the reference's up to their rounding)
    np.testing.assert_allclose(lse, bf16_lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-2, atol=2e-2)


def test_descale_shapes_broadcast():
    q, k, v = inputs(jnp.float8_e4m3fn)
    full = flashjax.flash_attention(q, k, v, implementation="cpu",
                                    q_descale=jnp.full((B, HK), 0.3, jnp.float32))
    for shape in ((), (1, 1), (B, 1), (1, HK)):
        got = flashjax.flash_attention(q, k, v, implementation="cpu",
                                       q_descale=jnp.full(shape, 0.3, jnp.float32))
        np.testing.assert_array_equal(got, full)
    ones = flashjax.flash_attention(q, k, v, implementation="cpu")
    np.testing.assert_array_equal(
        ones, flashjax.flash_attention(q, k, v, implementation="cpu",
                                       k_descale=jnp.ones((), jnp.float32)))


@pytest.mark.parametrize("out_dtype", [jnp.float16, jnp.float32])
def test_out_dtype(out_dtype):
    q, k, v = inputs(jnp.float8_e4m3fn)
    out = flashjax.flash_attention(q, k, v, out_dtype=out_dtype, implementation="cpu",
                                   **DESCALES)
    assert out.dtype == out_dtype
    ref = reference.attention(*dequantised(q, k, v, DESCALES), compute_dtype=jnp.float64)
    assert rel_err(out, ref) < (1e-5 if out_dtype == jnp.float32 else 2e-3)


def test_jit_with_traced_descales():
    q, k, v = inputs(jnp.float8_e4m3fn)
    call = jax.jit(lambda q, k, v, s: flashjax.flash_attention(q, k, v, q_descale=s,
                                                               implementation="cpu"))
    np.testing.assert_array_equal(
        call(q, k, v, DESCALES["q_descale"]),
        flashjax.flash_attention(q, k, v, q_descale=DESCALES["q_descale"], implementation="cpu"))


def test_forward_only():
    q, k, v = inputs(jnp.float8_e4m3fn)
    loss = lambda q: flashjax.flash_attention(q, k, v, implementation="cpu").astype(
        jnp.float32).sum()
    with pytest.raises(TypeError, match="float8_e4m3fn inputs is forward only"):
        jax.grad(loss)(q)


BAD = {
    "descale_shape": (ValueError, r"q_descale must have shape .* = \(2, 2\)",
                      dict(q_descale=jnp.ones((3,), jnp.float32))),
    "descale_heads_q": (ValueError, "k_descale must have shape",
                        dict(k_descale=jnp.ones((B, H), jnp.float32))),
    "descale_dtype": (TypeError, "v_descale must be float32",
                      dict(v_descale=jnp.ones((1, 1), jnp.float16))),
    "out_dtype": (TypeError, "out_dtype must be bfloat16, float16 or float32",
                  dict(out_dtype=jnp.int8)),
}


@pytest.mark.parametrize("error, match, kwargs", BAD.values(), ids=BAD.keys())
def test_bad_input(error, match, kwargs):
    q, k, v = inputs(jnp.float8_e4m3fn)
    with pytest.raises(error, match=match):
        flashjax.flash_attention(q, k, v, **kwargs)


def test_fp8_options_need_fp8_inputs():
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="q_descale is for float8"):
        flashjax.flash_attention(q, k, v, q_descale=jnp.ones((), jnp.float32))
    with pytest.raises(ValueError, match="out_dtype is for float8"):
        flashjax.flash_attention(q, k, v, out_dtype=jnp.float32)
    with pytest.raises(TypeError, match="one float8 dtype"):
        flashjax.flash_attention(q.astype(jnp.float8_e4m3fn), k, v)


# ----------------------------------------------------------------------------- varlen

LENGTHS_Q, LENGTHS_K = (13, 0, 27), (20, 9, 18)  # (a sequence without queries)


def packed(x, lengths):
    """Sequence i's rows of x (batch, seqlen, heads, dim): its first lengths[i], packed."""
    return jnp.concatenate([x[i % x.shape[0], :n] for i, n in enumerate(lengths)])


def cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def test_varlen_rows_take_their_sequences_descales():
    """Packed float8 q, k, v with descales per (sequence, kv head): each sequence's out
    and lse equal flash_attention's on that sequence alone with its descales (e5m2 goes
    the same way: the dtype only changes the elements)."""
    q, k, v = inputs(jnp.float8_e5m2)
    descales = dict(q_descale=jnp.asarray(RNG.uniform(0.1, 0.5, (3, HK)), jnp.float32),
                    k_descale=jnp.asarray(RNG.uniform(0.1, 0.5, (3, 1)), jnp.float32),
                    v_descale=jnp.float32(0.7))
    out, lse = flashjax.flash_attention_varlen(
        packed(q, LENGTHS_Q), packed(k, LENGTHS_K), packed(v, LENGTHS_K), cu(LENGTHS_Q),
        cu(LENGTHS_K), SQ, SK, causal=True, return_lse=True, **descales)
    assert out.dtype == jnp.bfloat16 and out.shape == (sum(LENGTHS_Q), H, D)
    start = 0
    for i, (nq, nk) in enumerate(zip(LENGTHS_Q, LENGTHS_K)):
        one = {name: jnp.broadcast_to(d, (3, HK))[i:i + 1] for name, d in descales.items()}
        want, want_lse = flashjax.flash_attention(
            q[i % B:i % B + 1, :nq], k[i % B:i % B + 1, :nk], v[i % B:i % B + 1, :nk],
            causal=True, return_lse=True, **one)
        np.testing.assert_allclose(np.asarray(out[start:start + nq], np.float32),
                                   np.asarray(want[0], np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(np.asarray(lse[:, start:start + nq]), np.asarray(want_lse[0]),
                                   rtol=1e-3, atol=1e-3)
        start += nq


def test_varlen_out_dtype_forward_only_and_errors():
    q, k, v = (packed(x, lens) for x, lens in zip(inputs(jnp.float8_e4m3fn),
                                                   (LENGTHS_Q, LENGTHS_K, LENGTHS_K)))
    call = lambda q, k, v, **kw: flashjax.flash_attention_varlen(
        q, k, v, cu(LENGTHS_Q), cu(LENGTHS_K), SQ, SK, **kw)
    assert call(q, k, v, out_dtype=jnp.float32).dtype == jnp.float32
    with pytest.raises(TypeError, match="forward only"):
        jax.grad(lambda q: call(q, k, v).astype(jnp.float32).sum())(q)
    with pytest.raises(TypeError, match="one float8 dtype"):
        call(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match=r"q_descale must have shape"):
        call(q, k, v, q_descale=jnp.ones((2, HK), jnp.float32))
    bf16 = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="q_descale is for float8"):
        call(bf16, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
             q_descale=jnp.ones((3, HK), jnp.float32))
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        call(bf16, k, v)


def test_permuted_transpose_layout():
    # V^T as the Hopper float8 kernel reads it (tests/test_gpu_fp8.py runs the kernel):
    # slot 4t + j of each 16 of a 32-key block holds key 2t + (j & 1) + 8 (j >> 1),
    # keys zero-padded to whole blocks (tools/fp8_wgmma_check.cu checks the packing
    # this order matches on a GPU).
    v = jnp.arange(2 * 70 * 3 * 4, dtype=jnp.float32).reshape(2, 70, 3, 4)
    vt = np.asarray(_fp8.permuted_transpose(v))
    assert vt.shape == (2, 3, 4, 96)
    for slot in range(96):
        block, j = divmod(slot, 32)
        key = 32 * block + 16 * (j // 16) + 2 * ((j % 16) // 4) + (j % 2) + 8 * ((j % 4) // 2)
        want = np.asarray(v)[:, key] if key < 70 else np.zeros((2, 3, 4))
        np.testing.assert_array_equal(vt[:, :, :, slot], want)


def test_native_operands_flip_q_where_the_score_descale_is_negative():
    q = jnp.asarray(RNG.normal(size=(B, SQ, H, D)), jnp.float32).astype(jnp.float8_e4m3fn)
    qd = jnp.asarray([[0.5, -0.25], [-1.0, 2.0]], jnp.float32)
    kd = jnp.asarray([[1.0, 1.0], [-1.0, 1.0]], jnp.float32)
    signed, score = _fp8.native_operands(q, qd, kd)
    np.testing.assert_array_equal(np.asarray(score), np.abs(np.asarray(qd * kd)))
    sign = np.repeat(np.sign(np.asarray(qd * kd)), GROUP, axis=1)[:, None, :, None]
    np.testing.assert_array_equal(np.asarray(signed.astype(jnp.float32)),
                                  np.asarray(q.astype(jnp.float32)) * sign)


def test_a_call_the_float8_kernel_could_take_runs_the_fallback_off_hopper():
    # e4m3, head dim 128, bf16 out, sinks, a window and softcap: a native candidate; on a machine
    # without an sm_90 GPU (this one: the CPU) the same numbers as the dequantised call.
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.normal(size=s) * 2, jnp.float32).astype(jnp.float8_e4m3fn)
               for s in ((1, 40, 4, 128), (1, 33, 2, 128), (1, 33, 2, 128)))
    sinks = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    options = dict(sinks=sinks, window_size=(8, 3), softcap=2.0, return_lse=True, **DESCALES_1)
    assert _fp8.native_candidate(q, k, v, jnp.bfloat16, dict(
        softmax_scale=None, causal=False, window_size=(8, 3), softcap=2.0, sinks=sinks,
        return_lse=True, deterministic=False, q_segment_ids=None, kv_segment_ids=None,
        seqused_q=None, seqused_k=None, q_offset=None, kv_offset=None, bias=None, mask=None,
        alibi_slopes=None, dropout_rate=0.0, dropout_key=None, implementation=None))
    auto = jax.jit(lambda q, k, v: flashjax.flash_attention(q, k, v, **options))(q, k, v)
    cpu = flashjax.flash_attention(q, k, v, implementation="cpu", **options)
    for a, b in zip(auto, cpu):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))


def test_the_float8_kernel_takes_e4m3_and_e5m2_with_16_bit_out():
    options = dict(softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                   sinks=None, return_lse=False, deterministic=False, q_segment_ids=None,
                   kv_segment_ids=None, seqused_q=None, seqused_k=None, q_offset=None,
                   kv_offset=None, bias=None, mask=None, alibi_slopes=None, dropout_rate=0.0,
                   dropout_key=None, implementation=None)
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        q = jax.ShapeDtypeStruct((1, 40, 4, 256), dtype)
        kv = jax.ShapeDtypeStruct((1, 33, 2, 256), dtype)
        for out_dtype, native in ((jnp.bfloat16, True), (jnp.float16, True), (jnp.float32, False)):
            assert _fp8.native_candidate(q, kv, kv, out_dtype, options) == native, (dtype, out_dtype)
        assert _fp8.ELEMENT_CODES[jnp.dtype(dtype)] in (1, 2)


DESCALES_1 = dict(q_descale=jnp.float32(0.3), k_descale=jnp.full((1, 2), -0.2, jnp.float32),
                  v_descale=jnp.full((1, 1), 0.5, jnp.float32))
