"""flash_attention_with_kvcache with bias=, mask= and alibi_slopes= on the CPU (the
dense C++ kernels after the FFI call's append) and the pure-JAX path, against the
float64 reference of kvcache_helpers.py (each sequence's keys gathered from the cache
by hand, the terms sliced at its logical positions, ALiBi written out as a bias):
contiguous (in place, cache_seqlens static or traced), cache_batch_idx, leftpad and
paged caches, new rows appended (past the capacity too), rotary, GQA, ALiBi per head
and per sequence, every broadcast shape of bias and mask; validation errors; the route
(no split-KV call with score terms: the dense kernels attend over the cache).

Cases share their shapes (3 sequences, 4/2 heads, capacity 24) so that the reference's
and the calls' compilations are shared; the C++ path runs with implementation="cpu"
(None would also trace the pure-JAX branch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax._spec import KVCACHE
from kvcache_helpers import KVCase, check, make_inputs

B, SQ, H, HK, CAP = 3, 2, 4, 2, 24

CONTIGUOUS = KVCase(seqlen_q=SQ, seqlen_new=SQ, causal=True)
LAYOUTS = {
    "contiguous": CONTIGUOUS,
    "static_seqlens": KVCase(seqlen_q=SQ, seqlen_new=SQ, seqlens=(7, 7, 7), causal=True),
    "no_new_rows": KVCase(seqlen_q=SQ, seqlens=(5, 1, 24)),
    "past_capacity": KVCase(seqlen_q=SQ, seqlen_new=SQ, seqlens=(20, 23, 24), causal=True),
    "batch_idx_leftpad": KVCase(seqlen_q=SQ, seqlen_new=SQ, batch_cache=5, leftpad=(2, 0, 4),
                                sinks=True, rotary_dim=16, causal=True),
    "paged_leftpad": KVCase(seqlen_q=SQ, seqlen_new=SQ, page_size=4, num_pages=30,
                            seqlens=(9, 2, 20), leftpad=(3, 0, 1), rotary_dim=16,
                            interleaved=False, window_size=(5, 0), poison=True),
}
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)


def terms(bias=None, mask=None, alibi=None, seed=7):
    """Score terms of the given shapes (None: absent) over the capacity; masks keep ~70%
    and hide every key of query 1 of the first sequence (out 0, lse -inf or the sink)."""
    rng = np.random.default_rng(seed)
    out = {}
    if bias is not None:
        out["bias"] = jnp.asarray(rng.standard_normal(bias), jnp.float32)
    if mask is not None:
        m = rng.random(mask) < 0.7
        m[0, :, 1, :] = False
        out["mask"] = jnp.asarray(m)
    if alibi is not None:
        slopes = SLOPES if alibi == (H,) else SLOPES * (1 + np.arange(B, dtype=np.float32))[:, None]
        out["alibi_slopes"] = jnp.asarray(slopes)
    return out


ALL_TERMS = dict(bias=(B, HK, SQ, CAP), mask=(1, 1, SQ, CAP), alibi=(B, H))


def cases(names, xla_names):
    """(implementation, name) pairs: the C++ CPU kernels on every name, the pure-JAX
    path (whose compilations cost several times the CPU path's) on `xla_names`."""
    return ([pytest.param("cpu", n, id=f"cpu-{n}") for n in names]
            + [pytest.param("xla", n, id=f"xla-{n}") for n in xla_names])


@pytest.mark.parametrize("implementation, layout",
                         cases(LAYOUTS, ["paged_leftpad"]))
def test_every_layout_with_bias_mask_and_alibi(layout, implementation):
    """bias (per sequence, per kv head), a mask and ALiBi per sequence together, on every
    cache layout: the terms follow the logical positions, the caches get the new rows."""
    case = LAYOUTS[layout]
    check(case, terms=terms(**ALL_TERMS), implementation=implementation,
          int_seqlens=layout == "static_seqlens")


SHAPES = {
    "alibi_per_head": dict(alibi=(H,)),
    "alibi_per_sequence": dict(alibi=(B, H)),
    "bias_shared": dict(bias=(1, 1, SQ, CAP)),
    "bias_per_head": dict(bias=(1, H, SQ, CAP)),
    "mask_per_sequence_head": dict(mask=(B, H, SQ, CAP)),
    "mask_per_kv_head_and_alibi": dict(mask=(1, HK, SQ, CAP), alibi=(H,)),
}


@pytest.mark.parametrize("implementation, shape", cases(SHAPES, ["mask_per_kv_head_and_alibi"]))
def test_term_shapes(shape, implementation):
    check(CONTIGUOUS, terms=terms(**SHAPES[shape]), implementation=implementation)


def test_alibi_follows_the_decode_positions():
    """One decoding step of ALiBi equals the dense call over the cache's used rows with
    the query at the last position (FlashAttention's |i + seqlen_k - seqlen_q - j|);
    implementation=None (also traces the other platforms' routes)."""
    case = KVCase(seqlen_q=1, seqlen_new=1, seqlens=(6, 6, 6), heads_q=H, heads_kv=HK)
    q, k_cache, v_cache, new, _ = make_inputs(case)
    slopes = jnp.asarray(SLOPES)
    out, k_cache, v_cache = flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, **new, cache_seqlens=6, alibi_slopes=slopes)
    want = flashjax.flash_attention(q, k_cache[:, :7], v_cache[:, :7], alibi_slopes=slopes,
                                    implementation="cpu")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def _call(**kw):
    q, k_cache, v_cache, new, extra = make_inputs(CONTIGUOUS)
    return lambda **more: flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, **new, cache_seqlens=jnp.asarray(CONTIGUOUS.seqlens, jnp.int32),
        **extra, **kw, **more)


