"""Score terms and dropout (issue 27): ``python -m flashjax.bench --terms all``.

One command runs issue 27's target table: on a GPU at head_dim 128, seqlen 8k and 16k,
bfloat16, the FlashAttention-3 shapes' batch and heads (16k tokens, 2048 hidden: batch 2
and 1, 16 heads); on the CPU a small version (seqlen 512, head_dim 64, batch 1, 4 heads,
float32). ``--seqlen``, ``--head-dim``, ``--batch``, ``--heads``, ``--dtype``, ``--mode``
(default fwd and fwdbwd), ``--iters`` and ``--warmup`` override these; ``--terms`` picks
groups (any of mask, bias, alibi, dropout, nn; ``all``).

Variants, each one call on the same q, k, v (``flash_attention`` unless said otherwise):

- mask: ``causal`` (causal=True), ``mask-causal`` (the same causal mask passed as a bool
  ``mask=`` of shape (1, 1, s, s)), ``mask-dense`` (an all-True mask) and
  ``mask-blocks`` (block-sparse: in each row of 128x128 tiles a random half of the tiles
  is empty, the rest all True);
- bias: ``none``, ``bias`` (float32 (1, heads, s, s), the dtype the kernels read, so no
  conversion is timed; constant: no dbias), ``bias-grad`` (the same bias differentiated:
  fwdbwd and bwd compute dbias) and their peers ``cudnn-bias`` / ``cudnn-bias-grad``
  (``jax.nn.dot_product_attention(implementation="cudnn")`` with the bias in q's dtype);
- alibi: ``none`` and ``alibi`` (slopes 2^(-8(h+1)/heads));
- dropout: ``none``, ``dropout`` (dropout_rate 0.1, a traced key) and the peer
  ``torch-dropout`` (FlashAttention 2's dropout: PyTorch's scaled_dot_product_attention
  on its FLASH_ATTENTION backend, dropout_p 0.1, timed with CUDA events; needs PyTorch
  and a GPU);
- nn: ``nn`` / ``nn-causal`` (``flashjax.nn.dot_product_attention``, is_causal off / on)
  against ``cudnn`` / ``cudnn-causal`` (``jax.nn.dot_product_attention(implementation=
  "cudnn")``).

Every array besides q, k, v (mask, bias, slopes, key) is an argument of the timed
jitted step, never a captured constant. Modes are bench_core's: ``fwd``, ``fwdbwd`` (the
gradient of q, k, v, and of the bias for the ``-grad`` variants), ``bwd``.

FLOPs follow the FlashAttention convention, counting the visible query-key pairs:
fwd = 4 * batch * heads * s^2 * head_dim (2 * (d + d_v) per pair) times the fraction of
pairs the call's causal flag or mask lets through: 1/2 for causal=True as FA counts it
(not (s + 1) / 2s), 1/2 for ``mask-causal`` too (counted as the causal call it equals,
so the two rates compare), exactly 1/2 for ``mask-blocks`` (half the tiles), 1 for the
rest; fwdbwd = 3.5x, bwd = 2.5x fwd. Bias and ALiBi additions, dbias and dropout's
generator are not counted: their cost shows as a lower rate than ``none``'s. Times are
medians after warm-up (bench_core.median_ms). A variant that cannot run (no GPU for cuDNN,
no PyTorch, out of memory) shows n/a with the reason.

The summary lists each issue-27 target as a time ratio with its limit (a speed target
of >= 1.8x is a time ratio <= 0.556); peers without a target (torch-dropout) are listed
for information.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import bench_core

TERMS = ("mask", "bias", "alibi", "dropout", "nn")  # --terms: the groups of VARIANTS
GPU_SEQLENS, GPU_HEAD_DIM = (8192, 16384), 128
CPU_SEQLENS, CPU_HEAD_DIM, CPU_HEADS = (512,), 64, 4
TILE = 128  # mask-blocks: tile size of the block-sparse pattern
DROPOUT_RATE = 0.1


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    build: Callable  # (case, q) -> (fn(q, k, v, *operands), operands, differentiated)
    density: float = 1.0  # fraction of the query-key pairs counted (FA convention)
    modes: tuple = bench_core.MODES  # the modes it runs in
    torch: bool = False  # timed by torch_ms instead of bench_core.median_ms


# --------------------------------------------------------------------------- variants

def _flashjax(keyword: str | None, make_operand: Callable | None = None, differentiated=0,
              **options) -> Callable:
    """A variant's build: flash_attention(q, k, v, keyword=operand, **options), the
    operand made by make_operand(case, q) (None: no operand)."""
    def build(case, q):
        import flashjax
        if keyword is None:
            return (lambda q, k, v: flashjax.flash_attention(q, k, v, **options)), (), 0
        fn = lambda q, k, v, x: flashjax.flash_attention(q, k, v, **{keyword: x}, **options)
        return fn, (make_operand(case, q),), differentiated
    return build


def _causal_mask(case, q):
    ones = jnp.ones((case.seqlen_q, case.seqlen_k), bool)
    return jnp.tril(ones, case.seqlen_k - case.seqlen_q)[None, None]


def _dense_mask(case, q):
    return jnp.ones((1, 1, case.seqlen_q, case.seqlen_k), bool)


def block_sparse_mask(seqlen_q: int, seqlen_k: int, tile: int = TILE, seed: int = 0):
    """Bool (1, 1, seqlen_q, seqlen_k): in each row of tile x tile tiles a random half of
    the tiles (rounded down) all False, the others all True."""
    rows, cols = -(-seqlen_q // tile), -(-seqlen_k // tile)
    rng = np.random.default_rng(seed)
    tiles = np.ones((rows, cols), bool)
    for r in range(rows):
        tiles[r, rng.permutation(cols)[:cols // 2]] = False
    mask = jnp.repeat(jnp.repeat(jnp.asarray(tiles), tile, axis=0), tile, axis=1)
    return mask[:seqlen_q, :seqlen_k][None, None]


def _bias(case, q, dtype=jnp.float32):
    """(1, heads, seqlen_q, seqlen_k): random rows plus random columns (no random draw of
    seqlen^2 elements: 2^32 of them at 16k)."""
    kr, kc = jax.random.split(jax.random.key(5))
    rows = jax.random.normal(kr, (1, case.heads, case.seqlen_q, 1), jnp.float32)
    columns = jax.random.normal(kc, (1, case.heads, 1, case.seqlen_k), jnp.float32)
    return (rows + columns).astype(dtype)


def alibi_slopes(heads: int) -> np.ndarray:
    """ALiBi's geometric slopes 2^(-8(h+1)/heads), float32 (heads,)."""
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)


