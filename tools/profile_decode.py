"""Where a decode step's time goes: one configuration of `python -m flashjax.bench
--decode` as a jitted loop of dependent steps, traced with JAX's profiler (CUPTI on a
GPU). Prints, per implementation: whether XLA put the step into command buffers, the
host-timed time per step, and from the trace the kernels of a step (count, mean time),
the GPU's busy time per step and the span of the loop per step (span - busy: the GPU
idle, waiting for the host), and the host events that cost most.

    python tools/profile_decode.py BATCH CACHE PAGE [IMPL[:SPLITS]...] [--heads 32/8]
        [--head-dim 128]

IMPL: any of bench_decode.IMPLS (default: all); flashjax:N forces N splits. At batch 1
the loop body's launch decides the step: XLA_FLAGS=--xla_gpu_graph_min_graph_size=1
captures every body in a CUDA graph, as a model's step is (bench_decode says why).
"""

import argparse
import collections
import glob
import tempfile
import time

import jax

from flashjax import bench_decode

LOOP = 20
TOP_HOST_EVENTS = 8


def _intervals_busy(intervals):
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start >= end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def _by_place(kernels: dict, steps: int) -> dict:
    """name -> durations, from name -> (start, duration) events; a kernel that runs k > 1
    times in every step is split by its place in the step ("name [i/k]", in start
    order), so that, say, FA3's forward and backward kernels (one template, one name)
    read apart."""
    places = {}
    for name, events in kernels.items():
        per_step = len(events) // steps
        if per_step > 1 and len(events) == per_step * steps:
            for i, (_, duration) in enumerate(sorted(events)):
                places.setdefault(f"{name} [{i % per_step + 1}/{per_step}]", []).append(duration)
        else:
            places[name] = [duration for _, duration in events]
    return places


def summarize(trace_dir: str, steps: int = LOOP):
    """Kernels per step of a trace of `steps` steps."""
    from jax.profiler import ProfileData

    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = ProfileData.from_file(path)
    kernels = collections.defaultdict(list)
    host = collections.defaultdict(list)
    intervals = []
    for plane in data.planes:
        gpu = plane.name.startswith("/device:GPU")
        if not gpu and plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            if gpu and not line.name.startswith("Stream"):
                continue
            for event in line.events:
                if gpu:
                    kernels[event.name[:70]].append((event.start_ns, event.duration_ns))
                    intervals.append((event.start_ns, event.start_ns + event.duration_ns))
                elif line.name != "python":
                    host[event.name[:70]].append(event.duration_ns)
    if not intervals:
        print("  (no GPU events in the trace)")
    else:
        span = max(e for _, e in intervals) - min(s for s, _ in intervals)
        print(f"  GPU busy {_intervals_busy(intervals) / steps / 1e3:.1f} us per step, "
              f"span {span / steps / 1e3:.1f} us per step")
        for name, times in sorted(_by_place(kernels, steps).items(), key=lambda kv: -sum(kv[1])):
            print(f"    {len(times) / steps:5.2f}/step {sum(times) / len(times) / 1e3:8.2f} us  {name}")
    print("  host (top events by total time):")
    for name, times in sorted(host.items(), key=lambda kv: -sum(kv[1]))[:TOP_HOST_EVENTS]:
        print(f"    {len(times):5d} x {sum(times) / len(times) / 1e3:8.2f} us  {name}")


def profile(impl: str, case):
    splits = None
    if ":" in impl:
        impl, splits = impl.split(":")
    step, q, k, v = bench_decode.attend(impl, case, num_splits=int(splits) if splits else None)
    steps = jax.jit(lambda q, k, v: jax.lax.fori_loop(
        0, LOOP, lambda _, q: step(q, k, v).astype(q.dtype), q))
    hlo = steps.lower(q, k, v).compile().as_text()
    buffers = sum("command_buffer" in line for line in hlo.splitlines())
    print(f"{impl}{':' + splits if splits else ''} {case.label()}: "
          f"{buffers} command-buffer lines", flush=True)
    for _ in range(3):
        jax.block_until_ready(steps(q, k, v))
    start = time.perf_counter()
    jax.block_until_ready(steps(q, k, v))
    print(f"  {(time.perf_counter() - start) / LOOP * 1e6:.1f} us per step (one host-timed loop)")
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(steps(q, k, v))
        summarize(trace_dir)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("batch", type=int, nargs="?", default=1)
    p.add_argument("cache", type=int, nargs="?", default=8192)
    p.add_argument("page", type=int, nargs="?", default=0)
    p.add_argument("impls", nargs="*")
    p.add_argument("--heads", default="32/8", help="q/kv heads")
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args()
    heads_q, heads_kv = bench_decode.parse_heads(args.heads)
    case = bench_decode.DecodeCase(args.batch, args.cache, heads_q, heads_kv, args.head_dim,
                                   args.page, "bfloat16")
    for impl in args.impls or bench_decode.IMPLS:
        try:
            profile(impl, case)
        except Exception as e:  # noqa: BLE001 -- one implementation failing is a result
            print(f"{impl}: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
