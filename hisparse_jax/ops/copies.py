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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hisparse_jax.ops import _checks, _registry
from pallas_kernels import _compat


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

    host_pool: [host_rows, W] (or [host_blocks, B, W]) in pinned_host memory; a pool of
      G * W-wide rows (packed) is read as its flat W-wide rows (host_rows counts those).
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StagedCopies:
    """A swap plan whose first rows are crossing PCIe on a copy stream
    (`gather_compact_group_start`); `gather_compact_group_finish` lands it in the caches.

    Attributes:
      staging: one buffer per pool array [N, stage_rows, pool row width], filled on the copy
        stream: row (n, m) holds the pool row swap_src[n, m] for m < stage_rows.
      swap_src, swap_dst, swap_counts: the plan (int32[N, K], int32[N, K], int32[N]).
      backend: the copy implementation the two halves use (static).
    """

    staging: tuple[jax.Array, ...]
    swap_src: jax.Array
    swap_dst: jax.Array
    swap_counts: jax.Array
    backend: str = dataclasses.field(metadata=dict(static=True))

    @property
    def stage_rows(self) -> int:
        return self.staging[0].shape[1] if self.staging else 0

    def precede(self, x):
        """`x` (any pytree of arrays), tied to the plan these copies read: the work that reads
        the returned arrays comes after the plan is computed, so that the copies (which may
        start then) run during that work rather than after it."""
        x, _ = jax.lax.optimization_barrier((x, (self.swap_src, self.swap_counts)))
        return x


def _staging_rows(n: int, k: int, c: int) -> tuple[jax.Array, jax.Array]:
    """m int32[1, K] (the plan's columns) and the staging row of each (n, m), for c staged
    columns per batch row: n * c + m (meaningful where m < c)."""
    m = jnp.arange(k, dtype=jnp.int32)[None, :]
    return m, jnp.arange(n, dtype=jnp.int32)[:, None] * c + m


