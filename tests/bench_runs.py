"""Runs a benchmark module on the CPU at its small shapes (HISPARSE_BENCH_SMALL=1), in a
subprocess from the repository root, for the `tests/test_bench_*.py` checks."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_small(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` with small shapes; the completed process (output kept)."""
    env = dict(os.environ, HISPARSE_BENCH_SMALL="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def refusal(module: str, *args: str, monkeypatch, capsys) -> str:
    """`<module>.main(args)` in this process (small shapes: the module's `SMALL` set, where it
    has one): it must refuse its arguments by exiting non-zero; returns what it said (stderr
    and the exit's message). A subprocess per refusal would spend seconds importing jax to
    check a parser."""
    mod = importlib.import_module(module)
    if hasattr(mod, "SMALL"):  # ncu_kernels reads its sizes inside the ops, after parsing
        monkeypatch.setattr(mod, "SMALL", True)
    with pytest.raises(SystemExit) as exc:
        mod.main(list(args))
    code = exc.value.code
    assert code not in (0, None), f"{module} {args} exited {code!r}"
    return capsys.readouterr().err + ("" if isinstance(code, int) else str(code))
