"""Adversarial KV-cache metadata through every GPU path of flash_attention_with_kvcache
(split-KV with forced and automatic splits, float8 caches read by the split-KV kernel,
SIMT, the prefill route), for
`compute-sanitizer --tool memcheck python tools/sanitize_kvcache.py`: the sanitizer must
report 0 errors (results are documented as clamped; no read or write leaves the cache)."""

import jax
import jax.numpy as jnp

import flashjax

BIG = 2 ** 31 - 1
SEQLENS = ([-7, 15, BIG], [16, 0, 3], [-BIG - 1, BIG, 8])
LEFTPADS = (None, [-3, 40, 1], [BIG, -BIG - 1, 15])


def run(dtype, head_dim, seqlen_q, num_splits, implementation, cache_dtype=None):
    """cache_dtype: a float8 dtype for the caches (descales per sequence and kv head)."""
    key = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *s: jax.random.normal(next(key), s, dtype)
    q = normal(3, seqlen_q, 8, head_dim)
    k_new, v_new = normal(3, 2, 2, head_dim), normal(3, 2, 2, head_dim)
    pages, contiguous = normal(12, 4, 2, head_dim), normal(4, 16, 2, head_dim)
    descales = {}
    if cache_dtype is not None:
        pages, contiguous = pages.astype(cache_dtype), contiguous.astype(cache_dtype)
        descales = dict(k_descale=jnp.full((3, 2), 0.5, jnp.float32),
                        v_descale=jnp.full((3, 2), 2.0, jnp.float32))
    table = jnp.asarray([[0, 1, 99, -5], [2, 3, 4, 5], [6, 7, 8, BIG]], jnp.int32)
    batch_idx = jnp.asarray([-1, 3, BIG], jnp.int32)
    for seqlens in SEQLENS:
        n = jnp.asarray(seqlens, jnp.int32)
        for leftpad in LEFTPADS:
            left = None if leftpad is None else jnp.asarray(leftpad, jnp.int32)
            for causal in (False, True):
                common = dict(cache_seqlens=n, cache_leftpad=left, causal=causal,
                              num_splits=num_splits, sinks=jnp.zeros((8,), jnp.float32),
                              implementation=implementation, **descales)
                jax.block_until_ready(flashjax.flash_attention_with_kvcache(
                    q, pages, pages, k_new, v_new, page_table=table, **common))
                jax.block_until_ready(flashjax.flash_attention_with_kvcache(
                    q, contiguous, contiguous, k_new, v_new, cache_batch_idx=batch_idx, **common))
                jax.block_until_ready(flashjax.flash_attention_with_kvcache(
                    q, contiguous[:3], contiguous[:3], **common))


if __name__ == "__main__":
    for path in ("cuda", "cuda:simt"):
        for dtype, head_dim in ((jnp.bfloat16, 128), (jnp.float32, 40)):
            for seqlen_q in (1, 40):  # 40 x 4 packed rows: the prefill route
                for num_splits in (1, 3):
                    run(dtype, head_dim, seqlen_q, num_splits, path)
        print(f"path {path}: done", flush=True)
    for dtype, head_dim, cache_dtype in ((jnp.bfloat16, 128, jnp.float8_e4m3fn),
                                         (jnp.float16, 64, jnp.float8_e5m2)):
        for num_splits in (1, 3):
            run(dtype, head_dim, 1, num_splits, "cuda", cache_dtype)
    print("float8 caches: done", flush=True)
