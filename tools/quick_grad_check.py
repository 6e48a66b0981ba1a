"""Fast GPU backward sanity check: flashjax's gradients (default and deterministic)
against the pure-JAX path in float32, at a few dense shapes (relative Frobenius errors).
Usage: python tools/quick_grad_check.py"""
import time

import jax
import jax.numpy as jnp
import numpy as np

import flashjax


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window): more key
    # blocks than SMs (persistent CTAs take several), fewer, and blocks without queries
    shapes = [(2, 2048, 2048, 16, 8, 128, True, (-1, -1)), (2, 2048, 2048, 16, 16, 128, False, (-1, -1)),
              (1, 3000, 3000, 8, 8, 64, True, (-1, -1)), (4, 1024, 1024, 8, 2, 64, False, (-1, -1)),
              (3, 700, 700, 4, 4, 128, True, (-1, -1)), (4, 256, 2048, 8, 8, 128, False, (128, 0))]
    worst = 0.0
    start = time.perf_counter()
    for b, s, sk, h, hk, d, causal, window in shapes:
        ks = jax.random.split(jax.random.PRNGKey(s + d), 4)
        q = jax.random.normal(ks[0], (b, s, h, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, sk, hk, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, sk, hk, d), jnp.bfloat16)
        g = jax.random.normal(ks[3], (b, s, h, d), jnp.float32)

        def grads(impl, det=False, dtype=jnp.bfloat16):
            def f(q, k, v, g):  # (g an argument: a captured constant is folded slowly)
                o = flashjax.flash_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                             causal=causal, window_size=window, deterministic=det,
                                             implementation=impl)
                return jnp.sum(o.astype(jnp.float32) * g)
            return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v, g)

        ref = grads("xla", dtype=jnp.float32)
        for det in (False, True):
            out = grads(None, det)
            errs = [rel(a, r) for a, r in zip(out, ref)]
            worst = max(worst, *errs)
            print(f"b{b} s{s}/{sk} h{h}/{hk} d{d} causal={causal} window={window} det={det}: "
                  f"dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    print("worst", worst, "OK" if worst < 2e-2 else "FAIL")


if __name__ == "__main__":
    main()
