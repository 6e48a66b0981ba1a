#!/usr/bin/env python3
"""Randomised differential runs of flashjax against independent definitions.

    python tools/fuzz_attention.py [--mode dense|varlen|kvcache|nn] [--impl cpu|xla|cuda] \
        [--dtype float32|bfloat16|float16] [--large] [--start 0] [--count 100]

dense: `flashjax.flash_attention` with a random combination of its options (GQA, causal,
windows, softcap, sinks, bias and mask of every broadcast shape, ALiBi, dropout,
seqused_k, segment ids, position offsets, deterministic, a scale) against
`flashjax.reference.attention` in float64 on the same (rounded) inputs: out, lse and the
gradients of q, k, v and bias. varlen: `flash_attention_varlen` (packed sequences, some
empty, padding past the last, seqused_q / seqused_k) against
`reference.attention_varlen`, likewise. kvcache: `flash_attention_with_kvcache`
(contiguous, paged, cache_batch_idx, leftpad, appended tokens, rotary, splits, bias,
mask, float8 caches with descales) against its pure-JAX path (`implementation="xla"`,
itself checked against the reference by the test suite): out, lse and the updated
caches. nn:
`flashjax.nn.dot_product_attention` against `jax.nn.dot_product_attention(
implementation="xla")` (rank 3 and 4, bias, mask, windows, lengths), out and gradients,
on the rows jax.nn defines (a row that sees no key is left out: jax.nn averages every
value there). Each case is a seed: a failure prints its seed, shapes and options, and
the run exits 1. --large takes the GPU kernels' head dims (64 to 256) and longer
sequences; on the GPU machine run with --impl cuda and a 16-bit dtype. (A first run of
the CPU path's version found two bugs, in the reference itself: benchmarks/NOTES.md,
"Nineteenth session".)
"""

import argparse
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import flashjax  # noqa: E402  (after x64: the reference computes in float64)
import flashjax.nn  # noqa: E402
from flashjax import reference  # noqa: E402

# |got - want| <= ATOL + RTOL * |want| for out and lse; gradients relative to the largest
# reference entry (a gradient's error scales with its largest terms).
TOLERANCES = {"float32": (2e-4, 2e-4, 5e-4), "bfloat16": (2e-2, 2e-2, 4e-2),
              "float16": (5e-3, 5e-3, 1e-2)}


def dense_case(rng, large):
    """Shapes (b, sq, sk, hq, hk, d, dv) and the options to draw inputs for."""
    b, hk, group = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2, 3])
    if large:
        sq, sk = rng.choice([1, 64, 130, 257]), rng.choice([1, 70, 129, 300])
        d = rng.choice([64, 96, 128, 192, 256])
        dv = d
    else:
        sq, sk = rng.choice([1, 3, 17, 40, 65]), rng.choice([1, 5, 17, 40, 70])
        d = rng.choice([8, 16, 24, 40])
        dv = rng.choice([d, 8, 32])
    o = {}
    if rng.random() < 0.4:
        o["causal"] = True
    if rng.random() < 0.25:
        o["window_size"] = (rng.choice([-1, 0, 3, 9]), rng.choice([-1, 0, 2, 7]))
    if rng.random() < 0.2:
        o["softcap"] = rng.choice([2.0, 10.0])
    if rng.random() < 0.2:
        o["sinks"] = True
    if rng.random() < 0.3:
        o["bias"] = (rng.choice([1, b]), rng.choice([1, hk * group, hk]))
    if rng.random() < 0.3:
        o["mask"] = (rng.choice([1, b]), rng.choice([1, hk * group, hk]))
    if rng.random() < 0.25:
        o["alibi_slopes"] = rng.choice(["heads", "batch_heads"])
    if rng.random() < 0.2:
        o["dropout_rate"] = rng.choice([0.1, 0.5])
    if rng.random() < 0.2:
        o["seqused_k"] = True
    if rng.random() < 0.15:
        o["segments"] = True
    if rng.random() < 0.15:
        o["offsets"] = True
    if rng.random() < 0.2:
        o["deterministic"] = True
    if rng.random() < 0.3:
        o["softmax_scale"] = rng.choice([0.1, 0.7])
    return (b, sq, sk, hk * group, hk, d, dv), o


