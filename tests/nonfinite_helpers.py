"""Non-finite inputs (docs/api.md, "Non-finite values"): placing NaN / +-inf in q, k or v
and checking a flashjax call against the float64 reference, which implements the
semantics exactly (tests/test_nonfinite.py checks it against a direct loop). Shared by
the CPU tests (test_nonfinite.py) and the GPU ones (test_gpu*.py).

Forward: NaN and inf positions of out and lse must equal the reference's, the finite
entries be close to it. Gradients: every entry that no non-finite value reaches (rows
whose out and lse are finite, keys that only such rows see, other batch entries and
heads) must be finite and equal the reference's gradients of the same inputs with the
non-finite values replaced by 0 (they cannot depend on them); somewhere a gradient
must be non-finite.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import flashjax
from flashjax import reference, xla_attention
from helpers import Case, case_inputs, jitted_reference, rand, to_cpu

VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the non-finite value goes: tensor ("q", "k", "v"), the row (batch entry,
    sequence position, head) and the column (None: the whole row)."""

    tensor: str
    value: str = "nan"
    batch: int = 0
    row: int = 0
    head: int = 0
    column: int | None = 3

    def __str__(self):
        col = "row" if self.column is None else f"c{self.column}"
        return f"{self.tensor}[{self.batch},{self.row},{self.head},{col}]={self.value}"

    def apply(self, x):
        """x (..., seqlen, heads, dim) with the value placed (x's leading dims: batch or
        none for packed rows)."""
        return x.at[self._at(x)].set(jnp.asarray(VALUES[self.value], x.dtype))

    def place(self, q, k, v):
        q, k, v = (self.apply(x) if name == self.tensor else x
                   for name, x in zip("qkv", (q, k, v)))
        return q, k, v

    def cleaned(self, q, k, v):
        """The inputs with a 0 where the value went."""
        q, k, v = (x.at[self._at(x)].set(0) if name == self.tensor else x
                   for name, x in zip("qkv", (q, k, v)))
        return q, k, v

    def _at(self, x):
        at = (self.row, self.head) if x.ndim == 3 else (self.batch, self.row, self.head)
        return at + ((slice(None),) if self.column is None else (self.column,))


def tolerance(dtype) -> float:
    """Absolute and relative tolerance on the finite entries (values are O(1))."""
    return 2e-5 if jnp.dtype(dtype) == jnp.float32 else 3e-2


