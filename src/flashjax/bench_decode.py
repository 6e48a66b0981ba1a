"""Decoding benchmark: ``python -m flashjax.bench --decode``.

One query row per sequence attends to a KV cache of ``--cache`` tokens (batch
``--decode-batch``, heads ``--decode-heads`` as q/kv pairs, e.g. 32/8, head dims
``--head-dim``), the cache contiguous or paged (``--page-size``). Each step's query is
the previous step's output, so a step is timed as a jitted loop of ``--loop``
dependent steps (a single call's host dispatch, ~50 us through JAX, is longer than the
kernel); the time is per step, the median of ``--iters`` runs after warm-up.

Implementations, one process:

- ``flashjax``: ``flashjax.flash_attention_with_kvcache`` (no new tokens);
- ``flashjax-fp8``: the same call on the cache in float8_e4m3fn (descales per sequence
  and kv head), half the bytes (its GB/s counts the float8 bytes);
- ``xla``, ``cudnn``: ``jax.nn.dot_product_attention`` on the cache as a dense key
  sequence (cuDNN on a GPU only);
- ``pallas``: ``jax.experimental.pallas.ops.gpu.decode_attention.gqa`` (GPU, contiguous),
  ``paged_attention.paged_attention`` for paged caches (its layout, heads first, is
  made once outside the timed loop).

Next to each time: the K/V bytes read per step and that rate in GB/s, against a copy
bandwidth measured in the same run (a jitted copy of a large buffer: bytes read +
written over its time).

At batch 1 the step is short enough that how XLA launches the loop body decides it:
XLA captures runs of 5 or more thunks in a CUDA graph (command buffers), so the body
of XLA's attention (five kernels) runs as one graph launch while flashjax's body (its
call and the carry's copy) is launched thunk by thunk from the host (~20 us a step more
on an H200; tools/profile_decode.py shows the kernels, the gaps and the command
buffers). A model's decoding step is many thunks long and gets the graph:
`XLA_FLAGS=--xla_gpu_graph_min_graph_size=1` times every implementation that way (the
header shows XLA_FLAGS when set).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics

import jax
import jax.numpy as jnp

from . import bench_core

IMPLS = ("flashjax", "flashjax-fp8", "xla", "cudnn", "pallas", "torch-flash",
         "torch-cudnn")  # --impl
FP8_IMPL, FP8_CACHE_DTYPE = "flashjax-fp8", jnp.float8_e4m3fn
GPU_BATCHES, CPU_BATCHES = (1, 16, 128), (1, 4)
GPU_CACHES, CPU_CACHES = (1024, 8192, 65536), (1024, 4096)
GPU_HEADS, CPU_HEADS = ("32/8",), ("8/2",)
DEFAULT_LOOP = 20
COPY_BYTES = {"gpu": 1 << 30, "cpu": 1 << 27}


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    batch: int
    cache: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int  # 0: contiguous
    dtype: str
    shuffled: bool = True  # paged: pages in a random order over the pool

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_of(self.dtype)

    def kv_bytes_of(self, dtype) -> int:
        return 2 * self.batch * self.cache * self.heads_kv * self.head_dim * \
            jnp.dtype(dtype).itemsize

    def label(self) -> str:
        layout = (f"paged {self.page_size}{'' if self.shuffled else ' in order'}"
                  if self.page_size else "contiguous")
        return (f"b={self.batch} cache={self.cache} h={self.heads_q}/{self.heads_kv} "
                f"d={self.head_dim} {self.dtype} {layout}")


def _cache(case: DecodeCase, key):
    """(q, k_cache, v_cache, extra kwargs of flashjax's call)."""
    dt = bench_core.DTYPES[case.dtype]
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (case.batch, 1, case.heads_q, case.head_dim), dt)
    if not case.page_size:
        shape = (case.batch, case.cache, case.heads_kv, case.head_dim)
        return q, jax.random.normal(kk, shape, dt), jax.random.normal(kv, shape, dt), {}
    pages = -(-case.cache // case.page_size)
    shape = (case.batch * pages, case.page_size, case.heads_kv, case.head_dim)
    order = jnp.arange(case.batch * pages)  # pages in order, or shuffled over the pool
    if case.shuffled:
        order = jax.random.permutation(key, case.batch * pages)
    table = order.reshape(case.batch, pages)
    return (q, jax.random.normal(kk, shape, dt), jax.random.normal(kv, shape, dt),
            {"page_table": table.astype(jnp.int32)})


def attend(impl: str, case: DecodeCase, num_splits: int | None = None):
    """(step(q, k_cache, v_cache) -> out like q, k_cache, v_cache); num_splits: flashjax's
    (None: its heuristic)."""
    q, k_cache, v_cache, extra = _cache(case, jax.random.key(0))
    if impl in ("flashjax", FP8_IMPL):
        import flashjax

        seqlens = jnp.full((case.batch,), case.cache, jnp.int32)
        if impl == FP8_IMPL:
            k_cache, v_cache = (c.astype(FP8_CACHE_DTYPE) for c in (k_cache, v_cache))
            # (not one repeated value: XLA would broadcast a splat constant each step)
            descale = jnp.linspace(0.4, 0.6, case.batch * case.heads_kv,
                                   dtype=jnp.float32).reshape(case.batch, case.heads_kv)
            extra = dict(extra, k_descale=descale, v_descale=descale)
        return (lambda q, k, v: flashjax.flash_attention_with_kvcache(
            q, k, v, cache_seqlens=seqlens, num_splits=num_splits or 0, **extra)), \
            q, k_cache, v_cache
    if case.page_size and impl == "pallas":
        if not bench_core.on_gpu():
            raise bench_core.Unsupported("needs a CUDA GPU")
        from jax.experimental.pallas.ops.gpu import paged_attention

        lengths = jnp.full((case.batch,), case.cache, jnp.int32)
        table = extra["page_table"]
        pages_per_block = max(1, min(8, table.shape[1]))
        heads_first = lambda c: jnp.transpose(c, (2, 0, 1, 3))  # (heads_kv, pages, page, d)

        def paged_step(q, k, v):
            return paged_attention.paged_attention(
                q[:, 0], k, v, table, lengths,
                pages_per_compute_block=pages_per_block)[:, None].astype(q.dtype)
        return paged_step, q, heads_first(k_cache), heads_first(v_cache)
    if case.page_size:
        raise bench_core.Unsupported("contiguous caches only")
    if impl in ("xla", "cudnn"):
        if impl == "cudnn" and not bench_core.on_gpu():
            raise bench_core.Unsupported("needs a CUDA GPU")
        return (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl)), \
            q, k_cache, v_cache
    if impl == "pallas":
        if not bench_core.on_gpu():
            raise bench_core.Unsupported("needs a CUDA GPU")
        from jax.experimental.pallas.ops.gpu import decode_attention

        def step(q, k, v):  # its layout: q (batch, heads_q, d), k/v (batch, seq, heads_kv, d)
            return decode_attention.gqa(q[:, 0], k, v)[:, None].astype(q.dtype)
        return step, q, k_cache, v_cache
    raise ValueError(impl)


