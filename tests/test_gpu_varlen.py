"""Packed, padded and segment-id batches on the GPU, on every kernel path (default,
i.e. Hopper on an H100, mma.sync, SIMT), forward and gradients, against the float64 per-sequence references
of varlen_helpers (skipped without a GPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import use_implementation
from nonfinite_helpers import check_varlen_nonfinite
from varlen_helpers import (SegmentCase, VarlenCase, check_segments, check_varlen,
                            segment_cases, varlen_cases)

pytestmark = pytest.mark.gpu

# "default" is the Hopper path on an H100 (packed and seqused layouts; segment ids
# take the mma.sync path there too).
PATHS = ["cuda", "cuda:mma", "cuda:simt"]

# Tensor-core shapes (head dims % 8, fp16/bf16) plus lengths across 64/128/192-row tiles.
GPU_VARLEN_CASES = (
    varlen_cases(dtypes=("float32", "bfloat16"))
    + [dataclasses.replace(c, head_dim=64, dtype="float16") for c in varlen_cases()[:4]]
    + [VarlenCase(lengths_q=(300, 129, 1, 0, 257), lengths_k=(300, 129, 1, 5, 257), heads_q=4,
                  heads_kv=1, head_dim=128, dtype="bfloat16", causal=True, sinks=True),
       VarlenCase(lengths_q=(7, 200), lengths_k=(500, 3), heads_q=6, heads_kv=2, head_dim=96,
                  head_dim_v=64, dtype="bfloat16", window_size=(40, 10), softcap=20.0),
       VarlenCase(lengths_q=(190, 64, 65), lengths_k=(190, 64, 65), heads_q=2, heads_kv=2,
                  head_dim=256, dtype="bfloat16", causal=True, seqused_q=(150, 64, 1),
                  seqused_k=(190, 0, 65), pad_q=9, pad_k=4)])
# (Head dims 64 / 128 in 16 bits: the Hopper kernels' segment-id path on an H100.)
GPU_SEGMENT_CASES = (segment_cases(dtypes=("float32", "bfloat16"))
                     + [dataclasses.replace(c, head_dim=64) for c in segment_cases(("bfloat16",))]
                     + [dataclasses.replace(c, head_dim=128, dtype="float16")
                        for c in segment_cases()[1:]]
                     + [SegmentCase(docs=((100, 200, 1, 211), (512,)), seqlen=512, head_dim=128,
                                    dtype="bfloat16", causal=True, sinks=True),
                        SegmentCase(docs=((300, 1, 90, 209), (129, 63, 128, 200)), seqlen=600,
                                    heads_q=6, heads_kv=2, head_dim=64, dtype="bfloat16",
                                    window_size=(70, 20), softcap=10.0)])


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch):
    use_implementation(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("case", GPU_VARLEN_CASES, ids=map(str, GPU_VARLEN_CASES))
def test_varlen(case, kernel_path, gpu_device):
    check_varlen(case, gpu_device)


@pytest.mark.parametrize("case", GPU_VARLEN_CASES[:6], ids=map(str, GPU_VARLEN_CASES[:6]))
def test_varlen_deterministic(case, gpu_device):
    check_varlen(case, gpu_device, deterministic=True)


@pytest.mark.parametrize("case", GPU_SEGMENT_CASES, ids=map(str, GPU_SEGMENT_CASES))
def test_segment_ids(case, kernel_path, gpu_device):
    check_segments(case, gpu_device)


@pytest.mark.parametrize("case", GPU_SEGMENT_CASES[-4:], ids=map(str, GPU_SEGMENT_CASES[-4:]))
def test_segment_ids_deterministic(case, gpu_device):
    check_segments(case, gpu_device, deterministic=True)


def test_adversarial_metadata_stays_in_bounds(kernel_path, gpu_device):
    """Garbage cu_seqlens / seqused: finite results, no fault (run under
    compute-sanitizer memcheck by tools/sanitize_varlen.py for the memory check)."""
    q = jax.device_put(jax.random.normal(jax.random.key(0), (90, 4, 64), jnp.bfloat16), gpu_device)
    k = jax.device_put(jax.random.normal(jax.random.key(1), (80, 2, 64), jnp.bfloat16), gpu_device)
    for cu_q, cu_k, used in (([0, 50, 20, 90], [0, 40, 10, 80], None),
                             ([-5, 30, 1000, 2 ** 31 - 1], [-100, 60, 70, 5000], None),
                             ([0, 30, 60, 90], [0, 30, 60, 80], [100, -3, 2 ** 31 - 1])):
        meta = [None if x is None else jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used)]
        f = lambda q, k, v: flashjax.flash_attention_varlen(
            q, k, v, meta[0], meta[1], 16, 64, seqused_q=meta[2], seqused_k=meta[2], causal=True)
        out, grads = jax.value_and_grad(lambda *a: f(*a).astype(jnp.float32).sum(),
                                        argnums=(0, 1, 2))(q, k, k)
        assert np.isfinite(float(out)) and all(np.isfinite(np.asarray(g, np.float32)).all()
                                               for g in grads)


def test_non_finite_rows_outside_a_sequence_do_not_leak(kernel_path, gpu_device):
    """NaN/inf in rows no used query or key covers (past seqused, in the padding after the
    last sequence, in a neighbour's rows read by a tile that crosses a sequence's end)
    must not reach the used rows: they are finite and match the clean input's result."""
    total, heads, dim = 300, 2, 64
    key = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(kk, (total, heads, dim), jnp.bfloat16) for kk in key)
    cu = jnp.array([0, 100, 230, 260], jnp.int32)  # rows 260.. belong to no sequence
    used = jnp.array([90, 130, 3], jnp.int32)     # rows 90..99 and 233..259 unused
    bad = np.zeros((total,), bool)
    bad[90:100] = bad[233:] = True
    poison = lambda x: jnp.where(jnp.asarray(bad)[:, None, None], jnp.nan, x)

    def f(q, k, v):
        return flashjax.flash_attention_varlen(q, k, v, cu, cu, 130, 130, seqused_q=used,
                                               seqused_k=used, causal=True, return_lse=True)
    clean = jax.device_put((q, k, v), gpu_device)
    dirty = jax.device_put((poison(q), poison(k), poison(v)), gpu_device)
    (out_c, lse_c), (out_d, lse_d) = f(*clean), f(*dirty)
    good = ~bad
    np.testing.assert_array_equal(np.asarray(out_d, np.float32)[good], np.asarray(out_c, np.float32)[good])
    np.testing.assert_array_equal(np.asarray(lse_d)[:, good], np.asarray(lse_c)[:, good])
    assert (np.asarray(out_d, np.float32)[bad] == 0).all() and np.isneginf(np.asarray(lse_d)[:, bad]).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_non_finite_rows_outside_a_sequence_do_not_leak_into_gradients(kernel_path, gpu_device,
                                                                     causal, deterministic):
    """The backward's side of the test above: NaN in the unused rows of q, k, v and of the
    output cotangent leave the used rows' gradients finite and as with clean inputs, and
    give the unused rows zero gradients."""
    total, heads, dim = 300, 2, 64
    key = jax.random.split(jax.random.key(8), 4)
    q, k, v, ct = (jax.random.normal(kk, (total, heads, dim), jnp.bfloat16) for kk in key)
    cu = jnp.array([0, 100, 230, 260], jnp.int32)
    used = jnp.array([90, 130, 3], jnp.int32)
    bad = np.zeros((total,), bool)
    bad[90:100] = bad[233:] = True
    poison = lambda x: jnp.where(jnp.asarray(bad)[:, None, None], jnp.nan, x)

    def grads(q, k, v, ct):
        f = lambda q, k, v: flashjax.flash_attention_varlen(
            q, k, v, cu, cu, 130, 130, seqused_q=used, seqused_k=used, causal=causal,
            deterministic=deterministic)
        return jax.vjp(f, q, k, v)[1](ct)

    clean = grads(*jax.device_put((q, k, v, ct), gpu_device))
    dirty = grads(*jax.device_put(tuple(map(poison, (q, k, v, ct))), gpu_device))
    good = ~bad
    for name, d, c in zip(("dq", "dk", "dv"), dirty, clean):
        d, c = np.asarray(d, np.float32), np.asarray(c, np.float32)
        assert np.isfinite(d[good]).all(), name
        np.testing.assert_allclose(d[good], c[good], rtol=2e-2, atol=2e-2, err_msg=name)
        assert (d[bad] == 0).all(), name


@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 64), ("float16", 128), ("float32", 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_stays_in_its_sequence(causal, dtype, head_dim, kernel_path, gpu_device):
    """docs/api.md, "Non-finite values": NaN / inf in one packed sequence reach that
    sequence's rows only, forward and gradients (nonfinite_helpers)."""
    check_varlen_nonfinite(causal, device=gpu_device, dtype=dtype, head_dim=head_dim)
