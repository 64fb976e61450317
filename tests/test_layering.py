"""The layers' import arrows point down only, checked by importing every module alone.

Each module of `pallas_kernels`, `host_tier` and `hisparse_jax` is imported alone in a fresh
process (so an import cycle or an upward import shows up as it would for a user who imports
that module first), and the modules it pulled in are checked against its layer. The fresh
processes are forked from a probe process per package that has imported only third-party
packages the package may load (none for `host_tier`, jax for `pallas_kernels`, jax and flax
for `hisparse_jax`), so each import costs our modules' time, not jax's:

  * `pallas_kernels.*` loads jax and numpy only: nothing of `hisparse_jax`, `host_tier` or flax;
  * `host_tier` (the package itself), `host_tier.scheduler.*`, `host_tier.plan` and
    `host_tier.sizes` load no jax at all (the scheduler side runs in a process without it);
  * `host_tier.worker.*` and `host_tier.testing` load jax but nothing of `hisparse_jax` or flax,
    and of `pallas_kernels` only its compat module (never a kernel);
  * `hisparse_jax.*` may load everything below it.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "host_tier", "hisparse_jax")
# Forks one child per module named in argv[2:] after importing the packages named in argv[1]
# (comma-separated); each child imports its module and reports the modules then loaded.
PROBE = """
import importlib, json, os, sys, traceback
for name in filter(None, sys.argv[1].split(',')):
    importlib.import_module(name)
OURS = ('jax', 'flax', 'hisparse_jax', 'host_tier', 'pallas_kernels')
report = {}
for module in sys.argv[2:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            out = {'loaded': sorted(m for m in sys.modules if m.split('.')[0] in OURS)}
        except BaseException:
            out = {'error': traceback.format_exc()[-2000:]}
        with os.fdopen(write, 'w') as f:
            f.write(json.dumps(out))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    report[module] = json.loads(text) if text else {'error': 'the child died'}
print(json.dumps(report))
"""
# What each package's probe imports before forking: only what every module of the package
# may load (the scheduler side of host_tier may not load jax, so its probe imports nothing).
PRELOAD = {"pallas_kernels": "jax,jax.numpy", "host_tier": "",
           "hisparse_jax": "jax,jax.numpy,flax,flax.nnx"}


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        path = [str(ROOT / package)]
        names += [m.name for m in pkgutil.walk_packages(path, prefix=package + ".")]
    return sorted(names)


def _probe(package: str, modules: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-c", PROBE, PRELOAD[package], *modules],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)


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
    probes = [_probe(p, [m for m in modules if m.split(".")[0] == p]) for p in PACKAGES]
    report = {}
    for proc in probes:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        report.update(json.loads(out.strip().splitlines()[-1]))
    failed = {m: r["error"] for m, r in report.items() if "error" in r}
    assert not failed, f"modules that fail to import alone: {failed}"
    assert sorted(report) == modules
    return {m: r["loaded"] for m, r in report.items()}


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