def test_cpu_route_takes_the_dense_kernels():
    """With score terms the KV-cache FFI call only appends (no query rows) and
    flash_attention's forward attends; without them the KV-cache call attends."""
    q, k_cache, v_cache, new, _ = make_inputs(CONTIGUOUS)
    seqlens = jnp.asarray(CONTIGUOUS.seqlens, jnp.int32)

    def lowered(**more):
        return jax.jit(lambda q, kc, vc, k, v, n: flashjax.flash_attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=n, implementation="cpu", **more)).lower(
            q, k_cache, v_cache, new["k"], new["v"], seqlens).as_text()
    with_terms = lowered(alibi_slopes=jnp.asarray(SLOPES))
    assert "flashjax_fwd" in with_terms and "flashjax_kvcache" in with_terms
    assert f"tensor<{B}x0x{H}x" in with_terms  # the KV-cache call has no query rows
    assert "flashjax_fwd" not in lowered()
    # The route relies on the KV-cache target taking none (its handlers refuse extra
    # operands): a kernel that reads them adds the slots and changes kvcache._kvcache.
    assert not {"bias", "mask", "alibi_slopes"} & {op.name for op in KVCACHE.optional}


INVALID = [
    ("bias", np.zeros((B, H, SQ, 20), np.float32), ValueError, r"capacity.*24"),
    ("bias", np.zeros((2, H, SQ, CAP), np.float32), ValueError, r"bias must have shape"),
    ("bias", np.zeros((1, 3, SQ, CAP), np.float32), ValueError, r"heads_q or heads_kv"),
    ("bias", np.zeros((B, H, SQ + 1, CAP), np.float32), ValueError, r"seqlen_q"),
    ("bias", np.zeros((H, SQ, CAP), np.float32), ValueError, r"bias must have shape"),
    ("bias", np.zeros((B, H, SQ, CAP), np.int32), TypeError, r"bias must be a float"),
    ("mask", np.ones((B, H, SQ, CAP), np.float32), TypeError, r"mask must be a bool"),
    ("mask", np.ones((B, H, SQ, 10), bool), ValueError, r"mask must have shape.*capacity"),
    ("alibi_slopes", np.ones((H,), np.float16), TypeError, r"alibi_slopes must be float32"),
    ("alibi_slopes", np.ones((HK,), np.float32), ValueError, r"alibi_slopes must have shape"),
    ("alibi_slopes", np.ones((1, H), np.float32), ValueError, r"\(batch, heads_q\)"),
]


@pytest.mark.parametrize("name, value, error, match", INVALID,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1].shape))}-{c[1].dtype}"
                              for c in INVALID])
def test_validation(name, value, error, match):
    with pytest.raises(error, match=match):
        _call(**{name: jnp.asarray(value)})()


def test_paged_terms_span_the_pages():
    """A paged cache's capacity is max_pages * page_size: a bias over page_size columns
    is refused with the expected shape."""
    case = LAYOUTS["paged_leftpad"]
    q, k_cache, v_cache, new, extra = make_inputs(case)
    with pytest.raises(ValueError, match=r"max_pages \* page_size.*24\)"):
        flashjax.flash_attention_with_kvcache(
            q, k_cache, v_cache, **new, cache_seqlens=jnp.asarray(case.seqlens, jnp.int32),
            **extra, bias=jnp.zeros((1, 1, SQ, case.page_size)))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged_leftpad"])
def test_gpu_routes_score_terms_to_pure_jax(layout):
    """On a CUDA GPU (implementation=None) calls with score terms run in JAX, never on the
    split-KV kernel, with the reference's answer."""
    check(LAYOUTS[layout], terms=terms(**ALL_TERMS))
