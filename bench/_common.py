"""Shared plumbing of the benchmarks: device timing and result files.

Every result file under `bench/results/` is JSON with the machine, the jax version, the date
and, for each figure, the baseline measured in the same run and the ratio to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The benchmarks' --help: appends "(default: X)" to a flag's help once, not where the
    help already says its default, nor for a default of None or False (a flag that is off,
    or whose help says what it falls back to)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def machine_description() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "num_devices": jax.device_count(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
    }


def time_fn(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 20) -> dict[str, float]:
    """Wall-clock seconds of `fn()` (which must return jax arrays), synchronised each call.

    Returns the median, min and p90 in microseconds. On the GPU this includes the launch
    overhead of one jitted call; benchmarks that need pure device time say so.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - t0) * 1e6)
    samples.sort()
    return {
        "median_us": statistics.median(samples),
        "min_us": samples[0],
        "p90_us": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
        "iters": iters,
    }


def write_result(name: str, payload: dict[str, Any], path: Path | None = None) -> Path:
    """Writes `bench/results/<name>-<backend>.json` (or `path`); the GPU suite ships the
    folder back."""
    record = {
        "benchmark": name,
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        **payload,
    }
    if path is None:
        path = RESULTS_DIR / f"{name}-{jax.default_backend()}.json"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=2, sort_keys=False, default=str)
    path.write_text(text + "\n")
    return path
