"""What flashjax's benchmarks share (``python -m flashjax.bench`` and its modes:
bench_varlen, bench_decode, bench_terms): the shapes (`Case`), inputs, the timed step
(`build_step`, jitted loops of dependent calls), timing (`median_ms`), the CPU's
reference GEMM rate, failure reasons, records and tables. It imports none of them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

MODES = ("fwd", "fwdbwd", "bwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5, "bwd": 2.5}
# (the float8 types: flash_attention's float8 forward, out in bfloat16; fwd mode only)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}

FA3_TOKENS = 16384
FA3_HIDDEN = 2048
FA3_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
FA3_HEAD_DIMS = (64, 128, 256)

REASON_CHARS = 60
GEMM_SIZE = 2048  # the CPU's reference GEMM: two float32 GEMM_SIZE x GEMM_SIZE matrices
GEMM_ITERS = 5


class Unsupported(Exception):
    """An implementation cannot run a case; the message is the short reason."""


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    deterministic: bool = False  # flashjax's option (the baselines ignore it)

    def fwd_flops(self) -> float:
        flops = 2.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k
        flops *= self.head_dim + self.head_dim_v
        return flops / 2 if self.causal else flops

    def label(self) -> str:
        return (f"b={self.batch} sq={self.seqlen_q} sk={self.seqlen_k} h={self.heads}"
                f"/{self.heads_kv} d={self.head_dim}/{self.head_dim_v} {self.dtype}"
                f" causal={int(self.causal)}" + (" deterministic" if self.deterministic else ""))


@dataclasses.dataclass
class Result:
    case: Case
    mode: str
    impl: str
    ms: float | None = None
    error: str | None = None
    gemm_gflops: float | None = None  # CPU: the float32 GEMM rate around this measurement

    @property
    def tflops(self) -> float | None:
        if self.ms is None:
            return None
        return self.case.fwd_flops() * MODE_FLOP_FACTOR[self.mode] / (self.ms * 1e-3) / 1e12

    @property
    def gflops(self) -> float | None:
        return None if self.tflops is None else self.tflops * 1e3

    @property
    def gemm_fraction(self) -> float | None:
        if self.gflops is None or not self.gemm_gflops:
            return None
        return self.gflops / self.gemm_gflops


# --------------------------------------------------------------------------- steps and timing

def make_inputs(case: Case, seed: int = 0):
    dtype = DTYPES[case.dtype]
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
    q = normal(kq, (b, sq, case.heads, case.head_dim))
    k = normal(kk, (b, sk, case.heads_kv, case.head_dim))
    v = normal(kv, (b, sk, case.heads_kv, case.head_dim_v))
    dout = normal(kd, (b, sq, case.heads, case.head_dim_v))
    return q, k, v, dout


def build_step(fn: Callable, mode: str, q, k, v, dout, loop: int = 1, operands: tuple = (),
               differentiated: int = 0):
    """Returns ``(jitted_step, args)``: the function to time and its arguments. With
    loop > 1 the step is a jitted loop of `loop` dependent calls (each call's q, or
    dout for bwd, depends on the previous result), so host dispatch is amortised.
    fn(q, k, v, *operands): the operands (a bias, a mask, ...) are arguments of the step,
    not constants captured in it; fwdbwd and bwd differentiate q, k, v and the first
    `differentiated` operands."""
    if loop > 1:
        if operands:
            raise Unsupported("--loop takes no operands besides q, k, v")
        return _looped_step(fn, mode, loop, q, k, v, dout)
    wrt, rest = (q, k, v, *operands[:differentiated]), operands[differentiated:]
    if mode == "fwd":
        return jax.jit(fn), (q, k, v, *operands)
    if mode == "fwdbwd":
        def loss(dout, *args):
            out = fn(*args).astype(jnp.float32)
            return jnp.sum(out * dout.astype(jnp.float32))
        argnums = tuple(range(1, 1 + len(wrt)))
        return jax.jit(jax.grad(loss, argnums=argnums)), (dout, *wrt, *rest)
    if mode == "bwd":
        jitted = jax.jit(fn)  # (rest: arguments of the jitted call, not differentiated)
        # residuals computed once, untimed
        _, pullback = jax.vjp(lambda *wrt: jitted(*wrt, *rest), *wrt)
        return jax.jit(lambda pullback, dout: pullback(dout)), (pullback, dout)
    raise ValueError(f"unknown mode {mode!r}")


def _nudge(x, by):
    """x plus a negligible multiple of `by`: a data dependence XLA cannot drop."""
    return (x.astype(jnp.float32) + 1e-6 * by.astype(jnp.float32).reshape(x.shape)).astype(x.dtype)


def _looped_step(fn: Callable, mode: str, loop: int, q, k, v, dout):
    if q.shape[:-1] + (v.shape[-1],) != q.shape:
        raise Unsupported("--loop needs head_dim_v == head_dim (each output feeds the next q)")
    # The other operands are arguments of the jitted loop, not constants captured
    # in it (large ones make lowering slow).
    if mode == "fwd":
        def fwd_loop(q, k, v):
            return jax.lax.fori_loop(0, loop, lambda _, q: _nudge(q, fn(q, k, v)), q)
        return jax.jit(fwd_loop), (q, k, v)
    if mode == "fwdbwd":
        def loss(q, k, v, dout):
            return jnp.sum(fn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
        grad = jax.grad(loss, argnums=(0, 1, 2))

        def fwdbwd_loop(q, k, v, dout):
            def body(_, q):
                dq, dk, dv = grad(q, k, v, dout)
                return _nudge(q, dq + dk[..., :1, :, :].sum() + dv[..., :1, :, :].sum())
            return jax.lax.fori_loop(0, loop, body, q)
        return jax.jit(fwdbwd_loop), (q, k, v, dout)
    if mode == "bwd":
        _, pullback = jax.vjp(jax.jit(fn), q, k, v)

        def body(_, dout):
            dq, dk, dv = pullback(dout)
            return _nudge(dout, dq + dk[..., :1, :, :].sum() + dv[..., :1, :, :].sum())
        return jax.jit(lambda dout: jax.lax.fori_loop(0, loop, body, dout)), (dout,)
    raise ValueError(f"unknown mode {mode!r}")


def median_ms(step: Callable, args, warmup: int, iters: int) -> float:
    jax.block_until_ready(step(*args))  # compile
    for _ in range(warmup):
        jax.block_until_ready(step(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemm_gflops(iters: int = GEMM_ITERS) -> float:
    """This process's float32 GEMM rate in GFLOP/s: a jitted ``jnp.dot`` of two
    GEMM_SIZE x GEMM_SIZE matrices, median of `iters` runs after warm-up."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (GEMM_SIZE, GEMM_SIZE), jnp.float32)
    b = jax.random.normal(kb, (GEMM_SIZE, GEMM_SIZE), jnp.float32)
    ms = median_ms(jax.jit(jnp.dot), (a, b), warmup=1, iters=iters)
    return 2.0 * GEMM_SIZE ** 3 / (ms * 1e-3) / 1e9


