"""Sharded inputs on 4 and 8 host devices (subprocesses, since the device count is fixed
when jax starts): jax.jit over arrays sharded along batch and/or heads runs the kernels
on each shard with no collective (custom_partitioning, src/flashjax/_partitioning.py),
other shardings are correct (gathered), and shard_map runs the kernels per shard,
forward and gradients, including operands replicated across a sharded axis (their
gradients are summed over the shards)."""

import textwrap

import pytest

from helpers import run_on_host_devices

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


# jax.jit over sharded arrays: forward and gradients match the float64 reference for
# every mesh below. Batch and/or heads sharded ("local"): the outputs keep q's
# sharding and the compiled programs have no collective -- except the all-reduce that
# sums a replicated sinks' gradient over the shards. Sequence sharded ("ring"): the
# outputs keep it, collective-permutes and no all-gather.
JIT_SCRIPT = textwrap.dedent("""
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax import reference

    COLLECTIVE = r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()).reshape(2, n // 2), ("data", "model"))
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    normal = lambda *shape: jax.random.normal(next(ks), shape, jnp.float32)

    def check(got, want, what):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                   err_msg=what)

    def collectives(f, *args):
        return sorted(set(re.findall(COLLECTIVE, f.lower(*args).compile().as_text())))

    def case(spec, heads_q, heads_kv, want, kv_spec=None, **options):
        b, s = 4, 48
        q, k, v = normal(b, s, heads_q, 16), normal(b, s, heads_kv, 16), normal(b, s, heads_kv, 8)
        arrays = {}  # traced keyword arguments (the rest of `options` are static)
        if options.pop("sinks", False):
            arrays["sinks"] = jnp.linspace(-1.0, 1.0, heads_q, dtype=jnp.float32)
        if options.pop("segments", False):
            ids = jnp.repeat(jnp.arange(3, dtype=jnp.int32), s // 3)[None].repeat(b, 0)
            arrays.update(q_segment_ids=ids, kv_segment_ids=ids,
                          seqused_k=jnp.array([48, 40, 17, 33], jnp.int32))
        attn = lambda q, k, v, kw: flashjax.flash_attention(q, k, v, **options, **kw)
        ref = lambda q, k, v, kw: reference.attention(q, k, v, compute_dtype=jnp.float64,
                                                      **options, **kw)
        loss = lambda f: (lambda q, k, v, kw: jnp.sum(jnp.sin(f(q, k, v, kw))))
        kv_sharding = NamedSharding(mesh, spec if kv_spec is None else kv_spec)
        args = (jax.device_put(q, NamedSharding(mesh, spec)),
                jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding), arrays)
        what = f"{spec} {heads_q}/{heads_kv} {sorted(options)} {sorted(arrays)}"
        forward = jax.jit(attn)
        out = forward(*args)
        check(out, ref(q, k, v, arrays), what)
        if want in ("local", "ring"):
            padded = lambda p: tuple(p) + (None,) * (4 - len(p))
            assert padded(out.sharding.spec) == padded(spec), (what, out.sharding.spec)
        argnums = (0, 1, 2, 3) if "sinks" in arrays else (0, 1, 2)
        grad = jax.jit(jax.grad(loss(attn), argnums=argnums, allow_int=True))
        got = grad(*args)
        want = jax.grad(loss(ref), argnums=argnums, allow_int=True)(q, k, v, arrays)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            if g.dtype != jax.dtypes.float0:
                check(g, w, what + " grad")
        sums_sinks = "sinks" in arrays and (spec[0] or want == "ring")
        if want == "local":
            assert collectives(forward, *args) == [], (what, collectives(forward, *args))
            expected = ["all-reduce"] if sums_sinks else []
            assert collectives(grad, *args) == expected, (what, collectives(grad, *args))
        if want == "ring":
            permute = ["collective-permute"]
            assert collectives(forward, *args) == permute, (what, collectives(forward, *args))
            expected = ["all-reduce"] + permute if sums_sinks else permute
            assert collectives(grad, *args) == expected, (what, collectives(grad, *args))

    heads = n // 2  # the "model" axis
    case(P("data", None, "model", None), 2 * heads, heads, "local", causal=True)
    case(P("data", None, None, None), 4, 2, "local", window_size=(5, 3), softcap=4.0)
    case(P(None, None, "model", None), 2 * heads, heads, "local", sinks=True, causal=True)
    case(P("data", None, "model", None), 4 * heads, heads, "local", sinks=True, segments=True)
    case(P(("data", "model"), None, None, None) if n == 4 else P("data"), 4, 1, "local",
         causal=True)
    # the sequence over "model" (and batch over "data"): a ring, causal or not, sinks
    case(P("data", "model", None, None), 4, 2, "ring", causal=True)
    case(P(None, "model", None, None), 4, 4, "ring", sinks=True, softcap=2.0)
    # gathered (correct): one kv head with q heads sharded; a sequence-sharded call the
    # ring does not take (a window, segment ids)
    case(P(None, None, "model", None), 3 * n, 1, "gathered", kv_spec=P(), causal=True)
    case(P(None, "data", None, None), 4, 2, "gathered", window_size=(7, 0))
    case(P(None, "data", None, None), 4, 2, "gathered", causal=True, segments=True)

    # flash_attention_varlen with heads sharded: local, no collective
    cu = jnp.array([0, 5, 17, 40], jnp.int32)
    q, k, v = normal(40, 2 * heads, 16), normal(40, heads, 16), normal(40, heads, 16)
    packed = NamedSharding(mesh, P(None, "model", None))
    args = [jax.device_put(x, packed) for x in (q, k, v)]
    varlen = lambda q, k, v: flashjax.flash_attention_varlen(q, k, v, cu, cu, 23, 23,
                                                             causal=True)
    ref = lambda q, k, v: reference.attention_varlen(q, k, v, np.asarray(cu), np.asarray(cu),
                                                     23, 23, causal=True,
                                                     compute_dtype=jnp.float64)
    out = jax.jit(varlen)(*args)
    check(out, ref(q, k, v), "varlen")
    assert tuple(out.sharding.spec)[:2] == (None, "model"), out.sharding.spec
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(varlen(*a))), argnums=(0, 1, 2)))
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(ref(*a))), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grad(*args), want):
        check(g, w, "varlen grad")
    assert collectives(jax.jit(varlen), *args) == [], collectives(jax.jit(varlen), *args)
    assert collectives(grad, *args) == [], collectives(grad, *args)
    print("ok")
""")


def test_sharded_inputs_and_shard_map():
    run_on_host_devices(SCRIPT, 4)


@pytest.mark.parametrize("devices", [4, 8])
def test_jit_partitions_batch_and_heads(devices):
    run_on_host_devices(JIT_SCRIPT, devices)
