"""flash_attention_varlen(alibi_slopes=): FlashAttention's varlen ALiBi (-slope *
|i + seqlen_k_b - seqlen_q_b - j| within each sequence b) with per-head (heads_q,) and
per-sequence (num_seqs, heads_q) slopes, against the float64 per-sequence reference
(reference.attention_varlen), forward, lse and gradients of q, k, v (and sinks), with
causal, windows, softcap, sinks, GQA, seqused, padding rows and positions; on the C++ CPU
kernels and the pure-JAX path; traced slopes; validation.

Every case has varlen_helpers' default packing (five sequences, one empty, GQA 4/2), so
the kernels' and the references' compilations differ by options only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import counting_jit, has_gpu, rand, use_implementation
from varlen_helpers import VarlenCase, check_varlen

CASES = [
    VarlenCase(alibi="heads"),
    VarlenCase(alibi="sequences", causal=True, sinks=True, pad_q=7, pad_k=3),
    VarlenCase(alibi="sequences", window_size=(9, 3), softcap=4.0, sinks=True),
    VarlenCase(alibi="sequences", causal=True, seqused_q=(5, 0, 40, 1, 20),
               seqused_k=(9, 2, 64, 1, 100)),
    # positions (chunked prefill: sequence 4's queries continue its keys)
    VarlenCase(alibi="sequences", causal=True, sinks=True, pad_q=7, pad_k=3,
               q_offset=(4, 0, 0, 0, 97), kv_offset=(0, 0, 0, 0, 0)),
]
# The pure-JAX path's compilations dominate this file: one case, forward and lse (its
# backward reads the per-row slopes through the same _Terms.add; test_bias_mask checks
# its ALiBi gradients on dense calls).
XLA_CASES = CASES[-1:]


@pytest.mark.parametrize("case", CASES, ids=map(str, CASES))
def test_varlen_alibi_cpu_kernels(case, cpu_kernels):
    check_varlen(case)


def test_varlen_alibi_cpu_two_pass_backward(cpu_kernels, monkeypatch):
    """The CPU backward's other path (a key-tile pass, then a query-tile pass)."""
    monkeypatch.setenv("FLASHJAX_CPU_BACKWARD", "two-pass")
    check_varlen(CASES[1])


@pytest.mark.parametrize("case", XLA_CASES, ids=map(str, XLA_CASES))
def test_varlen_alibi_pure_jax(case, monkeypatch):
    use_implementation(monkeypatch, "xla")
    check_varlen(case, gradients=False)


def _packed(case=VarlenCase()):
    cu_q, cu_k = (jnp.asarray(c) for c in case.cu_seqlens())
    q = rand(0, (case.total_q, case.heads_q, case.head_dim))
    k, v = (rand(i, (case.total_k, case.heads_kv, case.head_dim)) for i in (1, 2))
    return (q, k, v, cu_q, cu_k, *case.max_seqlens()), case


def test_traced_slopes_share_one_program():
    """Slopes are traced: new values, no recompilation (and a different result)."""
    args, _ = _packed()
    f, traces = counting_jit(lambda slopes: flashjax.flash_attention_varlen(
        *args, alibi_slopes=slopes, causal=True, implementation="cpu"))
    slopes = VarlenCase(alibi="sequences").alibi_slopes()
    a, b = f(slopes), f(slopes[::-1].copy())
    assert len(traces) == 1
    assert not np.allclose(a, b)


BAD = {
    "heads_kv": (ValueError, r"alibi_slopes must have shape \(heads_q,\) = \(4,\) or "
                 r"\(num_seqs, heads_q\) = \(5, 4\)", np.ones((2,), np.float32)),
    "sequences": (ValueError, "alibi_slopes must have shape", np.ones((6, 4), np.float32)),
    "dtype": (TypeError, "alibi_slopes must be float32", np.ones((4,), jnp.bfloat16)),
}


@pytest.mark.parametrize("error, match, slopes", BAD.values(), ids=BAD.keys())
def test_bad_slopes(error, match, slopes):
    args, _ = _packed()
    with pytest.raises(error, match=match):
        flashjax.flash_attention_varlen(*args, alibi_slopes=slopes)


def test_no_packed_scores():
    """bias= and mask= are not arguments of the packed call (docs/api.md: segment ids +
    flash_attention instead)."""
    args, _ = _packed()
    for name in ("bias", "mask"):
        with pytest.raises(TypeError, match=name):
            flashjax.flash_attention_varlen(*args, **{name: None})


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_gpu_kernels_match_pure_jax():
    """On a CUDA GPU, a packed call with per-sequence ALiBi on the CUDA kernels gives the
    pure-JAX path's result."""
    (q, k, v, cu_q, cu_k, max_q, max_k), _ = _packed()
    gpu = jax.devices("gpu")[0]
    slopes = jax.device_put(VarlenCase(alibi="sequences").alibi_slopes(), gpu)
    q, k, v, cu_q, cu_k = jax.device_put((q, k, v, cu_q, cu_k), gpu)
    call = lambda **o: flashjax.flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                                       alibi_slopes=slopes, causal=True, **o)
    np.testing.assert_allclose(call(), call(implementation="xla"), atol=1e-5)