def torch_sdpa():
    """(torch, SDPBackend, sdpa_kernel) for the PyTorch peers, or Unsupported without
    PyTorch or a CUDA GPU."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise Unsupported("needs PyTorch") from e
    if not torch.cuda.is_available():
        raise Unsupported("needs a CUDA GPU")
    return torch, SDPBackend, sdpa_kernel


def keep_record(records: list, record: dict, json_file) -> None:
    """Appends `record` and, with --json, writes it as a JSON line at once (flushed: an
    interrupted run keeps every finished measurement)."""
    records.append(record)
    if json_file:
        json_file.write(json.dumps(record) + "\n")
        json_file.flush()


def short_reason(error: Exception) -> str:
    text = str(error) or type(error).__name__
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "out of memory"
    first = text.strip().splitlines()[0]
    return first if len(first) <= REASON_CHARS else first[:REASON_CHARS - 3] + "..."


# --------------------------------------------------------------------------- configuration

def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def parse_int(text: str) -> int:
    """An integer; a `k` suffix multiplies by 1024 (`16k` = 16384)."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def make_cases(args: argparse.Namespace) -> list[Case]:
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    cases = []
    for head_dim in args.head_dim:
        for seqlen in args.seqlen:
            batch = args.batch or (max(1, FA3_TOKENS // seqlen) if args.fa3_shapes else 1)
            heads = args.heads or (max(1, FA3_HIDDEN // head_dim) if args.fa3_shapes else 8)
            for causal in causals:
                cases.append(Case(
                    batch=batch, seqlen_q=seqlen, seqlen_k=args.seqlen_k or seqlen,
                    heads=heads, heads_kv=args.heads_kv or heads, head_dim=head_dim,
                    head_dim_v=args.head_dim_v or head_dim, dtype=args.dtype,
                    causal=causal, deterministic=args.deterministic))
    return cases


# --------------------------------------------------------------------------- reporting

def device_info() -> dict:
    device = jax.devices()[0]
    return {"device": device.device_kind, "platform": device.platform,
            "jax": jax.__version__}


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns whose first cell starts with a digit are right-aligned, others left-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = [bool(rows) and rows[0][i][:1].isdigit() for i in range(len(header))]

    def line(row):
        return "  ".join(c.rjust(w) if r else c.ljust(w)
                         for c, w, r in zip(row, widths, right)).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])