TORCH_BACKENDS = {"torch-flash": "FLASH_ATTENTION", "torch-cudnn": "CUDNN_ATTENTION"}


def torch_median_ms(impl: str, case: DecodeCase, warmup: int, iters: int, loop: int) -> float:
    """PyTorch's scaled_dot_product_attention on one backend (`impl`), per loop of `loop`
    dependent steps captured in a CUDA graph (so that PyTorch's own dispatch is not
    timed) and timed with CUDA events: the median of `iters` replays after warm-up.
    Its layout, heads before the sequence, is made once outside the timed loop."""
    if case.page_size:
        raise bench_core.Unsupported("contiguous caches only")
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise bench_core.Unsupported("needs PyTorch") from e
    if not torch.cuda.is_available():
        raise bench_core.Unsupported("needs a CUDA GPU")
    dt = getattr(torch, case.dtype)
    make = lambda heads, rows: torch.randn(case.batch, heads, rows, case.head_dim,
                                           device="cuda", dtype=dt)
    q, k, v = make(case.heads_q, 1), make(case.heads_kv, case.cache), make(case.heads_kv, case.cache)
    gqa = case.heads_q != case.heads_kv

    def steps(q):
        for _ in range(loop):
            q = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        return q
    with sdpa_kernel(getattr(SDPBackend, TORCH_BACKENDS[impl])):
        side = torch.cuda.Stream()  # graph capture wants its warm-up off the default stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                steps(q)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            steps(q)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(warmup + iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[warmup:])


