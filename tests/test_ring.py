"""flashjax.ring_attention inside jax.shard_map on 4 and 8 host devices (subprocesses:
the device count is fixed when jax starts): a sequence sharded along one mesh axis
(and batch along another), contiguous and zigzag layouts, both strategies (ring,
all-gather), causal or not, sliding windows, GQA, sinks, softcap, lse; forward and
gradients (q, k, v, sinks) against the float64 reference of the whole sequence; the
compiled ring has collective-permutes and no all-gather, the all-gather strategy
gathers K/V only (never q) and reduce-scatters their gradients."""

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
    rng = np.random.default_rng(1)  # numpy: jax.random compiles a program per shape
    b, s, hq, hk = 2, 8 * n, 4, 2
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32))
               for shape in ((b, s, hq, 16), (b, s, hk, 16), (b, s, hk, 8)))
    sinks = jnp.linspace(-1.0, 1.0, hq, dtype=jnp.float32)
    rows, lse_rows = P("data", "seq", None, None), P("data", None, "seq")

    def check(got, want, what):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                   err_msg=what)

    loss = lambda out, lse: jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(jnp.cos(lse))
    # (causal, window): windows reach 0..2 neighbouring chunks of 8 (4 with zigzag)
    masks = ((False, (-1, -1)), (True, (-1, -1)), (False, (5, 3)), (True, (11, -1)),
             (False, (0, 9)))
    # A ring of 4 (8 devices): the ring strategy with each layout x mask, the all-gather
    # one (one local call on the gathered keys, masked by positions) with the first
    # three masks; sinks on every other case. A ring of 2 (4 devices): a few of them.
    combinations = [(layout, strategy, mask) for layout, strategy, mask in itertools.product(
        ("contiguous", "zigzag"), ("ring", "all_gather"), masks)
        if strategy == "ring" or mask in masks[:3]]
    cases = [(layout, strategy, mask, i % 2 == 1)
             for i, (layout, strategy, mask) in enumerate(combinations)]
    if devices == 4:
        cases = cases[::3]
    # The float64 reference of the whole sequence: out, lse and gradients from one jitted
    # program per `with_sinks`, each case's causal / window passed as a traced mask
    # (run eagerly per case, it cost about as much compilation as the ring programs).
    @jax.jit
    def whole(q, k, v, sinks, mask):
        attention = lambda q, k, v, sinks: reference.attention(
            q, k, v, compute_dtype=jnp.float64, return_lse=True, sinks=sinks, softcap=3.0,
            mask=mask)
        (out, lse), pull = jax.vjp(attention, q, k, v, sinks)
        return out, lse, pull(jax.grad(loss, argnums=(0, 1))(out, lse))

    for i, (layout, strategy, (causal, window), with_sinks) in enumerate(cases):
        options = dict(causal=causal, window_size=window, softcap=3.0)
        # the C++ kernels: implementation=None (the first case; its HLO shows None picks
        # them) also traces the pure-JAX branch, most of a case's compile time
        implementation = None if i == 0 else "cpu"
        what = (f"{layout} {strategy} causal={causal} window={window} sinks={with_sinks} "
                f"implementation={implementation}")
        order = (lambda x, axis=1: ring.zigzag(x, n, axis)) if layout == "zigzag" else \\
            (lambda x, axis=1: x)
        restore = (lambda x, axis=1: ring.unzigzag(x, n, axis)) if layout == "zigzag" else \\
            (lambda x, axis=1: x)

        def sharded(q, k, v, sinks):
            return jax.shard_map(
                lambda q, k, v, sinks: flashjax.ring_attention(
                    q, k, v, "seq", layout=layout, strategy=strategy, return_lse=True,
                    sinks=sinks if with_sinks else None, implementation=implementation,
                    **options),
                mesh=mesh, in_specs=(rows, rows, rows, P()), out_specs=(rows, lse_rows))(
                    q, k, v, sinks)

        args = (order(q), order(k), order(v), sinks)
        # one compilation gives out, lse (ring_attention's forward: the custom_vjp's
        # primal and forward rule are one function), the gradients and the HLO below
        def loss_and_outputs(*a):
            out, lse = sharded(*a)
            return loss(out, lse), (out, lse)

        grad = jax.jit(jax.value_and_grad(loss_and_outputs, argnums=(0, 1, 2, 3), has_aux=True))
        compiled = grad.lower(*args).compile()
        (_, (out, lse)), got = compiled(*args)
        mask = reference.visible_mask(s, s, causal, window)[None, None]
        want_out, want_lse, want = whole(q, k, v, sinks if with_sinks else None, mask)
        check(restore(out), want_out, what)
        check(restore(lse, 2), want_lse, what + " lse")
        for name, g, w in zip("qkv", got[:3], want[:3]):
            check(restore(g), w, what + " d" + name)
        if with_sinks:
            check(got[3], want[3], what + " dsinks")
        hlo = compiled.as_text()
        found = set(re.findall(r"(all-gather|collective-permute|reduce-scatter)", hlo))
        if strategy == "ring":
            assert found == {"collective-permute"}, (what, found)
        else:  # K/V (kv heads) gathered, never q; dK/dV reduce-scattered
            assert found == {"all-gather", "reduce-scatter"}, (what, found)
            heads = re.findall(r"= \\w+\\[\\d+,\\d+,(\\d+),\\d+\\][^ ]* all-gather", hlo)
            assert heads and set(heads) == {str(hk)}, (what, heads)
    print("ok")
