"""One backward (fwd + grad) of one implementation at one shape, for ncu.

    python3 benchmarks/bwd_profile.py IMPL D SEQLEN CAUSAL [REPEAT]
IMPL: flashjax | fa3 | cudnn. Shapes as the FA3 paper's (batch * seqlen = 16k,
heads * d = 2048), bf16. Run under ncu with a kernel filter; the program runs the
gradient REPEAT times (default 2: the first includes autotuning / first-use work).
"""
import sys

import jax
import jax.numpy as jnp


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


def main():
    impl, d, s, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "causal"
    repeat = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    b, h = 16384 // s, 2048 // d
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in keys)
    attn = attention(impl)

    @jax.jit
    def grads(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, causal), q, k, v)
        return vjp(do.astype(out.dtype))

    for _ in range(repeat):
        jax.block_until_ready(grads(q, k, v, do))


if __name__ == "__main__":
    main()
