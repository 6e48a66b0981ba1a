"""Shared pytest setup.

- float64 references need jax_enable_x64 (flashjax itself still rejects float64 inputs);
- the `gpu` marker: such tests are skipped when jax sees no GPU;
- the `slow` marker: long tests that still run in CI (deselect with -m "not slow");
- XLA's CPU backend compiles fast (TEST_XLA_FLAGS, FAST_COMPILE_FLAG).
Helpers (rand, has_gpu, Case, check_close, ...) live in helpers.py.
"""

import os

# The CPU suite is bound by XLA compiling small programs (the references, the pure-JAX
# path): at level 0 a pure-JAX case compiles in about half the time (test_xla_attention.py
# 133 -> 82 s on the 2-core machine), and XLA's loop emitters instead of its MLIR fusion
# emitters halve it again (the whole suite 11 min 40 s -> 6 min 49 s, jaxlib 0.10.2,
# thirtieth session). flashjax's own kernels are compiled by its build, not by XLA, and
# run as shipped. Set before jax starts a backend (run_on_host_devices passes the flags on
# to its subprocesses; xdist's workers inherit the controller's).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`: an unknown one aborts the process that
    parses it, so a subprocess asks (~2 s, once: the controller's answer is inherited)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                              timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


if "FLASHJAX_TEST_XLA_FLAGS" not in os.environ:
    os.environ["FLASHJAX_TEST_XLA_FLAGS"] = " ".join(
        [TEST_XLA_FLAGS] + ([FAST_COMPILE_FLAG] if _xla_accepts(FAST_COMPILE_FLAG) else []))
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in os.environ["FLASHJAX_TEST_XLA_FLAGS"].split() if f not in _flags]
os.environ["XLA_FLAGS"] = " ".join(_flags)

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