def _start(host_pools, swap_src, swap_dst, swap_counts, *, backend, stream, stage_rows,
           programs=None):
    gather = _group_kernel(backend, programs)
    n, k = swap_src.shape
    c = min(stage_rows or max(1, k // 8), k)  # None: an eighth of the plan's width

    def stage(pools, src, counts):
        m, stage_row = _staging_rows(n, k, c)
        bufs = tuple(jnp.zeros((n, c, p.shape[-1]), p.dtype) for p in pools)
        return tuple(gather(pools, bufs, src, jnp.where(m < c, stage_row, -1), counts))

    # Across PCIe on the copy stream: each pool array's whole (packed) rows, one launch. The
    # call's operands are the pools and the plan alone (the staging rows are numbered
    # inside), so that XLA may start it once the plan is computed: an operand XLA computes
    # late (it placed such an operand-free one right before the landing) holds it back.
    staging = _compat.on_stream(stage, stream)(tuple(host_pools), swap_src, swap_counts)
    return StagedCopies(tuple(staging), swap_src, swap_dst, swap_counts, backend)


def _finish(host_pools, kv_caches, staged, after=None, programs=None):
    # The landing reads device memory: the kernel's full grid. `programs` moves the misses
    # past the staged ones, from host.
    land, from_host = _group_kernel(staged.backend, None), _group_kernel(staged.backend, programs)
    src, dst, counts = staged.swap_src, staged.swap_dst, staged.swap_counts
    n, k = src.shape
    c = staged.stage_rows
    staging = staged.staging
    if after is not None:  # the landing waits for `after`: the copies overlap what makes it
        staging, _ = jax.lax.optimization_barrier((staging, after))
    m, stage_row = _staging_rows(n, k, c)
    staged_m = m < c
    # On this stream: staging -> caches (device to device), then the misses past c, if any.
    kv_caches = tuple(land(staging, kv_caches, jnp.where(staged_m & (src >= 0), stage_row, -1),
                           dst, counts))
    if c < k:
        kv_caches = tuple(from_host(host_pools, kv_caches, jnp.where(staged_m, -1, src), dst,
                                    counts))
    return kv_caches


@functools.partial(jax.jit, static_argnames=("backend", "stream", "stage_rows", "programs"),
                   donate_argnames=("kv_caches",))
def _gather_group_staged(host_pools, kv_caches, swap_src, swap_dst, swap_counts, *, backend,
                         stream, stage_rows, programs):
    staged = _start(host_pools, swap_src, swap_dst, swap_counts, backend=backend,
                    stream=stream, stage_rows=stage_rows, programs=programs)
    return _finish(host_pools, kv_caches, staged, programs=programs)


def _check_stream_args(stream, stage_rows, copy_programs):
    for name, value in (("stream", stream), ("stage_rows", stage_rows),
                        ("copy_programs", copy_programs)):
        if value is not None:
            _checks.check_static_int(name, value, minimum=1)


def gather_compact_group_start(
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    stream: int,
    backend: str | None = None,
    stage_rows: int | None = None,
    copy_programs: int | None = None,
) -> StagedCopies:
    """The first half of `gather_compact_group(stream=stream)`, for use inside a jit: starts
    the copies of the plan's first `stage_rows` misses per row (K // 8 when None) on GPU
    stream `stream` into staging buffers it allocates, and returns them in flight.
    `gather_compact_group_finish` lands them (and the misses past stage_rows) in the
    caches; the work traced between the two, when it does not read those caches, may run
    while the rows cross. kv_caches is only checked here (the caches the plan lands in).
    copy_programs: as `gather_compact_group`'s (here: so that the work on the main stream
    keeps the rest of the GPU).

    Raises: as `gather_compact_group`; stream is required.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    _checks.validate_group(host_pools, kv_caches)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    _checks.check_static_int("stream", stream, minimum=1)  # required here
    _check_stream_args(None, stage_rows, copy_programs)
    backend = _registry.select("gather_compact_group", backend, host_pools, kv_caches,
                               swap_src, swap_dst, swap_counts)
    return _start(host_pools, swap_src, swap_dst, swap_counts, backend=backend, stream=stream,
                  stage_rows=stage_rows, programs=copy_programs)


def gather_compact_group_finish(
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    staged: StagedCopies,
    *,
    after: object = None,
    copy_programs: int | None = None,
) -> tuple[jax.Array, ...]:
    """The second half: lands `staged` (`gather_compact_group_start` of the same pools and
    plan) in kv_caches and copies the misses past its stage_rows from the pools; returns the
    updated caches (the same as `gather_compact_group`'s). after: arrays (any pytree) the
    landing waits for, so that the work computing them runs while the rows cross (XLA would
    otherwise wait for the copies as soon as their results are free to land).
    copy_programs: as `gather_compact_group`'s, for the misses past stage_rows (the landing
    copies device memory with the kernel's full grid)."""
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    _checks.validate_group(host_pools, kv_caches)
    _check_stream_args(None, None, copy_programs)
    if not isinstance(staged, StagedCopies) or len(staged.staging) != len(host_pools):
        raise ValueError("staged must be the StagedCopies of gather_compact_group_start over "
                         f"the same {len(host_pools)} pool arrays")
    return _finish(host_pools, kv_caches, staged, after, copy_programs)


def gather_compact_group(
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    backend: str | None = None,
    fused: bool = True,
    stream: int | None = None,
    stage_rows: int | None = None,
    copy_programs: int | None = None,
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
    stream: None (default): the copies run where the call does. An int s >= 1: the rows
      cross PCIe on GPU stream s (`_compat.on_stream`), so that work of the enclosing jit
      that does not read these caches runs meanwhile. The first `stage_rows` misses of each
      batch row (K // 8 when None) go from the pools into a staging buffer, allocated inside
      that call ([N, stage_rows, pool row width] of the pool's dtype per pool array); this
      stream then copies them into the caches (device to device) and copies the misses past
      stage_rows straight from the pools. (A call on another stream cannot update the caches
      in place: XLA would copy them whole.) Same result. The reference backend gathers on
      the host and runs in place. `fused` is ignored.
    copy_programs: None (default): the kernel's grid has a program per chunk of up to 16
      misses of every batch row's plan (K wide), most of which find nothing to copy. An int
      P >= 1: at most P programs, each looping over its share of the chunks that hold a
      miss (a copy from pinned host is bound by PCIe, not by the programs issuing it). The
      same result; the reference ignores it.

    Raises:
      TypeError / ValueError: stream, stage_rows or copy_programs is neither None nor an
        int >= 1.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    _checks.validate_group(host_pools, kv_caches)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    _check_stream_args(stream, stage_rows, copy_programs)
    if not kv_caches:
        return ()
    backend = _registry.select("gather_compact_group", backend, host_pools, kv_caches,
                               swap_src, swap_dst, swap_counts)
    if stream is not None and swap_src.size:
        return _gather_group_staged(
            host_pools, kv_caches, swap_src, swap_dst, swap_counts, backend=backend,
            stream=stream, stage_rows=stage_rows, programs=copy_programs)
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
) -> tuple[jax.Array, ...]:
    """`mirror_rows` of one row list into every layer's pool, as ONE jitted call (one
    dispatch per spill plan instead of one per layer).

    kv_caches[l]: [num_blocks, B, W] on the device. host_pools: one array per layer (as
    `mirror_rows`), or one per G layers side by side (as `gather_compact_group`); donated,
    returned updated (a tuple, same memory kinds). device_rows, host_rows: int32[R], as
    `mirror_rows` (host rows of the pool's [host_blocks * B] rows, whatever its packing), the
    same for every layer.
    """
    kv_caches, host_pools = tuple(kv_caches), tuple(host_pools)
    if not kv_caches and not host_pools:
        return ()
    _checks.validate_group(host_pools, kv_caches)
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
