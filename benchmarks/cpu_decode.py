"""CPU decoding in one process: flash_attention_with_kvcache on the C++ kernels, on
flashjax's pure-JAX path (implementation="xla") and jax.nn.dot_product_attention on
the cache as a dense key sequence (issue 28's CPU target).

One query row per sequence, the cache full (cache_seqlens = its rows); each step's
query is the previous step's output, timed as a jitted loop of LOOP dependent steps
(one host-timed call through JAX is ~50-100 us of dispatch), per step, the median of
--iters runs. The in-process float32 GEMM rate (flashjax.bench_core.gemm_gflops) is printed
before and after: on a shared machine it says how loaded the run was.

    PYTHONPATH=... python benchmarks/cpu_decode.py [--dtype float32 bfloat16] [--iters 5]

An A/B of two CPU builds on a noisy host: processes of their own, alternating builds,
several rounds, and the ratio to jax.nn within each process (benchmarks/NOTES.md,
"Twenty-seventh session"):

    for r in 1 2 3 4 5; do for b in /tmp/fj_a /tmp/fj_b; do
      PYTHONPATH=$b python benchmarks/cpu_decode.py --dtype bfloat16 --impls flashjax jax.nn
    done; done
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import flashjax
from flashjax import bench_core

LOOP = 20
IMPLS = ("flashjax", "flashjax-xla", "jax.nn")
# (batch, cached tokens, heads_q, heads_kv, head_dim): issue 28's CPU shapes
SHAPES = ((1, 4096, 4, 2, 64), (1, 4096, 32, 8, 128))


def steps(name, seqlens):
    """step(q, k_cache, v_cache) -> out like q."""
    if name == "jax.nn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v)
    implementation = {"flashjax": None, "flashjax-xla": "xla"}[name]
    return lambda q, k, v: flashjax.flash_attention_with_kvcache(
        q, k, v, cache_seqlens=seqlens, implementation=implementation)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["float32"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    args = p.parse_args()
    print(f"flashjax {flashjax.__file__}; GEMM {bench_core.gemm_gflops():.1f} GFLOP/s", flush=True)
    for dtype in args.dtype:
        for batch, cache, hq, hkv, d in SHAPES:
            kq, kk, kv = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(kq, (batch, 1, hq, d), dtype)
            k_cache = jax.random.normal(kk, (batch, cache, hkv, d), dtype)
            v_cache = jax.random.normal(kv, (batch, cache, hkv, d), dtype)
            seqlens = jnp.full((batch,), cache, jnp.int32)
            print(f"b={batch} cache={cache} h={hq}/{hkv} d={d} {dtype}", flush=True)
            for name in args.impls:
                step = steps(name, seqlens)
                loop = jax.jit(lambda q, k, v, step=step: jax.lax.fori_loop(
                    0, LOOP, lambda _, q: step(q, k, v).astype(q.dtype), q))
                ms = bench_core.median_ms(loop, (q, k_cache, v_cache), 1, args.iters) / LOOP
                print(f"  {name:13s} {ms:8.3f} ms/step", flush=True)
    print(f"GEMM {bench_core.gemm_gflops():.1f} GFLOP/s", flush=True)


if __name__ == "__main__":
    main()
