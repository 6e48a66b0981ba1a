"""Loads the compiled flashjax library and registers its XLA FFI handlers (one per
target of _spec.TARGETS and platform, and the CPU-only targets of _TEST_TARGETS)."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import jax

from . import _spec

# XLA's platform names and the library's symbol suffixes.
_PLATFORMS = {"cpu": "Cpu", "CUDA": "Cuda"}
# CPU targets outside the attention table, for the tests: target -> symbol.
# flashjax_dropout_mask: dropout's keep mask from csrc/include/flashjax/dropout.h
# (csrc/ffi/dropout_mask.cc), compared with the pure-JAX generator (_dropout.py).
_TEST_TARGETS = {"flashjax_dropout_mask": "FlashjaxDropoutMaskCpu"}


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


CPU_THREADS_VARIABLE = "FLASHJAX_CPU_THREADS"  # read by csrc/cpu/thread_pool.cc


def check_environment() -> None:
    """A ValueError naming the variable when a flashjax environment variable is set to
    something the library cannot use (it would otherwise be ignored)."""
    threads = os.environ.get(CPU_THREADS_VARIABLE)
    if threads is not None and not (threads.strip().isdigit() and int(threads) >= 1):
        raise ValueError(f"{CPU_THREADS_VARIABLE} must be a positive integer (threads of the "
                         f"CPU path), got {threads!r}; unset it to use every core")


def load() -> frozenset[str]:
    """Checks the environment, registers every handler the library has (once); returns
    the platforms served."""
    check_environment()
    return _register()


@functools.cache
def _register() -> frozenset[str]:
    lib = library()
    platforms = set()
    for platform, suffix in _PLATFORMS.items():
        symbols = {target.name: target.symbol + suffix for target in _spec.TARGETS}
        if not all(hasattr(lib, symbol) for symbol in symbols.values()):
            continue  # e.g. a CPU-only build has no CUDA handlers
        for target, symbol in symbols.items():
            jax.ffi.register_ffi_target(
                target, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform
            )
        platforms.add(platform)
    for target, symbol in _TEST_TARGETS.items():
        if hasattr(lib, symbol):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    return frozenset(platforms)


def has_cuda_kernels() -> bool:
    """True when this build of flashjax contains the CUDA kernels."""
    return "CUDA" in load()
