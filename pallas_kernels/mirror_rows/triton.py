"""mirror_rows as a Pallas kernel (Triton lowering): device rows written straight into the
pinned_host pool, in place (why this needs the Triton lowering: `pallas_kernels/_triton.py`).
One program moves `rows_per_program` entries of the row lists.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat, _triton
from pallas_kernels._triton import CopyTuning

DEFAULT = CopyTuning()


def supports(*args: Any, **kwargs: Any) -> str | None:
    """None (takes the arguments of `mirror_rows`): the kernel runs every input the validated
    op accepts (either pool layout, any row width and dtype)."""
    del args, kwargs
    return None


def _mirror_kernel(dev_ref, host_ref, cache_ref, _pool_in, pool_ref, *, total, rows, pieces,
                   cache_rows, pool_rows, cache_block, pool_block, pool_pack):
    e = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
    flat = jnp.minimum(e, total - 1)
    d = dev_ref[flat]
    h = host_ref[flat]
    keep = (e < total) & (d >= 0) & (d < cache_rows) & (h >= 0) & (h < pool_rows)
    _triton.copy_rows(cache_ref, jnp.where(keep, d, cache_rows),
                      pool_ref, jnp.where(keep, h, pool_rows),
                      load_mask=keep, store_mask=keep, pieces=pieces,
                      src_block=cache_block, dst_block=pool_block, dst_pack=pool_pack)


def mirror_rows(kv_cache: jax.Array, host_pool: jax.Array, device_rows: jax.Array,
                host_rows: jax.Array, *, interpret: bool = False,
                tuning: CopyTuning = DEFAULT) -> jax.Array:
    """host_pool row host_rows[i] := kv_cache row device_rows[i], in place.

    kv_cache: [num_blocks, B, W] on the device. host_pool: [host_rows, W] or
    [host_blocks, B, W] (or G * W wide, read as its flat W-wide rows: a packed pool),
    written in place (aliased): the enclosing jit must donate it and,
    for a pinned_host pool on the GPU, name it pinned_host in `out_shardings` (XLA refuses
    a host-memory kernel output otherwise). device_rows, host_rows: int32[R]. Contract of
    `reference.mirror_rows`, exactly.
    """
    total = device_rows.shape[0]
    num_blocks, cache_block, width = kv_cache.shape
    pool_rows = host_pool.size // width if width else 0
    if total == 0 or pool_rows == 0 or kv_cache.size == 0:
        return host_pool
    rows = _triton.rows_per_program(total, tuning)
    # The interpreter cannot alias a kernel output onto a host buffer: run it on a device copy.
    moved_to_device = interpret and _compat.in_host_memory(host_pool)
    if moved_to_device:
        host_pool = _compat.to_device(host_pool)
    kernel = functools.partial(
        _mirror_kernel, total=total, rows=rows,
        pieces=_triton.row_pieces(width, tuning.max_piece), cache_rows=num_blocks * cache_block,
        pool_rows=pool_rows, cache_block=cache_block, pool_block=_triton.block_of(host_pool.shape),
        pool_pack=host_pool.shape[-1] // width)

    (out,) = _triton.call_in_place(
        kernel, (device_rows, host_rows, kv_cache), (host_pool,),
        grid=(pl.cdiv(total, rows),), num_warps=tuning.num_warps, interpret=interpret,
        name="hisparse_mirror_rows")
    if moved_to_device:
        out = _compat.to_host(out)
    return out