def _cudnn(causal=False, differentiated=0, with_bias=False) -> Callable:
    """A variant's build: jax.nn.dot_product_attention(implementation="cudnn"), with a
    bias in q's dtype (its dbias computed when differentiated) or none."""
    def build(case, q):
        _needs_gpu()
        attention = lambda q, k, v, *bias: jax.nn.dot_product_attention(
            q, k, v, *bias, is_causal=causal, implementation="cudnn")
        return attention, ((_bias(case, q, q.dtype),) if with_bias else ()), differentiated
    return build


def _nn(causal: bool) -> Callable:
    def build(case, q):
        import flashjax.nn
        return (lambda q, k, v: flashjax.nn.dot_product_attention(q, k, v, is_causal=causal)), (), 0
    return build


def _needs_gpu():
    if not bench_core.on_gpu():
        raise bench_core.Unsupported("needs a CUDA GPU")


GRAD_MODES = ("fwdbwd", "bwd")
VARIANTS = {v.name: v for v in (
    Variant("none", _flashjax(None)),
    Variant("causal", _flashjax(None, causal=True), density=0.5),
    Variant("mask-causal", _flashjax("mask", _causal_mask), density=0.5),
    Variant("mask-dense", _flashjax("mask", _dense_mask)),
    Variant("mask-blocks", _flashjax("mask", lambda case, q: block_sparse_mask(
        case.seqlen_q, case.seqlen_k)), density=0.5),
    Variant("bias", _flashjax("bias", _bias)),
    Variant("bias-grad", _flashjax("bias", _bias, differentiated=1), modes=GRAD_MODES),
    Variant("cudnn-bias", _cudnn(with_bias=True)),
    Variant("cudnn-bias-grad", _cudnn(with_bias=True, differentiated=1), modes=GRAD_MODES),
    Variant("alibi", _flashjax("alibi_slopes", lambda case, q: jnp.asarray(
        alibi_slopes(case.heads)))),
    Variant("dropout", _flashjax("dropout_key", lambda case, q: jax.random.key(7),
                                 dropout_rate=DROPOUT_RATE)),
    Variant("torch-dropout", None, torch=True),
    Variant("nn", _nn(False)),
    Variant("cudnn", _cudnn()),
    Variant("nn-causal", _nn(True), density=0.5),
    Variant("cudnn-causal", _cudnn(causal=True), density=0.5),
)}
GROUPS = {
    "mask": ("causal", "mask-causal", "mask-dense", "mask-blocks"),
    "bias": ("none", "bias", "bias-grad", "cudnn-bias", "cudnn-bias-grad"),
    "alibi": ("none", "alibi"),
    "dropout": ("none", "dropout", "torch-dropout"),
    "nn": ("nn", "cudnn", "nn-causal", "cudnn-causal"),
}


