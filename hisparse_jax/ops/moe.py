"""The mixture of experts' grouped matmul: `grouped_matmul`.

The MoE (`hisparse_jax.models.dsa_moe`) sorts its token-expert pairs by expert and multiplies
each expert's run of rows by that expert's weights; this op is that product, one call for all
experts. Contract (`pallas_kernels/grouped_matmul/reference.py`): lhs [M, K] rows sorted by
group, rhs [G, K, N], group_sizes int32[G] (>= 0, summing to M; empty groups anywhere);
out[r] = lhs[r] @ rhs[group of r], float32[M, N], accumulated in float32.

Backends (`backend=`, through `hisparse_jax.ops._registry`):
  "reference":  `jax.lax.ragged_dot` (`.../reference.py`); any platform, bf16/f16/f32. On a
                CPU its work is proportional to M; on an NVIDIA GPU XLA (without its
                grouped-GEMM flag) runs it as a dense product over every group, G times the
                work with a [G, M, K] temporary.
  "triton":     Pallas kernel through the Triton lowering (`.../triton.py`): tiles of one
                group's rows, each a pass over its group's weight block; empty groups cost
                nothing. bf16/f16, K and N multiples of 16. The default on a GPU.
  "mosaic_gpu": jax's Hopper grouped matmul, `ragged_dot_mgpu` (`.../mosaic_gpu.py`): Hopper
                GPUs, bf16/f16, K % 64 and N % 128 (its default blocks); a full tile for
                every group, empty or not. Output rounded once to the inputs' dtype.
                Opt-in.
  None:         "triton" on a GPU when it supports the inputs, else "reference".
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.ops import _checks, _registry

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("backend", "config"))
def _run(lhs, rhs, group_sizes, *, backend, config):
    fn = _registry.implementation("grouped_matmul", backend)
    if backend != "reference" and config is not None:
        fn = functools.partial(fn, tuning=config)
    return fn(lhs, rhs, group_sizes)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    backend: str | None = None,
    config: Any = None,
) -> jax.Array:
    """Rows of lhs, sorted by group, times their group's matrix.

    Args:
      lhs: [M, K] bfloat16, float16 or float32; group g owns rows [start_g, start_g +
        group_sizes[g]), start_g the sum of the sizes before it. M may be 0.
      rhs: [G, K, N] of lhs's dtype, G >= 1, K >= 1, N >= 1.
      group_sizes: int32[G], each >= 0, summing to M (checked when concrete; traced sizes
        that break the rule leave the rows past their sum unspecified).
      backend: "reference", "triton", "mosaic_gpu" or None (module docstring).
      config: optional tuning of the kernel that runs:
        `pallas_kernels.grouped_matmul.triton.GroupedTuning` (triton) or
        `pallas_kernels.grouped_matmul.mosaic_gpu.MosaicGroupedTuning` (mosaic_gpu);
        ignored by the reference.

    Returns:
      float32[M, N]: out[r] = lhs[r] @ rhs[g] for the group g owning row r, accumulated in
      float32 (the mosaic_gpu backend rounds it once to lhs's dtype).

    Raises:
      TypeError: a non-array argument, a dtype other than the ones above, rhs of another
        dtype than lhs, group_sizes not int32.
      ValueError: wrong ranks, K or G disagreeing, an empty dimension, concrete group_sizes
        negative or not summing to M, or a backend that cannot run the inputs.
    """
    _validate(lhs, rhs, group_sizes)
    backend = _registry.select("grouped_matmul", backend, lhs, rhs, group_sizes)
    if lhs.shape[0] == 0:
        return jnp.zeros((0, rhs.shape[2]), jnp.float32)
    return _run(lhs, rhs, group_sizes, backend=backend, config=config)


def _validate(lhs: Any, rhs: Any, group_sizes: Any) -> None:
    """The shape, dtype and (for concrete sizes) value rules of `grouped_matmul`."""
    _checks.check_array("lhs", lhs, ndim=2)
    _checks.check_array("rhs", rhs, ndim=3)
    _checks.check_array("group_sizes", group_sizes, ndim=1, dtype=jnp.int32)
    if jnp.dtype(lhs.dtype) not in _DTYPES:
        raise TypeError(f"lhs must be bfloat16, float16 or float32, got "
                        f"{jnp.dtype(lhs.dtype).name}")
    if jnp.dtype(rhs.dtype) != jnp.dtype(lhs.dtype):
        raise TypeError(f"rhs dtype must equal lhs's dtype {jnp.dtype(lhs.dtype).name}, got "
                        f"{jnp.dtype(rhs.dtype).name}")
    (m, k), (g, k2, n) = lhs.shape, rhs.shape
    if min(g, k2, n) < 1:
        raise ValueError(f"rhs must be [G, K, N] with G, K, N >= 1, got shape "
                         f"{tuple(rhs.shape)}")
    if k2 != k:
        raise ValueError(f"rhs must be [G, K={k}, N] (K of lhs [M, K]), got shape "
                         f"{tuple(rhs.shape)}")
    if group_sizes.shape[0] != g:
        raise ValueError(f"group_sizes must hold one size per group of rhs (G={g}), got "
                         f"shape {tuple(group_sizes.shape)}")
    if _checks.is_concrete(group_sizes):
        sizes = np.asarray(group_sizes, np.int64)
        if (sizes < 0).any():
            raise ValueError(f"group_sizes must be >= 0, got {sizes.min()} at group "
                             f"{int(np.argmin(sizes))}")
        if sizes.sum() != m:
            raise ValueError(f"group_sizes must sum to M={m} (the rows of lhs), got "
                             f"{int(sizes.sum())}")
