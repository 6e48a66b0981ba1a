"""Shared pytest setup.

- float64 references need jax_enable_x64 (flashjax itself still rejects float64 inputs);
- the `gpu` marker: such tests are skipped when jax sees no GPU;
- the `slow` marker: long tests that still run in CI (deselect with -m "not slow").
Helpers (rand, has_gpu, Case, check_close, ...) live in helpers.py.
"""

import jax
import pytest

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