def assert_same_nonfinite(actual, expected, dtype, name):
    """NaN and +-inf exactly where `expected` has them, the finite entries close."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        bad = test(actual) != test(expected)
        assert not bad.any(), (f"{name}: {what} differs at {np.count_nonzero(bad)} entries, "
                               f"e.g. {tuple(np.argwhere(bad)[0])}")
    tol = tolerance(dtype)
    finite = np.isfinite(expected)
    np.testing.assert_allclose(actual[finite], expected[finite], rtol=tol, atol=tol,
                               err_msg=f"{name}: finite entries")


@functools.lru_cache(maxsize=None)
def _compiled(case: Case, attention, blocks, deterministic, gradients):
    """flash_attention (`attention`: the entry point the test patched in) on the case as
    one jitted program, f(q, k, v, sinks, extra) -> (out, lse), or with `gradients`
    f(q, k, v, sinks, extra, ct) -> (dq, dk, dv) of sum(out * ct): cached, so that the
    placements of a case share one compilation. `blocks`: the pure-JAX path's block
    sizes (patched by the CPU tests; read when tracing)."""
    def call(q, k, v, sinks, extra):
        return attention(q, k, v, sinks=sinks, return_lse=True, **case.options(),
                         deterministic=deterministic, **extra)

    if not gradients:
        return jax.jit(call)

    def grads(q, k, v, sinks, extra, ct):
        loss = lambda q, k, v: jnp.sum(call(q, k, v, sinks, extra)[0].astype(jnp.float32)
                                       * ct.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(grads)


def compiled(case: Case, deterministic=False, gradients=False):
    blocks = (xla_attention.BLOCK_Q, xla_attention.BLOCK_K)
    return _compiled(case, flashjax.flash_attention, blocks, deterministic, gradients)


def expect(case: Case, q, k, v, sinks, extra):
    q, k, v, sinks = (to_cpu(x, jnp.float64) for x in (q, k, v, sinks))
    extra = {name: to_cpu(x) for name, x in extra.items()}
    return jitted_reference(q, k, v, sinks=sinks, return_lse=True, compute_dtype=jnp.float64,
                            **case.options(), **extra)


@functools.lru_cache(maxsize=None)
def _reference_gradients(case: Case):
    """(dq, dk, dv) of sum(reference out * ct) in float64, one jitted program per case."""
    def grads(q, k, v, sinks, extra, ct):
        loss = lambda q, k, v: jnp.sum(reference.attention(
            q, k, v, sinks=sinks, compute_dtype=jnp.float64, **case.options(), **extra) * ct)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(grads)


def check_nonfinite(case: Case, placement: Placement, device=None, *, gradients=False,
                    seed=0, deterministic=False, **extra):
    """flash_attention on the case's inputs with `placement` applied, against the
    reference: forward and, if `gradients`, the gradients (the `deterministic`
    backward if asked) as the module doc says. extra: more flash_attention arguments
    (segment ids, seqused). Returns the expected (out, lse) so that callers can check
    that the value reached something."""
    q, k, v, sinks = case_inputs(case, seed, device)
    q, k, v = placement.place(q, k, v)
    out, lse = compiled(case)(q, k, v, sinks, extra)
    want_out, want_lse = expect(case, q, k, v, sinks, extra)
    name = f"{case} {placement}"
    assert_same_nonfinite(out.astype(jnp.float32), want_out, case.dtype, f"{name}: out")
    assert_same_nonfinite(lse, want_lse, jnp.float32, f"{name}: lse")
    if gradients:
        _check_gradients(case, placement, (q, k, v, sinks), want_out, want_lse, name, seed, extra,
                         deterministic)
    return np.asarray(want_out), np.asarray(want_lse)


def reached_rows(want_out, want_lse):
    """(batch, seqlen_q, heads_q) bool: rows a non-finite value reaches."""
    lse = np.moveaxis(np.asarray(want_lse), -2, -1)
    return ~np.isfinite(np.asarray(want_out)).all(-1) | np.isnan(lse) | np.isposinf(lse)


def _check_gradients(case, placement, args, want_out, want_lse, name, seed, extra,
                     deterministic):
    q, k, v, sinks = args
    ct = jax.device_put(rand(seed + 1, want_out.shape, q.dtype), q.devices().pop())

    got = compiled(case, deterministic, gradients=True)(q, k, v, sinks, extra, ct)
    got = [np.asarray(g.astype(jnp.float32), np.float64) for g in got]
    clean = [to_cpu(x, jnp.float64) for x in placement.cleaned(q, k, v)]
    hi_sinks = to_cpu(sinks, jnp.float64)
    cpu_extra = {n: to_cpu(x) for n, x in extra.items()}
    ct_hi = to_cpu(ct, jnp.float64)
    want = [np.asarray(g) for g in _reference_gradients(case)(*clean, hi_sinks, cpu_extra, ct_hi)]

    rows = reached_rows(want_out, want_lse)  # (batch, seqlen_q, heads_q)
    group = case.heads_q // case.heads_kv
    mask = np.broadcast_to(_visibility(case, extra), rows.shape[:1] + (case.seqlen_q, case.seqlen_k))
    # A key is reached when a reached row of its kv head's group sees it.
    rows_kv = rows.reshape(rows.shape[0], case.seqlen_q, case.heads_kv, group).any(-1)
    keys = np.einsum("bqh,bqk->bkh", rows_kv.astype(np.int64), mask.astype(np.int64)) > 0
    tol = 10 * tolerance(case.dtype)
    assert not all(np.isfinite(g).all() for g in got), f"{name}: no gradient is non-finite"
    for g, w, unreached, what in ((got[0], want[0], ~rows, "dq"), (got[1], want[1], ~keys, "dk"),
                                  (got[2], want[2], ~keys, "dv")):
        g, w = g[unreached], w[unreached]
        assert np.isfinite(g).all(), (f"{name}: {what} non-finite at "
                                      f"{np.count_nonzero(~np.isfinite(g))} unreached entries")
        scale = max(np.abs(w).max(initial=0.0), 1.0)
        np.testing.assert_allclose(g / scale, w / scale, rtol=0, atol=tol, err_msg=f"{name}: {what}")


def _visibility(case: Case, extra):
    """(batch or 1, seqlen_q, seqlen_k) bool: query row sees key (mask, segment ids,
    seqused)."""
    mask = case.mask()[None]
    if "q_segment_ids" in extra:
        qid, kid = np.asarray(extra["q_segment_ids"]), np.asarray(extra["kv_segment_ids"])
        mask = mask & (qid[:, :, None] == kid[:, None, :])
    if "seqused_k" in extra:
        used = np.asarray(extra["seqused_k"])
        mask = mask & (np.arange(case.seqlen_k)[None, None, :] < used[:, None, None])
    return mask


VARLEN_CU = np.array([0, 20, 45, 70], np.int32)


def _varlen_inputs(dtype, head_dim):
    """q, k, v of check_varlen_nonfinite (on the CPU): a NaN key element in sequence 1,
    an +inf value row in sequence 2."""
    q, k, v = (rand(i, (70, 2, head_dim), dtype) for i in range(3))
    return q, k.at[30, 1, 3].set(jnp.nan), v.at[60, 0].set(jnp.inf)


@functools.lru_cache(maxsize=None)
def _varlen_references(causal, dtype, head_dim):
    """The float64 reference's (out, lse) of _varlen_inputs, and its gradients of
    sum(out * ct) with sequences 1 and 2 zeroed (sequence 0 cannot depend on them), as
    numpy; cached (each case runs on several implementations)."""
    hi = [to_cpu(x, jnp.float64) for x in _varlen_inputs(dtype, head_dim)]
    ct_hi = to_cpu(rand(9, (70, 2, head_dim), dtype), jnp.float64)
    attention = lambda q, k, v, **kw: reference.attention_varlen(
        q, k, v, VARLEN_CU, VARLEN_CU, 25, 25, compute_dtype=jnp.float64, causal=causal, **kw)
    out, lse = jax.jit(lambda *a: attention(*a, return_lse=True))(*hi)
    clean = [x.at[20:].set(0) for x in hi]
    loss = lambda q, k, v: jnp.sum(attention(q, k, v) * ct_hi)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*clean)
    return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


def check_varlen_nonfinite(causal, device=None, dtype="float32", head_dim=16, gradients=True):
    """Packed sequences (flash_attention_varlen): a NaN key element in sequence 1 and an
    +inf value row in sequence 2 reach their own sequences' rows only (as the
    reference says), and (if `gradients`) sequence 0's gradients are those without them."""
    q, k, v = jax.device_put(_varlen_inputs(dtype, head_dim), device)
    run = lambda q, k, v: flashjax.flash_attention_varlen(q, k, v, VARLEN_CU, VARLEN_CU, 25, 25,
                                                          causal=causal, return_lse=True)
    out, lse = jax.jit(run)(q, k, v)
    want_out, want_lse, want = _varlen_references(causal, dtype, head_dim)
    assert_same_nonfinite(out.astype(jnp.float32), want_out, dtype, "varlen out")
    assert_same_nonfinite(lse, want_lse, jnp.float32, "varlen lse")
    assert np.isfinite(want_out[:20]).all() and np.isnan(want_out).any()
    if not gradients:
        return

    ct = jax.device_put(rand(9, out.shape, dtype), device)
    loss = lambda q, k, v: jnp.sum(run(q, k, v)[0].astype(jnp.float32) * ct.astype(jnp.float32))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    tol = 10 * tolerance(dtype)
    for name, g, w in zip("qkv", got, want):
        g, w = np.asarray(g.astype(jnp.float32))[:20], w[:20]
        assert np.isfinite(g).all(), f"d{name} of sequence 0 is not finite"
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"d{name}")


