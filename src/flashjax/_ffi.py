"""Loads the compiled flashjax library and registers its XLA FFI handlers."""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax

FORWARD_TARGET = "flashjax_fwd"
BACKWARD_TARGET = "flashjax_bwd"

# (target name, symbol in the library) per platform, as XLA names platforms.
_HANDLERS = {
    "cpu": {FORWARD_TARGET: "FlashjaxForwardCpu", BACKWARD_TARGET: "FlashjaxBackwardCpu"},
    "CUDA": {FORWARD_TARGET: "FlashjaxForwardCuda", BACKWARD_TARGET: "FlashjaxBackwardCuda"},
}


def _library_path() -> pathlib.Path:
    here = pathlib.Path(__file__).parent
    for name in ("libflashjax_ffi.so", "libflashjax_ffi.dylib", "flashjax_ffi.dll"):
        if (here / name).exists():
            return here / name
    raise ImportError(
        f"flashjax: compiled library not found in {here}; install the package with "
        "`pip install .` rather than importing it from the source tree"
    )


@functools.cache
def load() -> frozenset[str]:
    """Registers every handler the library has; returns the platforms served."""
    lib = ctypes.cdll.LoadLibrary(str(_library_path()))
    platforms = set()
    for platform, targets in _HANDLERS.items():
        if not all(hasattr(lib, symbol) for symbol in targets.values()):
            continue  # e.g. a CPU-only build has no CUDA handlers
        for target, symbol in targets.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform
            )
        platforms.add(platform)
    return frozenset(platforms)


def has_cuda_kernels() -> bool:
    """True when this build of flashjax contains the CUDA kernels."""
    return "CUDA" in load()
