"""Sequence-sharded attention over every visible device: ring vs all-gather vs the
unsharded call (issue "multi-GPU run" executes this; one GPU or host CPU devices run
it as a smoke test).

    python benchmarks/ring_bench.py [--seqlen 32k 128k 512k] [--heads 32 8] [--dim 128]
                                    [--batch 1] [--dtype bfloat16] [--mode fwd fwdbwd]

Implementations, one process, the sequence sharded over a 1-D mesh of all devices:
- jit: jax.jit of flash_attention on inputs sharded along the sequence (plain chunk
  order; the partitioned call picks ring or all-gather by flashjax.ring.choose_strategy);
- ring, ring-zigzag: jax.shard_map of flashjax.ring_attention, strategy="ring",
  layout "contiguous" / "zigzag" (inputs reordered once, outside the timed loop);
- gather, gather-zigzag: the same with strategy="all_gather" (K/V all-gathered, the
  local queries against every key; dK/dV reduce-scattered);
- unsharded: flash_attention on one device with the whole sequence (the per-device
  baseline; skipped where it does not fit).
Times are medians of jitted loops of dependent calls (the next q is the output); FA
FLOP convention (4 * b * h * s^2 * d, halved when causal, x2.5 for fwd+bwd), TFLOP/s
per device.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import flashjax
from flashjax import bench_core, ring

LOOP = 5
BWD_FLOP_FACTOR = 2.5  # fwd + bwd = 1 + 1.5 forwards (FlashAttention's convention)


def looped(attend, mode: str):
    """A jitted loop of LOOP dependent calls of attend(q, k, v) (fwd), or of its
    gradient with respect to q, k, v (fwdbwd)."""
    if mode == "fwdbwd":
        grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2))

        def step(q, k, v):
            dq, dk, dv = grad(q, k, v)
            return dq.astype(q.dtype), k + dk.astype(k.dtype) * 0, v + dv.astype(v.dtype) * 0
    else:
        def step(q, k, v):
            return attend(q, k, v).astype(q.dtype), k, v
    return jax.jit(lambda q, k, v: jax.lax.fori_loop(0, LOOP, lambda _, c: step(*c), (q, k, v)))


def implementations(mesh, causal: bool, n: int):
    """name -> (attend(q, k, v) on sequence-sharded inputs, the reorder of the inputs)."""
    rows = P(None, "seq", None, None)

    def jit_default(q, k, v):
        return flashjax.flash_attention(q, k, v, causal=causal)

    def shard_mapped(layout, strategy):
        def attend(q, k, v):
            return jax.shard_map(functools.partial(flashjax.ring_attention, axis_name="seq",
                                                   causal=causal, layout=layout,
                                                   strategy=strategy),
                                 mesh=mesh, in_specs=(rows,) * 3, out_specs=rows)(q, k, v)
        return attend

    plain, zigzagged = (lambda x: x), (lambda x: ring.zigzag(x, n))
    return {"jit": (jit_default, plain),
            "ring": (shard_mapped("contiguous", "ring"), plain),
            "ring-zigzag": (shard_mapped("zigzag", "ring"), zigzagged),
            "gather": (shard_mapped("contiguous", "all_gather"), plain),
            "gather-zigzag": (shard_mapped("zigzag", "all_gather"), zigzagged)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", nargs="+", type=bench_core.parse_int, default=[32768, 131072, 524288])
    p.add_argument("--heads", nargs=2, type=int, default=[32, 8], help="q heads, kv heads")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()

    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("seq",))
    sharding = NamedSharding(mesh, P(None, "seq", None, None))
    dtype = jnp.dtype(args.dtype)
    hq, hk = args.heads
    print(f"{n} x {devices[0].device_kind}, jax {jax.__version__}; per call, median of "
          f"{args.iters} jitted loops of {LOOP}", flush=True)
    for s, causal, mode in ((s, c, m) for s in args.seqlen for c in (False, True)
                            for m in args.mode):
        if s % (2 * n):
            print(f"seqlen {s}: not a multiple of 2 x {n} devices, skipped")
            continue
        key = iter(jax.random.split(jax.random.key(0), 3))
        make = lambda h: jax.random.normal(next(key), (args.batch, s, h, args.dim), dtype)
        try:
            q, k, v = make(hq), make(hk), make(hk)
        except Exception as e:  # noqa: BLE001 -- too large for one host buffer
            print(f"seqlen {s}: inputs do not fit ({type(e).__name__})")
            continue
        flops = 4 * args.batch * hq * s * s * args.dim * (0.5 if causal else 1.0)
        flops *= BWD_FLOP_FACTOR if mode == "fwdbwd" else 1.0
        label = f"seqlen {s} {'causal' if causal else 'full'} {mode}"
        impls = implementations(mesh, causal, n)
        impls["unsharded"] = (lambda q, k, v: flashjax.flash_attention(q, k, v, causal=causal),
                              None)
        for name, (attend, order) in impls.items():
            try:
                if order is None:  # one device, the whole sequence
                    inputs = tuple(jax.device_put(x, devices[0]) for x in (q, k, v))
                    per_device = 1
                else:
                    inputs = tuple(jax.device_put(order(x), sharding) for x in (q, k, v))
                    per_device = n
                ms = bench_core.median_ms(looped(attend, mode), inputs, 1, args.iters) / LOOP
                tflops = flops / per_device / (ms * 1e-3) / 1e12
                print(f"{label:32s} {name:14s} {ms:10.2f} ms {tflops:7.1f} TFLOP/s per device",
                      flush=True)
            except Exception as e:  # noqa: BLE001 -- one failing implementation is a result
                print(f"{label:32s} {name:14s} n/a ({type(e).__name__}: {str(e)[:100]})",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