def check_kvcache_nonfinite(device=None, dtype="float32", head_dim=16, seqlen_q=3,
                            causal=False, last_key_nan=False):
    """flash_attention_with_kvcache: NaN in cache rows past cache_seqlens is never read;
    a NaN value element inside entry 1's keys reaches that column of entry 1 only.
    last_key_nan (causal): also one in entry 1's last key, which its last query row
    alone sees (the other rows' hidden pairs must not multiply it)."""
    batch, cache, hq, hk = 2, 64, 4, 2
    q = rand(0, (batch, seqlen_q, hq, head_dim), dtype)
    k_cache = rand(1, (batch, cache, hk, head_dim), dtype)
    v_cache = rand(2, (batch, cache, hk, head_dim), dtype)
    seqlens = jnp.asarray([40, 64], jnp.int32)
    k_cache = k_cache.at[0, 50].set(jnp.nan)        # past entry 0's length: never read
    v_cache = v_cache.at[0, 45, 1, 2].set(jnp.nan)  # likewise
    v_cache = v_cache.at[1, 10, 0, 5].set(jnp.nan)  # read by entry 1, heads 0-1, column 5
    if last_key_nan:  # entry 1's last query row, heads 2-3, column 7
        v_cache = v_cache.at[1, 63, 1, 7].set(jnp.nan)
    q, k_cache, v_cache = jax.device_put((q, k_cache, v_cache), device)
    out, lse = flashjax.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                     causal=causal, return_lse=True)
    hi = [to_cpu(x, jnp.float64) for x in (q, k_cache, v_cache)]
    want_out, want_lse = jitted_reference(*hi, seqused_k=seqlens, causal=causal,
                                          return_lse=True, compute_dtype=jnp.float64)
    assert_same_nonfinite(out.astype(jnp.float32), want_out, dtype, "kvcache out")
    assert_same_nonfinite(lse, want_lse, jnp.float32, "kvcache lse")
    want_out = np.asarray(want_out)
    assert np.isfinite(want_out[0]).all() and np.isnan(want_out[1, -1, :2, 5]).all()
    if last_key_nan:
        assert np.isnan(want_out[1, -1, 2:, 7]).all() and np.isfinite(want_out[1, :-1, :, 7]).all()
        want_out = np.delete(want_out, 7, axis=-1)
    assert np.isfinite(np.delete(want_out[1], 5, axis=-1)).all()
