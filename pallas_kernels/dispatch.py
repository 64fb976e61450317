"""The Pallas kernels behind `backend="pallas"`, keyed by op name (read by `hisparse_jax.ops`).

Each entry takes exactly the arguments of the matching `*_ref` function plus the keyword
`interpret` (True off the GPU: the same kernel runs in the Pallas interpreter). Kernels use
their module defaults (`DEFAULT_RESOLVE`, `DEFAULT_INVALIDATE`, ...); a caller that wants
another tuning calls the kernel function with `tuning=` itself, as the benchmarks do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pallas_kernels import triton_kernels

KERNELS: dict[str, Callable[..., Any]] = {
    "resolve_residency": triton_kernels.resolve_rows,
    "gather_compact": triton_kernels.gather_rows_into_cache,
    "mirror_rows": triton_kernels.scatter_rows_into_pool,
    "invalidate_written_rows": triton_kernels.invalidate_rows,
}
