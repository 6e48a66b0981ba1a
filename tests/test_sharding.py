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
    rng = np.random.default_rng(0)  # numpy: jax.random compiles a program per shape
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32))
               for shape in ((4, 64, 4, 16), (4, 64, 2, 16), (4, 64, 2, 16)))
    spec = P("data", None, "model", None)  # batch over "data", heads over "model"
    qs, kss, vs = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    attn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True)
    ref = lambda q, k, v: reference.attention(q, k, v, causal=True, compute_dtype=jnp.float64)
    loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))))

    def check(got, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    # the reference's out and gradients, jitted, computed once for both calls
    want = jax.jit(ref)(q, k, v)
    want_grads = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    check(jax.jit(attn)(qs, kss, vs), want)
    grads = jax.jit(jax.grad(loss(attn), argnums=(0, 1, 2)))(qs, kss, vs)
    for g, w in zip(grads, want_grads):
        check(g, w)
    sharded = jax.jit(jax.shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    check(sharded(qs, kss, vs), want)
    sharded_grad = jax.jit(jax.shard_map(jax.grad(loss(attn), argnums=(0, 1, 2)), mesh=mesh,
                                         in_specs=(spec,) * 3, out_specs=(spec,) * 3))
    for g, w in zip(sharded_grad(qs, kss, vs), want_grads):
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
    want_s = jax.jit(jax.grad(loss_s(ref_s), argnums=(0, 1, 2, 3)))(q, k, v, s)
    for g, w in zip(grad_s(q, k, v, s), want_s):
        check(g, w)
    print("ok")
""")


# jax.jit over sharded arrays: forward and gradients match the float64 reference for
# every mesh below. Batch and/or heads sharded ("local"): the outputs keep q's
# sharding and the compiled programs have no collective -- except the all-reduce that
# sums a replicated sinks' gradient over the shards. Sequence sharded: the outputs
# keep it; "ring": collective-permutes and no all-gather; "gather" (GQA): K/V are
# all-gathered (never q), dK/dV reduce-scattered, no collective-permute. The batch and
# head cases run on 4 devices, the sequence ones on 8 (rings of 2 and 4). With dropout,
# batch and head shards keep the unsharded call's mask (the dropout operand shards with
# q: each sequence and head carries its indices); a sequence-sharded call is gathered.
JIT_SCRIPT = textwrap.dedent("""
    import inspect, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax import _ffi_calls, _fp8, reference

    # flash_attention's default options, as attention._describe takes them (float8_case)
    FLOAT8_OPTIONS = {name: p.default for name, p in
                      inspect.signature(flashjax.flash_attention).parameters.items()
                      if p.kind == p.KEYWORD_ONLY and name not in _fp8.DESCALES + ("out_dtype",)}

    def float8_stand_in(q, k, v, vt, score_descale, v_descale, rows, layout, cfg, out_dtype):
        # (the local call's operands, as the Hopper kernel would get them: V from V^T)
        b, s, hk, e = v.shape
        assert vt.shape[:3] == (b, hk, e) and score_descale.shape == v_descale.shape == (b, hk)
        # (a block's slot 16a + 4b + 2c + d holds key 16a + 8c + 2b + d, _fp8.PERMUTED_KEYS:
        # undone by reshapes, since custom_partitioning takes no constant arrays)
        assert _fp8.FLOAT8_KEY_BLOCK == 32
        blocks = vt.reshape(b, hk, e, -1, 2, 4, 2, 2).transpose(0, 1, 2, 3, 4, 6, 5, 7)
        v_back = blocks.reshape(b, hk, e, -1).transpose(0, 3, 1, 2)[:, :s]
        g = q.shape[2] // hk
        group = lambda x: jnp.repeat(x, g, axis=1)[:, None, :, None]
        k_, v_ = (jnp.repeat(x, g, axis=2) for x in (k, v_back))
        scores = jnp.einsum("bshd,bthd->bhst", q * group(score_descale), k_) * cfg.softmax_scale
        rows = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 2)
        cols = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 3)
        assert (cfg.window_left, cfg.window_right) == (-1, 0)  # (causal, square)
        scores = jnp.where(cols <= rows, scores, -jnp.inf)
        lse = jax.nn.logsumexp(scores, axis=-1)
        out = jnp.einsum("bhst,bthe->bshe", jnp.exp(scores - lse[..., None]), v_)
        return (out * group(v_descale)).astype(out_dtype), lse
    _ffi_calls.float8_forward = float8_stand_in  # (no float8 FFI handler on the CPU)

    COLLECTIVE = r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
    n = len(jax.devices())
    mesh = Mesh(np.array(jax.devices()).reshape(2, n // 2), ("data", "model"))
    rng = np.random.default_rng(0)  # numpy: jax.random compiles a program per shape
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))

    def check(got, want, what):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                   err_msg=what)

    def compiled(f, *args):  # one compilation: the program to run and its HLO text
        program = f.lower(*args).compile()
        return program, program.as_text()

    def out_and_grads(f, argnums):  # f's out and the gradients of sum(sin(out)): one program
        def loss(*args):
            out = f(*args)
            return jnp.sum(jnp.sin(out)), out

        def run(*args):
            (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True,
                                                 allow_int=True)(*args)
            return out, grads
        return jax.jit(run)

    def collectives(hlo):
        return sorted(set(re.findall(COLLECTIVE, hlo)))

    def gathered_heads(hlo):  # head counts of the rank-4 arrays all-gathered
        shapes = re.findall(r"= \\w+\\[(\\d+),(\\d+),(\\d+),(\\d+)\\][^ ]* all-gather", hlo)
        return sorted({int(shape[2]) for shape in shapes})

    # implementation="cpu": the C++ kernels that None picks on the CPU, without tracing
    # None's pure-JAX branch too (most of a case's compile time); each device count's
    # first case keeps None.
    def case(spec, heads_q, heads_kv, want, kv_spec=None, implementation="cpu", **options):
        b, s = 4, 48
        q, k, v = normal(b, s, heads_q, 16), normal(b, s, heads_kv, 16), normal(b, s, heads_kv, 8)
        arrays = {}  # traced keyword arguments (the rest of `options` are static)
        if options.pop("sinks", False):
            arrays["sinks"] = jnp.linspace(-1.0, 1.0, heads_q, dtype=jnp.float32)
        if options.pop("segments", False):
            ids = jnp.repeat(jnp.arange(3, dtype=jnp.int32), s // 3)[None].repeat(b, 0)
            arrays.update(q_segment_ids=ids, kv_segment_ids=ids,
                          seqused_k=jnp.array([48, 40, 17, 33], jnp.int32))
        if options.pop("seqused_q", False):
            arrays["seqused_q"] = jnp.array([41, 48, 9, 30], jnp.int32)
        if options.pop("offsets", False):  # positions: rows of a longer sequence
            arrays.update(q_offset=jnp.array([0, 5, -3, 60], jnp.int32), kv_offset=2)
        if options.get("dropout_rate"):  # the unsharded call's mask (global b, h)
            arrays["dropout_key"] = jax.random.key(7)
        attn = lambda q, k, v, kw: flashjax.flash_attention(
            q, k, v, implementation=implementation, **options, **kw)
        ref = lambda q, k, v, kw: reference.attention(q, k, v, compute_dtype=jnp.float64,
                                                      **options, **kw)
        loss = lambda f: (lambda q, k, v, kw: jnp.sum(jnp.sin(f(q, k, v, kw))))
        kv_sharding = NamedSharding(mesh, spec if kv_spec is None else kv_spec)
        args = (jax.device_put(q, NamedSharding(mesh, spec)),
                jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding), arrays)
        what = f"{spec} {heads_q}/{heads_kv} {sorted(options)} {sorted(arrays)} {implementation}"
        argnums = (0, 1, 2, 3) if "sinks" in arrays else (0, 1, 2)
        want_out, want_grads = out_and_grads(ref, argnums)(q, k, v, arrays)
        forward, forward_hlo = compiled(jax.jit(attn), *args)
        out = forward(*args)
        check(out, want_out, what)
        if want in ("local", "ring", "gather"):
            padded = lambda p: tuple(p) + (None,) * (4 - len(p))
            assert padded(out.sharding.spec) == padded(spec), (what, out.sharding.spec)
        grad, grad_hlo = compiled(jax.jit(jax.grad(loss(attn), argnums=argnums, allow_int=True)),
                                  *args)
        got = grad(*args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_grads)):
            if g.dtype != jax.dtypes.float0:
                check(g, w, what + " grad")
        sums_sinks = "sinks" in arrays and (spec[0] or want == "ring")
        found_forward, found_grad = collectives(forward_hlo), collectives(grad_hlo)
        if want == "local":
            assert found_forward == [], (what, found_forward)
            expected = ["all-reduce"] if sums_sinks else []
            assert found_grad == expected, (what, found_grad)
        if want == "ring":
            permute = ["collective-permute"]
            assert found_forward == permute, (what, found_forward)
            expected = ["all-reduce"] + permute if sums_sinks else permute
            assert found_grad == expected, (what, found_grad)
        if want == "gather":  # K/V gathered, dK/dV reduce-scattered, q never gathered
            assert found_forward == ["all-gather"], (what, found_forward)
            assert gathered_heads(forward_hlo) == [heads_kv], (what, gathered_heads(forward_hlo))
            assert gathered_heads(grad_hlo) == [heads_kv], (what, gathered_heads(grad_hlo))
            assert "collective-permute" not in found_grad, what

    def local_cases():  # batch and / or heads sharded, packed sequences
        heads = n // 2  # the "model" axis
        case(P("data", None, "model", None), 2 * heads, heads, "local", causal=True,
             implementation=None)
        case(P("data", None, None, None), 4, 2, "local", window_size=(5, 3), softcap=4.0)
        case(P(None, None, "model", None), 2 * heads, heads, "local", sinks=True, causal=True)
        case(P("data", None, "model", None), 4 * heads, heads, "local", sinks=True, segments=True)
        case(P(("data", "model"), None, None, None), 4, 1, "local", causal=True)
        case(P("data", None, "model", None), 2 * heads, heads, "local", dropout_rate=0.3)
        # gathered (correct): one kv head with q heads sharded
        case(P(None, None, "model", None), 3 * n, 1, "gathered", kv_spec=P(), causal=True)
        # flash_attention_varlen with heads sharded: local, no collective
        cu = jnp.array([0, 5, 17, 40], jnp.int32)
        q, k, v = normal(40, 2 * heads, 16), normal(40, heads, 16), normal(40, heads, 16)
        packed = NamedSharding(mesh, P(None, "model", None))
        args = [jax.device_put(x, packed) for x in (q, k, v)]
        varlen = lambda q, k, v: flashjax.flash_attention_varlen(q, k, v, cu, cu, 23, 23,
                                                                 causal=True,
                                                                 implementation="cpu")
        ref = lambda q, k, v: reference.attention_varlen(q, k, v, np.asarray(cu), np.asarray(cu),
                                                         23, 23, causal=True,
                                                         compute_dtype=jnp.float64)
        want_out, want_grads = out_and_grads(ref, (0, 1, 2))(q, k, v)
        varlen_program, varlen_hlo = compiled(jax.jit(varlen), *args)
        out = varlen_program(*args)
        check(out, want_out, "varlen")
        assert tuple(out.sharding.spec)[:2] == (None, "model"), out.sharding.spec
        grad, grad_hlo = compiled(
            jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(varlen(*a))), argnums=(0, 1, 2))), *args)
        for g, w in zip(grad(*args), want_grads):
            check(g, w, "varlen grad")
        assert collectives(varlen_hlo) == [], collectives(varlen_hlo)
        assert collectives(grad_hlo) == [], collectives(grad_hlo)

    def sequence_cases():
        heads = n // 2
        # the sequence over "model" (and batch over "data"): a ring, causal or not, sinks,
        # sliding windows, segment ids + seqused, positions (q_offset / kv_offset)
        case(P("data", "model", None, None), 4, 2, "ring", causal=True, implementation=None)
        case(P(None, "model", None, None), 4, 4, "ring", sinks=True, softcap=2.0)
        case(P(None, "data", None, None), 4, 2, "ring", window_size=(7, 0))
        case(P(None, "model", None, None), 4, 2, "ring", window_size=(5, 9), sinks=True)
        case(P(None, "data", None, None), 4, 2, "ring", causal=True, segments=True, seqused_q=True)
        case(P("data", "model", None, None), 2, 2, "ring", causal=True, offsets=True)
        # dropout: no ring (its blocks would draw other indices): the sequence gathered
        case(P("data", "model", None, None), 4, 2, "gathered", causal=True, dropout_rate=0.3)
        # GQA with heads_q >= 4 heads_kv: K/V all-gathered (Llama-3 style), q never
        case(P(None, "model", None, None), 8, 2, "gather", causal=True, sinks=True)
        case(P("data", "model", None, None), 4, 1, "gather", segments=True, offsets=True,
             causal=True)

    def float8_case():
        # The float8 forward's partitioning (_core.float8_forward): V^T (_fp8.permuted_
        # transpose) and the descales shard with k along batch and kv heads, no
        # collective. The Hopper kernel runs only on a GPU: a stand-in takes its operands
        # (float32 here), checks their local shapes and computes out and lse from them
        # (V from V^T, the descales applied), against the reference on the inputs.
        from flashjax import _core
        from flashjax.attention import _describe
        heads = n // 2
        b, s, hq, hk, d = 4, 40, 2 * heads, heads, 16
        q, k, v = normal(b, s, hq, d), normal(b, s, hk, d), normal(b, s, hk, d)
        score_descale = jnp.asarray(rng.uniform(0.5, 2.0, (b, hk)), jnp.float32)
        v_descale = jnp.asarray(rng.uniform(0.5, 2.0, (b, hk)), jnp.float32)
        extras, layout, cfg = _describe(q, k, v, **dict(FLOAT8_OPTIONS, causal=True))

        def call(q, k, v, score_descale, v_descale):
            return _core.float8_forward(q, k, v, _fp8.permuted_transpose(v), score_descale,
                                        v_descale, extras, layout, cfg, jnp.dtype(jnp.float32))
        spec = P("data", None, "model", None)
        per_kv_head = NamedSharding(mesh, P("data", "model"))
        args = (*(jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)),
                jax.device_put(score_descale, per_kv_head), jax.device_put(v_descale, per_kv_head))
        program, hlo = compiled(jax.jit(call), *args)
        out, lse = program(*args)
        group = lambda x: jnp.repeat(x, hq // hk, axis=1)[:, None, :, None]
        want_out, want_lse = reference.attention(q * group(score_descale), k, v, causal=True,
                                                 return_lse=True, compute_dtype=jnp.float64)
        check(out, want_out * group(v_descale), "float8 partitioned out")
        check(lse, want_lse, "float8 partitioned lse")
        assert collectives(hlo) == [], collectives(hlo)
        assert tuple(out.sharding.spec)[:3] == ("data", None, "model"), out.sharding.spec

    # 4 devices: the local cases; 8 devices: a ring of 4 and a gather over 4
    if n == 4:
        local_cases()
        float8_case()
    else:
        sequence_cases()
    print("ok")
""")


def test_sharded_inputs_and_shard_map():
    run_on_host_devices(SCRIPT, 4)


@pytest.mark.parametrize("devices", [4, 8])
def test_jit_partitions_batch_and_heads(devices):
    run_on_host_devices(JIT_SCRIPT, devices)


# flash_attention_with_kvcache under jax.jit: a contiguous cache (an entry per
# sequence) shards along batch and heads with no collective, the caches keep their
# sharding and, donated, are updated in place; a paged pool shards along heads, and a
# batch-sharded call that writes it keeps the batch whole (each device would write
# its own copy of the pool): correct either way, against the unsharded call.
KVCACHE_SCRIPT = textwrap.dedent("""
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax

    COLLECTIVE = r"(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng(0)  # numpy: jax.random compiles a program per shape
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    b, hq, hk, d, capacity, new = 4, 8, 4, 16, 24, 2
    q, k, v = normal(b, new, hq, d), normal(b, new, hk, d), normal(b, new, hk, d)
    seqlens = jnp.array([0, 5, 20, 9], jnp.int32)

    def check(got, want, what):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                                   err_msg=what)

    def step(q, kc, vc, k, v, n, **extra):
        return flashjax.flash_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n,
                                                     causal=True, return_lse=True, **extra)

    # contiguous: batch over "data", heads over "model"
    kc, vc = normal(b, capacity, hk, d), normal(b, capacity, hk, d)
    want = jax.jit(step)(q, kc, vc, k, v, seqlens)  # (eager, each set-up op compiles)
    rows = ("data", None, "model", None)
    args = (put(q, *rows), put(kc, *rows), put(vc, *rows), put(k, *rows), put(v, *rows),
            put(seqlens, "data"))
    sharded = jax.jit(step, donate_argnums=(1, 2))
    compiled = sharded.lower(*args).compile()
    assert not re.findall(COLLECTIVE, compiled.as_text()), "contiguous cache: a collective"
    analysis = compiled.memory_analysis()
    if analysis is not None:  # the local caches are updated in place
        assert analysis.alias_size_in_bytes >= 2 * kc.nbytes // 4, analysis
    got = sharded(*args)
    for name, g, w in zip(("out", "lse", "k_cache", "v_cache"), got, want):
        check(g, w, "contiguous " + name)
    assert tuple(got[2].sharding.spec)[:3] == rows[:3], got[2].sharding.spec

    # paged: 12 pages of 8 rows, heads over "model", batch over "data" (writes: kept whole)
    pages = np.arange(12, dtype=np.int32)[::-1].reshape(4, 3).copy()
    kp, vp = normal(12, 8, hk, d), normal(12, 8, hk, d)
    want = jax.jit(lambda *a: step(*a, page_table=pages))(q, kp, vp, k, v, seqlens)
    pool = (None, None, "model", None)
    args = (put(q, *rows), put(kp, *pool), put(vp, *pool), put(k, *rows), put(v, *rows),
            put(seqlens, "data"))
    paged = jax.jit(lambda *a: step(*a, page_table=put(pages, "data", None)))
    got = paged(*args)
    for name, g, w in zip(("out", "lse", "k_pool", "v_pool"), got, want):
        check(g, w, "paged " + name)
    # read-only (no new rows): batch shards too, no collective
    read = jax.jit(lambda q, kc, vc, n: flashjax.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=n, page_table=put(pages, "data", None)))
    check(read(args[0], args[1], args[2], args[5]),
          jax.jit(lambda q, kc, vc, n: flashjax.flash_attention_with_kvcache(
              q, kc, vc, cache_seqlens=n, page_table=pages))(q, kp, vp, seqlens),
          "paged read-only")
    hlo = read.lower(args[0], args[1], args[2], args[5]).compile().as_text()
    assert not re.findall(COLLECTIVE, hlo), "paged read-only: a collective"
    print("ok")
""")


def test_kvcache_call_shards_along_batch_and_heads():
    run_on_host_devices(KVCACHE_SCRIPT, 4)