@dataclasses.dataclass(frozen=True)
class Target:
    """time(variant) / time(baseline) in `modes` should be <= limit (None: information)."""
    group: str
    variant: str
    baseline: str
    modes: tuple
    limit: float | None
    text: str


TARGETS = (
    Target("mask", "mask-causal", "causal", ("fwd", "fwdbwd"), 1.15, "within 1.15x"),
    Target("mask", "mask-blocks", "mask-dense", ("fwd", "fwdbwd"), 1 / 1.8, ">= 1.8x faster"),
    Target("bias", "bias", "none", ("fwd",), 1.3, "within 1.3x"),
    Target("bias", "bias-grad", "cudnn-bias-grad", ("fwdbwd",), 1.0, "faster than cuDNN"),
    Target("bias", "bias", "cudnn-bias", ("fwd",), None, "(peer)"),
    Target("alibi", "alibi", "none", ("fwd",), 1.1, "within 1.1x"),
    Target("alibi", "alibi", "none", ("fwdbwd",), None, "(information)"),
    Target("dropout", "dropout", "none", ("fwdbwd",), 1.25, "within 1.25x"),
    Target("dropout", "dropout", "torch-dropout", ("fwd", "fwdbwd"), None, "(FA2 peer)"),
    Target("nn", "nn", "cudnn", ("fwd", "fwdbwd"), 1.0, "as fast as cuDNN"),
    Target("nn", "nn-causal", "cudnn-causal", ("fwd", "fwdbwd"), 1.0, "as fast as cuDNN"),
)


# --------------------------------------------------------------------------- timing

def torch_ms(case: bench_core.Case, mode: str, warmup: int, iters: int) -> float:
    """PyTorch's scaled_dot_product_attention with dropout_p 0.1 on its FLASH_ATTENTION
    backend (FlashAttention 2), fwd or fwd+bwd, median of CUDA-event times."""
    if mode == "bwd":
        raise bench_core.Unsupported("fwd and fwdbwd only")
    torch, SDPBackend, sdpa_kernel = bench_core.torch_sdpa()
    dt = getattr(torch, case.dtype)
    grad = mode == "fwdbwd"
    make = lambda heads, rows: torch.randn(case.batch, heads, rows, case.head_dim,
                                           device="cuda", dtype=dt, requires_grad=grad)
    q = make(case.heads, case.seqlen_q)
    k, v = make(case.heads_kv, case.seqlen_k), make(case.heads_kv, case.seqlen_k)
    dout = torch.randn_like(q)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT_RATE,
                                                             enable_gqa=case.heads != case.heads_kv)
        if grad:
            torch.autograd.grad(out, (q, k, v), dout)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(1 + warmup + iters):
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times[1 + warmup:])


def measure(variant: Variant, case: bench_core.Case, modes: list[str], inputs, warmup: int,
            iters: int) -> list[dict]:
    """One record per mode: ms and TFLOP/s, or the error."""
    records = []
    built = None
    for mode in modes:
        if mode not in variant.modes:
            continue
        record = {**dataclasses.asdict(case), "variant": variant.name, "mode": mode,
                  "density": variant.density, "ms": None, "tflops": None, "error": None}
        try:
            if variant.torch:
                ms = torch_ms(case, mode, warmup, iters)
            else:
                built = built or variant.build(case, inputs[0])
                fn, operands, differentiated = built
                step, args = bench_core.build_step(fn, mode, *inputs, operands=operands,
                                              differentiated=differentiated)
                ms = bench_core.median_ms(step, args, warmup, iters)
            flops = case.fwd_flops() * variant.density * bench_core.MODE_FLOP_FACTOR[mode]
            record.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as e:  # noqa: BLE001 -- a failure becomes an "n/a" cell
            record["error"] = bench_core.short_reason(e)
        records.append(record)
    return records


