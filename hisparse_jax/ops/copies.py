"""The host <-> device row copies: `gather_compact` (one layer), `gather_compact_group` (every
layer of an index group), `mirror_rows` (device -> host; `mirror_rows_group`: every layer in
one call) and `restore_rows` (host -> device, the host tier's page restores).

The pool lives in pinned_host memory: [host_rows, W] or [host_blocks, B, W]; the caches are
[num_blocks, B, W] on the device, of the pool's dtype. Rows are copied as opaque elements of
any dtype and width: bf16 rows are W = 576 bf16, fp8_ds_mla rows W = 656 uint8
(`pallas_kernels/kv_format.py`), moved by the Triton kernel as 512 + 128 + 16-byte pieces.
Outside a jit, `gather_compact`, `gather_compact_group` and `restore_rows` donate the caches
and `mirror_rows` the pool (inside a user's jit, donate at that jit's boundary). `backend=`
picks the implementation through `hisparse_jax.ops._registry` (None: the Triton kernel on a
GPU, else the reference).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hisparse_jax.ops import _checks, _registry


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("kv_cache",))
def _gather(host_pool, kv_cache, swap_src, swap_dst, swap_counts, *, backend):
    return _registry.implementation("gather_compact", backend)(
        host_pool, kv_cache, swap_src, swap_dst, swap_counts)


def gather_compact(
    host_pool: jax.Array,
    kv_cache: jax.Array,
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    backend: str | None = None,
) -> jax.Array:
    """Copies the misses of a swap plan from the pinned host pool into the device cache.

    host_pool: [host_rows, W] (or [host_blocks, B, W]) in pinned_host memory.
    kv_cache: [num_blocks, B, W] on the device; donated, returned updated.
    swap_src, swap_dst: int32[N, K]; swap_counts: int32[N] (a `Resolution`'s plan).
    For each n and m < swap_counts[n]: device row swap_dst[n, m] := host row swap_src[n, m]
    (zeros if swap_src >= host_rows); skipped when swap_src < 0 or swap_dst is outside the
    cache. Destinations must be distinct.
    """
    _checks.validate_pool_and_cache(host_pool, kv_cache)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    backend = _registry.select("gather_compact", backend, host_pool, kv_cache, swap_src,
                               swap_dst, swap_counts)
    return _gather(host_pool, kv_cache, swap_src, swap_dst, swap_counts, backend=backend)


@functools.partial(jax.jit, static_argnames=("backend", "fused"), donate_argnames=("kv_caches",))
def _gather_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts, *, backend, fused):
    if fused:
        return tuple(_registry.implementation("gather_compact_group", backend)(
            host_pools, kv_caches, swap_src, swap_dst, swap_counts))
    gather = _registry.implementation("gather_compact", backend)
    return tuple(gather(pool, cache, swap_src, swap_dst, swap_counts)
                 for pool, cache in zip(host_pools, kv_caches, strict=True))


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

    All sparse layers of an index group share one top-k and one hot state, so the leader's
    `resolve_residency` yields one swap plan that every layer applies to its own pool and
    cache.

    host_pools[l]: [host_rows, W] or [host_blocks, B, W] in pinned_host memory.
    kv_caches[l]: [num_blocks, B, W] on the device; donated, returned updated (a tuple).
    swap_src, swap_dst: int32[N, K]; swap_counts: int32[N] (from the leader's resolve).
    fused: with a kernel backend, ONE launch for all layers (else one launch per layer,
      inside the same jit); the reference always runs layer by layer.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    _checks.validate_group(host_pools, kv_caches)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    if not kv_caches:
        return ()
    backend = _registry.select("gather_compact_group", backend, host_pools, kv_caches,
                               swap_src, swap_dst, swap_counts)
    return _gather_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts,
                         backend=backend, fused=bool(fused))


def _mirror_body(kv_cache, host_pool, device_rows, host_rows, *, backend):
    return _registry.implementation("mirror_rows", backend)(kv_cache, host_pool, device_rows,
                                                            host_rows)


@functools.cache
def _mirror_jit(out_sharding):
    """The jitted mirror; `out_sharding` (the pool's own sharding, or None inside a user's
    jit) keeps the updated pool in pinned_host memory: a kernel writing a host buffer in
    place is refused by XLA unless the jit names the output's memory kind."""
    kwargs = {} if out_sharding is None else {"out_shardings": out_sharding}
    return jax.jit(_mirror_body, static_argnames=("backend",), donate_argnames=("host_pool",),
                   **kwargs)


def mirror_rows(
    kv_cache: jax.Array,
    host_pool: jax.Array,
    device_rows: jax.Array,
    host_rows: jax.Array,
    *,
    backend: str | None = None,
) -> jax.Array:
    """Writes device rows into the pinned host pool in place (write-back / spill).

    kv_cache: [num_blocks, B, W] on the device. host_pool: [host_rows, W] or
    [host_blocks, B, W] in pinned_host memory; donated, returned updated (same memory kind).
    device_rows, host_rows: int32[R]; host row host_rows[i] := device row device_rows[i];
    entries with a negative or out-of-range index are skipped; kept destinations distinct.
    """
    _checks.validate_pool_and_cache(host_pool, kv_cache)
    _checks.check_same_length("device_rows", device_rows, "host_rows", host_rows)
    backend = _registry.select("mirror_rows", backend, kv_cache, host_pool, device_rows,
                               host_rows)
    sharding = host_pool.sharding if _checks.is_concrete(host_pool) else None
    return _mirror_jit(sharding)(kv_cache, host_pool, device_rows, host_rows, backend=backend)


def _mirror_group_body(kv_caches, host_pools, device_rows, host_rows, *, backend):
    mirror = _registry.implementation("mirror_rows", backend)
    return tuple(mirror(kv, pool, device_rows, host_rows)
                 for kv, pool in zip(kv_caches, host_pools, strict=True))


@functools.cache
def _mirror_group_jit(out_shardings):
    """The jitted `mirror_rows_group`; `out_shardings` (the pools' own, or None inside a
    user's jit) keeps the updated pools in pinned_host memory (`_mirror_jit`)."""
    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(_mirror_group_body, static_argnames=("backend",),
                   donate_argnames=("host_pools",), **kwargs)


def mirror_rows_group(
    kv_caches: Sequence[jax.Array],
    host_pools: Sequence[jax.Array],
    device_rows: jax.Array,
    host_rows: jax.Array,
    *,
    backend: str | None = None,
) -> tuple[jax.Array, ...]:
    """`mirror_rows` of one row list into every layer's pool, as ONE jitted call (one
    dispatch per spill plan instead of one per layer).

    kv_caches[l]: [num_blocks, B, W] on the device. host_pools[l]: layer l's pool (as
    `mirror_rows`), donated; returned updated (a tuple, same memory kinds). device_rows,
    host_rows: int32[R], as `mirror_rows`, the same for every layer.
    """
    kv_caches, host_pools = tuple(kv_caches), tuple(host_pools)
    if len(kv_caches) != len(host_pools):
        raise ValueError(f"mirror_rows_group: kv_caches has {len(kv_caches)} layers, "
                         f"host_pools {len(host_pools)}; they must have one each per layer")
    if not kv_caches:
        return ()
    for pool, kv in zip(host_pools, kv_caches, strict=True):
        _checks.validate_pool_and_cache(pool, kv)
    _checks.check_same_length("device_rows", device_rows, "host_rows", host_rows)
    backend = _registry.select("mirror_rows", backend, kv_caches[0], host_pools[0],
                               device_rows, host_rows)
    shardings = (tuple(p.sharding for p in host_pools)
                 if all(_checks.is_concrete(p) for p in host_pools) else None)
    return _mirror_group_jit(shardings)(kv_caches, host_pools, device_rows, host_rows,
                                        backend=backend)


def restore_rows(
    host_pool: jax.Array,
    kv_cache: jax.Array,
    host_rows: jax.Array,
    device_rows: jax.Array,
    *,
    backend: str | None = None,
) -> jax.Array:
    """Copies host rows back into device rows (page restores of the host tier).

    host_rows, device_rows: int32[R], the live entries packed at the front and padded with -1
    (the layout `host_tier.TransferEngine` builds); device row device_rows[i] := host row
    host_rows[i]. One batch row of `gather_compact`: `kv_cache` is donated, returned updated.
    """
    count = jnp.sum(host_rows >= 0, dtype=jnp.int32).reshape(1)
    return gather_compact(host_pool, kv_cache, host_rows[None], device_rows[None], count,
                          backend=backend)