def dense_inputs(shape, o, key, dtype):
    """q, k, v in dtype and flash_attention's keyword arguments."""
    b, sq, sk, hq, hk, d, dv = shape
    keys = iter(jax.random.split(key, 12))
    normal = lambda s: jax.random.normal(next(keys), s, jnp.float32)
    q, k, v = (normal(s).astype(dtype) for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv)))
    kw = {n: o[n] for n in ("causal", "window_size", "softcap", "deterministic",
                            "softmax_scale", "dropout_rate") if n in o}
    if "sinks" in o:
        kw["sinks"] = normal((hq,))
    if "bias" in o:
        kw["bias"] = normal((*o["bias"], sq, sk))
    if "mask" in o:
        kw["mask"] = jax.random.uniform(next(keys), (*o["mask"], sq, sk)) < 0.7
    if "alibi_slopes" in o:
        kw["alibi_slopes"] = 0.5 * jax.random.uniform(
            next(keys), (hq,) if o["alibi_slopes"] == "heads" else (b, hq), jnp.float32)
    if "dropout_rate" in o:
        kw["dropout_key"] = jax.random.key(7)
    if "seqused_k" in o:
        kw["seqused_k"] = jax.random.randint(next(keys), (b,), 0, sk + 1).astype(jnp.int32)
    if "segments" in o:
        ids = lambda s: jnp.sort(jax.random.randint(next(keys), (b, s), 0, 3), axis=1)
        kw["q_segment_ids"], kw["kv_segment_ids"] = ids(sq).astype(jnp.int32), ids(sk).astype(jnp.int32)
    if "offsets" in o:
        kw["q_offset"], kw["kv_offset"] = position_offsets(next(keys))
    return q, k, v, kw


def position_offsets(key):
    """(q_offset, kv_offset): Python ints in [0, 20)."""
    return tuple(int(x) for x in jax.random.randint(key, (2,), 0, 20))


def to_float64(x):
    """A floating-point array in float64 (the references' inputs); anything else (None,
    bool masks, integer lengths, Python options) as it is."""
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.float64)
    return x


def max_relative(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not got.size:
        return 0.0
    return float(np.max(np.abs(got - want))) / (1.0 + float(np.max(np.abs(want))))


def within(got, want, atol, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    both_neg_inf = np.isneginf(got) & np.isneginf(want)
    with np.errstate(invalid="ignore"):  # (-inf - -inf: masked by both_neg_inf)
        err = np.where(both_neg_inf, 0.0, np.abs(got - want) - rtol * np.abs(want))
    return bool(np.all(err <= atol)), float(np.max(err, initial=0.0))


def gradient_errors(ours, theirs, args, weights, gtol, names=("dq", "dk", "dv", "dbias"),
                    rounded_to=None):
    """The gradients of sum(f(*args) * weights) (in float64) by ours and by theirs that
    differ by more than gtol, relative to theirs' largest entry: ["dq err ...", ...].
    rounded_to (ours' output dtype; theirs then takes return_lse=True): also accept the
    gradients of FlashAttention's backward exactly, which takes D = rowsum(dO * O) from
    the output rounded to that dtype (the error of the algorithm, not of a kernel: at a
    peaked softmax in bfloat16 it exceeds gtol; jax.nn's autodiff keeps P in float32).
    With D off by delta_i = dO_i . (round(O_i) - O_i), FlashAttention's dS_ij is
    P_ij (dP_ij - D_i - delta_i): the gradient of sum(O * weights) - sum_i delta_i lse_i
    with delta held constant (d lse_i / d s_ij = P_ij)."""
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float64) * weights)
    argnums = tuple(range(len(args)))
    got = jax.grad(loss(ours), argnums)(*args)
    wants = [jax.grad(loss(theirs), argnums)(*args)]
    if rounded_to is not None:
        def rounded_d_loss(*a):
            out, lse = theirs(*a, return_lse=True)
            out = out.astype(jnp.float64)
            delta = jax.lax.stop_gradient(
                jnp.sum(weights * (out.astype(rounded_to).astype(jnp.float64) - out), -1))
            rows = jnp.where(jnp.isfinite(lse), lse, 0.0)  # (a row without keys: out 0)
            return jnp.sum(out * weights) - jnp.sum(jnp.swapaxes(delta, -1, -2) * rows)
        wants.append(jax.grad(rounded_d_loss, argnums)(*args))
    bad = []
    for i, (name, a) in enumerate(zip(names, got)):
        err = min(max_relative(a, w[i]) for w in wants)
        if not np.isfinite(err) or err > gtol:
            bad.append(f"{name} err {err:.3g}")
    return bad


