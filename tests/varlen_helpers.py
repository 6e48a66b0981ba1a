"""Cases and checks for packed (cu_seqlens), padded (seqused) and segment-id batches,
against float64 references computed sequence by sequence (reference.attention_varlen)
and per segment. Tolerances follow helpers.check_close's rule.

Shared by test_varlen.py (CPU) and test_gpu_varlen.py (every GPU kernel path).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import flashjax
from flashjax import reference
from helpers import check_close, cpu, rand


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """A packed batch: sequence i has lengths_q[i] queries and lengths_k[i] keys.

    pad_q / pad_k rows after the last sequence belong to none (zeros expected);
    seqused_* (None: all rows) and max_seqlen (None: the longest) as in the API.
    """

    lengths_q: tuple = (5, 0, 70, 1, 33)
    lengths_k: tuple = (9, 4, 70, 1, 130)
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    head_dim_v: int | None = None
    dtype: str = "float32"
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    seqused_q: tuple | None = None
    seqused_k: tuple | None = None
    pad_q: int = 0
    pad_k: int = 0
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    q_offset: tuple | None = None  # per-sequence positions (None: bottom-right alignment)
    kv_offset: tuple | None = None
    alibi: str | None = None  # slopes: "heads" (heads_q,) or "sequences" (num_seqs, heads_q)

    @property
    def dv(self):
        return self.head_dim_v or self.head_dim

    @property
    def lowp(self):
        return jnp.dtype(self.dtype) != jnp.float32

    @property
    def total_q(self):
        return sum(self.lengths_q) + self.pad_q

    @property
    def total_k(self):
        return sum(self.lengths_k) + self.pad_k

    def cu_seqlens(self):
        return (np.concatenate([[0], np.cumsum(self.lengths_q)]).astype(np.int32),
                np.concatenate([[0], np.cumsum(self.lengths_k)]).astype(np.int32))

    def max_seqlens(self):
        return (max(self.lengths_q) if self.max_seqlen_q is None else self.max_seqlen_q,
                max(self.lengths_k) if self.max_seqlen_k is None else self.max_seqlen_k)

    def metadata(self):
        """cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k as numpy int32 (or None)."""
        used = [None if u is None else np.asarray(u, np.int32)
                for u in (self.seqused_q, self.seqused_k)]
        return (*self.cu_seqlens(), *used)

    def options(self):
        positions = ({} if self.q_offset is None and self.kv_offset is None else
                     dict(q_offset=None if self.q_offset is None else np.asarray(self.q_offset, np.int32),
                          kv_offset=None if self.kv_offset is None
                          else np.asarray(self.kv_offset, np.int32)))
        if self.alibi is not None:
            positions["alibi_slopes"] = self.alibi_slopes()
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap,
                    **positions)

    def alibi_slopes(self):
        """float32 slopes as `alibi` says: per head 2^-(h+1) / 4, or per sequence and head
        (a different draw for each sequence)."""
        if self.alibi == "heads":
            return (0.25 * 0.5 ** np.arange(1, self.heads_q + 1)).astype(np.float32)
        assert self.alibi == "sequences", self.alibi
        rng = np.random.default_rng(11)
        return rng.uniform(0.01, 0.5, (len(self.lengths_q), self.heads_q)).astype(np.float32)

    def __str__(self):
        s = (f"q{'-'.join(map(str, self.lengths_q))}+{self.pad_q}"
             f"_k{'-'.join(map(str, self.lengths_k))}+{self.pad_k}"
             f"-h{self.heads_q}/{self.heads_kv}-d{self.head_dim}/{self.dv}-{self.dtype}")
        for flag, tag in ((self.causal, "causal"), (self.sinks, "sinks"),
                          (self.seqused_q is not None, f"usedq{self.seqused_q}"),
                          (self.seqused_k is not None, f"usedk{self.seqused_k}"),
                          (self.softcap, f"cap{self.softcap:g}"),
                          (self.max_seqlen_q is not None, f"maxq{self.max_seqlen_q}"),
                          (self.q_offset is not None, f"atq{self.q_offset}"),
                          (self.kv_offset is not None, f"atk{self.kv_offset}"),
                          (self.alibi is not None, f"alibi-{self.alibi}"),
                          (tuple(self.window_size) != (-1, -1), f"w{self.window_size}")):
            if flag:
                s += f"-{tag}"
        return s.replace(" ", "").replace("(", "").replace(")", "").replace(",", "_")


def varlen_inputs(case: VarlenCase, seed=0, device=None):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = rand(keys[0], (case.total_q, case.heads_q, case.head_dim), case.dtype)
    k = rand(keys[1], (case.total_k, case.heads_kv, case.head_dim), case.dtype)
    v = rand(keys[2], (case.total_k, case.heads_kv, case.dv), case.dtype)
    sinks = rand(keys[3], (case.heads_q,), jnp.float32) if case.sinks else None
    if device is not None:
        q, k, v, sinks = jax.device_put((q, k, v, sinks), device)
    return q, k, v, sinks


def flash_varlen(case: VarlenCase, metadata, deterministic=False):
    """f(q, k, v, sinks) -> (out, lse) with the case's (device) metadata."""
    cu_q, cu_k, used_q, used_k = metadata
    max_q, max_k = case.max_seqlens()

    def f(q, k, v, sinks=None):
        return flashjax.flash_attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q, seqused_k=used_k, sinks=sinks,
            return_lse=True, deterministic=deterministic, **case.options())
    return f


