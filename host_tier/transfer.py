"""`TransferEngine`: executes the copies of a `StepPlan` on device arrays (worker side).

The engine moves bytes, the coordinator decides: it never looks at residency state, it only
turns plan entries into row lists and calls the data-plane copy functions it was given:

  - `mirror_fn(kv_cache, host_pool, device_rows, host_rows) -> host_pool`: host row
    `host_rows[i]` := device row `device_rows[i]` (flat rows of `[blocks, B, W]`), skipping
    negative or out-of-range entries; `host_pool` is donated and the result stays in
    `pinned_host` memory (`hisparse_jax.mirror_rows`);
  - `restore_fn(host_pool, kv_cache, host_rows, device_rows) -> kv_cache`: device row
    `device_rows[i]` := host row `host_rows[i]`, same skipping rules, `kv_cache` donated (the
    swap copy, e.g. `hisparse_jax` `gather_compact` with one batch row). Only partial prefix
    hits need it.

Nothing here blocks the decode step: copies are dispatched asynchronously and their completion is
observed later (`poll`). Spills into one layer's pool form a chain (each donates the previous
pool array), so once a pool array is ready every spill dispatched before it has completed; the
engine checks readiness before each new dispatch donates the array, and in `poll`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from host_tier.host_pool import HostPool
from host_tier.plan import StepPlan, TransferReport

MirrorFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
RestoreFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _bucket(n: int) -> int:
    """Row lists are padded (with -1) to a power of two, at least 64, to bound recompilations."""
    return max(64, 1 << (n - 1).bit_length())


def _page_rows(blocks: Sequence[int], num_rows: Sequence[int], block_size: int) -> np.ndarray:
    """Flat rows `block * B + [0, n)` of each (block, n), padded with -1 to a bucket size."""
    total = int(sum(num_rows))
    out = np.full(_bucket(total), -1, np.int32)
    if total:
        out[:total] = np.concatenate([b * block_size + np.arange(n, dtype=np.int64)
                                      for b, n in zip(blocks, num_rows, strict=True)])
    return out


class TransferEngine:
    """Runs a plan's restores (before the forward) and spills (after it) on every layer.

    Args:
      host_pool: the pinned pool; its arrays are replaced by the results of `mirror_fn`.
      mirror_fn: device -> host row copy (see module docstring).
      restore_fn: host -> device row copy; required only when a plan carries restores.
    """

    def __init__(self, host_pool: HostPool, *, mirror_fn: MirrorFn,
                 restore_fn: RestoreFn | None = None) -> None:
        if not callable(mirror_fn):
            raise ValueError(f"TransferEngine.mirror_fn must be callable, got {mirror_fn!r}")
        if restore_fn is not None and not callable(restore_fn):
            raise ValueError(f"TransferEngine.restore_fn must be callable, got {restore_fn!r}")
        self.host_pool = host_pool
        self.mirror_fn = mirror_fn
        self.restore_fn = restore_fn
        self.block_size = host_pool.block_size
        device = next(iter(host_pool.sharding.device_set))
        self._index_sharding = jax.sharding.SingleDeviceSharding(device)
        self._enqueued: list[int] = []
        self._completed: list[int] = []
        self._in_flight: list[int] = []  # dispatched spills whose completion is not observed

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def before_forward(self, plan: StepPlan, kv_caches: Sequence[jax.Array]) -> list[jax.Array]:
        """Dispatches the plan's restores into every layer's cache; returns the new caches.

        The caches passed in are donated when there is something to restore.

        Raises:
          ValueError: wrong number of layers, or restores without a `restore_fn`.
        """
        kv_caches = self._check_layers(kv_caches)
        if not plan.restores:
            return kv_caches
        if self.restore_fn is None:
            raise ValueError(
                "TransferEngine: the plan restores pages (partial prefix hits) but the engine "
                "was built without restore_fn")
        hosts = [r.host_block for r in plan.restores]
        devices = [r.device_block for r in plan.restores]
        counts = [r.num_rows for r in plan.restores]
        host_rows = self._put(_page_rows(hosts, counts, self.block_size))
        device_rows = self._put(_page_rows(devices, counts, self.block_size))
        out = [self.restore_fn(self.host_pool.layer(i), kv, host_rows, device_rows)
               for i, kv in enumerate(kv_caches)]
        self._enqueued.extend(r.transfer_id for r in plan.restores)
        return out

    def after_forward(self, plan: StepPlan, kv_caches: Sequence[jax.Array]) -> None:
        """Enqueues the plan's spills from the post-forward caches into every layer's pool."""
        kv_caches = self._check_layers(kv_caches)
        if not plan.spills:
            return
        self._observe_completions()  # before the dispatch below donates the pool arrays
        B = self.block_size
        counts = [B] * len(plan.spills)
        device_rows = self._put(_page_rows([s.device_block for s in plan.spills], counts, B))
        host_rows = self._put(_page_rows([s.host_block for s in plan.spills], counts, B))
        for i, kv in enumerate(kv_caches):
            pool = self.mirror_fn(kv, self.host_pool.layer(i), device_rows, host_rows)
            self.host_pool.replace_layer(i, pool)
        ids = [s.transfer_id for s in plan.spills]
        self._enqueued.extend(ids)
        self._in_flight.extend(ids)

    def poll(self, *, wait: bool = False) -> TransferReport:
        """Transfers enqueued and completed since the previous poll.

        Args:
          wait: block until every dispatched spill has completed (e.g. when admission waits
            for host blocks that only completions release).
        """
        if wait and self._in_flight:
            jax.block_until_ready(self.host_pool.arrays)
        self._observe_completions()
        report = TransferReport(tuple(self._enqueued), tuple(self._completed))
        self._enqueued = []
        self._completed = []
        return report

    def update_hot_state(self, plan: StepPlan, hot_state: Any, *,
                         reset_rows_fn: Callable[[Any, jax.Array], Any] | None = None) -> Any:
        """Applies the plan's hot resets and invalidations to a `hisparse_jax.state.HotState`.

        Returns the new state (the old one's `slot_rows` may be donated). `reset_rows_fn`
        defaults to `hisparse_jax.state.reset_rows`.
        """
        return apply_hot_updates(plan, hot_state, block_size=self.block_size,
                                 reset_rows_fn=reset_rows_fn)

    def _observe_completions(self) -> None:
        if self._in_flight and all(a.is_ready() for a in self.host_pool.arrays):
            self._completed.extend(self._in_flight)
            self._in_flight = []

    def _check_layers(self, kv_caches: Sequence[jax.Array]) -> list[jax.Array]:
        kv_caches = list(kv_caches)
        if len(kv_caches) != self.host_pool.num_layers:
            raise ValueError(
                f"kv_caches must hold one cache per host pool layer "
                f"({self.host_pool.num_layers}), got {len(kv_caches)}")
        return kv_caches

    def _put(self, rows: np.ndarray) -> jax.Array:
        return jax.device_put(rows, self._index_sharding)


@functools.partial(jax.jit, static_argnames=("block_size",), donate_argnums=(0,))
def invalidate_host_blocks(slot_rows: jax.Array, state_rows: jax.Array, host_blocks: jax.Array,
                           *, block_size: int) -> jax.Array:
    """Empties the hot slots of `state_rows` that hold a row of their `host_blocks`.

    Args:
      slot_rows: int32[S, H], host row held by each hot slot (-1 empty); donated.
      state_rows: int32[R], distinct state rows; entries outside [0, S) are ignored.
      host_blocks: int32[R, M], host blocks per state row, padded with -1.
    Returns:
      The new `slot_rows`.
    """
    num_rows = slot_rows.shape[0]
    in_range = (state_rows >= 0) & (state_rows < num_rows)
    rows = slot_rows[jnp.where(in_range, state_rows, 0)]
    blocks = jnp.where(rows >= 0, rows // block_size, -2)  # -2 never matches padding
    stale = (blocks[:, :, None] == host_blocks[:, None, :]).any(-1)
    return slot_rows.at[jnp.where(in_range, state_rows, num_rows)].set(
        jnp.where(stale, -1, rows), mode="drop")


def apply_hot_updates(plan: StepPlan, hot_state: Any, *, block_size: int,
                      reset_rows_fn: Callable[[Any, jax.Array], Any] | None = None) -> Any:
    """Hot resets, then invalidations, of one plan applied to a state with a `slot_rows` field."""
    if plan.hot_resets:
        if reset_rows_fn is None:
            from hisparse_jax.state import reset_rows as reset_rows_fn  # data plane, lazily
        rows = np.full(_bucket(len(plan.hot_resets)), -1, np.int32)  # -1: ignored
        rows[:len(plan.hot_resets)] = plan.hot_resets
        hot_state = reset_rows_fn(hot_state, jnp.asarray(rows))
    if plan.hot_invalidations:
        n = len(plan.hot_invalidations)
        width = max(len(inv.host_blocks) for inv in plan.hot_invalidations)
        rows = np.full(_bucket(n), -1, np.int32)
        blocks = np.full((_bucket(n), _bucket(width)), -1, np.int32)
        for i, inv in enumerate(plan.hot_invalidations):
            rows[i] = inv.state_row
            blocks[i, :len(inv.host_blocks)] = inv.host_blocks
        slot_rows = invalidate_host_blocks(hot_state.slot_rows, jnp.asarray(rows),
                                           jnp.asarray(blocks), block_size=block_size)
        hot_state = dataclasses.replace(hot_state, slot_rows=slot_rows)
    return hot_state