def run_dense(seed, impl, dtype, large):
    rng = random.Random(seed)
    shape, o = dense_case(rng, large)
    q, k, v, kw = dense_inputs(shape, o, jax.random.key(seed), dtype)
    atol, rtol, gtol = TOLERANCES[dtype]
    try:
        out, lse = flashjax.flash_attention(q, k, v, return_lse=True, implementation=impl, **kw)
    except (ValueError, TypeError, NotImplementedError) as e:  # (a combination refused)
        return "raised", shape, o, str(e)[:150]
    rkw = {n: x for n, x in kw.items() if n != "deterministic"}
    ref = lambda *a, **x: reference.attention(*a, compute_dtype=jnp.float64, **x)
    rout, rlse = ref(q, k, v, return_lse=True, **rkw)
    bad = []
    for name, got, want in (("out", out, rout), ("lse", lse, rlse)):
        ok, err = within(got, want, atol, rtol)
        if not ok:
            bad.append(f"{name} err {err:.3g}")
    weights = jax.random.normal(jax.random.key(seed + 1), out.shape, jnp.float64)
    extra = {n: x for n, x in kw.items() if n != "bias"}
    rextra = {n: x for n, x in rkw.items() if n != "bias"}
    with_bias = lambda extra, bias: extra if bias is None else dict(extra, bias=bias)
    ours = lambda q, k, v, bias=None: flashjax.flash_attention(
        q, k, v, implementation=impl, **with_bias(extra, bias))
    theirs = lambda q, k, v, bias=None, **x: ref(*map(to_float64, (q, k, v)),
                                                 **with_bias(rextra, to_float64(bias)), **x)
    args = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    try:
        bad += gradient_errors(ours, theirs, args, weights, gtol, rounded_to=out.dtype)
    except (ValueError, TypeError, NotImplementedError) as e:
        bad.append("gradient raised " + str(e)[:120])
    return ("bad" if bad else "ok"), shape, o, "; ".join(bad)


def visible_rows(q, k, kw, rank3):
    """(batch, seqlen_q, heads, 1): the rows jax.nn defines (some key visible, within
    query_seq_lengths)."""
    batch, sq, sk = (1, q.shape[0], k.shape[0]) if rank3 else (q.shape[0], q.shape[1], k.shape[1])
    heads = q.shape[-2]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    vis = np.ones((batch, heads, sq, sk), bool)
    if kw.get("is_causal"):
        vis &= i >= j
    window = kw.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis &= (j >= i - left) & (j <= i + right)
    if "mask" in kw:
        mask = np.asarray(kw["mask"])
        vis &= mask if mask.ndim == 4 else mask[None]
    if "key_value_seq_lengths" in kw:
        vis &= j[None, None] < np.asarray(kw["key_value_seq_lengths"])[:, None, None, None]
    padded = np.zeros((batch, sq), bool)
    if "query_seq_lengths" in kw:
        padded = np.arange(sq)[None] >= np.asarray(kw["query_seq_lengths"])[:, None]
    keep = (vis.any(-1) & ~padded[:, None, :]).transpose(0, 2, 1)[..., None]
    return keep[0] if rank3 else keep


