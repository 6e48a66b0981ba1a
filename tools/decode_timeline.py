"""Where a decoding step's time goes on the GPU: the kernels of a jitted loop of
dependent steps (bench_decode's), from a jax.profiler trace.

    python tools/decode_timeline.py [--batch 1] [--cache 8192] [--head-dim 128]
        [--impl flashjax flashjax-fp8 xla] [--splits 0 16 64]

For each implementation (and flashjax split count; 0: the heuristic) it prints, over
the traced loops' steps, each kernel's count and median duration, the step period
(first kernel start to last kernel end over the loop, per step) and the idle time
between kernels a step. Kernel times under the profiler are close to untraced ones;
the gaps include the profiler's own per-launch cost, so compare gaps only between
implementations of one run. With XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 every
loop body is one CUDA graph (as a model's decoding step; flashjax.bench_decode says
why it matters at batch 1).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile

import jax

from flashjax import bench_decode

LOOP = 20
TRACED_CALLS = 3


def _gpu_kernels(trace_dir: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every event on a GPU stream, sorted by start."""
    path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    events = json.load(gzip.open(sorted(path)[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in e["args"]["name"]}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    stream = lambda e: "Stream" in threads.get((e["pid"], e.get("tid")), "")
    return sorted((e["ts"], e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and e["pid"] in gpu_pids and stream(e))


def _short(name: str) -> str:
    """A kernel's own name: no return type, namespaces, template or call arguments."""
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"[<(].*", "", name)
    return name.split("::")[-1].split(" ")[-1][:40]


def timeline(impl: str, case, splits: int | None) -> str:
    step, q, k_cache, v_cache = bench_decode.attend(impl, case, splits)
    loop = jax.jit(lambda q, k, v: jax.lax.fori_loop(
        0, LOOP, lambda _, q: step(q, k, v).astype(q.dtype), q))
    for _ in range(5):
        loop(q, k_cache, v_cache).block_until_ready()
    trace_dir = tempfile.mkdtemp(prefix="decode_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(TRACED_CALLS):
            loop(q, k_cache, v_cache).block_until_ready()
    kernels = _gpu_kernels(trace_dir)
    if not kernels:
        return f"{impl}: no GPU events in the trace"
    # The calls are separated by host round trips: split where the gap is the largest.
    calls = []
    gaps = sorted((kernels[i + 1][0] - (kernels[i][0] + kernels[i][1]), i)
                  for i in range(len(kernels) - 1))
    cuts = sorted(i for _, i in gaps[-(TRACED_CALLS - 1):]) if TRACED_CALLS > 1 else []
    start = 0
    for cut in cuts + [len(kernels) - 1]:
        calls.append(kernels[start:cut + 1])
        start = cut + 1
    durations = collections.defaultdict(list)
    periods, idles = [], []
    for call in calls:
        for _, dur, name in call:
            durations[_short(name)].append(dur)
        span = call[-1][0] + call[-1][1] - call[0][0]
        busy_end, idle = call[0][0], 0.0
        for ts, dur, _ in call:
            idle += max(0.0, ts - busy_end)
            busy_end = max(busy_end, ts + dur)
        periods.append(span / LOOP)
        idles.append(idle / LOOP)
    lines = [f"{impl} splits={splits or 'auto'}: step {statistics.median(periods):.1f} us, "
             f"idle between kernels {statistics.median(idles):.1f} us a step"]
    for name, ds in sorted(durations.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"    {name:40s} x{len(ds) / len(calls) / LOOP:5.2f} a step  "
                     f"median {statistics.median(ds):7.2f} us")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache", type=int, default=8192)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=0)
    ap.add_argument("--impl", nargs="+", default=["flashjax", "flashjax-fp8", "xla"])
    ap.add_argument("--splits", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    hq, _, hkv = args.heads.partition("/")
    case = bench_decode.DecodeCase(args.batch, args.cache, int(hq), int(hkv or hq),
                                   args.head_dim, args.page_size, "bfloat16")
    print(case.label(), flush=True)
    for impl in args.impl:
        for splits in (args.splits if impl.startswith("flashjax") else [0]):
            print(timeline(impl, case, splits or None), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