""")


@pytest.mark.parametrize("devices", [4, 8])
def test_ring_attention_matches_the_whole_sequence(devices):
    run_on_host_devices(SCRIPT, devices)


def test_ring_attention_static_errors():
    import jax.numpy as jnp

    import flashjax

    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="strategy"):
        flashjax.ring_attention(q, q, q, "seq", strategy="broadcast")
    with pytest.raises(ValueError, match="layout"):
        flashjax.ring_attention(q, q, q, "seq", layout="spiral")
    with pytest.raises(ValueError, match="as many local query rows"):
        flashjax.ring_attention(q, q[:, :4], q[:, :4], "seq")


def test_strategy_rule():
    """strategy="auto": all-gather for GQA with >= 4 query heads per kv head and no
    sliding window; the ring otherwise (docs/sharding.md)."""
    from flashjax import _checks, ring

    config = lambda causal, window: _checks.make_config(16, None, causal, window, 0.0, False)
    assert ring.choose_strategy("auto", 1, config(True, (-1, -1))) == "ring"
    assert ring.choose_strategy("auto", 2, config(False, (-1, -1))) == "ring"
    assert ring.choose_strategy("auto", 4, config(True, (-1, -1))) == "all_gather"
    assert ring.choose_strategy("auto", 8, config(False, (128, 0))) == "ring"
    assert ring.choose_strategy("ring", 8, config(True, (-1, -1))) == "ring"
    assert ring.choose_strategy("all_gather", 1, config(True, (-1, -1))) == "all_gather"


def test_zigzag_round_trip():
    import jax.numpy as jnp
    import numpy as np

    from flashjax import ring

    x = jnp.arange(2 * 24).reshape(2, 24)
    np.testing.assert_array_equal(ring.unzigzag(ring.zigzag(x, 3), 3), x)
    np.testing.assert_array_equal(ring.zigzag(jnp.arange(8)[None], 2, 1)[0], [0, 1, 6, 7, 2, 3, 4, 5])


def test_ring_bench_runs_on_host_devices():
    """benchmarks/ring_bench.py (the multi-GPU run's script) as a smoke test on 4 host
    devices: every implementation produces a forward time (causal or not; the gradients
    of each strategy are checked above)."""
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "ring_bench.py"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, str(script), "--seqlen", "64", "--heads", "4", "2", "--dim", "16",
         "--dtype", "float32", "--iters", "1", "--mode", "fwd"],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("seqlen")]
    assert len(lines) == 12 and not any("n/a" in line for line in lines), result.stdout
