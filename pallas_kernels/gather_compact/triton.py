"""gather_compact and gather_compact_group as one Pallas kernel (Triton lowering).

The kernel reads the pool in place (pinned_host on the GPU: zero-copy over PCIe; why this
needs the Triton lowering: `pallas_kernels/_triton.py`) and writes the device caches in place
(aliased: donate them at the jit boundary). One program moves `rows_per_program` consecutive
misses of one batch row for one layer; with several layers the grid is (layer, row, chunk),
each layer replaying the same swap plan, all in ONE launch.
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

DEFAULT = CopyTuning()


def supports(*args: Any, **kwargs: Any) -> str | None:
    """None, for `gather_compact` and `gather_compact_group` alike (the arguments of either):
    the kernel runs every input the validated ops accept (either pool layout, any row width
    and dtype; Pallas switches to 64-bit offsets for buffers past 4 GiB)."""
    del args, kwargs
    return None


def _gather_kernel(src_ref, dst_ref, count_ref, *refs, layers, k, rows, pieces, host_rows,
                   cache_rows, pool_block, cache_block):
    """One program: `rows` consecutive misses of batch row n, for one layer (grid axis 0
    when there are several layers)."""
    pools, caches = refs[:layers], refs[2 * layers:]
    if layers > 1:
        layer, n, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        layer, n, j = 0, pl.program_id(0), pl.program_id(1)
    m0 = j * rows
    count = count_ref[n]

    @pl.when(m0 < count)
    def _():
        m = m0 + jnp.arange(rows, dtype=jnp.int32)
        flat = n * k + jnp.minimum(m, k - 1)
        src = src_ref[flat]
        dst = dst_ref[flat]
        for i in range(layers):
            live = (m < count) & (m < k) & (src >= 0) & (dst >= 0) & (dst < cache_rows[i])
            in_pool = live & (src < host_rows[i])
            copy = functools.partial(
                _triton.copy_rows, pools[i], jnp.where(in_pool, src, host_rows[i]),
                caches[i], jnp.where(live, dst, cache_rows[i]), load_mask=in_pool,
                store_mask=live, pieces=pieces[i], src_block=pool_block[i],
                dst_block=cache_block[i])
            if layers == 1:
                copy()
            else:
                pl.when(layer == i)(copy)


def gather_compact_group(host_pools: Sequence[jax.Array], kv_caches: Sequence[jax.Array],
                         swap_src: jax.Array, swap_dst: jax.Array, swap_counts: jax.Array, *,
                         interpret: bool = False, tuning: CopyTuning = DEFAULT
                         ) -> tuple[jax.Array, ...]:
    """For every layer l, kv_caches[l] row swap_dst[n, m] := host_pools[l] row swap_src[n, m],
    in ONE launch.

    host_pools[l]: [host_rows, W] or [host_blocks, B, W], read in place (pinned_host on the
    GPU). kv_caches[l]: [num_blocks, B, W], written in place. swap_src, swap_dst: int32[N, K];
    swap_counts: int32[N]. Contract of `reference.gather_compact_group`, exactly. Returns the
    tuple of updated caches.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    layers = len(kv_caches)
    n, k = swap_src.shape
    if layers == 0 or n * k == 0 or any(c.size == 0 for c in kv_caches):
        return kv_caches
    rows = _triton.rows_per_program(n * k * layers, tuning)
    widths = [c.shape[-1] for c in kv_caches]
    if interpret:
        host_pools = tuple(_compat.interpret_operand(p) for p in host_pools)
    kernel = functools.partial(
        _gather_kernel, layers=layers, k=k, rows=rows,
        pieces=tuple(_triton.row_pieces(w, tuning.max_piece) for w in widths),
        host_rows=tuple(p.size // w for p, w in zip(host_pools, widths, strict=True)),
        cache_rows=tuple(c.shape[0] * c.shape[1] for c in kv_caches),
        pool_block=tuple(_triton.block_of(p.shape) for p in host_pools),
        cache_block=tuple(c.shape[1] for c in kv_caches))
    grid = (n, pl.cdiv(k, rows)) if layers == 1 else (layers, n, pl.cdiv(k, rows))
    return _triton.call_in_place(
        kernel, (swap_src.reshape(-1), swap_dst.reshape(-1), swap_counts, *host_pools),
        kv_caches, grid=grid, num_warps=tuning.num_warps, interpret=interpret,
        name="hisparse_gather_compact")


def gather_compact(host_pool: jax.Array, kv_cache: jax.Array, swap_src: jax.Array,
                   swap_dst: jax.Array, swap_counts: jax.Array, *, interpret: bool = False,
                   tuning: CopyTuning = DEFAULT) -> jax.Array:
    """One layer of `gather_compact_group`: kv_cache row swap_dst[n, m] := host_pool row
    swap_src[n, m] (contract of `reference.gather_compact`; `kv_cache` updated in place)."""
    (out,) = gather_compact_group((host_pool,), (kv_cache,), swap_src, swap_dst, swap_counts,
                                  interpret=interpret, tuning=tuning)
    return out