# --------------------------------------------------------------------------- driver

def variant_names(groups: list[str]) -> list[str]:
    """The variants of `groups` ("all": every group), each once, in group order."""
    chosen = TERMS if "all" in groups else groups
    return list(dict.fromkeys(name for g in chosen for name in GROUPS[g]))


def cases(args, gpu: bool) -> list[bench_core.Case]:
    """The shapes: bench's make_cases on this mode's defaults (non-causal shapes; the
    variants set causal themselves)."""
    args.fa3_shapes = args.fa3_shapes or gpu
    args.seqlen = args.seqlen or list(GPU_SEQLENS if gpu else CPU_SEQLENS)
    args.head_dim = args.head_dim or [GPU_HEAD_DIM if gpu else CPU_HEAD_DIM]
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.heads = args.heads or (None if args.fa3_shapes else CPU_HEADS)
    args.causal = "no"
    return bench_core.make_cases(args)


def main(args) -> int:
    gpu = bench_core.on_gpu()
    names = variant_names(args.terms)
    modes = args.mode or ["fwd", "fwdbwd"]
    iters = args.iters or (20 if gpu else 3)
    shapes = cases(args, gpu)
    info = bench_core.device_info()
    print(f"device: {info['device']} ({info['platform']}), jax {info['jax']}; "
          f"{len(shapes)} shapes x {len(names)} variants x modes {','.join(modes)}; "
          f"median of {iters} runs after {args.warmup} warm-up runs", flush=True)
    json_file = open(args.json, "w") if args.json else None
    records = []
    try:
        for case in shapes:
            print(case.label(), flush=True)
            inputs = bench_core.make_inputs(case)
            for name in names:
                for r in measure(VARIANTS[name], case, modes, inputs, args.warmup, iters):
                    print(f"  {r['mode']:6s} {name:16s} {cell(r, gpu)}", flush=True)
                    bench_core.keep_record(records, {**info, **r}, json_file)
                jax.clear_caches()
                gc.collect()
            del inputs
    finally:
        if json_file:
            json_file.close()
    print("\nTargets (issue 27): time ratio variant / baseline, FA-convention rates"
          + ("" if gpu else " (the limits are the GPU's; no verdict on the CPU)")
          + "\n" + summary(records, gpu))
    return 0 if any(r["ms"] for r in records) else 1


def cell(r: dict, gpu: bool) -> str:
    if r["ms"] is None:
        return f"n/a ({r['error']})"
    return (f"{r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s" if gpu
            else f"{r['ms']:.2f} ms, {r['tflops'] * 1e3:.2f} GFLOP/s")


def summary(records: list[dict], gpu: bool = True) -> str:
    """One row per (target, shape, mode) whose variants were measured."""
    by = {(r["seqlen_q"], r["head_dim"], r["batch"], r["variant"], r["mode"]): r
          for r in records}
    shapes = list(dict.fromkeys(key[:3] for key in by))
    rows = []
    for t in TARGETS:
        for seqlen, head_dim, batch in shapes:
            for mode in t.modes:
                ours = by.get((seqlen, head_dim, batch, t.variant, mode))
                base = by.get((seqlen, head_dim, batch, t.baseline, mode))
                if ours is None or base is None:
                    continue
                ratio = ours["ms"] / base["ms"] if ours["ms"] and base["ms"] else None
                verdict = ("" if t.limit is None or ratio is None or not gpu
                           else "met" if ratio <= t.limit else "MISSED")
                rows.append([t.group, f"{t.variant} / {t.baseline}", str(seqlen),
                             str(head_dim), str(batch), mode, cell(ours, gpu), cell(base, gpu),
                             "n/a" if ratio is None else f"{ratio:.3f}",
                             t.text if t.limit is None else f"<= {t.limit:.3g} ({t.text})",
                             verdict])
    header = ["term", "time ratio", "sq", "d", "b", "mode", "variant", "baseline", "ratio",
              "target", "verdict"]
    return bench_core.format_table(header, rows)

