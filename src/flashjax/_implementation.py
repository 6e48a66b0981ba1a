"""Which implementation runs a call: the `implementation=` keyword of the public
functions, resolved into Config.implementation ("auto", "cuda", "cpu", "xla") and
Config.kernel_cap (_checks.IMPLEMENTATIONS).

- "auto" (implementation=None): flashjax's kernels where it has them (CUDA GPUs, the
  CPU), the pure-JAX blockwise path (xla_attention) on every other platform (TPU, ROCm,
  ...). `jax.lax.platform_dependent` picks at lowering time, so one traced function
  serves every platform it is lowered for.
- "cuda" / "cpu": flashjax's kernels, and an error naming the platform when the call
  cannot run there.
- "xla": the pure-JAX path everywhere.
"""

from __future__ import annotations

import jax

from . import _calls, xla_attention

# implementation= values that need one platform: jax's platform name for it.
KERNEL_PLATFORMS = {"cuda": "gpu", "cpu": "cpu"}


def _platforms(*arrays) -> set:
    """The platforms of the arrays' devices (committed concrete arrays), else of the
    default backend (traced values carry no device)."""
    platforms = set()
    for x in arrays:
        if x is None or isinstance(x, jax.core.Tracer) or not hasattr(x, "devices"):
            continue
        platforms |= {d.platform for d in x.devices()}
    return platforms or {jax.default_backend()}


def check_platform(cfg: _calls.Config, *arrays) -> None:
    """A ValueError when a forced kernel implementation cannot run on the arrays'
    platform (ROCm GPUs report "gpu" too: their calls fail at compile time instead)."""
    needed = KERNEL_PLATFORMS.get(cfg.implementation)
    if needed is None:
        return
    found = _platforms(*arrays)
    if found != {needed}:
        raise ValueError(
            f"implementation={cfg.implementation!r} runs flashjax's {cfg.implementation} "
            f"kernels, but the arrays are on {sorted(found)}; use implementation=None "
            "(automatic) or 'xla' (pure JAX, any platform)")


def _no_work(q, k, cfg: _calls.Config) -> bool:
    """No query rows or no keys (static shapes): nothing for a kernel to do."""
    rows = lambda x: x.shape[0] if cfg.packed else x.shape[0] * x.shape[1]
    return rows(q) == 0 or rows(k) == 0


def attention(q, k, v, sinks, layout: _calls.Layout, cfg: _calls.Config, *arrays):
    """(out, lse) of a dense or packed call by cfg's implementation (`arrays`: the
    caller's inputs, for the platform check)."""
    if cfg.implementation != "auto":
        check_platform(cfg, q, *arrays)
    if _no_work(q, k, cfg):
        return xla_attention.no_work_attention(q, k, v, sinks, layout, cfg)
    if cfg.implementation == "xla":
        return xla_attention.attention_core(q, k, v, sinks, layout, cfg)
    if cfg.implementation != "auto":
        return _calls.attention_core(q, k, v, sinks, layout, cfg)
    kernels = lambda *a: _calls.attention_core(*a, cfg)
    return jax.lax.platform_dependent(
        q, k, v, sinks, layout, cuda=kernels, cpu=kernels,
        default=lambda *a: xla_attention.attention_core(*a, cfg))
