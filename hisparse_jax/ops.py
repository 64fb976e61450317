"""The data-plane ops: validation, then dispatch to a backend.

Backends:
  * "reference": vectorised jnp (the oracle); host-side copies run through
    `compute_on("device_host")`, so it works on any platform with `pinned_host` memory.
  * "pallas": the Pallas GPU kernels of `pallas_kernels` (interpret mode off the GPU).
  * None (default): "pallas" where a GPU kernel exists and a GPU is present, else
    "reference".

Every op validates shapes, dtypes and memory kinds before any work runs and raises a
ValueError/TypeError that names the argument and the rule. All ops are pure: state in,
state out. `gather_compact` donates `kv_cache` and `mirror_rows` donates `host_pool` when
called outside jit (inside a user's jit, donate at that jit's boundary).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.state import HotState
from pallas_kernels import _compat
from pallas_kernels.host_copy_ref import gather_compact_ref, mirror_rows_ref
from pallas_kernels.invalidate_ref import invalidate_written_rows_ref
from pallas_kernels.resolve_ref import resolve_residency_ref

BACKENDS = ("reference", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Resolution:
    """Output of `resolve_residency` for a batch of N rows with K selected positions.

    Attributes:
      attention_rows: int32[N, K], flat device row to attend per column, -1 = masked.
      valid_counts: int32[N], columns with a resident or host row.
      swap_src: int32[N, K], host row of miss m (compacted), -1 past swap_counts.
      swap_dst: int32[N, K], device row that miss m is copied to, -1 past swap_counts
        (and -1 for a miss that met an out-of-range LRU slot id).
      swap_counts: int32[N], misses per row.
      num_hits: int32[N], hot-region hits per row.
    """

    attention_rows: jax.Array
    valid_counts: jax.Array
    swap_src: jax.Array
    swap_dst: jax.Array
    swap_counts: jax.Array
    num_hits: jax.Array


# --------------------------------------------------------------------------- validation


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_array(name: str, x: Any, *, ndim: int | tuple[int, ...], dtype: Any = None) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        want = " or ".join(str(d) for d in ndims)
        raise ValueError(f"{name} must have rank {want}, got shape {tuple(x.shape)}")
    if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(x.dtype).name}")


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def _check_host_pool(name: str, pool: Any) -> None:
    if _is_concrete(pool):
        kind = pool.sharding.memory_kind
        if kind != "pinned_host":
            raise ValueError(
                f"{name} must live in pinned_host memory (jax.device_put with a sharding whose "
                f"memory_kind='pinned_host'; pageable host memory is ~7x slower to copy), got "
                f"memory_kind={kind!r}")
    elif not _compat.in_host_memory(pool):
        raise ValueError(f"{name} must live in pinned_host memory, got a traced array in "
                         "device memory")


def _validate_resolve(state, topk, state_rows, hot_block_table, source_block_table,
                      resident_block_table, block_size, host_rows) -> None:
    if not isinstance(state, HotState):
        raise TypeError(f"state must be a HotState, got {type(state).__name__}")
    _check_array("state.slot_rows", state.slot_rows, ndim=2, dtype=jnp.int32)
    _check_array("state.lru", state.lru, ndim=2, dtype=jnp.int16)
    if state.lru.shape != state.slot_rows.shape:
        raise ValueError(f"state.lru shape {state.lru.shape} must equal state.slot_rows shape "
                         f"{state.slot_rows.shape}")
    num_state_rows, hot = state.slot_rows.shape
    _check_array("topk", topk, ndim=2, dtype=jnp.int32)
    n, k = topk.shape
    if k > hot:
        raise ValueError(f"topk has {k} columns but the hot region holds only H={hot} slots; "
                         "the rule is top_k <= hot_size")
    _check_array("state_rows", state_rows, ndim=1, dtype=jnp.int32)
    if state_rows.shape[0] != n:
        raise ValueError(f"state_rows has {state_rows.shape[0]} entries but topk has N={n} rows")
    block_size = _check_int("block_size", block_size, minimum=1)
    _check_int("host_rows", host_rows, minimum=0)
    need = -(-hot // block_size)
    _check_array("hot_block_table", hot_block_table, ndim=2, dtype=jnp.int32)
    if hot_block_table.shape[0] != n or hot_block_table.shape[1] < need:
        raise ValueError(f"hot_block_table must be [N={n}, >= ceil(H/B)={need}], got "
                         f"{tuple(hot_block_table.shape)}")
    for name, table in (("source_block_table", source_block_table),
                        ("resident_block_table", resident_block_table)):
        if table is None and name == "resident_block_table":
            continue
        _check_array(name, table, ndim=2, dtype=jnp.int32)
        if table.shape[0] != n or table.shape[1] < 1:
            raise ValueError(f"{name} must be [N={n}, >= 1], got {tuple(table.shape)}")
    if _is_concrete(state_rows):
        rows = np.asarray(state_rows)
        live = rows[rows >= 0]
        if live.size and live.max() >= num_state_rows:
            raise ValueError(f"state_rows must be < max_num_reqs={num_state_rows} (or < 0 for "
                             f"padding), got {int(live.max())}")
        if np.unique(live).size != live.size:
            raise ValueError("state_rows must not repeat a state row within one batch")


def _validate_swap_plan(swap_src, swap_dst, swap_counts) -> None:
    _check_array("swap_src", swap_src, ndim=2, dtype=jnp.int32)
    _check_array("swap_dst", swap_dst, ndim=2, dtype=jnp.int32)
    _check_array("swap_counts", swap_counts, ndim=1, dtype=jnp.int32)
    if swap_dst.shape != swap_src.shape:
        raise ValueError(f"swap_dst shape {swap_dst.shape} must equal swap_src shape "
                         f"{swap_src.shape}")
    if swap_counts.shape[0] != swap_src.shape[0]:
        raise ValueError(f"swap_counts has {swap_counts.shape[0]} entries but swap_src has "
                         f"N={swap_src.shape[0]} rows")


def _validate_pool_and_cache(host_pool, kv_cache) -> None:
    _check_array("kv_cache", kv_cache, ndim=3)
    _check_array("host_pool", host_pool, ndim=(2, 3))
    _check_host_pool("host_pool", host_pool)
    if _compat.in_host_memory(kv_cache):
        raise ValueError("kv_cache must live in device memory, got a host-memory array")
    if host_pool.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"row_width mismatch: host_pool rows are {host_pool.shape[-1]} wide, "
                         f"kv_cache rows {kv_cache.shape[-1]}")
    if host_pool.dtype != kv_cache.dtype:
        raise TypeError(f"host_pool dtype {host_pool.dtype} must equal kv_cache dtype "
                        f"{kv_cache.dtype}")


# --------------------------------------------------------------------------- dispatch


def _kernels():
    """The Pallas kernels, imported lazily (None until `pallas_kernels` provides them)."""
    try:
        from pallas_kernels import dispatch  # noqa: PLC0415
    except ImportError:
        return None
    return dispatch


def _pick(op: str, backend: str | None) -> str:
    _check_backend(backend)
    kernels = _kernels()
    available = kernels is not None and op in kernels.KERNELS
    if backend is None:
        return "pallas" if available and _compat.has_gpu() else "reference"
    if backend == "pallas" and not available:
        raise NotImplementedError(f"backend='pallas' has no kernel for {op} yet; "
                                  "use backend='reference'")
    return backend


def _impl(op: str, backend: str) -> Callable[..., Any]:
    if backend == "reference":
        return {
            "resolve_residency": resolve_residency_ref,
            "gather_compact": gather_compact_ref,
            "mirror_rows": mirror_rows_ref,
            "invalidate_written_rows": invalidate_written_rows_ref,
        }[op]
    return functools.partial(_kernels().KERNELS[op], interpret=not _compat.has_gpu())


# --------------------------------------------------------------------------- public ops


@functools.partial(jax.jit, static_argnames=("block_size", "backend"))
def _resolve(state, topk, state_rows, hot_block_table, source_block_table,
             resident_block_table, *, block_size, host_rows, backend):
    (attention_rows, valid_counts, swap_src, swap_dst, swap_counts, num_hits, slot_rows,
     lru) = _impl("resolve_residency", backend)(
        state.slot_rows, state.lru, topk, state_rows, hot_block_table, source_block_table,
        resident_block_table, block_size=block_size, host_rows=host_rows)
    return (Resolution(attention_rows, valid_counts, swap_src, swap_dst, swap_counts,
                       num_hits), HotState(slot_rows, lru))


def resolve_residency(
    state: HotState,
    topk: jax.Array,
    *,
    state_rows: jax.Array,
    hot_block_table: jax.Array,
    source_block_table: jax.Array,
    resident_block_table: jax.Array | None = None,
    block_size: int,
    host_rows: int,
    backend: str | None = None,
) -> tuple[Resolution, HotState]:
    """Maps each selected position to a device row, updating the hot-region LRU.

    Args:
      state: the hot state (slot_rows int32[S, H], lru int16[S, H]).
      topk: int32[N, K] selected logical positions per batch row (-1 = none); valid host
        rows must be unique within a row.
      state_rows: int32[N], hot-state row of each batch row; -1 marks a padding row.
      hot_block_table: int32[N, >= ceil(H/B)], device blocks of each row's hot region.
      source_block_table: int32[N, Ms], host blocks of each row's request (0 = null).
      resident_block_table: int32[N, Mr] or None, still-resident device blocks (0 = none).
      block_size: B, static. host_rows: rows of the host pool (a Python int, passed as a
        traced scalar so a pool resize does not recompile); g >= host_rows is -1.
      backend: "reference", "pallas" or None (pick).
    Returns:
      (Resolution, new HotState); exact semantics in shared/spec/SEMANTICS.md.
    """
    _validate_resolve(state, topk, state_rows, hot_block_table, source_block_table,
                      resident_block_table, block_size, host_rows)
    return _resolve(state, topk, state_rows, hot_block_table, source_block_table,
                    resident_block_table, block_size=int(block_size),
                    host_rows=jnp.int32(host_rows), backend=_pick("resolve_residency", backend))


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("kv_cache",))
def _gather(host_pool, kv_cache, swap_src, swap_dst, swap_counts, *, backend):
    # The Pallas kernel addresses a [host_blocks, B, W] pool itself: no reshape of the
    # host buffer inside the computation.
    pool = host_pool if backend == "pallas" else host_pool.reshape(-1, host_pool.shape[-1])
    return _impl("gather_compact", backend)(pool, kv_cache, swap_src, swap_dst, swap_counts)


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
    For each n and m < swap_counts[n]: device row swap_dst[n, m] := host row swap_src[n, m]
    (zeros if swap_src >= host_rows); skipped when swap_src < 0 or swap_dst is outside the
    cache. Destinations must be distinct.
    """
    _validate_pool_and_cache(host_pool, kv_cache)
    _validate_swap_plan(swap_src, swap_dst, swap_counts)
    return _gather(host_pool, kv_cache, swap_src, swap_dst, swap_counts,
                   backend=_pick("gather_compact", backend))


