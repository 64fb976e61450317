"""Shared test set-up: the `gpu` marker, hypothesis profiles, x64 off, pinned host helpers."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import jax
import pytest
from hypothesis import HealthCheck, settings

# The engine turns on jax's persistent compilation cache under the user's cache directory by
# default; the suite keeps its own under the temporary directory instead, shared by the xdist
# workers and the benchmark subprocesses, so that the many engines the tests build over the
# same small models compile each program once per run (and a rerun reads them back).
# HISPARSE_JAX_COMPILATION_CACHE=0 runs the suite with the cache off.
os.environ.setdefault("HISPARSE_JAX_COMPILATION_CACHE", os.path.join(
    tempfile.gettempdir(), f"hisparse_jax_tests_{os.getuid()}", "jax_cache"))

# Off the GPU, XLA's CPU compiles dominate the suite (interpret-mode kernels, small engines):
# the suite compiles with LLVM's optimizations off, about a third less compile time; results
# are the same programs, run unoptimized. Kept out of a GPU run (a CUDA plugin installed),
# whose kernels the flags would slow; HISPARSE_TEST_XLA_FLAGS="" keeps XLA's defaults.
# Subprocesses inherit XLA_FLAGS; those that set their own flags add HISPARSE_TEST_XLA_FLAGS.
_CUDA = any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13))
os.environ.setdefault("HISPARSE_TEST_XLA_FLAGS", "" if _CUDA else (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"))
_FLAGS = os.environ["HISPARSE_TEST_XLA_FLAGS"]
if _FLAGS and _FLAGS not in os.environ.get("XLA_FLAGS", ""):  # xdist workers inherit them
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (
        _FLAGS, os.environ.get("XLA_FLAGS"))))

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
