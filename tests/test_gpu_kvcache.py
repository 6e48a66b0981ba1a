"""flash_attention_with_kvcache on the GPU: the split-KV kernel (fp16/bf16: decoding
blocks, GQA-packed, forced and automatic split counts, every cache layout), the SIMT
path (float32, and implementation="cuda:simt"), and the prefill route through the
dense kernels, against the float64 reference of kvcache_helpers.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import use_implementation
from kvcache_helpers import KVCase, check, make_inputs
from nonfinite_helpers import check_kvcache_nonfinite

pytestmark = pytest.mark.gpu

D128 = dict(head_dim=128, head_dim_v=128)
D64 = dict(head_dim=64, head_dim_v=64)
GPU_CASES = [
    # decoding, GQA 32/8 packed: 4 rows of 16
    KVCase(batch=2, heads_q=32, heads_kv=8, seqlens=(700, 1000), capacity=1024, seqlen_new=1,
           causal=True, dtype="bfloat16", **D128),
    # 3 queries x 8 heads: 24 packed rows over two 16-row tiles (a tile wraps)
    KVCase(seqlen_q=3, heads_q=8, heads_kv=1, seqlens=(300, 5, 509), capacity=512, seqlen_new=3,
           causal=True, rotary_dim=32, dtype="float16", **D64),
    KVCase(page_size=16, num_pages=110, capacity=512, seqlens=(400, 17, 0), seqlen_new=2,
           window_size=(100, 0), sinks=True, rotary_dim=64, interleaved=False,
           dtype="bfloat16", **D128),
    KVCase(page_size=1, num_pages=700, capacity=200, seqlens=(150, 199, 3), seqlen_new=1,
           dtype="bfloat16", poison=True, **D64),
    KVCase(page_size=64, num_pages=40, capacity=640, seqlens=(600, 64, 1), seqlen_new=1,
           leftpad=(70, 0, 0), softcap=10.0, dtype="bfloat16", poison=True, **D128),
    KVCase(page_size=256, num_pages=10, capacity=768, seqlens=(600, 100, 767), seqlen_new=2,
           leftpad=(50, 0, 700), causal=True, dtype="bfloat16", **D128),
    KVCase(batch_cache=5, capacity=300, seqlens=(250, 0, 299), seqlen_new=2, leftpad=(5, 0, 100),
           sinks=True, causal=True, dtype="bfloat16", poison=True, **D128),
    KVCase(heads_q=4, heads_kv=4, head_dim=96, head_dim_v=64, capacity=256,
           seqlens=(255, 7, 128), seqlen_new=1, dtype="float16"),  # padded bucket, MHA
    KVCase(seqlens=(100, 3, 200), capacity=256, seqlen_new=2, causal=True, dtype="float32",
           **D64),  # SIMT
    # prefill blocks (> 64 packed rows): dense kernels, in place and gathered
    KVCase(seqlen_q=40, heads_q=8, heads_kv=2, seqlens=(300, 0, 90), capacity=512,
           seqlen_new=40, causal=True, rotary_dim=32, dtype="bfloat16", **D128),
    KVCase(seqlen_q=40, heads_q=8, heads_kv=2, page_size=16, num_pages=100, capacity=512,
           seqlens=(300, 0, 90), seqlen_new=40, causal=True, dtype="bfloat16", **D128),
]


@pytest.mark.parametrize("case", GPU_CASES, ids=map(str, GPU_CASES))
def test_gpu_kvcache(case):
    check(case)


# (20 and 128: the combine kernel's other split-count buckets; 128 leaves most splits
# without a key)
@pytest.mark.parametrize("num_splits", [1, 3, 7, 20, 128, 0])
@pytest.mark.parametrize("case", GPU_CASES[:3], ids=map(str, GPU_CASES[:3]))
def test_gpu_forced_splits(case, num_splits):
    check(case, num_splits=num_splits)


@pytest.mark.parametrize("case", GPU_CASES[:3], ids=map(str, GPU_CASES[:3]))
def test_gpu_simt_path(case, monkeypatch):
    use_implementation(monkeypatch, "cuda:simt")
    check(case)


@pytest.mark.parametrize("cached", [0, 300, 472], ids=lambda n: f"cached{n}")
def test_gpu_prefill_with_int_cache_seqlens(cached):
    """A Python int cache_seqlens: the prefill route reads the cache's first rows through
    the dense kernels' uniform path (472 + 40 new rows fill the cache)."""
    check(KVCase(seqlen_q=40, heads_q=8, heads_kv=2, seqlens=(cached,) * 3, capacity=512,
                 seqlen_new=40, causal=True, dtype="bfloat16", **D128), int_seqlens=True)


def test_gpu_long_cache_many_splits():
    """64k cached keys of one sequence over the automatic split count."""
    check(KVCase(batch=1, heads_q=8, heads_kv=1, seqlens=(65000,), capacity=65536,
                 seqlen_new=1, causal=True, dtype="bfloat16", **D128))


def test_gpu_donated_decode_step_is_in_place_and_captured():
    """A jitted decoding step with donated caches aliases them (no copy, no second
    cache in temporaries) and repeats exactly under XLA's command buffers."""
    case = KVCase(batch=2, heads_q=32, heads_kv=8, seqlens=(700, 1000), capacity=1024,
                  seqlen_new=1, dtype="bfloat16", **D128)
    q, k_cache, v_cache, new, _ = make_inputs(case)
    step = jax.jit(lambda q, kc, vc, k, v, n: flashjax.flash_attention_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=n), donate_argnums=(1, 2))
    n = jnp.asarray(case.seqlens, jnp.int32)
    analysis = step.lower(q, k_cache, v_cache, new["k"], new["v"], n).compile().memory_analysis()
    assert analysis.alias_size_in_bytes >= k_cache.nbytes + v_cache.nbytes
    assert analysis.temp_size_in_bytes < k_cache.nbytes // 4
    out1, kc, vc = step(q, k_cache.copy(), v_cache.copy(), new["k"], new["v"], n)
    out2, _, _ = step(q, k_cache.copy(), v_cache.copy(), new["k"], new["v"], n)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@pytest.mark.parametrize("implementation", ["cuda", "cuda:simt"])
@pytest.mark.parametrize("dtype, head_dim, seqlen_q, causal",
                         [("bfloat16", 128, 1, False), ("float16", 64, 3, True),
                          ("float32", 32, 2, True)])
def test_gpu_nonfinite(dtype, head_dim, seqlen_q, causal, implementation, monkeypatch):
    """docs/api.md, "Non-finite values": cache rows past cache_seqlens are never read; a
    NaN value reaches its column of its own entry only (nonfinite_helpers)."""
    use_implementation(monkeypatch, implementation)
    check_kvcache_nonfinite(device=jax.devices("gpu")[0], dtype=dtype, head_dim=head_dim,
                            seqlen_q=seqlen_q, causal=causal)