def ref_varlen(case: VarlenCase, compute_dtype):
    cu_q, cu_k, used_q, used_k = case.metadata()
    max_q, max_k = case.max_seqlens()

    def f(q, k, v, sinks=None):
        return reference.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q,
                                          seqused_k=used_k, sinks=sinks, return_lse=True,
                                          compute_dtype=compute_dtype, **case.options())
    return f


def _args(case, q, k, v, sinks):
    return (q, k, v, sinks) if case.sinks else (q, k, v)


def _cotangents(case, seed):
    keys = jax.random.split(jax.random.key(seed + 1000), 2)
    d_out = rand(keys[0], (case.total_q, case.heads_q, case.dv), case.dtype)
    d_lse = rand(keys[1], (case.heads_q, case.total_q), jnp.float32)
    return d_out, d_lse


def value_and_pullback(f, args, cotangent):
    """f(*args) and its pullback of `cotangent`, in one jitted computation (the
    references run sequence by sequence: op by op they would compile per shape)."""
    def run(args, cotangent):
        value, pull = jax.vjp(f, *args)
        return value, pull(cotangent)
    return jax.jit(run)(tuple(args), cotangent)


@functools.lru_cache(maxsize=8)
def _references(case: VarlenCase, seed):
    """float64 (out, lse, grads) and same-precision (out, grads) or Nones, as numpy."""
    args = _args(case, *varlen_inputs(case, seed))
    d_out, d_lse = _cotangents(case, seed)
    hi_args = [x.astype(jnp.float64) for x in args]
    (out, lse), grads = value_and_pullback(ref_varlen(case, jnp.float64), hi_args,
                                           (d_out.astype(jnp.float64), d_lse.astype(jnp.float64)))
    lo_out, lo_grads = None, [None] * len(args)
    if case.lowp:
        (lo, _), lo_grads = value_and_pullback(ref_varlen(case, case.dtype), args, (d_out, d_lse))
        lo_out = np.asarray(lo.astype(jnp.float32))
        lo_grads = [np.asarray(g.astype(jnp.float32)) for g in lo_grads]
    return (np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads], lo_out, lo_grads)


def check_lse_rows(lse, ref_lse, name):
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape, (lse.dtype, lse.shape)
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), f"{name}: NaN/+inf"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg=f"{name}: -inf rows")
    finite = np.isfinite(ref_lse)
    if finite.any():
        check_close(lse[finite], ref_lse[finite], dtype=jnp.float32, name=name)


def check_varlen(case: VarlenCase, device=None, seed=0, deterministic=False, gradients=True):
    """Forward (out, lse) and, optionally, gradients of flash_attention_varlen on `device`
    against the float64 per-sequence reference (check_varlen_values)."""
    q, k, v, sinks = varlen_inputs(case, seed, device)
    args = _args(case, q, k, v, sinks)
    metadata = [None if x is None else jax.device_put(jnp.asarray(x), device or cpu())
                for x in case.metadata()]
    fn = flash_varlen(case, metadata, deterministic)
    out, lse = jax.jit(fn)(*args)
    grads = None
    if gradients:
        _, pull = jax.vjp(fn, *args)
        grads = jax.jit(lambda ct: pull(ct))(jax.device_put(_cotangents(case, seed), device or cpu()))
    check_varlen_values(case, out, lse, grads, seed)


def varlen_gradient_inputs(case: VarlenCase, seed=0):
    """(args, cotangent) of the gradient check: (q, k, v[, sinks]) and (d_out, d_lse)."""
    return _args(case, *varlen_inputs(case, seed)), _cotangents(case, seed)


