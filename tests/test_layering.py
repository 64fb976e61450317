"""The layers' import arrows point down only, checked by importing every module alone.

Each module of `pallas_kernels`, `host_tier` and `hisparse_jax` is imported in a fresh
interpreter (so an import cycle or an upward import shows up as it would for a user who
imports that module first), and the modules it pulled in are checked against its layer:

  * `pallas_kernels.*` loads jax and numpy only: nothing of `hisparse_jax`, `host_tier` or flax;
  * `host_tier` (the package itself), `host_tier.scheduler.*`, `host_tier.plan` and
    `host_tier.sizes` load no jax at all (the scheduler side runs in a process without it);
  * `host_tier.worker.*` and `host_tier.testing` load jax but nothing of `hisparse_jax` or flax,
    and of `pallas_kernels` only its compat module (never a kernel);
  * `hisparse_jax.*` may load everything below it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "host_tier", "hisparse_jax")
PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules
                        if m.split('.')[0] in ('jax', 'flax', 'hisparse_jax', 'host_tier',
                                               'pallas_kernels'))))
"""


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        path = [str(ROOT / package)]
        names += [m.name for m in pkgutil.walk_packages(path, prefix=package + ".")]
    return sorted(names)


def _loaded_by(module: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f"importing {module} alone fails:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _allowed(module: str, loaded: str) -> bool:
    top = loaded.split(".")[0]
    if module.startswith("pallas_kernels"):
        return top in ("jax", "pallas_kernels")
    if module.startswith("host_tier"):
        worker_side = module.startswith(("host_tier.worker", "host_tier.testing"))
        if not worker_side:
            return top == "host_tier"
        if top == "pallas_kernels":
            return loaded in ("pallas_kernels", "pallas_kernels._compat")
        return top in ("jax", "host_tier")
    return True


@pytest.fixture(scope="module")
def imports() -> dict[str, list[str]]:
    modules = _modules()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(modules, pool.map(_loaded_by, modules), strict=True))


def test_every_layer_imports_only_what_lies_below(imports):
    assert {"pallas_kernels._compat", "host_tier.scheduler.coordinator",
            "host_tier.worker.host_pool", "hisparse_jax.engine"} <= set(imports)
    wrong = {module: [m for m in loaded if not _allowed(module, m)]
             for module, loaded in imports.items()}
    wrong = {k: v for k, v in wrong.items() if v}
    assert not wrong, f"modules that import above their layer: {wrong}"


def test_the_scheduler_side_runs_without_jax(imports):
    for module in ("host_tier", "host_tier.scheduler", "host_tier.plan", "host_tier.sizes"):
        assert not [m for m in imports[module] if m.split(".")[0] == "jax"], module
    # ... while the worker side does use it (the check above is not vacuous).
    assert "jax" in imports["host_tier.worker.host_pool"]


def test_the_rule_catches_an_upward_import():
    assert not _allowed("pallas_kernels.x", "hisparse_jax.ops")
    assert not _allowed("host_tier.scheduler.coordinator", "jax")
    assert not _allowed("host_tier.worker.transfer", "pallas_kernels.resolve_residency.triton")
    assert not _allowed("host_tier.worker.transfer", "hisparse_jax")
    assert _allowed("host_tier.worker.transfer", "pallas_kernels._compat")
