"""The host <-> device row copies: `gather_compact` (one layer), `gather_compact_group` (every
layer of an index group), `mirror_rows` (device -> host; `mirror_rows_group`: every layer in
one call) and `restore_rows` (host -> device, the host tier's page restores).

The pool lives in pinned_host memory: [host_rows, W] or [host_blocks, B, W] per layer; the
caches are [num_blocks, B, W] on the device, of the pool's dtype. A packed pool keeps G layers
side by side in one array ([host_blocks, B, G * W]: layer l's row r is columns (l % G) * W on
of row r), so that a gather of one row list reads each selected row's bytes for all G layers
in one span (a random pinned-host row costs a fixed overhead: wider rows move more bytes per
second; `bench/NOTES-data_plane.md`). The group ops take either layout (`host_pools`: one
array per layer, or one per G layers); the one-layer ops read a packed array as its flat
W-wide rows (layer l's row r is flat row r * G + l % G: `HostPool.layer_rows`). Rows are
copied as opaque elements of any dtype and width: bf16 rows are W = 576 bf16, fp8_ds_mla
rows W = 656 uint8 (`pallas_kernels/kv_format.py`), moved by the Triton kernel as 512 + 128 +
16-byte pieces.
Outside a jit, `gather_compact`, `gather_compact_group` and `restore_rows` donate the caches
and `mirror_rows` the pool (inside a user's jit, donate at that jit's boundary). `backend=`
picks the implementation through `hisparse_jax.ops._registry` (None: the Triton kernel on a
GPU, else the reference).

`validate=` (every op): how the destinations' value rule is checked (two copies into one row
would race: the row would hold either). None (default): concrete index arrays are checked on
the host (a ValueError naming the two entries; the call waits for the arrays), traced ones
by `checkify.debug_check`s (raised under `jax.experimental.checkify.checkify`, free
otherwise); True: the host check only (a ValueError for traced arrays); False: none (the
engine's spills and restores). `hisparse_jax/ops/_values.py`, `docs/semantics.md`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hisparse_jax.ops import _checks, _registry, _values


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
    validate: bool | None = None,
) -> jax.Array:
    """Copies the misses of a swap plan from the pinned host pool into the device cache.

    host_pool: [host_rows, W] (or [host_blocks, B, W]) in pinned_host memory; a pool of
      G * W-wide rows (packed) is read as its flat W-wide rows (host_rows counts those).
    kv_cache: [num_blocks, B, W] on the device; donated, returned updated.
    swap_src, swap_dst: int32[N, K]; swap_counts: int32[N] (a `Resolution`'s plan).
    For each n and m < swap_counts[n]: device row swap_dst[n, m] := host row swap_src[n, m]
    (zeros if swap_src >= host_rows); skipped when swap_src < 0 or swap_dst is outside the
    cache. The destinations of the live entries must be distinct (`validate`: module
    docstring).
    """
    _checks.validate_pool_and_cache(host_pool, kv_cache)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    backend = _registry.select("gather_compact", backend, host_pool, kv_cache, swap_src,
                               swap_dst, swap_counts)
    check_plan(validate, "gather_compact", swap_src, swap_dst, swap_counts,
               kv_cache.size // kv_cache.shape[-1])
    return _gather(host_pool, kv_cache, swap_src, swap_dst, swap_counts, backend=backend)


def _group_kernel(backend, programs):
    """The gather_compact_group implementation of `backend`, moving its rows with at most
    `programs` GPU programs when given (the reference has no programs: ignored)."""
    gather = _registry.implementation("gather_compact_group", backend)
    if programs is not None and backend != "reference":
        gather = functools.partial(gather, max_programs=programs)
    return gather


@functools.partial(jax.jit, static_argnames=("backend", "fused", "programs"),
                   donate_argnames=("kv_caches",))
def _gather_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts, *, backend, fused,
                  programs=None):
    gather = _group_kernel(backend, programs)
    if fused:
        return tuple(gather(host_pools, kv_caches, swap_src, swap_dst, swap_counts))
    pack = len(kv_caches) // len(host_pools)
    return tuple(cache for a, pool in enumerate(host_pools)
                 for cache in gather((pool,), kv_caches[a * pack:(a + 1) * pack], swap_src,
                                     swap_dst, swap_counts))


def gather_compact_group(
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    backend: str | None = None,
    fused: bool = True,
    copy_programs: int | None = None,
    validate: bool | None = None,
) -> tuple[jax.Array, ...]:
    """`gather_compact` of one swap plan into every layer of an index group.

    All sparse layers of an index group share one top-k and one hot state, so the leader's
    `resolve_residency` yields one swap plan that every layer applies to its own pool and
    cache.

    host_pools: in pinned_host memory, one array per layer ([host_rows, W] or
      [host_blocks, B, W]), or A arrays for the L = A * G layers, array a holding layers
      aG..aG+G-1 side by side ([host_blocks, B, G * W], every one of them W wide).
    kv_caches[l]: [num_blocks, B, W] on the device; donated, returned updated (a tuple).
    swap_src, swap_dst: int32[N, K]; swap_counts: int32[N] (from the leader's resolve).
    fused: with a kernel backend, ONE launch for all layers (else one launch per pool
      array, inside the same jit); the reference always runs array by array.
    copy_programs: None (default): the kernel's grid has a program per chunk of up to 16
      misses of every batch row's plan (K wide), most of which find nothing to copy. An int
      P >= 1: at most P programs, each looping over its share of the chunks that hold a
      miss (a copy from pinned host is bound by PCIe, not by the programs issuing it). The
      same result; the reference ignores it.
    validate: the destinations' rule of `gather_compact` (module docstring).

    Raises:
      TypeError / ValueError: copy_programs is neither None nor an int >= 1.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    _checks.validate_group(host_pools, kv_caches)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    if copy_programs is not None:
        _checks.check_static_int("copy_programs", copy_programs, minimum=1)
    if not kv_caches:
        return ()
    backend = _registry.select("gather_compact_group", backend, host_pools, kv_caches,
                               swap_src, swap_dst, swap_counts)
    check_plan(validate, "gather_compact_group", swap_src, swap_dst, swap_counts,
               kv_caches[0].size // kv_caches[0].shape[-1])
    return _gather_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts,
                         backend=backend, fused=bool(fused), programs=copy_programs)


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
    validate: bool | None = None,
) -> jax.Array:
    """Writes device rows into the pinned host pool in place (write-back / spill).

    kv_cache: [num_blocks, B, W] on the device. host_pool: [host_rows, W] or
    [host_blocks, B, W] in pinned_host memory; donated, returned updated (same memory kind).
    device_rows, host_rows: int32[R]; host row host_rows[i] := device row device_rows[i];
    entries with a negative or out-of-range index are skipped; the kept destinations must be
    distinct (`validate`: module docstring).
    """
    _checks.validate_pool_and_cache(host_pool, kv_cache)
    _checks.check_same_length("device_rows", device_rows, "host_rows", host_rows)
    backend = _registry.select("mirror_rows", backend, kv_cache, host_pool, device_rows,
                               host_rows)
    width = kv_cache.shape[-1]
    _check_mirror(validate, "mirror_rows", device_rows, host_rows, kv_cache.size // width,
                  host_pool.size // width)
    sharding = host_pool.sharding if _checks.is_concrete(host_pool) else None
    return _mirror_jit(sharding)(kv_cache, host_pool, device_rows, host_rows, backend=backend)


def _mirror_group_body(kv_caches, host_pools, device_rows, host_rows, *, backend):
    mirror = _registry.implementation("mirror_rows", backend)
    pools = list(host_pools)
    pack = len(kv_caches) // len(pools)
    for i, kv in enumerate(kv_caches):
        rows = host_rows if pack == 1 else _packed_rows(host_rows, pack, i % pack)
        pools[i // pack] = mirror(kv, pools[i // pack], device_rows, rows)
    return tuple(pools)


def _packed_rows(rows: jax.Array, pack: int, slot: int) -> jax.Array:
    """Row ids of a layer's rows in a packed pool's flat W-wide rows: r * pack + slot where
    r >= 0, else r (negative ids stay skipped; ids past the pool stay past it)."""
    return jnp.where(rows >= 0, rows * pack + slot, rows)


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
    validate: bool | None = None,
) -> tuple[jax.Array, ...]:
    """`mirror_rows` of one row list into every layer's pool, as ONE jitted call (one
    dispatch per spill plan instead of one per layer).

    kv_caches[l]: [num_blocks, B, W] on the device. host_pools: one array per layer (as
    `mirror_rows`), or one per G layers side by side (as `gather_compact_group`); donated,
    returned updated (a tuple, same memory kinds). device_rows, host_rows: int32[R], as
    `mirror_rows` (host rows of the pool's [host_blocks * B] rows, whatever its packing), the
    same for every layer; validate: as `mirror_rows`'.
    """
    kv_caches, host_pools = tuple(kv_caches), tuple(host_pools)
    if not kv_caches and not host_pools:
        return ()
    _checks.validate_group(host_pools, kv_caches)
    _checks.check_same_length("device_rows", device_rows, "host_rows", host_rows)
    backend = _registry.select("mirror_rows", backend, kv_caches[0], host_pools[0],
                               device_rows, host_rows)
    _check_mirror(validate, "mirror_rows_group", device_rows, host_rows,
                  kv_caches[0].size // kv_caches[0].shape[-1],
                  host_pools[0].size // host_pools[0].shape[-1])
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
    validate: bool | None = None,
) -> jax.Array:
    """Copies host rows back into device rows (page restores of the host tier).

    host_rows, device_rows: int32[R], the live entries packed at the front and padded with -1
    (the layout `host_tier.TransferEngine` builds); device row device_rows[i] := host row
    host_rows[i]. One batch row of `gather_compact`: `kv_cache` is donated, returned updated;
    validate: as `gather_compact`'s.
    """
    count = jnp.sum(host_rows >= 0, dtype=jnp.int32).reshape(1)
    return gather_compact(host_pool, kv_cache, host_rows[None], device_rows[None], count,
                          backend=backend, validate=validate)


def check_plan(validate, op: str, swap_src, swap_dst, swap_counts, num_cache_rows: int
               ) -> None:
    """The swap plan's destination rule, as `validate` says (module docstring)."""
    check = _values.mode(validate, op, (("swap_src", swap_src), ("swap_dst", swap_dst),
                                        ("swap_counts", swap_counts)))
    if check is not None:
        (_values.plan_host if check == "host" else _values.plan_traced)(
            swap_src, swap_dst, swap_counts, num_cache_rows)


def _check_mirror(validate, op: str, device_rows, host_rows, num_cache_rows: int,
                  num_pool_rows: int) -> None:
    """The mirror's destination rule, as `validate` says (module docstring)."""
    check = _values.mode(validate, op, (("device_rows", device_rows),
                                        ("host_rows", host_rows)))
    if check is not None:
        (_values.mirror_host if check == "host" else _values.mirror_traced)(
            device_rows, host_rows, num_cache_rows, num_pool_rows)
