"""Packed-document benchmark: ``python -m flashjax.bench --varlen uniform|longtail|both``.

A batch of ``--tokens`` tokens (default 64k on GPU, 4k on CPU) made of documents
whose lengths are drawn from a mix:

- ``uniform``: lengths uniform in [256, 8192];
- ``longtail``: log-normal lengths (median 512) clipped to [32, 16384]: many short
  documents and a few long ones.

Implementations, all in one process on the same documents:

- ``varlen``: ``flashjax.flash_attention_varlen`` on the packed rows;
- ``segments``: ``flashjax.flash_attention`` on the same packing as one row of
  ``--tokens`` tokens with segment ids;
- ``padded``: ``flashjax.flash_attention`` on a right-padded batch (one document a
  row, max length) with ``seqused_q/k``;
- ``cudnn-padded``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on that
  padded batch with ``query_seq_lengths`` / ``key_value_seq_lengths`` (GPU only);
- ``dense-mean``: ``flashjax.flash_attention`` on a dense batch of the mix's mean
  length (the same token count): the yardstick for varlen's efficiency.

TFLOP/s count real query-key pairs only (sum of L^2, or L(L+1)/2 when causal; the
FlashAttention factor 4*h*d per pair, 3.5x for fwd+bwd). Times are per call, the
median over ``--iters`` runs of a jitted loop of ``--loop`` dependent calls (default
10) after warm-up.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import bench_core

MIXES = ("uniform", "longtail")
IMPLS = ("varlen", "segments", "padded", "cudnn-padded", "dense-mean")  # --impl
GPU_TOKENS, CPU_TOKENS = 65536, 4096
HIDDEN = 2048  # heads * head_dim, as in the FA3 shapes
DEFAULT_LOOP = 10


def document_lengths(mix: str, tokens: int, seed: int = 0) -> np.ndarray:
    """Lengths summing to `tokens` (the last one cut to fit)."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < tokens:
        if mix == "uniform":
            n = int(rng.integers(256, 8193))
        else:
            n = int(np.clip(rng.lognormal(np.log(512), 1.2), 32, 16384))
        n = min(n, tokens - total)
        lengths.append(n)
        total += n
    return np.asarray(lengths, np.int32)


@dataclasses.dataclass(frozen=True)
class Mix:
    name: str
    lengths: tuple
    head_dim: int
    heads: int
    dtype: str
    causal: bool

    @property
    def tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def mean_length(self) -> int:
        return max(1, round(self.tokens / len(self.lengths)))

    def pairs(self, lengths) -> float:
        lengths = np.asarray(lengths, np.float64)
        return float(np.sum(lengths * (lengths + 1) / 2 if self.causal else lengths ** 2))

    def label(self) -> str:
        return (f"{self.name} {len(self.lengths)} docs ({self.tokens} tokens, mean "
                f"{self.mean_length}, max {max(self.lengths)}) h={self.heads} d={self.head_dim} "
                f"{self.dtype} causal={int(self.causal)}")


def _inputs(shape_q, shape_k, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    dt = bench_core.DTYPES[dtype]
    return (jax.random.normal(kq, shape_q, dt), jax.random.normal(kk, shape_k, dt),
            jax.random.normal(kv, shape_k, dt), jax.random.normal(kd, shape_q, dt))


def implementation(impl: str, mix: Mix):
    """(fn(q, k, v) -> out, inputs (q, k, v, dout), real pairs) of one implementation."""
    import flashjax

    lengths = np.asarray(mix.lengths, np.int32)
    h, d, causal = mix.heads, mix.head_dim, mix.causal
    longest = int(lengths.max())
    if impl == "varlen":
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        fn = lambda q, k, v: flashjax.flash_attention_varlen(q, k, v, cu, cu, longest, longest,
                                                             causal=causal)
        return fn, _inputs((mix.tokens, h, d), (mix.tokens, h, d), mix.dtype), mix.pairs(lengths)
    if impl == "segments":
        ids = jnp.asarray(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None])
        fn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, q_segment_ids=ids,
                                                      kv_segment_ids=ids)
        shape = (1, mix.tokens, h, d)
        return fn, _inputs(shape, shape, mix.dtype), mix.pairs(lengths)
    if impl in ("padded", "cudnn-padded"):
        used = jnp.asarray(lengths)
        if impl == "padded":
            fn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal, seqused_q=used,
                                                          seqused_k=used)
        else:
            if not bench_core.on_gpu():
                raise bench_core.Unsupported("needs a CUDA GPU")
            fn = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, query_seq_lengths=used, key_value_seq_lengths=used,
                implementation="cudnn")
        shape = (len(lengths), longest, h, d)
        return fn, _inputs(shape, shape, mix.dtype), mix.pairs(lengths)
    if impl == "dense-mean":
        batch, seqlen = max(1, mix.tokens // mix.mean_length), mix.mean_length
        fn = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal)
        shape = (batch, seqlen, h, d)
        return fn, _inputs(shape, shape, mix.dtype), mix.pairs([seqlen] * batch)
    raise ValueError(impl)


