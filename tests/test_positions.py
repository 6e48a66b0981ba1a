"""q_offset / kv_offset: where the query and key rows sit in a longer sequence (causal
and windows compare positions). The case matrix runs in test_forward / test_backward
(and test_gpu); here the API: per-batch and traced offsets, vmap, argument errors,
and query rows sharded inside shard_map (the causal pitfall the offsets fix)."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax import reference
from helpers import check_close, counting_jit, rand, run_on_host_devices


def _qkv(batch=3, seqlen_q=40, seqlen_k=56, heads_q=4, heads_kv=2, dim=16):
    return (rand(1, (batch, seqlen_q, heads_q, dim)), rand(2, (batch, seqlen_k, heads_kv, dim)),
            rand(3, (batch, seqlen_k, heads_kv, dim)))


def _loss(attend):
    return lambda q, k, v, *a: jnp.sum(jnp.sin(attend(q, k, v, *a)))


def test_per_batch_traced_offsets_forward_and_gradients():
    q, k, v = _qkv()
    options = dict(causal=True, window_size=(12, -1))
    ours, traces = counting_jit(lambda q, k, v, qo, ko: flashjax.flash_attention(
        q, k, v, q_offset=qo, kv_offset=ko, **options))
    ref = jax.jit(lambda q, k, v, qo, ko: reference.attention(
        q, k, v, q_offset=qo, kv_offset=ko, compute_dtype=jnp.float64, **options))
    # one compilation serves every value (traced offsets)
    for qo, ko in ((np.array([0, 16, 100], np.int32), np.int32(3)),
                   (np.array([-5, 7, 56], np.int32), np.int32(0))):
        check_close(np.asarray(ours(q, k, v, qo, ko)), np.asarray(ref(q, k, v, qo, ko)),
                    name="out")
        got = jax.grad(_loss(ours), argnums=(0, 1, 2))(q, k, v, qo, ko)
        want = jax.jit(jax.grad(_loss(ref), argnums=(0, 1, 2)))(q, k, v, qo, ko)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            check_close(np.asarray(g), np.asarray(w), name=name)
    assert len(traces) == 1


def test_offsets_of_zero_are_top_left_alignment():
    q, k, v = _qkv(batch=1, seqlen_q=30, seqlen_k=50)
    top_left = flashjax.flash_attention(q, k, v, causal=True, q_offset=0)
    # top-left: query i sees keys 0..i, i.e. the first 30 keys bottom-right aligned
    first_keys = flashjax.flash_attention(q, k[:, :30], v[:, :30], causal=True)
    np.testing.assert_allclose(np.asarray(top_left), np.asarray(first_keys), atol=1e-6)


def test_vmap_over_offsets_folds_into_batch():
    q, k, v = _qkv(batch=2)
    offsets = jnp.array([[0, 10], [20, -4], [5, 5]], jnp.int32)  # (vmapped 3, batch 2)
    attend = lambda q, k, v, qo: flashjax.flash_attention(q, k, v, causal=True, q_offset=qo)
    got = jax.vmap(attend, in_axes=(None, None, None, 0))(q, k, v, offsets)
    for i in range(3):
        want = reference.attention(q, k, v, causal=True, q_offset=offsets[i],
                                   compute_dtype=jnp.float64)
        check_close(np.asarray(got[i]), np.asarray(want), name=f"vmapped entry {i}")


def test_varlen_offsets_per_sequence():
    cu = np.array([0, 7, 7, 40], np.int32)
    q, k, v = rand(4, (40, 2, 16)), rand(5, (40, 1, 16)), rand(6, (40, 1, 16))
    qo, ko = np.array([3, 0, 90], np.int32), np.array([0, 0, 80], np.int32)
    got = flashjax.flash_attention_varlen(q, k, v, cu, cu, 33, 33, causal=True, q_offset=qo,
                                          kv_offset=ko)
    want = jax.jit(lambda q, k, v: reference.attention_varlen(
        q, k, v, cu, cu, 33, 33, causal=True, q_offset=qo, kv_offset=ko,
        compute_dtype=jnp.float64))(q, k, v)
    check_close(np.asarray(got), np.asarray(want), name="varlen out")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(q_offset=1.5), TypeError, "q_offset must be an int or an integer array"),
    (dict(q_offset=jnp.zeros((3,), jnp.float32)), TypeError, "q_offset must be an int"),
    (dict(kv_offset=jnp.zeros((2,), jnp.int32)), ValueError, r"kv_offset must .* \(batch,\) = \(3,\)"),
    (dict(q_offset=jnp.zeros((3, 1), jnp.int32)), ValueError, "q_offset must"),
    (dict(q_offset=2**31), ValueError, "q_offset must fit in int32"),
])
def test_offset_argument_errors(kwargs, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        flashjax.flash_attention(q, k, v, causal=True, **kwargs)


# Query rows sharded over 4 devices inside shard_map, K/V whole: each shard's rows are
# rows [i * rows, (i + 1) * rows) of the sequence, which causal must know (q_offset);
# without it every shard aligns its rows bottom-right, as if they were the last ones.
SHARD_MAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import flashjax
    from flashjax import reference

    mesh = Mesh(np.array(jax.devices()), ("rows",))
    rng = np.random.default_rng(0)  # numpy: jax.random compiles a program per shape
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32))
               for shape in ((2, 64, 4, 16), (2, 64, 2, 16), (2, 64, 2, 16)))
    rows = P(None, "rows", None, None)

    def local(q, k, v, positioned):
        offset = jax.lax.axis_index("rows") * q.shape[1] if positioned else None
        return flashjax.flash_attention(q, k, v, causal=True, window_size=(20, 0),
                                        q_offset=offset)

    def sharded(positioned):
        return jax.jit(jax.shard_map(lambda q, k, v: local(q, k, v, positioned), mesh=mesh,
                                     in_specs=(rows, P(), P()), out_specs=rows))

    ref = lambda q, k, v: reference.attention(q, k, v, causal=True, window_size=(20, 0),
                                              compute_dtype=jnp.float64)

    def loss(f):  # (sum(sin(out)), out)
        def value(q, k, v):
            out = f(q, k, v)
            return jnp.sum(jnp.sin(out)), out
        return value

    # the reference's gradients and out from one jitted program
    want_grads, want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(sharded(True)(q, k, v)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(sharded(False)(q, k, v)), np.asarray(want), atol=1e-3)
    got, _ = jax.jit(jax.grad(loss(sharded(True)), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    for g, w in zip(got, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_query_rows_sharded_in_shard_map_with_q_offset():
    run_on_host_devices(SHARD_MAP_SCRIPT, 4)
