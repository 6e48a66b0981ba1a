"""Dense forward + backward through every GPU kernel path at small, odd shapes, for
`compute-sanitizer --tool memcheck python tools/sanitize_dense.py`: the sanitizer must
report 0 errors. Covers causal / window / sinks / GQA, bf16 d128 and d64, fp16 d96,
float32 d40, the wide kernel (d192, d256), default and deterministic backward, the
Hopper forward's schedules over more than one round of tiles, and its float8 kernels
(forward only: d128 GQA-packed and not, d256; keys off the 32-key blocks of V^T, a NaN
in a hidden key's V for the recompute)."""

import jax
import jax.numpy as jnp

import flashjax

CASES = [  # (dtype, head_dim, seqlen_q, seqlen_k, heads_q, heads_kv, options)
    (jnp.bfloat16, 128, 200, 333, 4, 2, dict(causal=True)),
    (jnp.bfloat16, 128, 256, 256, 2, 2, dict(window_size=(50, 20))),
    (jnp.bfloat16, 64, 130, 70, 6, 2, dict(causal=True, sinks=jnp.zeros((6,), jnp.float32))),
    (jnp.float16, 96, 90, 190, 2, 1, dict(softcap=20.0)),
    (jnp.float32, 40, 65, 65, 2, 2, dict(causal=True)),
    # dK / dV TMA stores: boxes past seqlen_k (30 keys), the wide kernel (d192, d256)
    (jnp.bfloat16, 128, 40, 30, 2, 2, dict()),
    (jnp.bfloat16, 192, 70, 90, 2, 1, dict(causal=True)),
    (jnp.float16, 256, 100, 150, 2, 2, dict(window_size=(30, 5))),
]
# More query tiles than SMs (the Hopper forward's dynamic schedule: head dim 64 causal,
# windows), batch 2, with a NaN in one query row (the recompute's walk of the tiles a
# CTA took).
MULTI_ROUND = [
    (jnp.bfloat16, 64, 900, 900, 15, 5, dict(causal=True)),
    (jnp.bfloat16, 128, 1100, 1100, 36, 12, dict(window_size=(300, 0))),
]
NAN_ROW = 70
FLOAT8 = [  # (head_dim, seqlen_q, seqlen_k, heads_q, heads_kv, options)
    (128, 200, 333, 4, 2, dict(causal=True)),
    (128, 16, 301, 8, 2, dict(causal=True)),  # GQA-packed rows
    (256, 130, 97, 2, 2, dict(window_size=(40, 0), sinks=jnp.zeros((2,), jnp.float32))),
]


def main():
    for multi_round, (dtype, d, sq, sk, hq, hk, options) in (
            [(False, c) for c in CASES] + [(True, c) for c in MULTI_ROUND]):
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (2, sq, hq, d), dtype)
        if multi_round:
            q = q.at[0, NAN_ROW, 1, 0].set(jnp.nan)
        k = jax.random.normal(keys[1], (2, sk, hk, d), dtype)
        v = jax.random.normal(keys[2], (2, sk, hk, d), dtype)
        for deterministic in (False, True):
            loss = lambda q, k, v: flashjax.flash_attention(
                q, k, v, deterministic=deterministic, **options).astype(jnp.float32).sum()
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
            jax.block_until_ready(grads)
            print(dtype.__name__, d, options.keys(), deterministic, "ok", flush=True)
    for d, sq, sk, hq, hk, options in FLOAT8:
        keys = jax.random.split(jax.random.key(1), 3)
        f8 = lambda key, shape: jax.random.normal(key, shape).astype(jnp.float8_e4m3fn)
        q, k, v = f8(keys[0], (2, sq, hq, d)), f8(keys[1], (2, sk, hk, d)), f8(keys[2], (2, sk, hk, d))
        v = v.at[1, sk - 1, 0, 3].set(jnp.nan)  # (hidden from the causal rows before the last)
        out = jax.jit(lambda q, k, v: flashjax.flash_attention(
            q, k, v, q_descale=jnp.float32(0.5), k_descale=jnp.float32(-0.25), **options))(q, k, v)
        jax.block_until_ready(out)
        print("float8_e4m3fn", d, options.keys(), "ok", flush=True)


if __name__ == "__main__":
    main()