def measure(impl: str, mix: Mix, mode: str, warmup: int, iters: int, loop: int) -> dict:
    record = {"mix": mix.name, "docs": len(mix.lengths), "tokens": mix.tokens,
              "mean_length": mix.mean_length, "max_length": max(mix.lengths),
              "heads": mix.heads, "head_dim": mix.head_dim, "dtype": mix.dtype,
              "causal": mix.causal, "mode": mode, "impl": impl, "ms": None, "tflops": None,
              "error": None}
    try:
        fn, inputs, pairs = implementation(impl, mix)
        step, args = bench_core.build_step(fn, mode, *inputs, loop=loop)
        ms = bench_core.median_ms(step, args, warmup, iters) / loop
        flops = 4.0 * pairs * mix.heads * mix.head_dim * bench_core.MODE_FLOP_FACTOR[mode]
        record.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    except Exception as e:  # noqa: BLE001 -- a failure becomes an "n/a" cell
        record["error"] = bench_core.short_reason(e)
    return record


def main(args) -> int:
    gpu = bench_core.on_gpu()
    mixes = MIXES if args.varlen == "both" else (args.varlen,)
    head_dims = args.head_dim or [64, 128]
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    causals = {"no": [False], "yes": [True], "both": [False, True], None: [False, True]}[args.causal]
    modes = args.mode or ["fwd", "fwdbwd"]
    impls = [i for i in (args.impl or IMPLS) if gpu or i != "cudnn-padded"]
    tokens = args.tokens or (GPU_TOKENS if gpu else CPU_TOKENS)
    iters = args.iters or (10 if gpu else 3)
    loop = args.loop if args.loop > 1 else (DEFAULT_LOOP if gpu else 1)
    info = bench_core.device_info()
    print(f"device: {info['device']} ({info['platform']}), jax {info['jax']}; "
          f"per-call median of {iters} runs of {loop} dependent calls", flush=True)
    json_file = open(args.json, "w") if args.json else None
    records = []
    for mix_name in mixes:
        lengths = tuple(int(n) for n in document_lengths(mix_name, tokens))
        for head_dim in head_dims:
            for causal in causals:
                mix = Mix(mix_name, lengths, head_dim, max(1, HIDDEN // head_dim), dtype, causal)
                print(mix.label(), flush=True)
                for mode in modes:
                    for impl in impls:
                        r = measure(impl, mix, mode, args.warmup, iters, loop)
                        cell = (f"{r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s" if r["ms"]
                                else f"n/a ({r['error']})")
                        print(f"  {mode:6s} {impl:13s} {cell}", flush=True)
                        bench_core.keep_record(records, {**info, **r}, json_file)
                    jax.clear_caches()
    if json_file:
        json_file.close()
    print("\n" + summary(records))
    return 0 if any(r["ms"] for r in records) else 1


def summary(records: list[dict]) -> str:
    """The targets' ratios per (mix, d, causal, mode): varlen vs dense-mean TFLOP/s,
    varlen time vs cudnn-padded, segments time vs varlen."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["mix"], r["head_dim"], r["causal"], r["mode"]), {})[r["impl"]] = r
    rows = []
    for (mix, d, causal, mode), by in groups.items():
        def ratio(a, b, key):
            x, y = by.get(a, {}).get(key), by.get(b, {}).get(key)
            return f"{x / y:.2f}" if x and y else "n/a"
        rows.append([mix, str(d), "yes" if causal else "no", mode,
                     *(f"{by[i]['tflops']:.1f}" if by.get(i, {}).get("tflops") else "n/a"
                       for i in IMPLS),
                     ratio("varlen", "dense-mean", "tflops"), ratio("varlen", "cudnn-padded", "ms"),
                     ratio("segments", "varlen", "ms")])
    header = ["mix", "d", "causal", "mode", *(f"{i} TF/s" for i in IMPLS),
              "varlen/dense-mean TF", "varlen/cudnn time", "segments/varlen time"]
    return bench_core.format_table(header, rows)

