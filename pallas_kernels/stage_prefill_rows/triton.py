"""stage_prefill_rows as one Pallas kernel (Triton lowering) for every layer of an index group.

The plan (which staging row takes which device or host row) is `reference.staging_plan`, one
jnp fusion that also yields the counts; the kernel then moves the rows: device rows from the
caches, host rows straight from the pools (pinned_host on the GPU, read in place, zero-copy
over PCIe; why this needs the Triton lowering: `pallas_kernels/_triton.py`), into the staging
buffers, written in place (aliased: donate them at the jit boundary). One program moves
`rows_per_program` consecutive staging rows of one layer; with several layers the grid is
(layer, chunk), all in ONE launch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat, _triton
from pallas_kernels._triton import CopyTuning
from pallas_kernels.stage_prefill_rows.reference import count_rows, staging_plan

DEFAULT = CopyTuning()


def supports(*args: Any, **kwargs: Any) -> str | None:
    """None (takes the arguments of `stage_prefill_rows`): the kernel runs every input the
    validated op accepts (any row width and dtype, per layer)."""
    del args, kwargs
    return None


def _stage_kernel(device_ref, host_ref, *refs, layers, pack, total, rows, pieces, host_rows,
                  cache_rows, block):
    """One program: staging rows [j * rows, (j + 1) * rows) of one layer (grid axis 0 when
    there are several layers). Layer i reads pool array i // pack, whose rows hold `pack`
    layers side by side (1: one array per layer)."""
    arrays = layers // pack
    pools = refs[:arrays]
    caches, staging = refs[arrays:arrays + layers], refs[arrays + 2 * layers:]
    if layers > 1:
        layer, j = pl.program_id(0), pl.program_id(1)
    else:
        layer, j = 0, pl.program_id(0)
    m = j * rows + jnp.arange(rows, dtype=jnp.int32)
    in_range = m < total
    flat = jnp.minimum(m, total - 1)
    d = device_ref[flat]
    h = host_ref[flat]
    from_device = in_range & (d >= 0) & (d < cache_rows)
    from_host = in_range & (h >= 0) & (h < host_rows)
    for i in range(layers):
        def copy(i=i):
            if cache_rows:
                _triton.copy_rows(caches[i], jnp.where(from_device, d, cache_rows), staging[i],
                                  jnp.where(from_device, m, total), load_mask=from_device,
                                  store_mask=from_device, pieces=pieces[i], src_block=block,
                                  dst_block=1)
            if host_rows:
                _triton.copy_rows(pools[i // pack],
                                  jnp.where(from_host, h * pack + i % pack, host_rows * pack),
                                  staging[i], jnp.where(from_host, m, total),
                                  load_mask=from_host, store_mask=from_host, pieces=pieces[i],
                                  src_block=block, dst_block=1, src_pack=pack)
        if layers == 1:
            copy()
        else:
            pl.when(layer == i)(copy)


def _nonempty(x: jax.Array) -> jax.Array:
    """`x`, or zeros of one block of its shape when it has no blocks."""
    if x.shape[0]:
        return x
    return jnp.zeros((1, *x.shape[1:]), x.dtype)


def stage_prefill_rows(host_pools: Sequence[jax.Array], caches: Sequence[jax.Array],
                       staging: Sequence[jax.Array], positions: jax.Array,
                       source_blocks: jax.Array, resident_blocks: jax.Array, *,
                       block_size: int, interpret: bool = False,
                       tuning: CopyTuning = DEFAULT
                       ) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
    """staging[l][m] := the resident device row (caches[l]) of position positions[m], else
    its host row (host_pools[l]), for every layer in ONE launch; rows with neither are left
    as passed in. Contract of `reference.stage_prefill_rows`, exactly.

    host_pools: per layer [host_blocks, B, W_l], or A arrays [host_blocks, B, G * W] each
    holding G = L / A layers side by side (packed), read in place (pinned_host on the GPU).
    caches[l]: [num_blocks, B, W_l]. staging[l]: [M, W_l], written in place. Returns (the
    updated staging buffers, rows from the device, rows from the host).
    """
    host_pools, caches, staging = tuple(host_pools), tuple(caches), tuple(staging)
    if not staging:
        return (), jnp.int32(0), jnp.int32(0)
    layers, total = len(staging), positions.shape[0]
    host_blocks, num_blocks = host_pools[0].shape[0], caches[0].shape[0]
    device_rows, host_rows = staging_plan(
        positions, source_blocks, resident_blocks, block_size=block_size,
        host_blocks=host_blocks, num_blocks=num_blocks)
    counts = count_rows(device_rows), count_rows(host_rows)
    widths = [s.shape[-1] for s in staging]
    if total == 0 or host_blocks + num_blocks == 0 or source_blocks.shape[0] == 0:
        return staging, *counts
    rows = _triton.rows_per_program(total * layers, tuning)
    if interpret:
        host_pools = tuple(_compat.interpret_operand(p) for p in host_pools)
    # An empty pool or cache (0 blocks) is never read (its copy is left out at trace time);
    # a one-block stand-in keeps zero-size operands out of the launch.
    host_pools = tuple(map(_nonempty, host_pools))
    caches = tuple(map(_nonempty, caches))
    kernel = functools.partial(
        _stage_kernel, layers=layers, pack=layers // len(host_pools), total=total, rows=rows,
        pieces=tuple(_triton.row_pieces(w, tuning.max_piece) for w in widths),
        host_rows=host_blocks * block_size, cache_rows=num_blocks * block_size,
        block=block_size)
    grid = (pl.cdiv(total, rows),) if layers == 1 else (layers, pl.cdiv(total, rows))
    out = _triton.call_in_place(
        kernel, (device_rows, host_rows, *host_pools, *caches), staging, grid=grid,
        num_warps=tuning.num_warps, interpret=interpret, name="hisparse_stage_prefill_rows")
    return out, *counts
