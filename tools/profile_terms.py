"""A few forward calls of one score-terms variant of flashjax.bench_terms (issue 27),
for Nsight Compute next to the plain call:

    ncu -k regex:hopper_forward_kernel --launch-skip 1 -c 1 \\
        python tools/profile_terms.py VARIANT [SEQLEN] [fwd|fwdbwd]

VARIANT: a name of bench_terms.VARIANTS (none, causal, alibi, bias, mask-dense,
mask-causal, mask-blocks, dropout); the FA3 shapes' batch and heads (16k tokens,
16 heads of 128), bfloat16; fwdbwd: the gradient of q, k, v too (-k
regex:hopper_key_kernel profiles the backward's key kernel)."""

import sys
import types

import jax
import jax.numpy as jnp

from flashjax import bench_terms


def main(name: str, seqlen: str = "8192", mode: str = "fwd") -> None:
    s = int(seqlen)
    batch, heads, head_dim = max(16384 // s, 1), 16, bench_terms.GPU_HEAD_DIM
    case = types.SimpleNamespace(seqlen_q=s, seqlen_k=s, heads=heads, batch=batch,
                                 head_dim=head_dim)
    q, k, v = (jax.random.normal(key, (batch, s, heads, head_dim), jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 3))
    fn, operands, _ = bench_terms.VARIANTS[name].build(case, q)
    step = jax.jit(fn)
    if mode == "fwdbwd":
        step = jax.jit(jax.grad(lambda q, k, v, *x: fn(q, k, v, *x).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))
    for _ in range(3):
        out = step(q, k, v, *operands)
    jax.block_until_ready(out)
    print(name, s, "done")


if __name__ == "__main__":
    main(*sys.argv[1:])
