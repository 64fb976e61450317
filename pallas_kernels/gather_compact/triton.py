"""gather_compact and gather_compact_group as one Pallas kernel (Triton lowering).

The kernel reads the pool in place (pinned_host on the GPU: zero-copy over PCIe; why this
needs the Triton lowering: `pallas_kernels/_triton.py`) and writes the device caches in place
(aliased: donate them at the jit boundary). One program moves `rows_per_program` consecutive
misses of one batch row for one layer; with several layers the grid is (layer, row, chunk),
each layer replaying the same swap plan, all in ONE launch. With `CopyTuning.max_programs`
set, at most that many programs loop over the same chunks instead (a copy that leaves the
rest of the GPU to work on another stream).
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
    the kernel runs every input the validated ops accept (either pool layout, packed pools,
    any row width and dtype; Pallas switches to 64-bit offsets for buffers past 4 GiB)."""
    del args, kwargs
    return None


def _gather_kernel(src_ref, dst_ref, count_ref, *refs, arrays, pack, src_pack, k, rows,
                   pieces, host_rows, cache_rows, pool_block, cache_block, batch, programs,
                   pid=None):
    """`rows` consecutive misses of batch row n, for every layer of one pool array: a packed
    array's `pack` layers are read together, the same pool rows one after the other. Layer i
    reads W-wide row `src * pack + i % pack` of its array a, whose rows hold `src_pack[a]`
    W-wide rows.

    programs None: one program per (array, n, chunk), the grid's axes. An int P: P programs,
    each looping over the chunks c = pid, pid + P, ... of the live ones (the first operand
    after the counts holds the chunks per batch row that any row needs), ordered
    (array, chunk, n) so that every program gets a share of every chunk column; `pid` (in
    [0, P)) replaces the program id when another kernel runs these P programs as part of
    its grid."""
    if programs is not None:
        live_ref, refs = refs[0], refs[1:]
    layers = arrays * pack
    pools, caches = refs[:arrays], refs[arrays + layers:]

    def chunk(array, n, j):
        m0 = j * rows
        count = count_ref[n]

        @pl.when(m0 < count)
        def _():
            m = m0 + jnp.arange(rows, dtype=jnp.int32)
            flat = n * k + jnp.minimum(m, k - 1)
            src = src_ref[flat]
            dst = dst_ref[flat]
            for a in range(arrays):
                def copy(a=a):
                    for i in range(a * pack, (a + 1) * pack):
                        live = (m < count) & (m < k) & (src >= 0) & (dst >= 0) & (
                            dst < cache_rows[i])
                        in_pool = live & (src < host_rows[a])
                        _triton.copy_rows(
                            pools[a], jnp.where(in_pool, src * pack + i % pack,
                                                host_rows[a] * pack),
                            caches[i], jnp.where(live, dst, cache_rows[i]), load_mask=in_pool,
                            store_mask=live, pieces=pieces[i], src_block=pool_block[a],
                            dst_block=cache_block[i], src_pack=src_pack[a])
                if arrays == 1:
                    copy()
                else:
                    pl.when(array == a)(copy)

    if programs is None:
        if arrays > 1:
            chunk(pl.program_id(0), pl.program_id(1), pl.program_id(2))
        else:
            chunk(0, pl.program_id(0), pl.program_id(1))
        return
    per_array = live_ref[0] * batch
    if pid is None:
        pid = pl.program_id(0)

    def step(i, carry):
        c = pid + i * programs
        rest = c % per_array

        @pl.when(c < arrays * per_array)
        def _():
            chunk(c // per_array, rest % batch, rest // batch)
        return carry

    jax.lax.fori_loop(0, (arrays * per_array + programs - 1) // programs, step, 0)


def gather_compact_group(host_pools: Sequence[jax.Array], kv_caches: Sequence[jax.Array],
                         swap_src: jax.Array, swap_dst: jax.Array, swap_counts: jax.Array, *,
                         interpret: bool = False, tuning: CopyTuning = DEFAULT,
                         max_programs: int | None = None) -> tuple[jax.Array, ...]:
    """For every layer l, kv_caches[l] row swap_dst[n, m] := layer l's row swap_src[n, m]
    of the pools, in ONE launch.

    host_pools: A arrays [host_rows, G * W] or [host_blocks, B, G * W] for the L = A * G
    layers (array a holds layers aG..aG+G-1 side by side; G = 1: one per layer), read in
    place (pinned_host on the GPU). kv_caches[l]: [num_blocks, B, W], written in place.
    swap_src, swap_dst: int32[N, K]; swap_counts: int32[N]. Contract of
    `reference.gather_compact_group`, exactly. Returns the tuple of updated caches.
    max_programs: when given, replaces `tuning.max_programs`.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    if nothing_to_copy(kv_caches, swap_src):
        return kv_caches
    programs = tuning.max_programs if max_programs is None else max_programs
    kernel, inputs, grid = copy_launch(host_pools, kv_caches, swap_src, swap_dst, swap_counts,
                                       interpret=interpret, tuning=tuning, programs=programs)
    return _triton.call_in_place(kernel, inputs, kv_caches, grid=grid,
                                 num_warps=tuning.num_warps, interpret=interpret,
                                 name="hisparse_gather_compact")


def nothing_to_copy(kv_caches: Sequence[jax.Array], swap_src: jax.Array) -> bool:
    """Whether a copy has no work to launch: no layers, an empty plan, or an empty cache."""
    return not kv_caches or swap_src.size == 0 or any(c.size == 0 for c in kv_caches)


def copy_launch(host_pools: tuple[jax.Array, ...], kv_caches: tuple[jax.Array, ...],
                swap_src: jax.Array, swap_dst: jax.Array, swap_counts: jax.Array, *,
                interpret: bool, tuning: CopyTuning, programs: int | None,
                fixed_programs: bool = False):
    """The copy's (kernel, inputs, grid) for non-empty operands: `kernel(*input_refs,
    *cache_in_refs, *cache_out_refs)` with the caches aliased in place. programs: None (the
    grid covers the plan) or P (at most P looping programs; None again when P is no fewer
    than the grid's). fixed_programs=True keeps P looping programs even then, for a launch
    that runs them beside other work (it passes each its `pid=`)."""
    layers, arrays = len(kv_caches), len(host_pools)
    n, k = swap_src.shape
    pack = layers // arrays
    rows = _triton.rows_per_program(n * k * layers, tuning)
    widths = [c.shape[-1] for c in kv_caches]
    # A pool row holds src_pack W-wide rows: `pack` layers (a group's packed array), or a
    # single layer's wider pool read as its flat W-wide rows (`gather_compact`).
    first = [widths[a * pack] for a in range(arrays)]
    src_pack = tuple(p.shape[-1] // w for p, w in zip(host_pools, first, strict=True))
    if interpret:
        host_pools = tuple(_compat.interpret_operand(p) for p in host_pools)
    chunks = pl.cdiv(k, rows)
    if not fixed_programs and programs is not None and programs >= arrays * n * chunks:
        programs = None  # no fewer than the grid's
    inputs = [swap_src.reshape(-1), swap_dst.reshape(-1), swap_counts]
    if programs is not None:  # the chunks per batch row that any row's misses reach
        inputs.append(((jnp.max(swap_counts).clip(0, k) + rows - 1) // rows)
                      .astype(jnp.int32).reshape(1))
    kernel = functools.partial(
        _gather_kernel, arrays=arrays, pack=pack, src_pack=src_pack, k=k, rows=rows,
        batch=n, programs=programs,
        pieces=tuple(_triton.row_pieces(w, tuning.max_piece) for w in widths),
        host_rows=tuple(p.size // (pack * w) for p, w in zip(host_pools, first, strict=True)),
        cache_rows=tuple(c.shape[0] * c.shape[1] for c in kv_caches),
        pool_block=tuple(_triton.block_of(p.shape) for p in host_pools),
        cache_block=tuple(c.shape[1] for c in kv_caches))
    if programs is not None:
        grid = (programs,)
    else:
        grid = (n, chunks) if arrays == 1 else (arrays, n, chunks)
    return kernel, (*inputs, *host_pools), grid


def gather_compact(host_pool: jax.Array, kv_cache: jax.Array, swap_src: jax.Array,
                   swap_dst: jax.Array, swap_counts: jax.Array, *, interpret: bool = False,
                   tuning: CopyTuning = DEFAULT) -> jax.Array:
    """One layer: kv_cache row swap_dst[n, m] := host_pool's W-wide row swap_src[n, m]
    (a pool of wider rows, [.., G * W], is read as its flat W-wide rows; contract of
    `reference.gather_compact`; `kv_cache` updated in place)."""
    (out,) = gather_compact_group((host_pool,), (kv_cache,), swap_src, swap_dst, swap_counts,
                                  interpret=interpret, tuning=tuning)
    return out
