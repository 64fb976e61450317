"""The Pallas kernels behind `backend="pallas"`, keyed by op name (read by `hisparse_jax.ops`).

Each entry takes exactly the arguments of the matching `*_ref` function plus the keyword
`interpret` (True off the GPU: the same kernel runs in the Pallas interpreter).

`set_tuning(op, tuning)` makes every later trace of `op` use `tuning` (a benchmark that
found a faster setting applies it to the public ops this way; None restores the kernel's
default). It acts at trace time: functions already jitted keep the tuning they were traced
with, so call `jax.clear_caches()` after changing it if the op was traced before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pallas_kernels import triton_kernels

TUNING_OVERRIDES: dict[str, Any] = {}


def set_tuning(op: str, tuning: Any) -> None:
    """Uses `tuning` (e.g. a `triton_kernels.ResolveTuning`) for op from the next trace on."""
    if op not in KERNELS:
        raise KeyError(f"no kernel for op {op!r}; ops: {sorted(KERNELS)}")
    if tuning is None:
        TUNING_OVERRIDES.pop(op, None)
    else:
        TUNING_OVERRIDES[op] = tuning


def _tunable(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args, **kwargs):
        tuning = TUNING_OVERRIDES.get(op)
        if tuning is not None and "tuning" not in kwargs:
            kwargs["tuning"] = tuning
        return fn(*args, **kwargs)
    return call


KERNELS: dict[str, Callable[..., Any]] = {
    op: _tunable(op, fn) for op, fn in {
        "resolve_residency": triton_kernels.resolve_rows,
        "gather_compact": triton_kernels.gather_rows_into_cache,
        "mirror_rows": triton_kernels.scatter_rows_into_pool,
        "invalidate_written_rows": triton_kernels.invalidate_rows,
    }.items()
}