def check_varlen_values(case: VarlenCase, out, lse, grads=None, seed=0):
    """out, lse and gradients (None: not checked) of varlen_gradient_inputs(case, seed),
    computed by the caller, against the float64 per-sequence reference; rows outside every
    sequence (or past seqused) are exactly 0."""
    args, _ = varlen_gradient_inputs(case, seed)
    ref_out, ref_lse, ref_grads, lo_out, lo_grads = _references(case, seed)
    assert out.shape == (case.total_q, case.heads_q, case.dv) and out.dtype == args[0].dtype
    out = np.asarray(out.astype(jnp.float32))
    check_close(out, ref_out, lo_out, dtype=case.dtype, name=f"{case}: out")
    check_lse_rows(lse, ref_lse, f"{case}: lse")
    unused = np.isneginf(ref_lse).all(axis=0) & (np.abs(ref_out).max(axis=(1, 2)) == 0)
    np.testing.assert_array_equal(out[unused], 0.0, err_msg=f"{case}: unused rows must be 0")
    if grads is None:
        return
    for name, g, x, r, lo in zip(("dq", "dk", "dv", "dsinks"), grads, args, ref_grads, lo_grads):
        assert g.shape == x.shape and g.dtype == x.dtype, f"{case}: {name} {g.shape} {g.dtype}"
        g = np.asarray(g.astype(jnp.float32))
        check_close(g, r, lo, dtype=case.dtype, name=f"{case}: {name}")
        exact_zero = r == 0
        if name != "dsinks":  # rows outside every sequence / past seqused: exactly 0
            rows = exact_zero.reshape(r.shape[0], -1).all(axis=1)
            np.testing.assert_array_equal(g[rows], 0.0, err_msg=f"{case}: {name} of unused rows")


# ----------------------------------------------------------------------------- segment ids


@dataclasses.dataclass(frozen=True)
class SegmentCase:
    """A dense batch packed with documents: row b holds documents of lengths docs[b]
    (then padding with id -1 up to seqlen); q and k share the packing."""

    docs: tuple = ((30, 1, 50, 17), (64, 64), (5,))
    seqlen: int = 130
    heads_q: int = 4
    heads_kv: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    causal: bool = False
    window_size: tuple = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False

    @property
    def batch(self):
        return len(self.docs)

    @property
    def lowp(self):
        return jnp.dtype(self.dtype) != jnp.float32

    def segment_ids(self):
        ids = np.full((self.batch, self.seqlen), -1, np.int32)
        for b, lengths in enumerate(self.docs):
            at = 0
            for i, n in enumerate(lengths):
                ids[b, at:at + n] = i
                at += n
        return ids

    def varlen_view(self):
        """The same documents as a packed varlen batch over the flattened rows."""
        lengths = []
        for lengths_b in self.docs:
            used = sum(lengths_b)
            lengths += list(lengths_b) + [self.seqlen - used]  # the padding is one more "document"
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return cu, max(lengths)

    def options(self):
        return dict(causal=self.causal, window_size=self.window_size, softcap=self.softcap)

    def __str__(self):
        docs = "_".join("-".join(map(str, d)) for d in self.docs)
        s = f"docs{docs}-s{self.seqlen}-h{self.heads_q}/{self.heads_kv}-d{self.head_dim}-{self.dtype}"
        for flag, tag in ((self.causal, "causal"), (self.sinks, "sinks"),
                          (self.softcap, f"cap{self.softcap:g}"),
                          (tuple(self.window_size) != (-1, -1), f"w{self.window_size[0]}_{self.window_size[1]}")):
            if flag:
                s += f"-{tag}"
        return s


def segment_reference(case: SegmentCase, per_segment=False):
    """f(q, k, v, sinks=None, compute_dtype=float64) -> (out, lse): the reference of the
    case's packing, with segment ids (one program), or (`per_segment`) as the varlen
    reference over the flattened rows, segment by segment (test_varlen checks that they
    agree)."""
    ids = case.segment_ids()
    cu, max_len = case.varlen_view()

    def dense(q, k, v, sinks=None, compute_dtype=jnp.float64):
        return reference.attention(q, k, v, sinks=sinks, return_lse=True,
                                   compute_dtype=compute_dtype, q_segment_ids=ids,
                                   kv_segment_ids=ids, **case.options())

    def segments(q, k, v, sinks=None, compute_dtype=jnp.float64):
        flat = [x.reshape((-1,) + x.shape[2:]) for x in (q, k, v)]
        out, lse = reference.attention_varlen(*flat, cu, cu, max_len, max_len, sinks=sinks,
                                              return_lse=True, compute_dtype=compute_dtype,
                                              **case.options())
        lse = lse.reshape(case.heads_q, case.batch, case.seqlen).transpose(1, 0, 2)
        return out.reshape(q.shape[:-1] + (v.shape[-1],)), lse
    return segments if per_segment else dense


