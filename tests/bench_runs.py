"""Runs a benchmark module on the CPU at its small shapes (HISPARSE_BENCH_SMALL=1), in a
subprocess from the repository root, for the `tests/test_bench_*.py` checks."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_small(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` with small shapes; the completed process (output kept)."""
    env = dict(os.environ, HISPARSE_BENCH_SMALL="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
