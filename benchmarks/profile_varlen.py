"""One forward call of each of `--impl` on the benchmark's packed documents, for a
profiler: e.g. ncu --kernel-name regex:hopper_forward_kernel --metrics
gpu__time_duration.sum,sm__cycles_active.avg,sm__cycles_active.max
python benchmarks/profile_varlen.py --mix uniform --head-dim 128 --impl varlen segments"""

import argparse

import jax

from flashjax import bench_varlen

p = argparse.ArgumentParser()
p.add_argument("--mix", default="uniform", choices=bench_varlen.MIXES)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--causal", action="store_true")
p.add_argument("--tokens", type=int, default=bench_varlen.GPU_TOKENS)
p.add_argument("--impl", nargs="+", default=["varlen", "segments"])
args = p.parse_args()
lengths = tuple(int(n) for n in bench_varlen.document_lengths(args.mix, args.tokens))
mix = bench_varlen.Mix(args.mix, lengths, args.head_dim, max(1, bench_varlen.HIDDEN // args.head_dim),
                       "bfloat16", args.causal)
for impl in args.impl:
    fn, (q, k, v, _), _ = bench_varlen.implementation(impl, mix)
    f = jax.jit(fn)
    jax.block_until_ready(f(q, k, v))  # compile (and a first run)
    jax.block_until_ready(f(q, k, v))
    print(impl, "done", flush=True)
