"""Benchmark flashjax.flash_attention against jax.nn.dot_product_attention.

Usage::

    python -m flashjax.bench                     # defaults for the device found (below)
    python -m flashjax.bench --seqlen 1k 4k --head-dim 64 128 --causal yes
    python -m flashjax.bench --mode bwd --impl flashjax,cudnn --dtype bfloat16
    python -m flashjax.bench --heads 32 --heads-kv 8 --seqlen 2048 --seqlen-k 8192
    python -m flashjax.bench --mode bwd --deterministic   # the cost of a repeatable backward
    python -m flashjax.bench --fa3-shapes --json out.jsonl --plot out.png
    python -m flashjax.bench --fa3-shapes --loop 10     # jitted loops of 10 dependent calls
    python -m flashjax.bench --varlen both --head-dim 64 128   # packed documents (bench_varlen)
    python -m flashjax.bench --decode --cache 8k 64k --decode-heads 32/8   # decoding (bench_decode)
    python -m flashjax.bench --terms all   # masks, bias, ALiBi, dropout, flashjax.nn (bench_terms)

List options take several values, space- or comma-separated; sequence lengths accept a
``k`` suffix (``16k`` = 16384).

Implementations (``--impl``): ``flashjax`` (this package's kernels), ``flashjax-xla``
(this package's pure-JAX path, ``implementation="xla"``), ``xla`` and ``cudnn``
(``jax.nn.dot_product_attention(implementation=...)``), all timed in the same run.
Modes (``--mode``): ``fwd``; ``fwdbwd`` (jitted ``jax.grad`` of ``sum(out * dout)``
with respect to q, k, v); ``bwd`` (the jitted pullback of ``jax.vjp`` applied to
precomputed residuals).

Defaults on CPU: batch 1, 8 heads, seqlen 2048, head_dim 64, float32, causal and not,
modes fwd and fwdbwd, impls flashjax and xla. On GPU: ``--fa3-shapes`` (the
FlashAttention-3 paper shapes: batch*seqlen = 16384 tokens, heads*head_dim = 2048,
seqlen 512..16k, head_dim 64/128/256, bfloat16, causal and not), modes fwd and fwdbwd,
impls flashjax, xla and cudnn. Explicit options override these defaults.

FLOPs follow the FlashAttention convention: fwd = 2*b*h*sq*sk*(d + d_v), which is
4*b*h*sq*sk*d when d_v == d, halved when causal; bwd = 2.5x fwd; fwd+bwd = 3.5x fwd.
Each time is the median over ``--iters`` runs after compilation and ``--warmup`` runs;
every run is blocked with ``block_until_ready`` and timed with ``time.perf_counter``.
A case that fails (unsupported by cuDNN, out of memory, ...) shows ``n/a`` and a reason.

On the CPU the rates are GFLOP/s, and a float32 GEMM is timed in the same process (a
jitted ``jnp.dot`` of two 2048x2048 matrices, median after warm-up) before and after
every measurement: each cell shows that GEMM rate (the mean of the two) and its own rate
as a fraction of it ("x GEMM"), which stays meaningful on a machine whose speed
(sharing, clocks) moves between and within runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import sys
from typing import Callable

import jax
import jax.numpy as jnp

from . import bench_decode, bench_terms, bench_varlen
from .bench_core import (DTYPES, FA3_HEAD_DIMS, FA3_SEQLENS, MODES, Case, Result, Unsupported,
                         build_step, device_info, format_table, gemm_gflops, make_cases,
                         make_inputs, median_ms, on_gpu, parse_int, short_reason)

IMPLS = ("flashjax", "flashjax-xla", "xla", "cudnn")


# --------------------------------------------------------------------------- implementations

def load_flash_attention() -> Callable:
    """Imports ``flashjax.flash_attention`` lazily, so the baselines run without it."""
    try:
        import flashjax
        return flashjax.flash_attention
    except (ImportError, AttributeError) as e:
        raise Unsupported("flashjax.flash_attention unavailable") from e


def _flashjax_attention(case: Case, implementation: str | None = None) -> Callable:
    flash_attention = load_flash_attention()
    # (no keyword when None: the A/B runs this file against older versions too)
    extra = {} if implementation is None else {"implementation": implementation}
    return lambda q, k, v: flash_attention(q, k, v, causal=case.causal,
                                           deterministic=case.deterministic, **extra)


def _jax_nn_attention(implementation: str, case: Case) -> Callable:
    if implementation == "cudnn" and not on_gpu():
        raise Unsupported("needs a CUDA GPU")
    if case.head_dim_v != case.head_dim:
        raise Unsupported("jax.nn.dot_product_attention needs head_dim_v == head_dim")
    bottom_right = case.causal and case.seqlen_q != case.seqlen_k
    if bottom_right and implementation == "cudnn":
        raise Unsupported("causal with seqlen_q != seqlen_k: jax mask is top-left")

    def attention(q, k, v):
        # jax's is_causal mask is top-left aligned; flashjax's is bottom-right aligned
        # (docs/api.md), so for seqlen_q != seqlen_k build the flashjax mask in-graph.
        mask = None
        if bottom_right:
            ones = jnp.ones((case.seqlen_q, case.seqlen_k), dtype=bool)
            mask = jnp.tril(ones, k=case.seqlen_k - case.seqlen_q)[None, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=case.causal and not bottom_right,
            implementation=implementation)

    return attention


def attention_fn(impl: str, case: Case) -> Callable:
    """Returns ``f(q, k, v) -> out`` for ``impl`` or raises ``Unsupported``."""
    if impl == "flashjax":
        return _flashjax_attention(case)
    if impl == "flashjax-xla":
        return _flashjax_attention(case, implementation="xla")
    return _jax_nn_attention(impl, case)


# --------------------------------------------------------------------------- modes and timing

def measure(case: Case, mode: str, impl: str, inputs, warmup: int, iters: int,
            loop: int = 1) -> Result:
    result = Result(case, mode, impl)
    try:
        step, args = build_step(attention_fn(impl, case), mode, *inputs, loop=loop)
        result.ms = median_ms(step, args, warmup, iters) / loop
    except Exception as e:  # noqa: BLE001 -- any failure becomes an "n/a" cell
        result.error = short_reason(e)
    return result


# --------------------------------------------------------------------------- configuration

def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [item for value in values for item in value.split(",") if item]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m flashjax.bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Options left out take the device defaults described in the module docstring.")
    p.add_argument("--batch", type=parse_int)
    p.add_argument("--heads", type=parse_int)
    p.add_argument("--heads-kv", type=parse_int, help="default: --heads (MHA)")
    p.add_argument("--seqlen", nargs="+", help="query sequence lengths, e.g. 1k 4k")
    p.add_argument("--seqlen-k", type=parse_int, help="default: the query sequence length")
    p.add_argument("--head-dim", nargs="+")
    p.add_argument("--head-dim-v", type=parse_int, help="default: --head-dim")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--causal", choices=("no", "yes", "both"))
    p.add_argument("--mode", nargs="+", help=f"any of {','.join(MODES)}")
    p.add_argument("--deterministic", action="store_true",
                   help="flashjax with deterministic=True (bitwise-repeatable GPU backward)")
    p.add_argument("--impl", nargs="+", help=f"any of {','.join(IMPLS)} "
                   f"(with --varlen: {','.join(bench_varlen.IMPLS)}; with --decode: "
                   f"{','.join(bench_decode.IMPLS)})")
    p.add_argument("--iters", type=int, help="timed runs (default 20 on GPU, 5 on CPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs after compilation")
    p.add_argument("--loop", type=int, default=1,
                   help="time a jitted loop of this many dependent calls (amortises the "
                        "~50-100 us host dispatch of one call; reported time is per call)")
    p.add_argument("--varlen", choices=("uniform", "longtail", "both"),
                   help="packed-document benchmark instead (see flashjax.bench_varlen)")
    p.add_argument("--tokens", type=parse_int, help="--varlen: tokens of the packed batch")
    p.add_argument("--decode", action="store_true",
                   help="decoding benchmark instead (see flashjax.bench_decode)")
    p.add_argument("--decode-batch", nargs="+", type=parse_int, help="--decode: batch sizes")
    p.add_argument("--prefill", nargs="+", type=parse_int,
                   help="--decode: prefill with a cache instead: new rows per sequence, e.g. 512 2k")
    p.add_argument("--page-order", choices=("shuffled", "sequential"), default="shuffled",
                   help="--decode: paged caches' pages in a random order (default) or in order")
    p.add_argument("--cache", nargs="+", type=parse_int, help="--decode: cached tokens, e.g. 8k 64k")
    p.add_argument("--decode-heads", nargs="+", help="--decode: q/kv heads, e.g. 32/8 64/8")
    p.add_argument("--page-size", nargs="+", type=int,
                   help="--decode: paged caches of these page sizes (0: contiguous)")
    p.add_argument("--terms", nargs="+", help="score-term and dropout benchmark instead "
                   f"(see flashjax.bench_terms): any of {','.join(bench_terms.TERMS)}, or all")
    p.add_argument("--fa3-shapes", action="store_true",
                   help="FlashAttention-3 paper shapes (the GPU default)")
    p.add_argument("--plot", metavar="PATH.png", help="TFLOP/s vs seqlen plot")
    p.add_argument("--json", metavar="PATH", help="JSON lines, one per measurement")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib, which is not installed: "
                "pip install 'flashjax[plot]' (or pip install matplotlib)")
    impls = bench_varlen.IMPLS if args.varlen else bench_decode.IMPLS if args.decode else IMPLS
    for name, allowed in (("mode", MODES), ("impl", impls), ("terms", bench_terms.TERMS + ("all",))):
        values = _split(getattr(args, name))
        if values is not None and not set(values) <= set(allowed):
            p.error(f"--{name}: expected values among {','.join(allowed)}, got {values}")
        setattr(args, name, values)
    for name in ("seqlen", "head_dim"):
        values = _split(getattr(args, name))
        setattr(args, name, None if values is None else [parse_int(x) for x in values])
    return args


def resolve_defaults(args: argparse.Namespace, gpu: bool) -> argparse.Namespace:
    """Fills the options left out with the CPU or GPU (FA3 shapes) defaults."""
    args.fa3_shapes = args.fa3_shapes or gpu
    fa3 = args.fa3_shapes

    def default(name, value):
        if getattr(args, name) is None:
            setattr(args, name, value)

    # CPU: 2k, so that the README's first command (build, then this) stays under 3
    # minutes on 2 cores (XLA's attention alone takes ~45 s at 4k there)
    default("seqlen", list(FA3_SEQLENS) if fa3 else [2048])
    default("head_dim", list(FA3_HEAD_DIMS) if fa3 else [64])
    default("dtype", "bfloat16" if fa3 else "float32")
    default("causal", "both")
    default("mode", ["fwd", "fwdbwd"])
    default("impl", ["flashjax", "xla", "cudnn"] if gpu else ["flashjax", "xla"])
    default("iters", 20 if gpu else 5)
    return args


# --------------------------------------------------------------------------- reporting

def result_record(result: Result, info: dict) -> dict:
    return {**info, **dataclasses.asdict(result.case), "impl": result.impl,
            "mode": result.mode, "ms": result.ms, "tflops": result.tflops,
            "gemm_gflops": result.gemm_gflops, "error": result.error}


def format_cell(result: Result) -> str:
    if result.ms is None:
        return f"n/a ({result.error})"
    if result.gemm_gflops is not None:  # CPU
        return (f"{result.ms:.1f} ms, {result.gflops:.1f} GFLOP/s, "
                f"{result.gemm_fraction:.2f}x GEMM")
    return f"{result.ms:.3f} ms, {result.tflops:.2f} TFLOP/s"


CASE_COLUMNS = {"mode": "mode", "causal": "causal", "batch": "b", "seqlen_q": "sq",
                "seqlen_k": "sk", "heads": "h", "heads_kv": "h_kv", "head_dim": "d",
                "head_dim_v": "d_v", "dtype": "dtype"}


def case_cells(case: Case, mode: str) -> list[str]:
    values = {**dataclasses.asdict(case), "mode": mode, "causal": "yes" if case.causal else "no"}
    return [str(values[name]) for name in CASE_COLUMNS]


def group_results(results: list[Result]) -> dict[tuple[Case, str], dict[str, Result]]:
    groups: dict[tuple[Case, str], dict[str, Result]] = {}
    for r in results:
        groups.setdefault((r.case, r.mode), {})[r.impl] = r
    return groups


def results_table(results: list[Result], impls: list[str]) -> str:
    """One row per (shape, mode), two columns (ms, TFLOP/s) per impl; n/a reasons as notes.
    On the CPU (results carry a GEMM rate) four per impl: ms, GFLOP/s, the GEMM's GFLOP/s
    around that measurement and the fraction of it."""
    notes: dict[str, int] = {}
    cpu = any(r.gemm_gflops is not None for r in results)

    def cells(r: Result) -> list[str]:
        if r.ms is None:
            return [f"n/a [{notes.setdefault(r.error, len(notes) + 1)}]"] + [""] * (1 + 2 * cpu)
        if cpu:
            return [f"{r.ms:.1f}", f"{r.gflops:.1f}", f"{r.gemm_gflops:.1f}",
                    f"{r.gemm_fraction:.2f}"]
        return [f"{r.ms:.3f}", f"{r.tflops:.2f}"]

    header = list(CASE_COLUMNS.values())
    for impl in impls:
        header += ([f"{impl} ms", f"{impl} GFLOP/s", "GEMM GFLOP/s", f"{impl} x GEMM"] if cpu
                   else [f"{impl} ms", f"{impl} TFLOP/s"])
    rows = [case_cells(case, mode) + [c for impl in impls for c in cells(by_impl[impl])]
            for (case, mode), by_impl in group_results(results).items()]
    return "\n".join([format_table(header, rows),
                      *(f"[{n}] {reason}" for reason, n in notes.items())])


def speedup_table(results: list[Result], impls: list[str]) -> str | None:
    """flashjax speed relative to each baseline: time_baseline / time_flashjax."""
    baselines = [i for i in impls if i != "flashjax"]
    if "flashjax" not in impls or not baselines:
        return None

    def ratio(ours: Result, theirs: Result) -> str:
        if ours.ms is None or theirs.ms is None:
            return "n/a"
        return f"{theirs.ms / ours.ms:.2f}x"

    rows = [case_cells(case, mode) + [ratio(by_impl["flashjax"], by_impl[b]) for b in baselines]
            for (case, mode), by_impl in group_results(results).items()]
    return format_table(list(CASE_COLUMNS.values()) + [f"vs {b}" for b in baselines], rows)


def plot(results: list[Result], impls: list[str], path: str, title: str) -> None:
    cpu = any(r.gemm_gflops is not None for r in results)
    unit, scale = ("GFLOP/s", 1e3) if cpu else ("TFLOP/s", 1.0)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in results))
    panels = list(dict.fromkeys((r.case.head_dim, r.case.causal) for r in results))
    seqlens = sorted({r.case.seqlen_q for r in results})
    fig, axes = plt.subplots(len(modes), len(panels), squeeze=False, sharex=True,
                             figsize=(4 * len(panels), 3.2 * len(modes)))
    for row, mode in enumerate(modes):
        for col, (head_dim, causal) in enumerate(panels):
            ax = axes[row][col]
            for impl in impls:
                points = sorted((r.case.seqlen_q, r.tflops * scale) for r in results
                                if r.impl == impl and r.mode == mode and r.tflops is not None
                                and (r.case.head_dim, r.case.causal) == (head_dim, causal))
                if points:
                    ax.plot(*zip(*points), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{mode}, d={head_dim}, {'causal' if causal else 'non-causal'}")
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s)
                                    for s in seqlens])
            ax.set_xlabel("seqlen")
            ax.set_ylabel(unit)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- driver

def check_flashjax(impls: list[str]) -> None:
    if "flashjax" not in impls:
        return
    try:
        load_flash_attention()
    except Unsupported as e:
        print(f"error: {e} ({e.__cause__}); flashjax results will be n/a. "
              "Install the package (pip install .) or pass --impl xla,cudnn.",
              file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> list[Result]:
    info = device_info()
    cases = make_cases(args)
    print(f"device: {info['device']} ({info['platform']}), jax {info['jax']}; "
          f"{len(cases)} shapes x modes {','.join(args.mode)} x impls {','.join(args.impl)}; "
          f"median of {args.iters} runs after {args.warmup} warm-up runs", flush=True)
    check_flashjax(args.impl)
    json_file = open(args.json, "w") if args.json else None
    cpu = not on_gpu()
    results = []
    try:
        for n, case in enumerate(cases, 1):
            inputs = make_inputs(case)
            # CPU: the GEMM rate before and after each measurement (the speed of a shared
            # machine moves within a run)
            gemm_before = gemm_gflops() if cpu else None
            for mode in args.mode:
                for impl in args.impl:
                    print(f"[{n}/{len(cases)}] {mode:6s} {impl:8s} {case.label()} ...",
                          end=" ", flush=True)
                    result = measure(case, mode, impl, inputs, args.warmup, args.iters,
                                     args.loop)
                    if cpu:
                        gemm_after = gemm_gflops()
                        result.gemm_gflops = (gemm_before + gemm_after) / 2
                        gemm_before = gemm_after
                    print(format_cell(result).strip(), flush=True)
                    results.append(result)
                    if json_file:
                        json_file.write(json.dumps(result_record(result, info)) + "\n")
                        json_file.flush()
            del inputs
            jax.clear_caches()
            gc.collect()
    finally:
        if json_file:
            json_file.close()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.varlen:
        return bench_varlen.main(args)
    if args.decode:
        return bench_decode.main(args)
    if args.terms:
        return bench_terms.main(args)
    args = resolve_defaults(args, on_gpu())
    results = run(args)
    unit = "TFLOP/s" if on_gpu() else "GFLOP/s and fraction of the float32 GEMM rate"
    print(f"\nResults (median time, {unit} in the FlashAttention convention)")
    print(results_table(results, args.impl))
    speedups = speedup_table(results, args.impl)
    if speedups:
        print("\nflashjax speed-up (time_baseline / time_flashjax)")
        print(speedups)
    if args.plot:
        info = device_info()
        plot(results, args.impl, args.plot, f"{info['device']}, {args.dtype}")
        print(f"\nplot written to {args.plot}")
    if args.json:
        print(f"JSON lines written to {args.json}")
    return 0 if any(r.ms is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
