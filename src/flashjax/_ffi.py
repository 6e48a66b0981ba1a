"""Loads the compiled flashjax library and registers its XLA FFI handlers."""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax

FORWARD_TARGET = "flashjax_fwd"
BACKWARD_TARGET = "flashjax_bwd"
VARLEN_FORWARD_TARGET = "flashjax_varlen_fwd"
VARLEN_BACKWARD_TARGET = "flashjax_varlen_bwd"
KVCACHE_TARGET = "flashjax_kvcache"

# Handler symbol stems per target; the library adds the platform's suffix.
_SYMBOLS = {
    FORWARD_TARGET: "FlashjaxForward",
    BACKWARD_TARGET: "FlashjaxBackward",
    VARLEN_FORWARD_TARGET: "FlashjaxVarlenForward",
    VARLEN_BACKWARD_TARGET: "FlashjaxVarlenBackward",
    KVCACHE_TARGET: "FlashjaxKvcache",
}
# XLA's platform names and the library's symbol suffixes.
_PLATFORMS = {"cpu": "Cpu", "CUDA": "Cuda"}


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
def library() -> ctypes.CDLL:
    return ctypes.cdll.LoadLibrary(str(_library_path()))


@functools.cache
def load() -> frozenset[str]:
    """Registers every handler the library has; returns the platforms served."""
    lib = library()
    platforms = set()
    for platform, suffix in _PLATFORMS.items():
        symbols = {target: stem + suffix for target, stem in _SYMBOLS.items()}
        if not all(hasattr(lib, symbol) for symbol in symbols.values()):
            continue  # e.g. a CPU-only build has no CUDA handlers
        for target, symbol in symbols.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform
            )
        platforms.add(platform)
    return frozenset(platforms)


def has_cuda_kernels() -> bool:
    """True when this build of flashjax contains the CUDA kernels."""
    return "CUDA" in load()
