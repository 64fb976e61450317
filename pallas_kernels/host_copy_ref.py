"""Host <-> device row copies without Pallas: the reference and the non-Triton fallback.

Both run the host side of the copy on the host (`compute_on("device_host")`) so that only
the selected rows cross PCIe, never the pool:
  * gather_compact_ref: host pool rows -> device cache rows (the swap-in of a decode step);
  * mirror_rows_ref: device cache rows -> host pool rows (write-back of new tokens / spills).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import _compat


def swap_plan_rows(swap_src, swap_dst, swap_counts, num_cache_rows):
    """Flattens a swap plan [N, K] to (src [N*K], dst [N*K]); dropped entries get dst = -1.

    Entry (n, m) is live when m < swap_counts[n], swap_src >= 0 and 0 <= swap_dst < rows.
    """
    k = swap_src.shape[1]
    live = (jnp.arange(k)[None, :] < swap_counts[:, None]) & (swap_src >= 0) & (
        swap_dst >= 0) & (swap_dst < num_cache_rows)
    return jnp.where(live, swap_src, -1).reshape(-1), jnp.where(live, swap_dst, -1).reshape(-1)


def gather_compact_ref(host_pool, kv_cache, swap_src, swap_dst, swap_counts):
    """kv_cache with row swap_dst[n, m] := host row swap_src[n, m] for m < swap_counts[n].

    host_pool: [host_rows, W] (any memory kind); kv_cache: [num_blocks, B, W] on the device.
    Rows with swap_src >= host_rows are zero-filled. Entries skipped as in `swap_plan_rows`.
    """
    num_blocks, block, width = kv_cache.shape
    host_rows = host_pool.shape[0]
    src, dst = swap_plan_rows(swap_src, swap_dst, swap_counts, num_blocks * block)
    in_pool = (src >= 0) & (src < host_rows)
    idx = jnp.where(in_pool, src, 0)
    if _compat.in_host_memory(host_pool):
        rows = _compat.on_host(lambda p, i: p[i], host_pool, _compat.to_host(idx))
        rows = _compat.to_device(rows)
    else:
        rows = host_pool[idx]
    rows = jnp.where(in_pool[:, None], rows, jnp.zeros((), rows.dtype)).astype(kv_cache.dtype)
    dst = jnp.where(dst >= 0, dst, num_blocks * block)           # dropped: out of bounds
    flat = kv_cache.reshape(num_blocks * block, width).at[dst].set(rows, mode="drop")
    return flat.reshape(kv_cache.shape)


def mirror_rows_ref(kv_cache, host_pool, device_rows, host_rows):
    """host_pool with row host_rows[i] := device row device_rows[i] of kv_cache.

    kv_cache: [num_blocks, B, W]; host_pool: [host_rows, W] or [host_blocks, B, W], any
    memory kind (kept). Entries with either index negative or out of range are skipped.
    Destinations must be distinct among the kept entries.
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
