"""gather_compact and gather_compact_group, jnp reference (and the non-kernel fallback).

The host side of the copy runs on the host (`compute_on("device_host")`, through
`_compat.on_host`) so that only the selected rows cross PCIe, never the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import _compat


def swap_plan_rows(swap_src: jax.Array, swap_dst: jax.Array, swap_counts: jax.Array,
                   num_cache_rows: int) -> tuple[jax.Array, jax.Array]:
    """Flattens a swap plan int32[N, K] to (src int32[N*K], dst int32[N*K]).

    Entry (n, m) is live when m < swap_counts[n], swap_src >= 0 and
    0 <= swap_dst < num_cache_rows; a dropped entry gets src = dst = -1.
    """
    k = swap_src.shape[1]
    live = (jnp.arange(k)[None, :] < swap_counts[:, None]) & (swap_src >= 0) & (
        swap_dst >= 0) & (swap_dst < num_cache_rows)
    return jnp.where(live, swap_src, -1).reshape(-1), jnp.where(live, swap_dst, -1).reshape(-1)


def gather_compact(host_pool: jax.Array, kv_cache: jax.Array, swap_src: jax.Array,
                   swap_dst: jax.Array, swap_counts: jax.Array) -> jax.Array:
    """kv_cache with row swap_dst[n, m] := host row swap_src[n, m] for m < swap_counts[n].

    Args:
      host_pool: [host_rows, W] or [host_blocks, B, W] (any memory kind; read only); a pool
        of wider rows ([.., G * W], a packed pool) is read as its flat W-wide rows: row v is
        columns (v % G) * W on of pool row v // G, `host_rows` counts W-wide rows.
      kv_cache: [num_blocks, B, W] on the device, the dtype of the pool.
      swap_src, swap_dst: int32[N, K]; swap_counts: int32[N].
    Returns:
      the updated cache, [num_blocks, B, W]. Rows with swap_src >= host_rows are
      zero-filled; entries dropped by `swap_plan_rows` write nothing. Destinations of the
      live entries must be distinct.
    """
    (out,) = _gather_packed(host_pool.reshape(-1, kv_cache.shape[-1]), (kv_cache,), swap_src,
                            swap_dst, swap_counts)
    return out


def _gather_packed(host_pool: jax.Array, kv_caches: Sequence[jax.Array], swap_src: jax.Array,
                   swap_dst: jax.Array, swap_counts: jax.Array) -> tuple[jax.Array, ...]:
    """The G caches' rows from ONE pool whose rows hold the G layers side by side (columns
    [l * W, (l + 1) * W) of a pool row: layer l); the selected pool rows are read once."""
    num_blocks, block, width = kv_caches[0].shape
    pack = len(kv_caches)
    host_pool = host_pool.reshape(-1, pack * width)
    host_rows = host_pool.shape[0]
    src, dst = swap_plan_rows(swap_src, swap_dst, swap_counts, num_blocks * block)
    in_pool = (src >= 0) & (src < host_rows)
    idx = jnp.where(in_pool, src, 0)
    if _compat.in_host_memory(host_pool):
        rows = _compat.on_host(lambda p, i: p[i], host_pool, _compat.to_host(idx))
        rows = _compat.to_device(rows)
    else:
        rows = host_pool[idx]
    rows = jnp.where(in_pool[:, None], rows, jnp.zeros((), rows.dtype))
    dst = jnp.where(dst >= 0, dst, num_blocks * block)           # dropped: out of bounds
    out = []
    for slot, cache in enumerate(kv_caches):
        part = rows[:, slot * width:(slot + 1) * width].astype(cache.dtype)
        flat = cache.reshape(num_blocks * block, width).at[dst].set(part, mode="drop")
        out.append(flat.reshape(cache.shape))
    return tuple(out)


def gather_compact_group(host_pools: Sequence[jax.Array], kv_caches: Sequence[jax.Array],
                         swap_src: jax.Array, swap_dst: jax.Array, swap_counts: jax.Array
                         ) -> tuple[jax.Array, ...]:
    """`gather_compact` of one swap plan into every layer: for each l, kv_caches[l] with row
    swap_dst[n, m] := layer l's host row swap_src[n, m].

    host_pools: one array per layer (as `gather_compact`), or A arrays for the L = A * G
    layers, array a [.., G * W] holding layers aG..aG+G-1 side by side in each row (a
    packed pool: layer l's row r is columns (l % G) * W on of row r).
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    if not host_pools:
        return ()
    pack = len(kv_caches) // len(host_pools)
    out: list[jax.Array] = []
    for a, pool in enumerate(host_pools):
        out += _gather_packed(pool, kv_caches[a * pack:(a + 1) * pack], swap_src, swap_dst,
                              swap_counts)
    return tuple(out)
