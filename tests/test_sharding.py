"""Sharded inputs on 4 host devices (a subprocess, since the device count is fixed when
jax starts): jit over sharded arrays is correct (XLA gathers the operands: the FFI call
has no partitioning rule), and shard_map runs the kernels per shard, forward and
gradients, including operands replicated across a sharded axis (their gradients are
summed over the shards)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax import reference

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (4, 64, 4, 16), jnp.float32)
    k = jax.random.normal(ks[1], (4, 64, 2, 16), jnp.float32)
    v = jax.random.normal(ks[2], (4, 64, 2, 16), jnp.float32)
    spec = P("data", None, "model", None)  # batch over "data", heads over "model"
    qs, kss, vs = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    attn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True)
    ref = lambda q, k, v: reference.attention(q, k, v, causal=True, compute_dtype=jnp.float64)
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))

    def check(got, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    check(jax.jit(attn)(qs, kss, vs), ref(q, k, v))
    grads = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(qs, kss, vs)
    for g, w in zip(grads, jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
        check(g, w)
    sharded = jax.jit(jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    check(sharded(qs, kss, vs), ref(q, k, v))
    sharded_grad = jax.jit(jax.shard_map(jax.grad(loss(attn), argnums=(0, 1, 2)), mesh=mesh,
                                         in_specs=(spec,) * 3, out_specs=(spec,) * 3))
    for g, w in zip(sharded_grad(qs, kss, vs), jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)):
        check(g, w)

    # Query rows sharded, k, v and sinks replicated (non-causal): dk, dv and dsinks
    # are sums over the query shards.
    s = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
    attn_s = lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s)
    ref_s = lambda q, k, v, s: reference.attention(q, k, v, sinks=s, compute_dtype=jnp.float64)
    loss_s = lambda f: (lambda q, k, v, s: jnp.sum(jnp.sin(f(q, k, v, s))))
    rows = P(None, ("data", "model"), None, None)
    grad_s = jax.jit(jax.shard_map(jax.grad(loss_s(attn_s), argnums=(0, 1, 2, 3)), mesh=mesh,
                                   in_specs=(rows, P(), P(), P()), out_specs=(rows, P(), P(), P())))
    for g, w in zip(grad_s(q, k, v, s), jax.grad(loss_s(ref_s), argnums=(0, 1, 2, 3))(q, k, v, s)):
        check(g, w)
    print("ok")
""")


def test_sharded_inputs_and_shard_map():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               JAX_ENABLE_X64="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
