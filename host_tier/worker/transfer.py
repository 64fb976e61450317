"""`TransferEngine`: executes the copies of a `StepPlan` on device arrays (worker side).

The engine moves bytes, the coordinator decides: it never looks at residency state, it only
turns plan entries into row lists and calls the data-plane copy functions it was given:

  - `mirror_fn(kv_cache, host_pool, device_rows, host_rows) -> host_pool`: host row
    `host_rows[i]` := device row `device_rows[i]` (flat rows of `[blocks, B, W]`; the row lists
    are int32[R], R a power of two >= 64, padded with -1), skipping negative or out-of-range
    entries; `host_pool` is the array holding the layer and, in a packed pool, `host_rows` are
    row ids of its flat W-wide rows (`HostPool.layer_rows`); `host_pool` is donated and the
    result stays in `pinned_host` memory (the data plane's `hisparse_jax.ops.mirror_rows`);
  - `restore_fn(host_pool, kv_cache, host_rows, device_rows) -> kv_cache`: device row
    `device_rows[i]` := host row `host_rows[i]`, same row lists, skipping rules and (packed)
    row ids, `kv_cache` donated (the data plane's `hisparse_jax.ops.restore_rows`). Only
    partial prefix hits need it.
  - optionally `mirror_group_fn(kv_caches, host_pools, device_rows, host_rows) -> host_pools`:
    `mirror_fn` of one row list into every layer at once, one call (the data plane's
    `hisparse_jax.ops.mirror_rows_group`): a spill plan costs one dispatch, not one per layer.
    It gets the pool's arrays (`HostPool.arrays`: per layer, or packed) and the plain host rows.

The caller passes these functions in: this module never imports the data plane. For CPU tests,
`host_tier/testing.py` has jnp references of both.

A copy function that raises does not raise out of `before_forward` / `after_forward`: the plan's
transfer ids of that call are reported failed by the next `poll` (`TransferReport.failed`), and
the caches and pool arrays the call did not replace stay the caller's, usable as they were. Only
when the failing call had already consumed (donated and deleted) one of them is nothing
recoverable: then a `TransferLostError` names the array.

Nothing here blocks the decode step: copies are dispatched asynchronously and their completion is
observed later (`poll`). Spills into one layer's pool form a chain (each donates the previous
pool array), so once a pool array is ready every spill dispatched before it has completed; the
engine checks readiness before each new dispatch donates the array, and in `poll`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from host_tier.plan import StepPlan, TransferReport
from host_tier.sizes import pow2_bucket
from host_tier.worker.host_pool import HostPool

__all__ = ["MirrorFn", "MirrorGroupFn", "RestoreFn", "TransferEngine", "TransferLostError"]

MirrorFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
MirrorGroupFn = Callable[[Sequence[jax.Array], Sequence[jax.Array], jax.Array, jax.Array],
                         Sequence[jax.Array]]
RestoreFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

MIN_ROWS_BUCKET = 64
"""Row lists are padded (with -1) to a power of two, at least this, to bound recompilations."""


def _page_rows(blocks: Sequence[int], num_rows: Sequence[int], block_size: int) -> np.ndarray:
    """int32 flat rows `block * B + [0, n)` of each (block, n), padded with -1 to a power of
    two >= MIN_ROWS_BUCKET."""
    total = int(sum(num_rows))
    out = np.full(pow2_bucket(total, MIN_ROWS_BUCKET), -1, np.int32)
    if total:
        out[:total] = np.concatenate([b * block_size + np.arange(n, dtype=np.int64)
                                      for b, n in zip(blocks, num_rows, strict=True)])
    return out


class TransferLostError(RuntimeError):
    """A copy function raised after consuming a pool array or KV cache it was donated: its
    contents are gone, so the host tier cannot go on (restart the engine)."""


class TransferEngine:
    """Runs a plan's restores (before the forward) and spills (after it) on every layer.

    Args:
      host_pool: the pinned pool; its arrays are replaced by the results of `mirror_fn`.
      mirror_fn: device -> host row copy (see module docstring).
      restore_fn: host -> device row copy; required only when a plan carries restores.
      mirror_group_fn: every layer's device -> host copy in one call; when given, spills use
        it instead of one `mirror_fn` call per layer.
    """

    def __init__(self, host_pool: HostPool, *, mirror_fn: MirrorFn,
                 restore_fn: RestoreFn | None = None,
                 mirror_group_fn: MirrorGroupFn | None = None) -> None:
        if not callable(mirror_fn):
            raise ValueError(f"TransferEngine.mirror_fn must be callable, got {mirror_fn!r}")
        if restore_fn is not None and not callable(restore_fn):
            raise ValueError(f"TransferEngine.restore_fn must be callable, got {restore_fn!r}")
        if mirror_group_fn is not None and not callable(mirror_group_fn):
            raise ValueError(f"TransferEngine.mirror_group_fn must be callable, got "
                             f"{mirror_group_fn!r}")
        self.host_pool = host_pool
        self.mirror_fn = mirror_fn
        self.mirror_group_fn = mirror_group_fn
        self.restore_fn = restore_fn
        self.block_size = host_pool.block_size
        devices = host_pool.sharding.device_set
        # Row lists live where the pool's copies run: its device, or (a pool replicated over a
        # mesh shard's devices) all of them.
        self.index_sharding = (jax.sharding.SingleDeviceSharding(next(iter(devices)))
                               if len(devices) == 1
                               else host_pool.sharding.with_memory_kind("device"))
        self._enqueued: list[int] = []
        self._completed: list[int] = []
        self._failed: list[int] = []
        self._in_flight: list[int] = []  # dispatched spills whose completion is not observed

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def before_forward(self, plan: StepPlan, kv_caches: Sequence[jax.Array]) -> list[jax.Array]:
        """Dispatches the plan's restores into every layer's cache; returns the new caches.

        The caches passed in are donated when there is something to restore. When `restore_fn`
        raises (on any layer), the plan's restores are reported failed by the next `poll` and
        the caches are returned as they are: the new ones of the layers already restored, the
        caller's own for the others.

        Raises:
          ValueError: wrong number of layers, or restores without a `restore_fn`.
          TransferLostError: `restore_fn` raised after deleting the cache it was given.
        """
        kv_caches = self._check_layers(kv_caches)
        if not plan.restores:
            return kv_caches
        if self.restore_fn is None:
            raise ValueError(
                "TransferEngine: the plan restores pages (partial prefix hits) but the engine "
                "was built without restore_fn")
        ids = [r.transfer_id for r in plan.restores]
        out = list(kv_caches)
        layer = None
        try:
            hosts = [r.host_block for r in plan.restores]
            devices = [r.device_block for r in plan.restores]
            counts = [r.num_rows for r in plan.restores]
            device_rows, host_rows = self._layer_rows(
                _page_rows(devices, counts, self.block_size),
                _page_rows(hosts, counts, self.block_size))
            for layer, kv in enumerate(kv_caches):
                out[layer] = self.restore_fn(self.host_pool.layer(layer), kv,
                                             host_rows[layer], device_rows)
        except Exception as error:
            if layer is not None and _deleted(kv_caches[layer]):
                raise TransferLostError(
                    f"TransferEngine: restore_fn raised ({error!r}) after consuming the KV "
                    f"cache of layer {layer}; its rows are lost") from error
            self._failed.extend(ids)
            return out
        self._enqueued.extend(ids)
        return out

    def after_forward(self, plan: StepPlan, kv_caches: Sequence[jax.Array]) -> None:
        """Enqueues the plan's spills from the post-forward caches into every layer's pool.

        When `mirror_fn` raises (or returns an array the pool refuses), the plan's spills are
        reported failed by the next `poll`; the layers already copied keep their new pool
        arrays (the failed pages' host rows there are written but never read: the pages are not
        clean), the others their old ones. With `mirror_group_fn` it is all layers or none.

        Raises:
          ValueError: wrong number of layers.
          TransferLostError: `mirror_fn` raised after deleting the pool array it was given.
        """
        kv_caches = self._check_layers(kv_caches)
        if not plan.spills:
            return
        self._observe_completions()  # before the dispatch below donates the pool arrays
        ids = [s.transfer_id for s in plan.spills]
        layer = None
        try:
            B = self.block_size
            counts = [B] * len(plan.spills)
            devices = _page_rows([s.device_block for s in plan.spills], counts, B)
            hosts = _page_rows([s.host_block for s in plan.spills], counts, B)
            if self.mirror_group_fn is not None:
                layer = 0
                device_rows, group_rows = self._put((devices, hosts))
                pools = self.mirror_group_fn(kv_caches, self.host_pool.arrays, device_rows,
                                             group_rows)
                for i, pool in enumerate(pools):
                    self.host_pool.replace_array(i, pool)
            else:
                device_rows, host_rows = self._layer_rows(devices, hosts)
                for layer, kv in enumerate(kv_caches):
                    pool = self.mirror_fn(kv, self.host_pool.layer(layer), device_rows,
                                          host_rows[layer])
                    self.host_pool.replace_layer(layer, pool)
        except Exception as error:
            lost = ([] if layer is None else
                    [i for i in range(self.host_pool.num_layers)
                     if _deleted(self.host_pool.layer(i))])
            if lost:
                raise TransferLostError(
                    f"TransferEngine: mirror_fn raised ({error!r}) after consuming the host "
                    f"pool array of layer {lost[0]}; the pool's rows are lost") from error
            self._failed.extend(ids)
            return
        self._enqueued.extend(ids)
        self._in_flight.extend(ids)

    def fail_spills(self, plan: StepPlan) -> None:
        """The plan's forward did not run (it raised before `after_forward`): its spills are
        reported failed by the next `poll` instead of running. The coordinator then releases
        their blocks and spills the pages again by a later plan (a request that left drops
        them). The plan's restores were reported by `before_forward` already."""
        self._failed.extend(s.transfer_id for s in plan.spills)

    def poll(self, *, wait: bool = False) -> TransferReport:
        """Transfers enqueued, completed and failed since the previous poll.

        Args:
          wait: block until every dispatched spill has completed (e.g. when admission waits
            for host blocks that only completions release).
        """
        if wait and self._in_flight:
            jax.block_until_ready(self.host_pool.arrays)
        self._observe_completions()
        report = TransferReport(tuple(self._enqueued), tuple(self._completed),
                                tuple(self._failed))
        self._enqueued = []
        self._completed = []
        self._failed = []
        return report

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

    def _layer_rows(self, device_rows: np.ndarray, host_rows: np.ndarray
                    ) -> tuple[jax.Array, list[jax.Array]]:
        """The device rows and each layer's row ids of host rows `host_rows` in its array
        (`HostPool.layer_rows`; the same array for every layer of an unpacked pool), on the
        copies' device in one transfer."""
        pool = self.host_pool
        g = pool.layers_per_array
        device, *slots = self._put((device_rows,
                                    *(pool.layer_rows(s, host_rows) for s in range(g))))
        return device, [slots[layer % g] for layer in range(pool.num_layers)]

    def _put(self, rows: Any) -> Any:
        """Row lists (an array or a tuple of them: one transfer call) to the copies' device."""
        return jax.device_put(rows, self.index_sharding)


def _deleted(array: object) -> bool:
    """Whether a jax array was deleted (donated and consumed); False for anything else."""
    is_deleted = getattr(array, "is_deleted", None)
    return bool(is_deleted()) if callable(is_deleted) else False
