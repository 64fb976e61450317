"""mirror_rows, jnp reference (and the non-kernel fallback).

The scatter into a host pool runs on the host (`compute_on("device_host")`, through
`_compat.on_host`): only the selected rows cross PCIe, never the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _compat


def mirror_rows(kv_cache: jax.Array, host_pool: jax.Array, device_rows: jax.Array,
                host_rows: jax.Array) -> jax.Array:
    """host_pool with row host_rows[i] := device row device_rows[i] of kv_cache.

    Args:
      kv_cache: [num_blocks, B, W] (read only).
      host_pool: [host_rows, W] or [host_blocks, B, W], any memory kind (kept); a pool of
        wider rows ([.., G * W], packed) takes flat W-wide row ids (as `reshape(-1, W)`).
      device_rows, host_rows: int32[R].
    Returns:
      the updated pool, shape and memory kind of `host_pool`. Entries with either index
      negative or out of range are skipped; destinations of the kept entries must be
      distinct.
    """
    width = kv_cache.shape[-1]
    cache_rows = kv_cache.size // width
    pool_shape = host_pool.shape
    pool = host_pool.reshape(-1, width)
    keep = (device_rows >= 0) & (device_rows < cache_rows) & (host_rows >= 0) & (
        host_rows < pool.shape[0])
    rows = kv_cache.reshape(cache_rows, width)[jnp.where(keep, device_rows, 0)]
    rows = rows.astype(pool.dtype)
    dst = jnp.where(keep, host_rows, pool.shape[0])             # dropped: out of bounds
    scatter = lambda p, r, d: p.at[d].set(r, mode="drop")
    if _compat.in_host_memory(host_pool):
        pool = _compat.on_host(scatter, pool, _compat.to_host(rows), _compat.to_host(dst))
    else:
        pool = scatter(pool, rows, dst)
    return pool.reshape(pool_shape)
