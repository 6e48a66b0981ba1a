"""Bias, mask, ALiBi and dropout forward + backward (dbias included) through every GPU
kernel path at small, odd shapes, for `compute-sanitizer --tool memcheck python
tools/sanitize_terms.py`: the sanitizer must report 0 errors. Covers owned and shared
dbias entries, masks with empty tiles and rows, block-sparse masks, seqused, default and deterministic
backward, bf16 d128 / d64 and float32 d40."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import flashjax

B, SQ, SK, HQ, HK = 2, 130, 199, 4, 2
PATHS = ("cuda", "cuda:mma", "cuda:simt")


def case_options(key):
    rng = np.random.default_rng(0)
    mask = rng.random((B, 1, SQ, SK)) < 0.5
    mask[:, :, :, 64:128] = False  # whole empty tiles
    mask[:, :, 7, :] = False       # a row that sees nothing
    # Block-sparse on every head (the Hopper backward skips the query tiles a key
    # block does not see: MaskedTiles); no bias, so the lean mask variant.
    blocks = rng.random((B, HQ, 3, 2)) < 0.5
    sparse = np.repeat(np.repeat(blocks, 64, 2), 128, 3)[:, :, :SQ, :SK]
    return [
        dict(bias=jax.random.normal(key, (B, HQ, SQ, SK)), causal=True),
        dict(bias=jax.random.normal(key, (1, 1, SQ, SK)), mask=jnp.asarray(mask)),
        dict(alibi_slopes=jnp.linspace(0.1, 0.5, HQ, dtype=jnp.float32), window_size=(40, 9),
             seqused_k=jnp.array([150, 77], jnp.int32)),
        dict(dropout_rate=0.3, dropout_key=key, bias=jax.random.normal(key, (1, HK, SQ, SK)),
             softcap=5.0),
        dict(mask=jnp.asarray(sparse), dropout_rate=0.1, dropout_key=key),
    ]


def main(only=()):
    """only: case indices to run (all when empty)."""
    for dtype, d in ((jnp.bfloat16, 128), (jnp.bfloat16, 64), (jnp.float32, 40)):
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (B, SQ, HQ, d), dtype)
        k = jax.random.normal(keys[1], (B, SK, HK, d), dtype)
        v = jax.random.normal(keys[2], (B, SK, HK, d), dtype)
        for n, options in enumerate(case_options(keys[3])):
            if only and n not in only:
                continue
            bias = options.pop("bias", None)
            for path in PATHS:
                for deterministic in (False, True):
                    loss = lambda q, k, v, bias: flashjax.flash_attention(
                        q, k, v, bias=bias, deterministic=deterministic, implementation=path,
                        **options).astype(jnp.float32).sum()
                    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
                    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)
                    jax.block_until_ready(grads)
                    print(dtype.__name__, d, n, path, deterministic, "ok", flush=True)


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]))