def run_nn(seed, impl, dtype, large):
    rng = random.Random(seed)
    b, hk, group = rng.choice([1, 2]), rng.choice([1, 2]), rng.choice([1, 2])
    hq = hk * group
    sq, sk = (rng.choice([1, 64, 200]), rng.choice([1, 70, 200])) if large else \
        (rng.choice([1, 7, 33]), rng.choice([1, 9, 33]))
    d = rng.choice([64, 128]) if large else rng.choice([8, 16])
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda s: jax.random.normal(next(keys), s, jnp.float32)
    q, k, v = (normal(s).astype(dtype) for s in ((b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, d)))
    kw = {}
    if rng.random() < 0.4:
        kw["is_causal"] = True
    if rng.random() < 0.3:
        kw["bias"] = normal((rng.choice([1, b]), rng.choice([1, hq]), sq, sk)).astype(dtype)
    if rng.random() < 0.3:
        kw["mask"] = jax.random.uniform(next(keys), (rng.choice([1, b]), rng.choice([1, hq]),
                                                     sq, sk)) < 0.7
    if rng.random() < 0.3:
        kw["scale"] = 0.3
    if rng.random() < 0.25:
        kw["local_window_size"] = rng.choice([3, (2, 1), (0, 4)])
    if rng.random() < 0.2:
        kw["query_seq_lengths"] = jax.random.randint(next(keys), (b,), 1, sq + 1).astype(jnp.int32)
    if rng.random() < 0.2:
        kw["key_value_seq_lengths"] = jax.random.randint(next(keys), (b,), 1, sk + 1).astype(jnp.int32)
    rank3 = rng.random() < 0.2
    if rank3:
        q, k, v = q[0], k[0], v[0]
        kw = {n: (x[0] if n in ("bias", "mask") else x) for n, x in kw.items()
              if n not in ("query_seq_lengths", "key_value_seq_lengths")}
    desc = dict(b=b, hq=hq, hk=hk, sq=sq, sk=sk, d=d, rank3=rank3)
    atol, rtol, gtol = TOLERANCES[dtype]
    theirs = lambda q, k, v: jax.nn.dot_product_attention(
        *map(to_float64, (q, k, v)), implementation="xla",
        **{n: to_float64(x) for n, x in kw.items()})
    ours = lambda q, k, v: flashjax.nn.dot_product_attention(q, k, v, implementation=impl, **kw)
    try:
        got = ours(q, k, v)
    except (ValueError, TypeError, NotImplementedError) as e:
        return "raised", desc, sorted(kw), str(e)[:150]
    want = theirs(q, k, v)
    keep = visible_rows(q, k, kw, rank3)
    bad = []
    ok, err = within(np.where(keep, got.astype(jnp.float64), 0), np.where(keep, want, 0), atol, rtol)
    if not ok:
        bad.append(f"out err {err:.3g}")
    if keep.all():  # (gradients where every row is defined)
        weights = jax.random.normal(next(keys), want.shape, jnp.float64)
        bad += gradient_errors(ours, theirs, (q, k, v), weights, gtol)
    return ("bad" if bad else "ok"), desc, sorted(kw), "; ".join(bad)


def position_and_score_options(rng, keys, heads_q):
    """The options the varlen and KV-cache calls draw alike: causal, a window, softcap,
    sinks and ALiBi slopes (keys: an iterator of PRNG keys)."""
    kw = {}
    if rng.random() < 0.4:
        kw["causal"] = True
    if rng.random() < 0.25:
        kw["window_size"] = (rng.choice([-1, 0, 2, 5]), rng.choice([-1, 0, 1, 3]))
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([4.0, 5.0])
    if rng.random() < 0.2:
        kw["sinks"] = jax.random.normal(next(keys), (heads_q,), jnp.float32)
    if rng.random() < 0.2:
        kw["alibi_slopes"] = jax.random.uniform(next(keys), (heads_q,), jnp.float32)
    return kw