def measure(impl: str, case: DecodeCase, warmup: int, iters: int, loop: int,
            num_splits: int | None = None) -> dict:
    """One implementation's step time on case; num_splits: flashjax's (None: its
    heuristic; the other implementations ignore it)."""
    kv_bytes = case.kv_bytes_of(FP8_CACHE_DTYPE if impl == FP8_IMPL else case.dtype)
    record = {**dataclasses.asdict(case), "impl": impl, "us": None, "gbps": None, "error": None,
              "kv_bytes": kv_bytes}
    try:
        if impl in TORCH_BACKENDS:
            ms = torch_median_ms(impl, case, warmup, iters, loop) / loop
        else:
            step, q, k_cache, v_cache = attend(impl, case, num_splits)

            def steps(q, k, v):
                return jax.lax.fori_loop(0, loop, lambda _, q: step(q, k, v).astype(q.dtype), q)
            ms = bench_core.median_ms(jax.jit(steps), (q, k_cache, v_cache), warmup, iters) / loop
        record.update(us=ms * 1e3, gbps=kv_bytes / (ms * 1e-3) / 1e9)
    except Exception as e:  # noqa: BLE001 -- a failure becomes an "n/a" cell
        record["error"] = bench_core.short_reason(e)
    return record


COPY_LOOP = 10


def copy_bandwidth(gpu: bool, warmup: int, iters: int) -> float:
    """GB/s of a jitted copy of a large buffer (bytes read + bytes written), per copy of
    a loop of COPY_LOOP dependent copies (one host-timed call would add its dispatch)."""
    n = COPY_BYTES["gpu" if gpu else "cpu"] // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copies = jax.jit(lambda x: jax.lax.fori_loop(0, COPY_LOOP, lambda _, x: x + 1.0, x))
    ms = bench_core.median_ms(copies, (x,), warmup, iters) / COPY_LOOP
    return 2 * 4 * n / (ms * 1e-3) / 1e9


PREFILL_LOOP = 5


def _median_ms_donating(loop, q, k_cache, v_cache, warmup, iters):
    """bench_core.median_ms of loop(q, caches) -> (q, caches), the caches donated and passed on."""
    state = [k_cache.copy(), v_cache.copy()]

    def run(q):
        out, state[0], state[1] = loop(q, *state)
        return out
    return bench_core.median_ms(run, (q,), warmup, iters)


