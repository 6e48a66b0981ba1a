"""Shared pytest setup: float64 references need x64; GPU tests skip without a GPU."""

import jax
import pytest

jax.config.update("jax_enable_x64", True)


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    if gpu_devices():
        return
    skip = pytest.mark.skip(reason="no GPU visible to jax")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