def check_segments(case: SegmentCase, device=None, seed=0, deterministic=False):
    """flash_attention with segment ids against the float64 reference with segment ids
    (segment_reference), forward and gradients."""
    keys = jax.random.split(jax.random.key(seed), 6)
    shape_q = (case.batch, case.seqlen, case.heads_q, case.head_dim)
    shape_k = (case.batch, case.seqlen, case.heads_kv, case.head_dim)
    q, k, v = (rand(kk, s, case.dtype) for kk, s in zip(keys, (shape_q, shape_k, shape_k)))
    sinks = rand(keys[3], (case.heads_q,), jnp.float32) if case.sinks else None
    d_out = rand(keys[4], shape_q, case.dtype)
    d_lse = rand(keys[5], (case.batch, case.heads_q, case.seqlen), jnp.float32)
    ids = case.segment_ids()
    dev = device or cpu()

    def ours(q, k, v, sinks=None):
        return flashjax.flash_attention(q, k, v, sinks=sinks, return_lse=True,
                                        q_segment_ids=jax.device_put(jnp.asarray(ids), dev),
                                        kv_segment_ids=jax.device_put(jnp.asarray(ids), dev),
                                        deterministic=deterministic, **case.options())

    reference_fn = segment_reference(case)
    args = (q, k, v, sinks) if case.sinks else (q, k, v)
    (out, lse), pull = jax.vjp(ours, *jax.device_put(args, dev))
    grads = pull(jax.device_put((d_out, d_lse), dev))
    (r_out, r_lse), r_grads = value_and_pullback(
        reference_fn, [x.astype(jnp.float64) for x in args],
        (d_out.astype(jnp.float64), d_lse.astype(jnp.float64)))
    lo_out, lo_grads = None, [None] * len(args)
    if case.lowp:
        lo = functools.partial(reference_fn, compute_dtype=case.dtype)
        (lo_out, _), lo_grads = value_and_pullback(lo, args, (d_out, d_lse))
        lo_out = np.asarray(lo_out.astype(jnp.float32))
        lo_grads = [np.asarray(g.astype(jnp.float32)) for g in lo_grads]
    check_close(np.asarray(out.astype(jnp.float32)), np.asarray(r_out), lo_out, dtype=case.dtype,
                name=f"{case}: out")
    check_lse_rows(lse, r_lse, f"{case}: lse")
    for name, g, r, lo in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads, lo_grads):
        check_close(np.asarray(g.astype(jnp.float32)), np.asarray(r), lo, dtype=case.dtype,
                    name=f"{case}: {name}")


# ----------------------------------------------------------------------------- case lists

def varlen_cases(dtypes=("float32",)):
    """Length mixes (0, 1, odd, above one tile), options, GQA, head dims, seqused, padding."""
    cases = []
    for dt in dtypes:
        cases += [
            VarlenCase(dtype=dt),
            VarlenCase(dtype=dt, causal=True),
            VarlenCase(dtype=dt, causal=True, sinks=True, pad_q=7, pad_k=3),
            VarlenCase(dtype=dt, window_size=(9, 3), softcap=4.0, sinks=True),
            VarlenCase(dtype=dt, lengths_q=(1, 1, 1), lengths_k=(200, 1, 77), heads_q=8,
                       heads_kv=1, causal=True),
            VarlenCase(dtype=dt, lengths_q=(130, 64, 3), lengths_k=(130, 64, 3), causal=True,
                       seqused_q=(100, 64, 0), seqused_k=(120, 10, 3)),
            VarlenCase(dtype=dt, head_dim=40, head_dim_v=72, lengths_q=(65, 17),
                       lengths_k=(17, 65), causal=True, sinks=True),
            # positions (chunked prefill: each sequence's queries continue its keys)
            VarlenCase(dtype=dt, causal=True, sinks=True, q_offset=(4, 0, 0, 0, 97),
                       kv_offset=(0, 0, 0, 0, 0)),
            VarlenCase(dtype=dt, window_size=(9, 3), q_offset=(0, 3, 30, 1, 500),
                       kv_offset=(5, 0, 0, 2, 400), seqused_k=(9, 2, 64, 1, 100)),
        ]
    return cases


def segment_cases(dtypes=("float32",)):
    cases = []
    for dt in dtypes:
        cases += [SegmentCase(dtype=dt), SegmentCase(dtype=dt, causal=True, sinks=True),
                  SegmentCase(dtype=dt, window_size=(5, 2), softcap=3.0, heads_kv=1)]
    return cases
