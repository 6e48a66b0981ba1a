"""Shared pytest setup.

- float64 references need jax_enable_x64 (flashjax itself still rejects float64 inputs);
- the `gpu` marker: such tests are skipped when jax sees no GPU;
- the `slow` marker: long tests that still run in CI (deselect with -m "not slow");
- XLA's CPU backend compiles at LLVM optimisation level 0 (TEST_XLA_FLAGS).
Helpers (rand, has_gpu, Case, check_close, ...) live in helpers.py.
"""

import os

# The CPU suite is bound by XLA compiling small programs (the references, the pure-JAX
# path): at level 0 a pure-JAX case compiles in about half the time (test_xla_attention.py
# 133 -> 82 s on the 2-core machine). flashjax's own kernels are compiled by its build,
# not by XLA, and run as shipped. Before jax starts a backend (run_on_host_devices passes
# the flags on to its subprocesses).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

from helpers import has_gpu, rand, use_implementation  # noqa: E402  (after enabling x64)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU visible to jax (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: a long test (< 60 s) that still runs in CI")


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no GPU visible to jax (jax.devices('gpu') unavailable)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gpu_device():
    """The first GPU; skips the test when there is none."""
    if not has_gpu():
        pytest.skip("no GPU visible to jax")
    return jax.devices("gpu")[0]


@pytest.fixture
def cpu_kernels(monkeypatch):
    """flashjax's entry points called with implementation="cpu": the C++ kernels that
    implementation=None runs on the CPU, without tracing the pure-JAX fallback branch
    that None's platform_dependent also traces (most of a small case's time). The
    default's dispatch is tested in test_implementation.py and by the files that do not
    use this fixture."""
    use_implementation(monkeypatch, "cpu")


@pytest.fixture
def key():
    """A fresh PRNG key for rand()."""
    return jax.random.key(0)


__all__ = ["has_gpu", "rand"]
