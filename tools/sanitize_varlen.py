"""Adversarial varlen / seqused / segment-id / position metadata through every GPU kernel path,
forward and backward, for `compute-sanitizer --tool memcheck python tools/sanitize_varlen.py`:
the sanitizer must report 0 errors (the results themselves are documented as clamped)."""

import jax
import jax.numpy as jnp

import flashjax

BAD_METADATA = [  # (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen)
    ([0, 50, 20, 90], [0, 40, 10, 80], None, None, 64),
    ([-5, 30, 1000, 2 ** 31 - 1], [-100, 60, 70, 5000], None, None, 64),
    ([0, 30, 60, 90], [0, 30, 60, 80], [100, -3, 2 ** 31 - 1], [40, 5, 1000], 64),
    ([0, 90, 90, 90], [0, 80, 80, 80], None, None, 16),
    ([2 ** 31 - 1, -2 ** 31, 7, 0], [0, 0, 0, 0], [-1, -1, -1], None, 300),
]


# (q_offset, kv_offset): diagonals far outside every tile, both ways (the int32 extremes)
BAD_POSITIONS = [(2 ** 31 - 1, 0), (-2 ** 31, 0), (0, 2 ** 31 - 1), ([5, -2 ** 31, 2 ** 31 - 1], 7)]


def run_varlen(dtype, head_dim, deterministic, implementation):
    q = jax.random.normal(jax.random.key(0), (90, 4, head_dim), dtype)
    k = jax.random.normal(jax.random.key(1), (80, 2, head_dim), dtype)
    for cu_q, cu_k, used_q, used_k, max_len in BAD_METADATA:
        meta = [None if x is None else jnp.asarray(x, jnp.int32) for x in (cu_q, cu_k, used_q, used_k)]
        for causal in (False, True):
            f = lambda q, k, v: flashjax.flash_attention_varlen(
                q, k, v, meta[0], meta[1], max_len, max_len, seqused_q=meta[2], seqused_k=meta[3],
                causal=causal, sinks=jnp.zeros((4,), jnp.float32),
                deterministic=deterministic, implementation=implementation).astype(jnp.float32).sum()
            jax.block_until_ready(jax.grad(f, argnums=(0, 1, 2))(q, k, k))


def run_dense(dtype, head_dim, deterministic, implementation):
    q = jax.random.normal(jax.random.key(0), (3, 100, 4, head_dim), dtype)
    used = jnp.asarray([2 ** 31 - 1, -7, 50], jnp.int32)
    ids = jax.random.randint(jax.random.key(2), (3, 100), -2 ** 31, 2 ** 31 - 1, jnp.int32)
    for q_ids, kv_ids in ((ids, ids[:, ::-1]), (None, None)):  # segments; seqused alone
        f = lambda q, k, v: flashjax.flash_attention(
            q, k, v, causal=True, seqused_q=used, seqused_k=used[::-1], q_segment_ids=q_ids,
            kv_segment_ids=kv_ids, deterministic=deterministic,
            implementation=implementation).astype(jnp.float32).sum()
        jax.block_until_ready(jax.grad(f, argnums=(0, 1, 2))(q, q, q))
    for q_offset, kv_offset in BAD_POSITIONS:
        for window in ((-1, 0), (3, 2), (-1, -1), (5, -1)):
            f = lambda q, k, v: flashjax.flash_attention(
                q, k, v, window_size=window, q_offset=jnp.asarray(q_offset, jnp.int32),
                kv_offset=kv_offset, deterministic=deterministic,
                implementation=implementation).astype(jnp.float32).sum()
            jax.block_until_ready(jax.grad(f, argnums=(0, 1, 2))(q, q, q))


if __name__ == "__main__":
    for path in ("cuda", "cuda:mma", "cuda:simt"):  # cuda: Hopper on an H100
        for dtype, head_dim in ((jnp.bfloat16, 128), (jnp.float16, 64), (jnp.float32, 40)):
            for deterministic in (False, True):
                run_varlen(dtype, head_dim, deterministic, path)
                run_dense(dtype, head_dim, deterministic, path)
        print(f"path {path}: done", flush=True)
