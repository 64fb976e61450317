"""The index-group entry point: the leader layer resolves once, every layer replays the plan.

All sparse layers of an index group share one top-k (one lightning indexer) and one hot
state, so one `resolve_residency` yields a swap plan (swap_src, swap_dst, swap_counts) that
every layer applies to its own host pool and device cache. `gather_compact_group` does that
for all layers in one jitted call: with `backend="pallas"` and `fused=True` (the default) as
ONE kernel launch over (layer, row, miss chunk); with `fused=False` as one launch per layer
inside the same jit; with `backend="reference"` as the jnp reference per layer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax

from hisparse_jax import ops
from hisparse_jax.state import HotState
from pallas_kernels import _compat


@functools.partial(jax.jit, static_argnames=("backend", "fused"), donate_argnames=("kv_caches",))
def _gather_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts, *, backend, fused):
    if backend == "pallas" and fused:
        from pallas_kernels import triton_kernels  # noqa: PLC0415 (GPU kernels, lazily)
        return tuple(triton_kernels.gather_rows_into_caches(
            host_pools, kv_caches, swap_src, swap_dst, swap_counts,
            interpret=not _compat.has_gpu()))
    impl = ops._impl("gather_compact", backend)
    out = []
    for pool, cache in zip(host_pools, kv_caches, strict=True):
        if backend != "pallas":
            pool = pool.reshape(-1, pool.shape[-1])
        out.append(impl(pool, cache, swap_src, swap_dst, swap_counts))
    return tuple(out)


def gather_compact_group(
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    backend: str | None = None,
    fused: bool = True,
) -> tuple[jax.Array, ...]:
    """`gather_compact` of one swap plan into every layer of an index group.

    host_pools[l]: [host_rows, W] or [host_blocks, B, W] in pinned_host memory.
    kv_caches[l]: [num_blocks, B, W] on the device; donated, returned updated (a tuple).
    swap_src, swap_dst: int32[N, K]; swap_counts: int32[N] (from the leader's resolve).
    fused: with the Pallas backend, one launch for all layers (else one per layer).
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    if len(host_pools) != len(kv_caches):
        raise ValueError(f"host_pools has {len(host_pools)} layers but kv_caches has "
                         f"{len(kv_caches)}")
    for i, (pool, cache) in enumerate(zip(host_pools, kv_caches, strict=True)):
        try:
            ops._validate_pool_and_cache(pool, cache)
        except (ValueError, TypeError) as e:
            raise type(e)(f"layer {i}: {e}") from None
    ops._validate_swap_plan(swap_src, swap_dst, swap_counts)
    if not kv_caches:
        return ()
    return _gather_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts,
                         backend=ops._pick("gather_compact", backend), fused=bool(fused))


def resolve_and_gather(
    state: HotState,
    topk: jax.Array,
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    *,
    state_rows: jax.Array,
    hot_block_table: jax.Array,
    source_block_table: jax.Array,
    resident_block_table: jax.Array | None = None,
    block_size: int,
    host_rows: int,
    backend: str | None = None,
    fused: bool = True,
) -> tuple[ops.Resolution, HotState, tuple[jax.Array, ...]]:
    """The leader's `resolve_residency`, then its swap plan replayed on every layer.

    Returns (resolution, new state, updated kv_caches); `kv_caches` are donated.
    """
    resolution, state = ops.resolve_residency(
        state, topk, state_rows=state_rows, hot_block_table=hot_block_table,
        source_block_table=source_block_table, resident_block_table=resident_block_table,
        block_size=block_size, host_rows=host_rows, backend=backend)
    caches = gather_compact_group(host_pools, kv_caches, resolution.swap_src,
                                  resolution.swap_dst, resolution.swap_counts,
                                  backend=backend, fused=fused)
    return resolution, state, caches