def _mirror_body(kv_cache, host_pool, device_rows, host_rows, *, backend):
    return _impl("mirror_rows", backend)(kv_cache, host_pool, device_rows, host_rows)


@functools.cache
def _mirror_jit(out_sharding):
    """The jitted mirror; `out_sharding` (the pool's own sharding, or None inside a user's
    jit) keeps the updated pool in pinned_host memory: a kernel writing a host buffer in
    place is refused by XLA unless the jit names the output's memory kind."""
    kwargs = {} if out_sharding is None else {"out_shardings": out_sharding}
    return jax.jit(_mirror_body, static_argnames=("backend",), donate_argnames=("host_pool",),
                   **kwargs)


def _mirror(kv_cache, host_pool, device_rows, host_rows, *, backend):
    sharding = host_pool.sharding if _is_concrete(host_pool) else None
    return _mirror_jit(sharding)(kv_cache, host_pool, device_rows, host_rows, backend=backend)


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
    _validate_pool_and_cache(host_pool, kv_cache)
    _check_array("device_rows", device_rows, ndim=1, dtype=jnp.int32)
    _check_array("host_rows", host_rows, ndim=1, dtype=jnp.int32)
    if device_rows.shape != host_rows.shape:
        raise ValueError(f"device_rows {device_rows.shape} and host_rows {host_rows.shape} "
                         "must have the same length")
    return _mirror(kv_cache, host_pool, device_rows, host_rows,
                   backend=_pick("mirror_rows", backend))


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