def run_varlen(seed, impl, dtype, large):
    rng = random.Random(seed)
    n, hk, group = rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.choice([1, 2])
    hq = hk * group
    if large:
        d = rng.choice([64, 128, 256])
        dv = d
        lq = [rng.choice([0, 1, 70, 129, 200]) for _ in range(n)]
        lk = [rng.choice([0, 1, 65, 130, 257]) for _ in range(n)]
    else:
        d = rng.choice([8, 16, 40])
        dv = rng.choice([d, 16])
        lq = [rng.choice([0, 1, 5, 17, 33]) for _ in range(n)]
        lk = [rng.choice([0, 1, 9, 17, 40]) for _ in range(n)]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lq, lk))
    total_q, total_k = int(cu_q[-1]) + rng.choice([0, 3]), int(cu_k[-1]) + rng.choice([0, 5])
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    normal = lambda s: jax.random.normal(next(keys), s, jnp.float32)
    q, k, v = (normal(s).astype(dtype) for s in ((total_q, hq, d), (total_k, hk, d), (total_k, hk, dv)))
    kw = position_and_score_options(rng, keys, hq)
    if rng.random() < 0.2:
        kw["seqused_k"] = np.array([rng.randint(0, x) for x in lk], np.int32)
    if rng.random() < 0.2:
        kw["seqused_q"] = np.array([rng.randint(0, x) for x in lq], np.int32)
    if rng.random() < 0.2:
        kw["dropout_rate"], kw["dropout_key"] = 0.2, jax.random.key(3)
    max_q, max_k = max(lq + [1]), max(lk + [1])
    desc = dict(n=n, hq=hq, hk=hk, d=d, dv=dv, lq=lq, lk=lk)
    atol, rtol, gtol = TOLERANCES[dtype]
    ours_kw = {name: (jnp.asarray(x) if name.startswith("seqused") else x) for name, x in kw.items()}
    ours = lambda q, k, v, **x: flashjax.flash_attention_varlen(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_q, max_k, implementation=impl,
        **ours_kw, **x)
    ref = lambda q, k, v, **x: reference.attention_varlen(
        *map(to_float64, (q, k, v)), cu_q, cu_k, max_q, max_k, compute_dtype=jnp.float64,
        **kw, **x)
    try:
        out, lse = ours(q, k, v, return_lse=True)
    except (ValueError, TypeError, NotImplementedError) as e:
        return "raised", desc, sorted(kw), str(e)[:150]
    rout, rlse = ref(q, k, v, return_lse=True)
    bad = []
    for name, got, want in (("out", out, rout), ("lse", lse, rlse)):
        if np.shape(got) != np.shape(want):
            bad.append(f"{name} shape {np.shape(got)} vs {np.shape(want)}")
            continue
        ok, err = within(got, want, atol, rtol)
        if not ok:
            bad.append(f"{name} err {err:.3g}")
    weights = jax.random.normal(next(keys), out.shape, jnp.float64)
    bad += gradient_errors(ours, ref, (q, k, v), weights, gtol, rounded_to=out.dtype)
    return ("bad" if bad else "ok"), desc, sorted(kw), "; ".join(bad)


