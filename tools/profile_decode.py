"""One decode configuration of `python -m flashjax.bench --decode` as a jitted loop of
dependent steps, for profiling: prints whether XLA put the step's calls into command
buffers (CUDA graphs) and the per-step time; run under
`ncu --metrics gpu__time_duration.sum python tools/profile_decode.py IMPL BATCH CACHE PAGE`
for each kernel's time.  IMPL: flashjax | xla | cudnn | pallas."""

import sys
import time

import jax

from flashjax import bench_decode

LOOP = 20


def main(impl="flashjax", batch=1, cache=8192, page=0):
    case = bench_decode.DecodeCase(int(batch), int(cache), 32, 8, 128, int(page), "bfloat16")
    step, q, k, v = bench_decode.attend(impl, case)
    steps = jax.jit(lambda q, k, v: jax.lax.fori_loop(
        0, LOOP, lambda _, q: step(q, k, v).astype(q.dtype), q))
    hlo = steps.lower(q, k, v).compile().as_text()
    buffers = [line.strip()[:160] for line in hlo.splitlines() if "command_buffer" in line]
    print(f"{impl} {case.label()}: {len(buffers)} command-buffer lines", flush=True)
    for line in buffers[:6]:
        print("   ", line)
    for _ in range(3):
        jax.block_until_ready(steps(q, k, v))
    start = time.perf_counter()
    jax.block_until_ready(steps(q, k, v))
    print(f"  {(time.perf_counter() - start) / LOOP * 1e6:.1f} us per step (one host-timed loop)")


if __name__ == "__main__":
    main(*sys.argv[1:])