@functools.partial(jax.jit, static_argnames=("backend",))
def _invalidate(state, state_rows_per_token, written_rows, *, backend):
    slot_rows = _impl("invalidate_written_rows", backend)(
        state.slot_rows, state_rows_per_token, written_rows)
    return HotState(slot_rows, state.lru)


def invalidate_written_rows(
    state: HotState,
    state_rows_per_token: jax.Array,
    written_rows: jax.Array,
    *,
    backend: str | None = None,
) -> HotState:
    """Drops hot copies of host rows that were just rewritten.

    state_rows_per_token, written_rows: int32[T]. For each token with written host row
    w >= 0 of state row s (0 <= s < S), every slot of slot_rows[s] equal to w becomes -1.
    """
    if not isinstance(state, HotState):
        raise TypeError(f"state must be a HotState, got {type(state).__name__}")
    _check_array("state_rows_per_token", state_rows_per_token, ndim=1, dtype=jnp.int32)
    _check_array("written_rows", written_rows, ndim=1, dtype=jnp.int32)
    if state_rows_per_token.shape != written_rows.shape:
        raise ValueError(f"state_rows_per_token {state_rows_per_token.shape} and written_rows "
                         f"{written_rows.shape} must have the same length")
    return _invalidate(state, state_rows_per_token, written_rows,
                       backend=_pick("invalidate_written_rows", backend))


def gather_compact_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts, *,
                         backend: str | None = None, fused: bool = True):
    """`gather_compact` of one swap plan into every layer of an index group (see
    `hisparse_jax.index_group.gather_compact_group`)."""
    from hisparse_jax.index_group import gather_compact_group as group  # noqa: PLC0415

    return group(host_pools, kv_caches, swap_src, swap_dst, swap_counts, backend=backend,
                 fused=fused)


def sparse_mla_decode(*args, **kwargs):
    """`hisparse_jax.attention.sparse_mla_decode`."""
    from hisparse_jax.attention import sparse_mla_decode as attend  # noqa: PLC0415

    return attend(*args, **kwargs)
