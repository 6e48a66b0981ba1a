"""Where a decode step's time goes: one configuration of `python -m flashjax.bench
--decode` as a jitted loop of dependent steps, traced with JAX's profiler (CUPTI on a
GPU). Prints, per implementation: whether XLA put the step into command buffers, the
host-timed time per step, and from the trace the kernels of a step (count, mean time),
the GPU's busy time per step and the span of the loop per step (span - busy: the GPU
idle, waiting for the host), and the host events that cost most.

    python tools/profile_decode.py BATCH CACHE PAGE [IMPL[:SPLITS]...]

IMPL: flashjax | xla | cudnn | pallas (default: all four); flashjax:N forces N splits.
"""

import collections
import glob
import sys
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
                    kernels[event.name[:70]].append(event.duration_ns)
                    intervals.append((event.start_ns, event.start_ns + event.duration_ns))
                elif line.name != "python":
                    host[event.name[:70]].append(event.duration_ns)
    if not intervals:
        print("  (no GPU events in the trace)")
    else:
        span = max(e for _, e in intervals) - min(s for s, _ in intervals)
        print(f"  GPU busy {_intervals_busy(intervals) / steps / 1e3:.1f} us per step, "
              f"span {span / steps / 1e3:.1f} us per step")
        for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
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


def main(batch="1", cache="8192", page="0", *impls):
    case = bench_decode.DecodeCase(int(batch), int(cache), 32, 8, 128, int(page), "bfloat16")
    for impl in impls or bench_decode.IMPLS:
        try:
            profile(impl, case)
        except Exception as e:  # noqa: BLE001 -- one implementation failing is a result
            print(f"{impl}: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
