"""flashjax.ring_attention inside jax.shard_map on 4 and 8 host devices (subprocesses:
the device count is fixed when jax starts): a sequence sharded along one mesh axis
(and batch along another), contiguous and zigzag layouts, causal or not, GQA, sinks,
softcap, lse; forward and gradients (q, k, v, sinks) against the float64 reference of
the whole sequence; the compiled ring has collective-permutes and no all-gather."""

import textwrap

import pytest
from helpers import run_on_host_devices

SCRIPT = textwrap.dedent("""
    import re, itertools
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import flashjax
    from flashjax import reference, ring

    devices = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()).reshape(2, devices // 2), ("data", "seq"))
    n = devices // 2
    ks = iter(jax.random.split(jax.random.PRNGKey(1), 16))
    b, s, hq, hk = 2, 8 * n, 4, 2
    q = jax.random.normal(next(ks), (b, s, hq, 16), jnp.float32)
    k = jax.random.normal(next(ks), (b, s, hk, 16), jnp.float32)
    v = jax.random.normal(next(ks), (b, s, hk, 8), jnp.float32)
    sinks = jnp.linspace(-1.0, 1.0, hq, dtype=jnp.float32)
    rows, lse_rows = P("data", "seq", None, None), P("data", None, "seq")

    def check(got, want, what):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                   err_msg=what)

    loss = lambda out, lse: jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.cos(lse))
    for layout, causal, with_sinks in itertools.product(("contiguous", "zigzag"), (False, True),
                                                        (False, True)):
        options = dict(causal=causal, softcap=3.0)
        what = f"{layout} causal={causal} sinks={with_sinks}"
        order = (lambda x, axis=1: ring.zigzag(x, n, axis)) if layout == "zigzag" else \\
            (lambda x, axis=1: x)
        restore = (lambda x, axis=1: ring.unzigzag(x, n, axis)) if layout == "zigzag" else \\
            (lambda x, axis=1: x)

        def sharded(q, k, v, sinks):
            return jax.shard_map(
                lambda q, k, v, sinks: flashjax.ring_attention(
                    q, k, v, "seq", layout=layout, return_lse=True,
                    sinks=sinks if with_sinks else None, **options),
                mesh=mesh, in_specs=(rows, rows, rows, P()), out_specs=(rows, lse_rows))(
                    q, k, v, sinks)

        def whole(q, k, v, sinks):
            return reference.attention(q, k, v, compute_dtype=jnp.float64, return_lse=True,
                                       sinks=sinks if with_sinks else None, **options)

        args = (order(q), order(k), order(v), sinks)
        out, lse = jax.jit(sharded)(*args)
        want_out, want_lse = whole(q, k, v, sinks)
        check(restore(out), want_out, what)
        check(restore(lse, 2), want_lse, what + " lse")
        grad = jax.jit(jax.grad(lambda *a: loss(*sharded(*a)), argnums=(0, 1, 2, 3)))
        got = grad(*args)
        want = jax.grad(lambda *a: loss(*whole(*a)), argnums=(0, 1, 2, 3))(q, k, v, sinks)
        for name, g, w in zip("qkv", got[:3], want[:3]):
            check(restore(g), w, what + " d" + name)
        if with_sinks:
            check(got[3], want[3], what + " dsinks")
        hlo = jax.jit(sharded).lower(*args).compile().as_text()
        found = set(re.findall(r"(all-gather|collective-permute)", hlo))
        assert found == {"collective-permute"}, (what, found)
    print("ok")
""")


@pytest.mark.parametrize("devices", [4, 8])
def test_ring_attention_matches_the_whole_sequence(devices):
    run_on_host_devices(SCRIPT, devices)


def test_ring_attention_static_errors():
    import jax.numpy as jnp

    import flashjax

    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        flashjax.ring_attention(q, q, q, "seq", window_size=(4, 0))
    with pytest.raises(ValueError, match="layout"):
        flashjax.ring_attention(q, q, q, "seq", layout="spiral")
    with pytest.raises(ValueError, match="as many local query rows"):
        flashjax.ring_attention(q, q[:, :4], q[:, :4], "seq")


def test_zigzag_round_trip():
    import jax.numpy as jnp
    import numpy as np

    from flashjax import ring

    x = jnp.arange(2 * 24).reshape(2, 24)
    np.testing.assert_array_equal(ring.unzigzag(ring.zigzag(x, 3), 3), x)
    np.testing.assert_array_equal(ring.zigzag(jnp.arange(8)[None], 2, 1)[0], [0, 1, 6, 7, 2, 3, 4, 5])


def test_ring_bench_runs_on_host_devices():
    """benchmarks/ring_bench.py (the multi-GPU run's script) as a smoke test on 4 host
    devices: every implementation produces a time."""
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ring_bench.py"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(script), "--seqlen", "64", "--heads", "4", "2", "--dim", "16",
         "--dtype", "float32", "--iters", "1"],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("seqlen")]
    assert len(lines) == 14 and not any("n/a" in line for line in lines), result.stdout
