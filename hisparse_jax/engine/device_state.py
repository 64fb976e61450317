"""`DeviceState`: the arrays one engine's steps carry over, and their rebuild after a loss.

  * The model's parameter leaves, the `DecodeCache` (the KV-cache handle and the model's
    per-seat arrays), the block tables, the top-k source's state, the sampling base key: all
    committed to the device up front, so each jitted step compiles once (an uncommitted
    argument that later arrives committed would compile again).
  * A plan's state reaches the device in order: block-table rows -> hot resets /
    invalidations (every index group's hot state) (`apply_plan_state`) -> restores
    (`restore`); the forward runs; then the spills (`after_forward`, enqueued without
    waiting). The table rows and hot updates of a typical step are deferred to the next
    decode step's own executable (`step_builder.TABLE_FOLD_ROWS`, `step_builder.HOT_FOLD_ROWS`).
  * After a failure the engine asks `lost` and, when the arrays cannot be trusted, rebuilds
    them (`reset`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.cache import HiSparseKVCache, Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.sampler import base_key
from hisparse_jax.engine.step_builder import HOT_FOLD_ROWS, HOT_FOLD_WIDTH, TABLE_FOLD_ROWS
from hisparse_jax.models.protocol import DecodeCache, ModelSpec
from hisparse_jax.state import apply_hot_updates, apply_packed_hot_updates, pack_hot_updates
from host_tier.plan import StepPlan, TableUpdate


def lost(array: jax.Array) -> bool:
    """Deleted (donated to a call that failed), or poisoned (its computation failed)."""
    if array.is_deleted():
        return True
    try:
        array.block_until_ready()
    except Exception:  # noqa: BLE001 - a failed computation's output raises here
        return True
    return False


def no_prev_tokens(max_seats: int, num_speculative_tokens: int) -> Any:
    """What an async decode step takes as the previous step's tokens when none is in flight
    (no row reads them): a decode step's token outputs of the same shapes and dtypes, so that
    one executable serves both: int32[S], or with k speculative tokens the verify step's
    (tokens int32[S, 1 + k], counts int32[S] (ones), drafts int32[S, k])."""
    S, k = max_seats, num_speculative_tokens
    if not k:
        return np.zeros(S, np.int32)
    return (np.zeros((S, 1 + k), np.int32), np.ones(S, np.int32), np.zeros((S, k), np.int32))


def with_residency(cache: DecodeCache, residency: Residency) -> DecodeCache:
    """`cache` with its KV-cache handle under `residency` (the same object when it already is:
    the common step pays for no pytree rebuild)."""
    if cache.kv.residency == residency:
        return cache
    return dataclasses.replace(cache, kv=cache.kv.with_residency(residency))


class DeviceState:
    """The device arrays of one engine (or one mesh data shard) (module docstring).

    Args:
      spec: the model's `ModelSpec`.
      ec: serving knobs (ops backend, copy options, top-k source, seed).
      cfg: sizes (the engine's one `HiSparseConfig`).
      residency: the mode's residency type (the cache keeps it between steps).
      tables: `host_tier.DeviceBlockTables` (src / res / hot per state row).
      transfers: the transfer worker (`before_forward` / `after_forward`).
      host_pool: the pinned `host_tier.HostPool` (None when the mode reads no host rows).
      device: where everything is committed (a device, or a sharding).
      params: the parameter leaves, already placed.
      index_keys: shapes and dtypes (`jax.ShapeDtypeStruct`s) of the model's per-seat arrays
        (`ServedModel.init_index_keys`), started as zeros.
      topk_source: the bound external top-k source, or None.
    """

    def __init__(self, spec: ModelSpec, ec: EngineConfig, cfg: HiSparseConfig,
                 residency: Residency, *, tables: Any, transfers: Any, host_pool: Any,
                 device: Any, params: Any, index_keys: Any, topk_source: Any) -> None:
        self.spec, self.config, self.cfg, self.residency = spec, ec, cfg, residency
        self.tables, self.transfers, self.host_pool = tables, transfers, host_pool
        self.device = device
        self.params = params
        self._index_keys = index_keys
        self.topk_source = topk_source
        self.init()
        self.sample_key = self.put(base_key(ec.seed))
        self.no_prev_tokens = self.put(no_prev_tokens(cfg.max_num_reqs,
                                                      ec.num_speculative_tokens))

    @property
    def cache(self) -> DecodeCache:
        """The device cache; a hot-state update still deferred for the next decode step
        (`apply_plan_state`) is applied first, so every reader sees the plan's state."""
        if self.hot_deferred is not None:
            packed, self.hot_deferred = self.hot_deferred, None
            kv = self._cache.kv
            hot = apply_packed_hot_updates(kv.hot, self.put(packed),
                                           block_size=self.cfg.block_size,
                                           num_rows=HOT_FOLD_ROWS)
            self._cache = dataclasses.replace(self._cache, kv=dataclasses.replace(kv, hot=hot))
        return self._cache

    @cache.setter
    def cache(self, cache: DecodeCache) -> None:
        self._cache = cache

    @property
    def raw_cache(self) -> DecodeCache:
        """The cache as it is, a deferred hot update (`hot_deferred`) not applied: the next
        decode step applies it inside its own executable."""
        return self._cache

    def hot_rows(self) -> np.ndarray:
        """The packed hot update deferred for the next decode step (an empty one when none);
        the caller clears `hot_deferred` once its step holds it."""
        if self.hot_deferred is None:
            return pack_hot_updates(None, HOT_FOLD_ROWS, HOT_FOLD_WIDTH)
        return self.hot_deferred

    def put(self, tree: Any) -> Any:
        """Commits a pytree of arrays to the state's device."""
        return jax.device_put(tree, self.device)

    def init(self) -> None:
        """Fresh arrays: zero KV caches and per-seat arrays, empty hot states, the top-k
        source's initial state (the block tables are the caller's)."""
        ec, cfg, spec = self.config, self.cfg, self.spec
        self.hot_deferred: np.ndarray | None = None  # `apply_plan_state`, fresh state: none
        kv = HiSparseKVCache.create(cfg, num_layers=spec.num_layers, residency=self.residency,
                                    group_layers=spec.group_layers,
                                    ops_backend=ec.tuning.ops_backend,
                                    copy_programs=ec.tuning.copy_programs,
                                    copy_with_attention=ec.tuning.copy_with_attention)
        self.cache = self.put(DecodeCache(
            kv=kv, index_keys=tuple(jnp.zeros(k.shape, k.dtype) for k in self._index_keys)))
        self.topk_state = None
        if self.topk_source is not None:
            self.topk_state = self.put(self.topk_source.init_state(
                max_seats=cfg.max_num_reqs, max_model_len=cfg.max_model_len,
                num_groups=spec.num_groups, top_k=spec.top_k))

    def arrays(self) -> list[jax.Array]:
        """The arrays the steps carry over (caches, hot states, top-k state, block tables)."""
        return (jax.tree.leaves(self._cache) + jax.tree.leaves(self.topk_state)
                + list(self.tables.arrays))

    def _lost_pool_arrays(self) -> list[int]:
        if self.host_pool is None:
            return []
        return [i for i, a in enumerate(self.host_pool.arrays) if lost(a)]

    def lost(self) -> bool:
        """Whether an array the steps carry over (caches, hot states, block tables, top-k
        state, host pool layers) was lost: deleted (donated to a call that failed) or
        poisoned (a failed computation produced it). Waits for the arrays."""
        return any(lost(a) for a in self.arrays()) or bool(self._lost_pool_arrays())

    def reset(self, tables: TableUpdate) -> None:
        """Rebuilds the arrays from scratch (`init`; zero block tables that then get
        `tables`, e.g. the manager's `tables.full_update()`) and replaces lost host pool
        arrays with zeros. The caller has released every request whose rows lived there
        (they are recomputed; the engine publishes no host page)."""
        lost_arrays = self._lost_pool_arrays()
        self.init()
        self.tables = type(self.tables).from_config(self.cfg, device=self.device)
        self.tables.apply(tables)
        pool = self.host_pool
        for i in lost_arrays:
            pool.replace_array(i, jax.device_put(np.zeros(pool.shape, pool.dtype), pool.sharding))

    def mode_cache(self) -> DecodeCache:
        """The cache under the mode's residency (what every prefill variant is traced with)."""
        return with_residency(self.cache, self.residency)

    def apply_plan_state(self, plan: StepPlan) -> None:
        """A plan's table rows, then its hot resets / invalidations. Idempotent: applying a
        plan's state again changes nothing more.

        The table rows and hot updates of a typical decode step (`TABLE_FOLD_ROWS`,
        `HOT_FOLD_ROWS`) are deferred: the next decode step applies them inside its own
        executable; anything else that reads the tables or the cache first applies them
        then (`DeviceBlockTables.defer`, the `cache` property)."""
        self.tables.defer(plan.tables, max_rows=TABLE_FOLD_ROWS)
        if not (plan.hot_resets or plan.hot_invalidations):
            return  # nothing else to apply
        cache = self.cache  # an update deferred earlier goes first
        if cache.kv.hot:
            packed = pack_hot_updates(plan, HOT_FOLD_ROWS, HOT_FOLD_WIDTH)
            if packed is not None:
                self.hot_deferred = packed
                return
        kv = cache.kv
        kv = dataclasses.replace(kv, hot=apply_hot_updates(plan, kv.hot,
                                                           block_size=self.cfg.block_size))
        self.cache = dataclasses.replace(self.cache, kv=kv)

    def restore(self, plan: StepPlan) -> None:
        """Hands a plan's restores to the transfer worker (into every layer's cache)."""
        if not plan.restores:
            return
        placed = [c.sharding for c in self.cache.kv.caches]
        self.set_caches(self.transfers.before_forward(plan, self.cache.kv.caches), placed)

    def set_caches(self, caches: Any, placed: list[Any]) -> None:
        """Takes new per-layer KV caches (a copy's outputs) under the placements `placed` the
        old ones had: a copy kernel's output may come back under an equivalent sharding of
        another type (e.g. the host pool's one-device mesh), which the jitted steps would
        compile for again; re-labelling an equivalent placement copies nothing."""
        caches = tuple(new if new.sharding == s else jax.device_put(new, s)
                       for new, s in zip(caches, placed, strict=True))
        kv = dataclasses.replace(self.cache.kv, caches=caches)
        self.cache = dataclasses.replace(self.cache, kv=kv)

    def after_forward(self, plan: StepPlan) -> None:
        """The plan's spills from the post-forward caches (enqueued, not waited for)."""
        self.transfers.after_forward(plan, self.cache.kv.caches)

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, per-seat arrays and hot state on the device."""
        leaves = jax.tree.leaves(self.params) + jax.tree.leaves(self.cache)
        return int(sum(x.nbytes for x in leaves))