def prefill(args, batches, caches, heads, head_dims, dtype, iters, info, json_file):
    """Prefill with a cache (--prefill ROWS..): `rows` new tokens appended to a contiguous
    cache of `cache - rows` tokens and attended causally (flash_attention_with_kvcache),
    against flash_attention on the same (rows x cache) shapes; TFLOP/s by the FA
    convention (4 * rows * cache * d per head; causal halves the square part only)."""
    import flashjax

    dt = bench_core.DTYPES[dtype]
    for b, n, rows, (hq, hkv), d in itertools.product(batches, caches, args.prefill, heads,
                                                     head_dims):
        key = iter(jax.random.split(jax.random.key(0), 6))
        normal = lambda *s: jax.random.normal(next(key), s, dt)
        q, k_new, v_new = (normal(b, rows, hq, d), normal(b, rows, hkv, d),
                           normal(b, rows, hkv, d))
        k_cache, v_cache = normal(b, n, hkv, d), normal(b, n, hkv, d)
        seqlens = jnp.full((b,), n - rows, jnp.int32)
        flops = 4 * b * hq * d * rows * (n - rows / 2)
        # (q, caches) -> (out, caches): the loop carries the caches, so that
        # the append updates them in place
        calls = {  # cache_seqlens traced, or a Python int (the static route)
            "kvcache": (lambda q, kc, vc: flashjax.flash_attention_with_kvcache(
                q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True)),
            "kvcache-int": (lambda q, kc, vc: flashjax.flash_attention_with_kvcache(
                q, kc, vc, k_new, v_new, cache_seqlens=n - rows, causal=True)),
            "dense": (lambda q, kc, vc: (flashjax.flash_attention(
                q, kc, vc, causal=True), kc, vc)),
        }
        label = f"prefill b={b} rows={rows} cache={n} h={hq}/{hkv} d={d} {dtype}"
        print(label, flush=True)
        for name, call in calls.items():
            def body(_, carry, call=call):
                out, kc, vc = call(*carry)
                return out.astype(carry[0].dtype), kc, vc
            loop = jax.jit(lambda q, kc, vc, body=body: jax.lax.fori_loop(
                0, PREFILL_LOOP, body, (q, kc, vc)), donate_argnums=(1, 2))
            record = dict(info, mode="prefill", impl=name, batch=b, rows=rows,
                          cache=n, heads_q=hq, heads_kv=hkv, head_dim=d,
                          dtype=dtype, us=None, tflops=None, error=None)
            try:
                ms = _median_ms_donating(loop, q, k_cache, v_cache, args.warmup,
                                         iters) / PREFILL_LOOP
                record.update(us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12)
                print(f"  {name:8s} {ms * 1e3:9.1f} us {record['tflops']:6.1f} "
                      "TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                record["error"] = bench_core.short_reason(e)
                print(f"  {name:8s} n/a ({record['error']})", flush=True)
            if json_file:
                json_file.write(json.dumps(record) + "\n")
                json_file.flush()
        jax.clear_caches()


def parse_heads(text: str) -> tuple[int, int]:
    """(q heads, kv heads) of "32/8" ("8": MHA)."""
    q, _, kv = text.partition("/")
    return int(q), int(kv or q)


def main(args) -> int:
    gpu = bench_core.on_gpu()
    batches = args.decode_batch or (GPU_BATCHES if gpu else CPU_BATCHES)
    caches = args.cache or (GPU_CACHES if gpu else CPU_CACHES)
    heads = [parse_heads(h) for h in (args.decode_heads or (GPU_HEADS if gpu else CPU_HEADS))]
    head_dims = args.head_dim or [128 if gpu else 64]
    pages = args.page_size or [0]
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    impls = [i for i in (args.impl or IMPLS) if gpu or i in ("flashjax", FP8_IMPL, "xla")]
    iters = args.iters or (20 if gpu else 3)
    loop = args.loop if args.loop > 1 else (DEFAULT_LOOP if gpu else 2)
    info = bench_core.device_info()
    bandwidth = copy_bandwidth(gpu, args.warmup, iters)
    print(f"device: {info['device']} ({info['platform']}), jax {info['jax']}; per-step median "
          f"of {iters} runs of {loop} dependent steps; copy bandwidth {bandwidth:.0f} GB/s"
          + (f"; XLA_FLAGS={os.environ['XLA_FLAGS']}" if os.environ.get("XLA_FLAGS") else ""),
          flush=True)
    json_file = open(args.json, "w") if args.json else None
    if args.prefill:
        prefill(args, batches, caches, heads, head_dims, dtype, iters, info, json_file)
        if json_file:
            json_file.close()
        return 0
    for b in batches:
        for n in caches:
            for hq, hkv in heads:
                for d in head_dims:
                    for page in pages:
                        case = DecodeCase(b, n, hq, hkv, d, page, dtype,
                                          args.page_order != "sequential")
                        floor_us = case.kv_bytes / (bandwidth * 1e9) * 1e6
                        print(f"{case.label()}: K/V {case.kv_bytes / 1e6:.1f} MB, "
                              f"{floor_us:.1f} us at copy bandwidth", flush=True)
                        for impl in impls:
                            r = measure(impl, case, args.warmup, iters, loop)
                            r.update(info, copy_gbps=bandwidth, floor_us=floor_us,
                                     xla_flags=os.environ.get("XLA_FLAGS", ""))
                            cell = (f"{r['us']:9.1f} us {r['gbps']:7.1f} GB/s "
                                    f"({r['us'] / floor_us:.2f}x floor)" if r["us"]
                                    else f"n/a ({r['error']})")
                            print(f"  {impl:9s} {cell}", flush=True)
                            if json_file:
                                json_file.write(json.dumps(r) + "\n")
                                json_file.flush()
                        jax.clear_caches()
    if json_file:
        json_file.close()
    return 0

