"""Shared test set-up: the `gpu` marker, hypothesis profiles, x64 off, pinned host helpers."""

from __future__ import annotations

import os

import jax
import pytest
from hypothesis import HealthCheck, settings

# The engine turns on jax's persistent compilation cache under the user's cache directory by
# default; the suite writes none there (tests that check the cache enable it on a tmp dir).
os.environ.setdefault("HISPARSE_JAX_COMPILATION_CACHE", "0")

# "ci": the default, sized so that `.ci/run` (three jax lines on two cores) stays well inside
# its 90-minute limit; "long" for thorough runs (HISPARSE_HYPOTHESIS_PROFILE=long).
settings.register_profile(
    "ci", max_examples=int(os.environ.get("HISPARSE_EXAMPLES", "30")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=int(os.environ.get("HISPARSE_EXAMPLES", "2000")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HISPARSE_HYPOTHESIS_PROFILE", "ci"))


def _on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _on_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pinned_host():
    """A SingleDeviceSharding in pinned_host memory on the first device."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


@pytest.fixture(scope="session")
def on_device():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
