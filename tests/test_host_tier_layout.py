"""Host tier layout: what each side's source imports, and the lazy re-exports of `host_tier`.

The scheduler side (`host_tier.scheduler`, `host_tier.plan`, `host_tier.sizes`) must run without
jax; the worker side may load jax and `pallas_kernels._compat` but never the data plane
(`hisparse_jax`) or a kernel. Checked here on the source (imports inside functions and
`import_module` calls included); `tests/test_layering.py` checks what importing each module
in a fresh interpreter really loads.
"""

import ast
import pathlib
import sys

import pytest

import host_tier

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "host_tier"

EXPORTS = ["ACTIVE_TAIL_PAGES", "Admitted", "BlockPool", "BlockTables", "CapacityError",
           "Coordinator", "DeviceBlockTables", "HostPool", "HotInvalidation", "NULL_BLOCK",
           "PageRestore", "PageSpill", "PoolExhaustedError", "RequestView", "StepPlan",
           "StepWrite", "TableRows", "TableUpdate", "TransferEngine", "TransferLostError",
           "TransferReport", "Wait", "memory_sharding"]


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a source file imports, anywhere in it (importlib calls included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names


def _allowed(name: str, side: str) -> bool:
    top = name.split(".")[0]
    if top in sys.stdlib_module_names or top == "numpy":
        return True
    if side == "scheduler":
        return name in ("host_tier.plan", "host_tier.sizes") or name.startswith(
            "host_tier.scheduler")
    # psutil: optional (HostPool's RAM check falls back to /proc/meminfo without it).
    return top in ("jax", "host_tier", "psutil") or name in ("pallas_kernels._compat",
                                                             "pallas_kernels")


def test_imports_point_down_only():
    sides = {"scheduler": [PACKAGE / "plan.py", PACKAGE / "sizes.py",
                           *sorted((PACKAGE / "scheduler").glob("*.py"))],
             "worker": [PACKAGE / "testing.py", PACKAGE / "__init__.py",
                        *sorted((PACKAGE / "worker").glob("*.py"))]}
    assert len(sides["scheduler"]) == 14 and len(sides["worker"]) == 6
    for side, paths in sides.items():
        for path in paths:
            bad = sorted(n for n in _imports(path) if not _allowed(n, side))
            assert not bad, f"{path.relative_to(ROOT)} ({side} side) imports {bad}"
    # `from pallas_kernels import _compat` is the only pallas_kernels import.
    source = (PACKAGE / "worker" / "host_pool.py").read_text()
    assert "from pallas_kernels import _compat\n" in source


def test_host_tier_re_exports_every_public_name_lazily():
    assert host_tier.__all__ == sorted(EXPORTS)
    assert set(EXPORTS) <= set(dir(host_tier))
    from host_tier import scheduler, worker

    for name in EXPORTS:
        value = getattr(host_tier, name)
        owner = scheduler if hasattr(scheduler, name) else worker
        if hasattr(owner, name):
            assert getattr(owner, name) is value, name
    for removed in ("apply_hot_updates", "invalidate_host_blocks"):
        with pytest.raises(AttributeError, match=removed):
            getattr(host_tier, removed)
    assert not hasattr(host_tier.TransferEngine, "update_hot_state")
