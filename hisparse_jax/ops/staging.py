"""The prefill staging copy: `stage_prefill_rows` (+ its `StagedRows`).

A chunked prefill's query tokens select (top-k) positions of the earlier context; the rows
of those positions are gathered once per index group into one staging buffer per layer,
which every layer of the group then reads: the resident device copy of a page when there is
one (it always wins: for a dirty page it is the only current copy), else the pinned host
copy. Semantics: `docs/prefill_staging.md`. Rows are opaque (any dtype and width: bf16 rows
W = 576, fp8_ds_mla rows uint8[656]). `backend=` picks the implementation through
`hisparse_jax.ops._registry` (None: the Triton kernel on a GPU, else the reference).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hisparse_jax.ops import _checks, _registry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StagedRows:
    """Output of `stage_prefill_rows`.

    Attributes:
      staging: the L updated staging buffers [M, W_l] (a tuple, one per layer).
      rows_from_device: int32 scalar, the staging rows taken from a resident device page
        (the same rows in every layer).
      rows_from_host: int32 scalar, the staging rows taken from the pinned host pool (the
        PCIe traffic, in bytes over all layers: `host_bytes()`).
    """

    staging: tuple[jax.Array, ...]
    rows_from_device: jax.Array
    rows_from_host: jax.Array

    @property
    def row_bytes(self) -> int:
        """Bytes of one staging row, summed over the layers (static)."""
        return sum(s.shape[-1] * jnp.dtype(s.dtype).itemsize for s in self.staging)

    def device_bytes(self) -> int:
        """Bytes copied device -> device over all layers (reads the count back: a sync;
        outside jit only)."""
        return int(self.rows_from_device) * self.row_bytes

    def host_bytes(self) -> int:
        """Bytes copied host -> device over all layers (reads the count back: a sync;
        outside jit only)."""
        return int(self.rows_from_host) * self.row_bytes


@functools.partial(jax.jit, static_argnames=("block_size", "backend"),
                   donate_argnames=("staging",))
def _stage(host_pools, caches, staging, positions, source_blocks, resident_blocks, *,
           block_size, backend):
    out, from_device, from_host = _registry.implementation("stage_prefill_rows", backend)(
        host_pools, caches, staging, positions, source_blocks, resident_blocks,
        block_size=block_size)
    return StagedRows(tuple(out), from_device, from_host)


def stage_prefill_rows(
    host_pools: Sequence[jax.Array],
    caches: Sequence[jax.Array],
    staging: Sequence[jax.Array],
    positions: jax.Array,
    source_blocks: jax.Array,
    resident_blocks: jax.Array,
    *,
    block_size: int,
    backend: str | None = None,
) -> StagedRows:
    """Gathers one request's selected context rows into every layer's staging buffer.

    Args:
      host_pools: L per-layer pools [host_blocks, B, W] in pinned_host memory (read only).
      caches: L per-layer device caches [num_blocks, B, W], each of its pool's dtype.
      staging: L per-layer staging buffers [M, W] on the device, of the caches' dtypes;
        donated, returned updated in `StagedRows.staging`.
      positions: int32[M], logical token positions of the request (-1: no row).
      source_blocks: int32[P], the request's host block of each page (<= 0: none).
      resident_blocks: int32[P], its resident device block of each page (<= 0: none).
      block_size: B, a static Python int (the pages of pools, caches and tables).
      backend: one of `BACKENDS` or None (see `_registry`).
    Returns:
      `StagedRows`: for each layer l and each m with p = positions[m] >= 0 and page
      q = p // B < P: staging[l][m] = caches[l][resident_blocks[q], p % B] when
      resident_blocks[q] > 0 (device to device: the resident copy always wins); else
      host_pools[l][source_blocks[q], p % B] when source_blocks[q] > 0; every other row
      (p < 0, q >= P, a page with neither copy, or a block id past its array) is left
      exactly as passed in. A resident block past the cache does not fall back to the host
      copy. Plus the counts of rows taken from the device and from the host (per layer).
    Raises:
      ValueError / TypeError naming the argument and the rule, before any work.
    """
    block_size = _checks.validate_stage_prefill(host_pools, caches, staging, positions,
                                                source_blocks, resident_blocks, block_size)
    host_pools, caches, staging = tuple(host_pools), tuple(caches), tuple(staging)
    backend = _registry.select("stage_prefill_rows", backend, host_pools, caches, staging,
                               positions, source_blocks, resident_blocks,
                               block_size=block_size)
    return _stage(host_pools, caches, staging, positions, source_blocks, resident_blocks,
                  block_size=block_size, backend=backend)
