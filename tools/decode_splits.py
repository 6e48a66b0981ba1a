"""Decode step time against the split count, one process (GPU).

    python tools/decode_splits.py BATCH CACHE [--impl flashjax flashjax-fp8]
        [--heads 32/8] [--head-dim 128] [--page-size 0] [--splits 0 16 32 64]

Each split count (0: kvcache.split_count's choice) of each implementation of
``python -m flashjax.bench --decode`` is timed by that benchmark's own measure (a
jitted loop of dependent steps, the median of runs after warm-up), so a change of the
automatic choice can be checked against its neighbours in the same process.
"""

from __future__ import annotations

import argparse

from flashjax import bench_core, bench_decode

WARMUP = 3  # untimed runs after compilation (as the benchmark's default)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("batch", type=int)
    p.add_argument("cache", type=bench_core.parse_int)
    p.add_argument("--impl", nargs="+", default=["flashjax", bench_decode.FP8_IMPL])
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=0)
    p.add_argument("--splits", nargs="+", type=int, default=[0, 16, 32, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--loop", type=int, default=bench_decode.DEFAULT_LOOP)
    args = p.parse_args()
    hq, hkv = bench_decode.parse_heads(args.heads)
    case = bench_decode.DecodeCase(args.batch, args.cache, hq, hkv, args.head_dim,
                                   args.page_size, "bfloat16")
    print(case.label(), flush=True)
    for impl in args.impl:
        for splits in args.splits:
            r = bench_decode.measure(impl, case, WARMUP, args.iters, args.loop, splits)
            cell = f"{r['us']:8.1f} us" if r["us"] else f"n/a ({r['error']})"
            print(f"  {impl:13s} splits {splits or 'auto':>4}: {cell}", flush=True)


if __name__ == "__main__":
    main()
