"""stage_prefill_rows, jnp reference (and the non-kernel fallback); `staging_plan`, the one
definition of which copy each staging row takes, which the kernel shares.

The host side of the copy runs on the host (`compute_on("device_host")`, through
`_compat.on_host`) so that only the gathered rows cross PCIe, never the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import _compat, _rows


def staging_plan(positions: jax.Array, source_blocks: jax.Array, resident_blocks: jax.Array,
                 *, block_size: int, host_blocks: int, num_blocks: int
                 ) -> tuple[jax.Array, jax.Array]:
    """Where staging row m comes from: (device_rows int32[M], host_rows int32[M]).

    Args:
      positions: int32[M], logical token positions (< 0: no row).
      source_blocks, resident_blocks: int32[P], the request's host / resident device block
        of each page (<= 0: none).
      block_size: B (static); host_blocks, num_blocks: blocks of the host pools and of the
        device caches (static).
    Returns:
      device_rows[m]: the flat cache row `resident_blocks[q] * B + p % B` of position
      p = positions[m], page q = p // B, when p >= 0, q < P and 0 < resident_blocks[q] <
      num_blocks; else -1. host_rows[m]: the flat pool row `source_blocks[q] * B + p % B`
      when the page has NO resident block (resident_blocks[q] <= 0) and
      0 < source_blocks[q] < host_blocks; else -1. A resident block past the cache does not
      fall back to the host copy: the row is then taken from neither. At most one of the
      two is >= 0 for each m.
    """
    m = positions.shape[0]
    if source_blocks.shape[0] == 0:
        none = jnp.full((m,), -1, jnp.int32)
        return none, none
    # flat_rows: -1 for p < 0, q >= P or a block id <= 0.
    resident = _rows.flat_rows(resident_blocks[None], positions[None], block_size)[0]
    host = _rows.flat_rows(source_blocks[None], positions[None], block_size)[0]
    device_rows = jnp.where(resident < num_blocks * block_size, resident, -1)
    host_ok = (resident < 0) & (host >= 0) & (host < host_blocks * block_size)
    return device_rows, jnp.where(host_ok, host, -1)


def count_rows(rows: jax.Array) -> jax.Array:
    """int32 scalar: the entries of a `staging_plan` row list that move a row (>= 0)."""
    return jnp.sum(rows >= 0, dtype=jnp.int32)


def _gather_rows(source: jax.Array, rows: jax.Array, width: int) -> jax.Array:
    """[M, width] rows `rows` (clamped to 0 where < 0) of `source` ([blocks, B, width], any
    memory kind), in device memory; zeros for an empty source."""
    flat = source.reshape(-1, width)
    if flat.shape[0] == 0:
        return jnp.zeros((rows.shape[0], width), source.dtype)
    idx = jnp.where(rows >= 0, rows, 0)
    if _compat.in_host_memory(flat):
        picked = _compat.on_host(lambda p, i: p[i], flat, _compat.to_host(idx))
        return _compat.to_device(picked)
    return flat[idx]


def stage_prefill_rows(host_pools: Sequence[jax.Array], caches: Sequence[jax.Array],
                       staging: Sequence[jax.Array], positions: jax.Array,
                       source_blocks: jax.Array, resident_blocks: jax.Array, *,
                       block_size: int) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
    """For every layer l and row m, staging[l][m] := the row of position positions[m]: the
    resident device copy (caches[l]) when its page has one, else the host copy
    (host_pools[l]); rows with neither (and m with positions[m] < 0 or a page past the
    tables) are left exactly as passed in. The rules: `staging_plan`.

    Args:
      host_pools: L arrays [host_blocks, B, W_l] (any memory kind; read only), or A arrays
        [host_blocks, B, G * W] for the L = A * G layers, each holding G layers side by side
        (a packed pool: layer l is columns (l % G) * W on of array l // G).
      caches: L arrays [num_blocks, B, W_l] on the device, the pools' dtypes.
      staging: L arrays [M, W_l], the caches' dtypes.
      positions: int32[M]; source_blocks, resident_blocks: int32[P]; block_size: B (static).
    Returns:
      (the updated staging buffers, rows taken from the device, rows taken from the host):
      the counts are int32 scalars, per layer (every layer moves the same rows).
    """
    host_pools, caches, staging = tuple(host_pools), tuple(caches), tuple(staging)
    if not staging:
        return (), jnp.int32(0), jnp.int32(0)
    device_rows, host_rows = staging_plan(
        positions, source_blocks, resident_blocks, block_size=block_size,
        host_blocks=host_pools[0].shape[0], num_blocks=caches[0].shape[0])
    from_device, from_host = (device_rows >= 0)[:, None], (host_rows >= 0)[:, None]
    pack = len(staging) // len(host_pools)
    # Each pool array's selected rows are read once (all its layers side by side).
    host = [_gather_rows(pool, host_rows, pool.shape[-1]) for pool in host_pools]
    out = []
    for i, (cache, buf) in enumerate(zip(caches, staging, strict=True)):
        width, slot = buf.shape[-1], i % pack
        rows = jnp.where(from_device, _gather_rows(cache, device_rows, width).astype(buf.dtype),
                         buf)
        picked = host[i // pack][:, slot * width:(slot + 1) * width]
        out.append(jnp.where(from_host, picked.astype(buf.dtype), rows))
    return tuple(out), count_rows(device_rows), count_rows(host_rows)
