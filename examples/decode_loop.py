"""Greedy decoding with a KV cache: a toy one-layer transformer whose jitted step
appends each new token's keys and values to donated caches (updated in place) and
attends over them with flashjax.flash_attention_with_kvcache. Prints tokens/s.

    python examples/decode_loop.py [--batch 4] [--prompt 16] [--steps 64] [--capacity 256]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import flashjax

VOCAB, MODEL, HEADS, KV_HEADS, HEAD_DIM, ROTARY_BASE = 256, 256, 8, 2, 32, 10000.0


def init_params(key):
    keys = jax.random.split(key, 6)
    dense = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(shape[0])
    return {
        "embed": jax.random.normal(keys[0], (VOCAB, MODEL), jnp.float32),
        "wq": dense(keys[1], (MODEL, HEADS * HEAD_DIM)),
        "wkv": dense(keys[2], (MODEL, 2 * KV_HEADS * HEAD_DIM)),
        "wo": dense(keys[3], (HEADS * HEAD_DIM, MODEL)),
        "mlp": dense(keys[4], (MODEL, MODEL)),
        "unembed": dense(keys[5], (MODEL, VOCAB)),
    }


def rotary_tables(length):
    inv = ROTARY_BASE ** (-jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def layer(params, tokens, k_cache, v_cache, cache_seqlens, cos, sin):
    """tokens (batch, n) -> logits (batch, n, vocab) and the caches with n rows appended."""
    batch, n = tokens.shape
    x = params["embed"][tokens]
    q = (x @ params["wq"]).reshape(batch, n, HEADS, HEAD_DIM)
    k, v = jnp.split((x @ params["wkv"]).reshape(batch, n, 2 * KV_HEADS, HEAD_DIM), 2, axis=2)
    attended, k_cache, v_cache = flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=False, causal=True)
    x = x + attended.reshape(batch, n, HEADS * HEAD_DIM) @ params["wo"]
    x = x + jax.nn.gelu(x @ params["mlp"])
    return x @ params["unembed"], k_cache, v_cache


@functools.partial(jax.jit, donate_argnums=(2, 3))
def prefill(params, prompt, k_cache, v_cache, cos, sin):
    seqlens = jnp.zeros((prompt.shape[0],), jnp.int32)
    logits, k_cache, v_cache = layer(params, prompt, k_cache, v_cache, seqlens, cos, sin)
    return jnp.argmax(logits[:, -1], axis=-1), k_cache, v_cache


@functools.partial(jax.jit, donate_argnums=(2, 3))
def decode_step(params, token, k_cache, v_cache, cache_seqlens, cos, sin):
    """One greedy step: the caches are donated, so the append happens in place."""
    logits, k_cache, v_cache = layer(params, token[:, None], k_cache, v_cache, cache_seqlens,
                                     cos, sin)
    return jnp.argmax(logits[:, -1], axis=-1), k_cache, v_cache


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--capacity", type=int, default=256)
    args = p.parse_args()
    if args.prompt + args.steps > args.capacity:
        p.error("--prompt + --steps must fit in --capacity")
    params = init_params(jax.random.key(0))
    cos, sin = rotary_tables(args.capacity)
    shape = (args.batch, args.capacity, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
    prompt = jax.random.randint(jax.random.key(1), (args.batch, args.prompt), 0, VOCAB)
    token, k_cache, v_cache = prefill(params, prompt, k_cache, v_cache, cos, sin)
    seqlens = jnp.full((args.batch,), args.prompt, jnp.int32)
    # Compile the step once (the timed loop then measures decoding only).
    token, k_cache, v_cache = decode_step(params, token, k_cache, v_cache, seqlens, cos, sin)
    seqlens = seqlens + 1
    generated = [token]
    start = time.perf_counter()
    for _ in range(args.steps - 1):
        token, k_cache, v_cache = decode_step(params, token, k_cache, v_cache, seqlens, cos, sin)
        seqlens = seqlens + 1
        generated.append(token)
    jax.block_until_ready(token)
    elapsed = time.perf_counter() - start
    tokens = jnp.stack(generated, axis=1)
    print(f"device: {jax.devices()[0].device_kind}; batch {args.batch}, prompt {args.prompt}, "
          f"{args.steps} steps")
    print(f"first sequence: {tokens[0, :16].tolist()} ...")
    print(f"{args.batch * (args.steps - 1) / elapsed:.0f} tokens/s "
          f"({elapsed / (args.steps - 1) * 1e3:.2f} ms per step)")


if __name__ == "__main__":
    main()
