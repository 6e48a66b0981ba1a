"""Which implementation runs a call: the `implementation=` keyword of every public
entry point, resolved into Config.implementation and Config.kernel_cap, and the one
router (`run`) they all go through.

- "auto" (implementation=None): flashjax's kernels where it has them (CUDA GPUs, the
  CPU), the pure-JAX path on every other platform (TPU, ROCm, ...).
  `jax.lax.platform_dependent` picks at lowering time, so one traced function serves
  every platform it is lowered for.
- "cuda" / "cpu": flashjax's kernels, and an error naming the platform when the call
  cannot run there.
- "xla": the pure-JAX path everywhere.
"""

from __future__ import annotations

from typing import Callable

import jax

__all__ = ["IMPLEMENTATIONS", "implementation_fields", "check_platform", "run"]

# implementation= values: (backend, CUDA kernel cap). None: flashjax's kernels on CUDA and
# CPU, the pure-JAX path elsewhere; "cuda:mma" / "cuda:simt" cap the CUDA kernel choice
# (the Hopper kernels, then mma.sync, then SIMT) at the mma.sync or SIMT kernels.
IMPLEMENTATIONS = {None: ("auto", 0), "cuda": ("cuda", 0), "cuda:mma": ("cuda", 1),
                   "cuda:simt": ("cuda", 2), "cpu": ("cpu", 0), "xla": ("xla", 0)}
# implementation= backends that need one platform: jax's platform name for it.
KERNEL_PLATFORMS = {"cuda": "gpu", "cpu": "cpu"}


def implementation_fields(implementation) -> dict:
    """Config fields of an implementation= value."""
    if not isinstance(implementation, (str, type(None))) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {list(IMPLEMENTATIONS)}, got "
                         f"{implementation!r}")
    backend, cap = IMPLEMENTATIONS[implementation]
    return dict(implementation=backend, kernel_cap=cap)


def _platforms(*arrays) -> set:
    """The platforms of the arrays' devices (committed concrete arrays), else of the
    default backend (traced values carry no device)."""
    platforms = set()
    for x in arrays:
        if x is None or isinstance(x, jax.core.Tracer) or not hasattr(x, "devices"):
            continue
        platforms |= {d.platform for d in x.devices()}
    return platforms or {jax.default_backend()}


def check_platform(cfg, *arrays) -> None:
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


def run(cfg, args: tuple, *, cuda: Callable, cpu: Callable, xla: Callable, arrays=()):
    """cuda(*args), cpu(*args) or xla(*args), as cfg.implementation says (`arrays`:
    the caller's inputs, whose platform a forced kernel implementation must match)."""
    check_platform(cfg, *arrays)
    if cfg.implementation == "xla":
        return xla(*args)
    if cfg.implementation == "cuda":
        return cuda(*args)
    if cfg.implementation == "cpu":
        return cpu(*args)
    return jax.lax.platform_dependent(*args, cuda=cuda, cpu=cpu, default=xla)