def run_kvcache(seed, impl, dtype, large):
    rng = random.Random(seed)
    b, hk, group = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([1, 2, 4])
    hq = hk * group
    d = rng.choice([64, 128, 256]) if large else rng.choice([8, 16, 32])
    dv = d if large else rng.choice([d, 16])
    sq = rng.choice([1, 1, 2, 4])
    new = rng.choice([0, 0, 1, sq])
    page = rng.choice([1, 4, 16]) if rng.random() < 0.4 else 0
    capacity = rng.choice([300, 1000, 2048]) if large else rng.choice([8, 24, 48])
    if page:
        capacity = -(-capacity // page) * page
    keys = iter(jax.random.split(jax.random.key(seed), 24))
    normal = lambda s: jax.random.normal(next(keys), s, jnp.float32).astype(dtype)
    q = normal((b, sq, hq, d))
    kw = {}
    cache_dtype = rng.choice(FLOAT8_CACHES) if rng.random() < FLOAT8_CACHE_CHANCE else None
    if page:
        pages = b * capacity // page + rng.choice([0, 2])
        k_cache, v_cache = normal((pages, page, hk, d)), normal((pages, page, hk, dv))
        kw["page_table"] = jax.random.permutation(next(keys), pages)[: b * (capacity // page)] \
            .reshape(b, capacity // page).astype(jnp.int32)
    else:
        extra = rng.choice([0, 1])
        k_cache, v_cache = normal((b + extra, capacity, hk, d)), normal((b + extra, capacity, hk, dv))
        if extra and rng.random() < 0.5:
            kw["cache_batch_idx"] = jax.random.permutation(next(keys), b + extra)[:b].astype(jnp.int32)
    if cache_dtype is not None:  # descales of every broadcast shape
        k_cache, v_cache = k_cache.astype(cache_dtype), v_cache.astype(cache_dtype)
        for name in ("k_descale", "v_descale"):
            kw[name] = jax.random.uniform(next(keys), rng.choice([(), (b, 1), (1, hk), (b, hk)]),
                                          jnp.float32, 0.25, 2.0)
    seqlens = jax.random.randint(next(keys), (b,), 0, capacity - new + 1).astype(jnp.int32)
    if rng.random() < 0.3 and not page:
        kw["cache_leftpad"] = jnp.minimum(jax.random.randint(next(keys), (b,), 0, 4),
                                          seqlens).astype(jnp.int32)
    if new:
        kw["k"], kw["v"] = normal((b, new, hk, d)), normal((b, new, hk, dv))
    kw.update(position_and_score_options(rng, keys, hq))
    if rng.random() < 0.15:
        kw["bias"] = jax.random.normal(next(keys), (1, hq, sq, capacity), jnp.float32)
    if rng.random() < 0.15:
        kw["mask"] = jax.random.uniform(next(keys), (b, 1, sq, capacity)) < 0.7
    if rng.random() < 0.2 and new and d >= 32:  # (rotary dims: multiples of 16)
        rotary_dim = rng.choice([16, d])
        angles = jax.random.uniform(next(keys), (capacity + 4, rotary_dim // 2), jnp.float32)
        kw["rotary_cos"], kw["rotary_sin"] = jnp.cos(angles), jnp.sin(angles)
        kw["rotary_interleaved"] = rng.random() < 0.5
    if rng.random() < 0.3:
        kw["num_splits"] = rng.choice([1, 2, 3])
    desc = dict(b=b, hq=hq, hk=hk, d=d, dv=dv, sq=sq, new=new, page=page, capacity=capacity,
                cache=jnp.dtype(cache_dtype or dtype).name)
    call = lambda implementation: flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True,
        implementation=implementation, **kw)
    try:
        got = call(impl)
    except (ValueError, TypeError, NotImplementedError) as e:
        return "raised", desc, sorted(kw), str(e)[:150]
    want = call("xla")
    atol, rtol, _ = TOLERANCES[dtype]
    bad = []
    for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), got, want):
        ok, err = within(x, y, atol, rtol)
        if not ok:
            bad.append(f"{name} err {err:.3g}")
    return ("bad" if bad else "ok"), desc, sorted(kw), "; ".join(bad)


PROGRESS_EVERY = 5  # seeds between progress lines
# kvcache mode: float8 caches (read by the kernels themselves where they can) this often
FLOAT8_CACHE_CHANCE = 0.3
FLOAT8_CACHES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
RUNS = {"dense": run_dense, "varlen": run_varlen, "kvcache": run_kvcache, "nn": run_nn}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(RUNS), default="dense")
    parser.add_argument("--impl", default=None,
                        help="flashjax's implementation= (default: the platform's)")
    parser.add_argument("--dtype", choices=sorted(TOLERANCES), default="float32")
    parser.add_argument("--large", action="store_true",
                        help="the GPU kernels' head dims and longer sequences")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--count", type=int, default=100, help="how many seeds")
    args = parser.parse_args(argv)
    run = RUNS[args.mode]
    counts = {}
    for done, seed in enumerate(range(args.start, args.start + args.count), 1):
        result = run(seed, args.impl, args.dtype, args.large)
        counts[result[0]] = counts.get(result[0], 0) + 1
        if result[0] != "ok":
            print(seed, *result, flush=True)
        if done % PROGRESS_EVERY == 0:  # (a run cut short by a time limit still reports)
            print(f"after seed {seed}: {counts}", flush=True)
    print(counts, flush=True)
    return 1 if counts.get("bad") else 0


if __name__ == "__main__":
    sys.exit(main())
