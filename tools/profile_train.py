"""Where a training step's attention time goes, per kernel: a jitted loop of dependent
forward+backward steps (as ../shared/peers/peers_gpu.py times them) traced with JAX's
profiler, for flashjax and its peers, on the FA3 paper's shapes (batch * seqlen = 16k,
heads * d = 2048, bf16).

    python tools/profile_train.py D SEQLEN causal|full [IMPL...]
    python tools/profile_train.py --once D SEQLEN causal|full IMPL [fwd]   # for ncu

IMPL: flashjax | fa3 (flash-attn3-jax, from the peers' wheels) | cudnn (default: all);
with --once also flashjax_fp8 (float8_e4m3fn q, k, v, forward only: pass fwd).
Prints per implementation the GPU busy time per step and each kernel's count and mean
time per step (profile_decode.summarize). --once runs two plain steps, no trace: run it
under ncu with a kernel filter (benchmarks/device_varlen.sh bwdncu), the second step's
kernels are past first-use work.
"""
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import profile_decode

LOOP = 10


def attention(impl):
    if impl == "flashjax":
        import flashjax
        return lambda q, k, v, causal: flashjax.flash_attention(q, k, v, causal=causal)
    if impl == "fa3":
        import flash_attn3_jax
        return lambda q, k, v, causal: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)
    if impl == "cudnn":
        return lambda q, k, v, causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")
    raise SystemExit(f"unknown impl {impl}")


def train_loop(attn, causal):
    def grads(q, k, v, do):
        def loss(q, k, v):
            return jnp.sum(attn(q, k, v, causal).astype(jnp.float32) * do.astype(jnp.float32))
        dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return dq.astype(q.dtype), dk[0, 0, 0, 0].astype(jnp.float32) + dv[0, 0, 0, 0]

    def prog(q, k, v, do):
        def body(_, carry):
            x, acc = carry
            dq, keep = grads(x, k, v, do)
            return dq, acc + keep
        return jax.lax.fori_loop(0, LOOP, body, (q, jnp.float32(0)))
    return jax.jit(prog)


def inputs(d, s):
    """The FA3 paper's shapes: batch * seqlen = 16k, heads * d = 2048, bf16."""
    b, h = 16384 // s, 2048 // d
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)


def once(d, s, mask, impl, mode="train"):
    causal = mask == "causal"
    args = inputs(int(d), int(s))
    if impl == "flashjax_fp8":  # (cast before the step: ncu sees the kernel, not the casts)
        impl = "flashjax"
        args = tuple(x.astype(jnp.float8_e4m3fn) for x in args[:3]) + args[3:]
    attn = attention(impl)
    if mode == "fwd":
        step = jax.jit(lambda q, k, v, do: attn(q, k, v, causal))
    else:
        step = jax.jit(lambda q, k, v, do: jax.vjp(
            lambda q, k, v: attn(q, k, v, causal), q, k, v)[1](do))
    for _ in range(2):
        jax.block_until_ready(step(*args))


def main(d="128", s="2048", mask="causal", *impls):
    if d == "--once":
        return once(s, mask, *impls)
    d, s, causal = int(d), int(s), mask == "causal"
    q, k, v, do = inputs(d, s)
    for impl in impls or ("flashjax", "fa3", "cudnn"):
        try:
            step = train_loop(attention(impl), causal)
            for _ in range(3):
                jax.block_until_ready(step(q, k, v, do))
            start = time.perf_counter()
            jax.block_until_ready(step(q, k, v, do))
            print(f"{impl} d{d} s{s} {mask}: {(time.perf_counter() - start) / LOOP * 1e3:.3f} ms "
                  "per fwd+bwd step (one host-timed loop)", flush=True)
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir):
                    jax.block_until_ready(step(q, k, v, do))
                profile_decode.summarize(trace_dir, LOOP)
        except Exception as e:  # noqa: BLE001 -- one implementation failing is a result
            print(f"{impl}: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
