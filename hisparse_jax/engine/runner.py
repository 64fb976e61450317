"""`Runner`: the device side of the engine: arrays, jitted steps, dispatch, plan execution.

  * The model's parameters and caches (`DecodeCache`: the KV-cache handle and the index-key
    caches) are committed to the device up front, and so is every array the jitted steps
    take, so each step variant compiles once (an uncommitted argument that later arrives
    committed would compile again).
  * The decode step is ONE `jax.jit` per residency variant over fixed shapes (N = max_seats
    batch rows; padding rows have state row -1), with the cache donated: "decode_fast"
    (`AllResident`: top-k positions through the resident table, no host pools passed) and,
    for modes with a host tier, "decode_hot" (the mode's residency: resolve, copy the misses,
    attend). The prefill ("prefill") is one jit per padded prompt length: the model over the
    prompt, or the synthetic prefill (deterministic random KV rows, a function of request,
    layer and position, written straight into the caches; the first generated token is the
    prompt's last token). With `EngineConfig.prefill_chunk_size` it is "prefill_chunk"
    instead, one jit per padded chunk length: `Transformer.prefill_chunk` over one chunk of a
    prompt, the earlier chunks' rows read through the request's resident pages. With
    `enable_prefix_caching` there is "prefill_chunk" besides "prefill" (the rest of a prompt
    after its prefix hit), and jitted copies of a batch of pages' index keys out of and into a seat.
    With `prefix_hit_pages="stage"` there is "prefill_chunk_staged" too: the chunk prefill of
    a request with host-only earlier pages (its prefix hit's), which also takes the host
    block-table row and the host pools and stages the rows its query rows select.
  * A plan is executed in order: block-table rows -> hot resets / invalidations (every index
    group's hot state) (`apply_plan_state`) -> restores (`restore`) -> the forward (decode,
    prefills) -> spills (`after_forward`, enqueued without waiting).
  * Sampling draws with per-request keys (`hisparse_jax.engine.sampler.token_keys`): the
    steps take the engine's base key, each row's sampling seed and the index of the token it
    samples.
  * `warmup` compiles every shape a run can reach (module `warmup` docstring); `CompileWatch`
    tells the engine which calls compiled, so their time is not counted as step time.
  * After a failure the engine asks `device_state_lost` and, when the device arrays cannot
    be trusted, rebuilds them (`reset_device_state`).

Seat = state row: batch row n of the decode step serves the request whose state row is n, so
the per-state-row tables and hot state are read without any renumbering.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.cache import AllResident, CacheBatch, HiSparseKVCache, Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.metrics import CompileWatch
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.sampler import base_key, sample, token_keys
from hisparse_jax.models.protocol import DecodeBatch, DecodeCache, ServedModel
from hisparse_jax.state import (
    apply_hot_updates,
    apply_packed_hot_updates,
    hot_updates,
    invalidation_width,
    pack_hot_updates,
    warm_hot_updates,
)
from host_tier.plan import StepPlan, TableRows, TableUpdate
from host_tier.sizes import pow2_bucket, round_up
from host_tier.worker.device_tables import MIN_ROWS_BUCKET as _TABLE_BUCKET
from host_tier.worker.device_tables import set_rows, table_update_size
from host_tier.worker.transfer import MIN_ROWS_BUCKET as _SPILL_BUCKET

# Donation is a no-op on some CPU builds; the warning says nothing actionable here.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


TABLE_FOLD_ROWS = 16
"""Block-table rows per table that a decode step applies inside its own executable (a
plan's table update of at most this many rows per table is deferred to the next decode
step; a larger one is applied by its own call, `DeviceBlockTables.defer`)."""

HOT_FOLD_ROWS, HOT_FOLD_WIDTH = 16, 8
"""A plan's hot resets and invalidations that a decode step applies inside its own
executable: at most HOT_FOLD_ROWS resets and invalidated rows, each of at most
HOT_FOLD_WIDTH host blocks (the typical step under pressure: a few pages spilled, one block
each); a larger update is applied by its own call (`apply_hot_updates`)."""


def _pow2_sizes(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, ..., hi (powers of two, lo <= hi)."""
    sizes = [lo]
    while sizes[-1] < hi:
        sizes.append(2 * sizes[-1])
    return sizes


def _lost(array: jax.Array) -> bool:
    """Deleted (donated to a call that failed), or poisoned (its computation failed)."""
    if array.is_deleted():
        return True
    try:
        array.block_until_ready()
    except Exception:  # noqa: BLE001 - a failed computation's output raises here
        return True
    return False


def _int32_bits(value: int) -> int:
    """An int's low 32 bits as an int32 (sampling seeds are folded in as uint32)."""
    return (int(value) + 2 ** 31) % 2 ** 32 - 2 ** 31


def fill_decode_inputs(reqs: list[Request], inputs: tuple[np.ndarray, ...], *,
                       offset: int = 0, ahead: frozenset[Hashable] = frozenset(),
                       prev_index: np.ndarray | None = None) -> None:
    """Writes the decode inputs of `reqs` into their seats' rows of `inputs` (tokens,
    positions, state_rows, temperature, seeds, steps, as `Runner._idle_inputs` makes them):
    each request's last token, then its `step_drafts` at the next positions (tokens and
    positions are [S, 1 + k] with speculation, else [S]). `offset`: the batch row of seat 0
    (the mesh engine's data shard d starts at d * seats; the state row stays the seat).

    One numpy assignment per array for the whole batch: element by element, the filling
    cost several microseconds a request, on the host's critical path between model steps.
    A function of its own, so that `bench/host_step.py` times it without a device.

    Asynchronous scheduling (`EngineConfig.async_scheduling`): `ahead` names the requests
    whose previous decode step is still in flight (its token not recorded yet: they are one
    token further than `live` says). Their token is the previous step's device token unless
    it is known on the host (a replayed one): those rows get their seat in `prev_index`
    (int32[S], -1: the host token) and token 0 here.
    """
    tokens, positions, state_rows, temperature, seeds, steps = inputs
    S = len(state_rows)
    token_rows, position_rows = tokens.reshape(S, -1), positions.reshape(S, -1)
    if ahead:
        # -1: the token is the in-flight step's, on the device only.
        rows = np.array([(req.seat, live, len(req.prompt),
                          req.generated[live - 1] if live <= len(req.generated) else -1,
                          req.sampling_seed)
                         for req in reqs
                         for live in (req.live + (req.request_id in ahead),)],
                        np.int64).reshape(-1, 5)
    else:
        rows = np.array([(req.seat, req.live, len(req.prompt), req.generated[req.live - 1],
                          req.sampling_seed) for req in reqs], np.int64).reshape(-1, 5)
    seats, lives = rows[:, 0], rows[:, 1]
    at = seats + offset
    token_rows[at, 0] = rows[:, 3]  # its last live token
    if ahead:
        on_device = rows[:, 3] < 0
        if on_device.any() and prev_index is None:
            raise ValueError("fill_decode_inputs: rows fed by the in-flight step's tokens "
                             "need prev_index")
        token_rows[at[on_device], 0] = 0
        prev_index[at[on_device]] = seats[on_device]
    position_rows[at, 0] = rows[:, 2] + lives - 1
    state_rows[at] = seats
    temperature[at] = [req.temperature for req in reqs]
    seeds[at] = rows[:, 4].astype(np.int32)  # the low 32 bits, as `_int32_bits`
    steps[at] = lives - 1  # decode steps since the prefill
    if token_rows.shape[1] > 1:  # speculation: the drafts at the next positions
        for req in reqs:
            if req.step_drafts:
                n, pos = len(req.step_drafts), len(req.prompt) + req.live
                token_rows[offset + req.seat, 1:1 + n] = req.step_drafts
                position_rows[offset + req.seat, 1:1 + n] = range(pos, pos + n)


def variant_name(residency: Residency) -> str:
    """The decode step variant of a residency: "decode_fast" (reads no host rows) or
    "decode_hot"."""
    return "decode_hot" if residency.reads_host else "decode_fast"


def _with_residency(cache: DecodeCache, residency: Residency) -> DecodeCache:
    """`cache` with its KV-cache handle under `residency` (the same object when it already is:
    the common step pays for no pytree rebuild)."""
    if cache.kv.residency == residency:
        return cache
    return dataclasses.replace(cache, kv=cache.kv.with_residency(residency))


@dataclasses.dataclass(frozen=True)
class PendingDecode:
    """A dispatched decode step whose tokens are not collected yet."""

    requests: list[Request]
    residency: Residency
    started: float  # perf_counter() at dispatch
    tokens: jax.Array  # int32[max_seats] (by seat; async scheduling feeds them back)
    aux: dict[str, jax.Array]
    compiles: int  # CompileWatch.count before the dispatch


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """A collected decode step: tokens int[max_seats, r] by seat (r = 1 + speculative
    tokens; the first counts[seat] are the step's output), hot hits / misses summed over
    rows and groups, attention [L, max_seats, r, h, kv_lora] when collected; drafts
    int[max_seats, k] the next step's on-device drafts (k = 0: none); `compiled`: this process
    compiled something between the dispatch and the collection."""

    tokens: np.ndarray
    counts: np.ndarray
    hits: int
    misses: int
    attention: np.ndarray | None
    seconds: float
    compiled: bool = False
    drafts: np.ndarray | None = None


class Runner:
    """Device arrays and jitted steps of one engine (module docstring).

    Args:
      model: the model; its parameters are split off and committed to `device`.
      ec: serving knobs (backends, top-k source, synthetic prefill, buckets, max_traces).
      cfg: sizes (the engine's one `HiSparseConfig`).
      residency: the mode's residency type (the cache keeps it between steps).
      tables: `host_tier.DeviceBlockTables` (src / res / hot per state row).
      transfers: the transfer worker (`before_forward` / `after_forward`).
      host_pool: the pinned `host_tier.HostPool` (None when the mode reads no host rows).
      device: where everything is committed (a device, or a sharding: e.g. one data shard's
        devices of a mesh, `hisparse_jax/engine/mesh.py`).
      params: the parameter leaves (in `jax.tree.flatten` order of the model's `nnx.State`)
        already placed (e.g. tensor-parallel views); None: the model's, committed to `device`.
    """

    # The rows the last `prefill_chunk` staged (from host, from device; summed over index
    # groups): (0, 0) unless it ran the staged variant.
    staged_rows: tuple[int, int] = (0, 0)

    def __init__(self, model: ServedModel, ec: EngineConfig, cfg: HiSparseConfig,
                 residency: Residency, *, tables: Any, transfers: Any, host_pool: Any,
                 device: jax.Device | jax.sharding.Sharding, params: Any = None) -> None:
        self.config, self.cfg, self.residency = ec, cfg, residency
        self.spec = mc = model.spec
        self.tables, self.transfers, self.host_pool = tables, transfers, host_pool
        self.device = device
        params_given = params
        self.graphdef, params = nnx.split(model)
        # Plain leaves at the jit boundary: flattening an nnx.State on every call costs more
        # host time than the rest of the call's dispatch.
        leaves, self._params_treedef = jax.tree.flatten(params)
        self.params = self._put(leaves) if params_given is None else params_given
        self.topk_source = None
        if ec.topk_source is not None:
            self.topk_source = ec.topk_source.bind(num_groups=mc.num_groups, top_k=mc.top_k)
        self.num_speculative_tokens = ec.num_speculative_tokens
        # Async scheduling: the decode step takes the previous step's device tokens.
        self.feeds_back = ec.async_scheduling
        self.draft = None if ec.draft is None else ec.draft.bind(vocab_size=mc.vocab_size)
        # The model's per-seat arrays: their shapes and dtypes (started as zeros, and again
        # after a device loss).
        self._index_key_specs = jax.eval_shape(functools.partial(
            model.init_index_keys, cfg.max_num_reqs, cfg.max_model_len,
            external_topk=ec.topk_source is not None))
        self._init_device_state()
        self.sample_key = self._put(base_key(ec.seed))
        self._no_prev_tokens = self._put(np.zeros(cfg.max_num_reqs, np.int32))
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self.warmed: dict[str, list[Any]] = {}  # the buckets `warmup` compiled, by kind
        # The jitted steps, built once per variant: {"decode_fast", "decode_hot", "prefill" or
        # "prefill_chunk"}.
        self.jitted: dict[str, Callable[..., Any]] = {}
        for variant in dict.fromkeys([AllResident(), residency]):
            self.jitted[variant_name(variant)] = self._jit_decode(variant_name(variant))
        if ec.prefill_chunk_size is not None or ec.enable_prefix_caching:
            # With prefix caching a one-shot engine prefills the rest of a hit prompt as one
            # chunk from its first uncached position.
            self.jitted["prefill_chunk"] = self._jit_prefill_chunk()
        if ec.stages_prefix_hits:
            # A chunk of a request with host-only earlier pages stages the rows it selects.
            self.jitted["prefill_chunk_staged"] = self._jit_prefill_chunk(staged=True)
        if ec.prefill_chunk_size is None:
            self.jitted["prefill"] = (self._jit_synthetic_prefill() if ec.synthetic_prefill
                                      else self._jit_prefill())
        self._read_page_keys = self._write_page_keys = None
        if ec.enable_prefix_caching:
            self._key_pages = min(256, -(-self.cfg.max_model_len // self.cfg.block_size))
            self._read_page_keys, self._write_page_keys = self._jit_page_keys()

    @property
    def cache(self) -> DecodeCache:
        """The device cache; a hot-state update still deferred for the next decode step
        (`apply_plan_state`) is applied first, so every reader sees the plan's state."""
        if self._hot_deferred is not None:
            packed, self._hot_deferred = self._hot_deferred, None
            kv = self._cache.kv
            hot = apply_packed_hot_updates(kv.hot, self._put(packed),
                                           block_size=self.cfg.block_size,
                                           num_rows=HOT_FOLD_ROWS)
            self._cache = dataclasses.replace(self._cache, kv=dataclasses.replace(kv, hot=hot))
        return self._cache

    @cache.setter
    def cache(self, cache: DecodeCache) -> None:
        self._cache = cache

    def _put(self, tree: Any) -> Any:
        """Commits a pytree of arrays to the runner's device."""
        return jax.device_put(tree, self.device)

    def _init_device_state(self) -> None:
        """Fresh device state: zero KV and index-key caches, empty hot states, the top-k
        source's initial state (the block tables are the caller's)."""
        ec, cfg, mc = self.config, self.cfg, self.spec
        self._hot_deferred: np.ndarray | None = None  # `apply_plan_state`, fresh state: none
        kv = HiSparseKVCache.create(cfg, num_layers=mc.num_layers, residency=self.residency,
                                    index_group_size=mc.index_group_size,
                                    ops_backend=ec.ops_backend, copy_stream=ec.copy_stream,
                                    copy_programs=ec.copy_programs,
                                    copy_with_attention=ec.copy_with_attention)
        self.cache = self._put(DecodeCache(
            kv=kv, index_keys=tuple(jnp.zeros(k.shape, k.dtype) for k in self._index_key_specs)))
        self.topk_state = None
        if self.topk_source is not None:
            self.topk_state = self._put(self.topk_source.init_state(
                max_seats=cfg.max_num_reqs, max_model_len=cfg.max_model_len,
                num_groups=mc.num_groups, top_k=mc.top_k))

    def _device_arrays(self) -> list[jax.Array]:
        return (jax.tree.leaves(self._cache) + jax.tree.leaves(self.topk_state)
                + list(self.tables.arrays))

    def _lost_pool_arrays(self) -> list[int]:
        if self.host_pool is None:
            return []
        return [i for i, a in enumerate(self.host_pool.arrays) if _lost(a)]

    def device_state_lost(self) -> bool:
        """Whether an array the steps carry over (caches, hot states, block tables, top-k
        state, host pool layers) was lost: deleted (donated to a call that failed) or
        poisoned (a failed computation produced it). Waits for the arrays."""
        return any(_lost(a) for a in self._device_arrays()) or bool(self._lost_pool_arrays())

    def reset_device_state(self, tables: TableUpdate) -> None:
        """Rebuilds the device state from scratch (`_init_device_state`; zero block tables
        that then get `tables`, e.g. the manager's `tables.full_update()`) and replaces lost
        host pool arrays with zeros. The caller has released every request whose rows lived
        there (they are recomputed; the engine publishes no host page)."""
        lost_arrays = self._lost_pool_arrays()
        self._init_device_state()
        self.tables = type(self.tables).from_config(self.cfg, device=self.device)
        self.tables.apply(tables)
        pool = self.host_pool
        for i in lost_arrays:
            pool.replace_array(i, jax.device_put(np.zeros(pool.shape, pool.dtype), pool.sharding))

    def _set_cache(self, cache: DecodeCache) -> None:
        """Keeps a step's new cache under the residency it ran with: a run of fast decode
        steps rebuilds no pytree between them (the prefills put the mode's residency back,
        `_mode_cache`: one prefill variant)."""
        self.cache = cache

    def _mode_cache(self) -> DecodeCache:
        """The cache under the mode's residency (what every prefill variant is traced with)."""
        return _with_residency(self.cache, self.residency)

    # ------------------------------------------------------------------ plan execution

    def apply_plan_state(self, plan: StepPlan) -> None:
        """A plan's table rows, then its hot resets / invalidations. Idempotent: applying a
        plan's state again changes nothing more.

        The table rows and hot updates of a typical decode step (`TABLE_FOLD_ROWS`,
        `HOT_FOLD_ROWS`) are deferred: the next decode step applies them inside its own
        executable (`_decode`); anything else that reads the tables or the cache first
        applies them then (`DeviceBlockTables.defer`, the `cache` property)."""
        self.tables.defer(plan.tables, max_rows=TABLE_FOLD_ROWS)
        if not (plan.hot_resets or plan.hot_invalidations):
            return  # nothing else to apply
        cache = self.cache  # an update deferred earlier goes first
        if cache.kv.hot:
            packed = pack_hot_updates(plan, HOT_FOLD_ROWS, HOT_FOLD_WIDTH)
            if packed is not None:
                self._hot_deferred = packed
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
        self._set_caches(self.transfers.before_forward(plan, self.cache.kv.caches), placed)

    def _set_caches(self, caches: Any, placed: list[Any]) -> None:
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

    # ------------------------------------------------------------------ decode

    def _idle_inputs(self) -> tuple[np.ndarray, ...]:
        """Decode inputs with every batch row padding (tokens, positions, state_rows,
        temperature, seeds, steps); tokens and positions int32[S, 1 + k] when speculating."""
        S, k = self.cfg.max_num_reqs, self.num_speculative_tokens
        shape = (S, 1 + k) if k else (S,)
        return (np.zeros(shape, np.int32), np.full(shape, -1, np.int32),
                np.full(S, -1, np.int32), np.zeros(S, np.float32), np.zeros(S, np.int32),
                np.zeros(S, np.int32))

    def dispatch_decode(self, reqs: list[Request], residency: Residency, *,
                        prev: PendingDecode | None = None,
                        ahead: frozenset[Hashable] = frozenset()) -> PendingDecode:
        """Launches the decode step variant of `residency` for `reqs` (asynchronously). With
        speculation each request's row holds its last token and its `step_drafts`, at
        consecutive positions (-1 past its drafts: no row).

        Async scheduling (`feeds_back`): `prev` is the decode step still in flight and
        `ahead` the requests of it scheduled again (`fill_decode_inputs`): their token is
        taken from `prev.tokens` on the device where the host does not know it."""
        if ahead and (prev is None or not self.feeds_back):
            raise ValueError("dispatch_decode: ahead needs prev (the step in flight) and "
                             "EngineConfig.async_scheduling")
        inputs = self._idle_inputs()
        prev_index = np.full(self.cfg.max_num_reqs, -1, np.int32) if self.feeds_back else None
        fill_decode_inputs(reqs, inputs, ahead=ahead, prev_index=prev_index)
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        next_tokens, aux = self._decode(residency, *inputs, prev_index=prev_index,
                                        prev_tokens=None if prev is None else prev.tokens)
        return PendingDecode(reqs, residency, t0, next_tokens, aux, compiles)

    def _decode(self, residency: Residency, *host_arrays: np.ndarray,
                prev_index: np.ndarray | None = None, prev_tokens: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Dispatches the decode variant of `residency` on host-built arrays (tokens,
        positions, state_rows, temperature, seeds, steps: `_idle_inputs`' shapes and dtypes),
        sent as one packed int32 array (`_jit_decode`). With `feeds_back` the packed array
        also carries `prev_index` (int32[S], default every row -1: the host token) and the
        step takes `prev_tokens` (a previous step's device tokens; default zeros)."""
        extra: tuple[jax.Array, ...] = ()
        if self.feeds_back:
            if prev_index is None:
                prev_index = np.full(self.cfg.max_num_reqs, -1, np.int32)
            host_arrays = (*host_arrays, prev_index)
            extra = (self._no_prev_tokens if prev_tokens is None else prev_tokens,)
        tables, table_rows = self.tables.take_deferred(TABLE_FOLD_ROWS)
        hot_rows = self._hot_deferred
        if hot_rows is None:
            hot_rows = pack_hot_updates(None, HOT_FOLD_ROWS, HOT_FOLD_WIDTH)
        inputs = self._put(np.concatenate([a.reshape(-1).view(np.int32) for a in host_arrays]
                                          + [table_rows, hot_rows]))
        host_pools = self.host_pool.arrays if residency.reads_host else ()
        cache = _with_residency(self._cache, residency)
        next_tokens, cache, aux, tables = self.jitted[variant_name(residency)](
            self.params, cache, inputs, tables, host_pools, self.sample_key, self.topk_state,
            *extra)
        self._hot_deferred = None  # in the new cache now
        self.tables.adopt(tables)
        self._set_cache(cache)
        return next_tokens, aux

    def collect_decode(self, pending: PendingDecode, *, since: float | None = None
                       ) -> DecodeResult:
        """Waits for a dispatched decode step's tokens and counters. Its `seconds` run from
        the dispatch, or from `since` when later (async scheduling: the previous step's
        collection, so that overlapping steps do not count the same time twice)."""
        # One device-to-host copy: the step packed its tokens and counter sums (`_jit_decode`).
        flat = np.asarray(pending.aux["to_host"])
        parts, at = [], 0
        for leaf in jax.tree.leaves(pending.tokens):
            parts.append(flat[at:at + leaf.size].reshape(leaf.shape))
            at += leaf.size
        out = jax.tree.unflatten(jax.tree.structure(pending.tokens), parts)
        hits, misses = flat[at:at + 2]
        started = pending.started if since is None else max(pending.started, since)
        seconds = time.perf_counter() - started
        S = self.cfg.max_num_reqs
        attention = np.asarray(pending.aux["attention"]) if "attention" in pending.aux else None
        if self.num_speculative_tokens:
            tokens, counts, drafts = out
            if attention is not None:
                attention = attention.reshape(attention.shape[0], S, -1, *attention.shape[2:])
        else:
            tokens, counts, drafts = out[:, None], np.ones(S, np.int32), None
            if attention is not None:
                attention = attention[:, :, None]
        return DecodeResult(tokens, counts, int(hits), int(misses), attention,
                            seconds, compiled=CompileWatch.count != pending.compiles,
                            drafts=drafts)

    # ------------------------------------------------------------------ prefill

    def prefill_length(self, num_tokens: int) -> int:
        """The padded length T of a prompt of `num_tokens` tokens: a multiple of
        `prefill_bucket`, at most max_model_len (one compiled prefill per T)."""
        return min(round_up(num_tokens, self.config.prefill_bucket), self.cfg.max_model_len)

    def prefill(self, req: Request, res_blocks: np.ndarray
                ) -> tuple[int, np.ndarray | None, float, Hashable, bool]:
        """Prefills an admitted request's prompt into its resident blocks `res_blocks`
        (int64[pages]); returns (sampled token, attention [L, h, kv_lora] or None, seconds,
        variant, whether something compiled meanwhile)."""
        B = self.cfg.block_size
        tokens = req.prompt
        n = len(tokens)
        T = self.prefill_length(n)
        padded = np.zeros(T, np.int32)
        padded[:n] = tokens
        pos = np.arange(n)
        write_rows = np.full(T, -1, np.int32)
        write_rows[:n] = res_blocks[pos // B] * B + pos % B
        compiles = CompileWatch.count
        if self.topk_source is not None:
            self.topk_state = self.topk_source.admit(self.topk_state, req.seat, req.index, n)
        t0 = time.perf_counter()
        token, aux = self._prefill(padded, n, req.seat, write_rows, req.temperature,
                                   req.sampling_seed, req.live, req.index)
        token = int(token)
        attention = np.asarray(aux["attention"]) if "attention" in aux else None
        return (token, attention, time.perf_counter() - t0, ("prefill", T),
                CompileWatch.count != compiles)

    def prefill_chunk(self, req: Request, res_blocks: np.ndarray, start: int, num_tokens: int,
                      host_blocks: np.ndarray | None = None
                      ) -> tuple[int, np.ndarray | None, float, Hashable, bool]:
        """Prefills prompt tokens [start, start + num_tokens) of an admitted request whose
        resident blocks `res_blocks` (int64[pages]) hold every page from the chunk's first
        page to its last position (`Transformer.prefill_chunk`); returns what `prefill`
        returns, the sampled token meaningful after the prompt's last chunk only. A page
        before the chunk's first page may be host-only (null in `res_blocks`) when
        `host_blocks` (int64[>= pages], the request's host blocks) is given: the chunk then
        runs as "prefill_chunk_staged" (its selected host-only rows staged from the host
        pool; `staged_rows` counts them) whenever such a page exists."""
        T = self.prefill_length(num_tokens)
        padded = np.zeros(T, np.int32)
        padded[:num_tokens] = req.prompt[start:start + num_tokens]
        pages = np.zeros(self.cfg.max_pages, np.int32)
        pages[:len(res_blocks)] = res_blocks
        host, self.staged_rows = None, (0, 0)
        if host_blocks is not None and np.any(pages[:start // self.cfg.block_size] <= 0):
            host = np.zeros(self.cfg.max_pages, np.int32)
            host[:len(host_blocks)] = host_blocks
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        token, aux = self._prefill_chunk(padded, start, num_tokens, req.seat, pages,
                                         req.temperature, req.sampling_seed, req.live,
                                         host_pages=host)
        token = int(token)
        attention = np.asarray(aux["attention"]) if "attention" in aux else None
        kind = "prefill_chunk"
        if host is not None:
            kind = "prefill_chunk_staged"
            self.staged_rows = (int(aux["staged_rows_host"]), int(aux["staged_rows_device"]))
        return (token, attention, time.perf_counter() - t0, (kind, T),
                CompileWatch.count != compiles)

    def _prefill_chunk(self, padded: np.ndarray, start: int, length: int, seat: int,
                       pages: np.ndarray, temperature: float, seed: int, token_index: int, *,
                       host_pages: np.ndarray | None = None
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Dispatches the chunk prefill of padded tokens int32[T] (the first `length` real)
        at positions from `start`, of state row `seat` (out of range: no index-key row) with
        block-table row `pages` int32[max_pages] (0: none, nothing written); samples token
        `token_index` of sampling seed `seed`. With `host_pages` int32[max_pages] (the host
        block-table row) the staged variant, which also takes the host pools."""
        args = [self.params, self._mode_cache(),
                *self._put((padded, np.int32(start), np.int32(length), np.int32(seat), pages,
                            np.float32(temperature))),
                self.sample_key, *self._put((np.int32(_int32_bits(seed)),
                                             np.int32(token_index)))]
        name = "prefill_chunk"
        if host_pages is not None:
            name = "prefill_chunk_staged"
            args += [self._put(host_pages), self.host_pool.arrays]
        token, cache, aux = self.jitted[name](*args)
        self._set_cache(cache)
        return token, aux

    def _prefill(self, padded: np.ndarray, length: int, seat: int, write_rows: np.ndarray,
                 temperature: float, seed: int, token_index: int, request_index: int
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Dispatches the prefill of padded tokens int32[T] (the first `length` real) written
        to flat rows write_rows int32[T] (-1: none) and index-key row `seat` (out of range:
        none); samples token `token_index` of sampling seed `seed`."""
        args = [self.params, self._mode_cache(),
                *self._put((padded, np.int32(length), np.int32(seat), write_rows,
                            np.float32(temperature))),
                self.sample_key, *self._put((np.int32(_int32_bits(seed)),
                                             np.int32(token_index)))]
        if self.config.synthetic_prefill:
            args.append(np.int32(request_index))
        token, cache, aux = self.jitted["prefill"](*args)
        self._set_cache(cache)
        return token, aux

    # ------------------------------------------------------------------ index keys of pages

    def _jit_page_keys(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Jitted reads and writes of the index keys of up to `_key_pages` pages at once (B
        rows each of every group's key cache at a state row; page -1: none): one compile
        each, whatever the pages (a 64K-token prefix is ~16 calls, not ~1,000)."""
        B = self.cfg.block_size

        def rows_of(pages, length):
            rows = pages[:, None] * B + jnp.arange(B, dtype=jnp.int32)[None, :]
            return jnp.where(pages[:, None] >= 0, rows, length)  # padding: out of range

        def read(index_keys, seat, pages):
            return tuple(k[seat, jnp.minimum(rows_of(pages, 0), k.shape[1] - 1)]
                         for k in index_keys)

        def write(index_keys, seat, pages, keys):
            return tuple(k.at[seat, rows_of(pages, k.shape[1])].set(new.astype(k.dtype),
                                                                   mode="drop")
                         for k, new in zip(index_keys, keys, strict=True))

        # The written caches keep the placement the steps were compiled for (a jit's default
        # output sharding may differ from a committed input's, and would compile them again).
        placed = (self.device if isinstance(self.device, jax.sharding.Sharding)
                  else jax.sharding.SingleDeviceSharding(self.device))
        return jax.jit(read), jax.jit(write, donate_argnums=0, out_shardings=placed)

    def _page_batches(self, pages: list[int]) -> list[tuple[list[int], np.ndarray]]:
        """`pages` in batches of `_key_pages`, each with its int32 page array padded with -1."""
        P = self._key_pages
        out = []
        for i in range(0, len(pages), P):
            part = pages[i:i + P]
            padded = np.full(P, -1, np.int32)
            padded[:len(part)] = part
            out.append((part, padded))
        return out

    def read_page_keys(self, seat: int, pages: list[int]) -> list[tuple[np.ndarray, ...]]:
        """The index keys of full pages `pages` of the request in state row `seat`: per page,
        one [B, index_dim] host array per index group (prefix caching only)."""
        batches = self._page_batches(pages)
        got = jax.device_get([self._read_page_keys(self.cache.index_keys,
                                                   *self._put((np.int32(seat), padded)))
                              for _, padded in batches])
        out = []
        for (part, _), groups in zip(batches, got, strict=True):
            groups = [np.asarray(g) for g in groups]
            out += [tuple(g[j] for g in groups) for j in range(len(part))]
        return out

    def write_page_keys(self, seat: int, pages: list[tuple[int, tuple[np.ndarray, ...]]]
                        ) -> None:
        """Writes index keys (page, per-group [B, index_dim]) into state row `seat`'s rows of
        those pages (prefix caching: a hit's reused pages, before its prefill)."""
        if not pages:
            return
        index_keys = self.cache.index_keys
        by_page = dict(pages)
        num_groups = len(index_keys)
        for part, padded in self._page_batches([p for p, _ in pages]):
            keys = []
            for g in range(num_groups):
                block = np.zeros((len(padded), *by_page[part[0]][g].shape),
                                 by_page[part[0]][g].dtype)
                block[:len(part)] = [by_page[p][g] for p in part]
                keys.append(block)
            index_keys = self._write_page_keys(index_keys, *self._put((np.int32(seat), padded,
                                                                       tuple(keys))))
        self.cache = dataclasses.replace(self.cache, index_keys=tuple(index_keys))

    # ------------------------------------------------------------------ warmup

    def warmup(self, *, max_spill_pages: int, decode: bool = True) -> list[Hashable]:
        """Compiles every shape bucket a run can reach, with inputs that change no state a
        request can see (call it while no request is admitted). Returns the step variants it
        compiled (for the step clock); `warmed` lists every bucket by kind ("decode",
        "prefill", "prefill_chunk", "prefill_chunk_staged", "table_rows",
        "invalidation_widths", "spill_rows").
        decode=False leaves out this runner's decode variants (the mesh engine runs its own:
        `hisparse_jax/engine/mesh.py`).

        Reached by a run, and compiled here:
          * each decode variant (`jitted`; "decode_fast" only when the mode can take the fast
            path): every batch row padding (state row -1 writes and selects nothing);
          * the prefill at every padded length `prefill_length(n)`, n = 1 .. max_model_len - 1
            (a prompt is shorter than max_model_len; a preempted request prefills its prompt
            again): writes to no row (-1) and index-key row S (dropped); with
            `prefill_chunk_size` C, the chunk prefill at every `prefill_length(n)`, n = 1 ..
            min(C, max_model_len - 1), with a block-table row of null blocks (writes nothing);
          * the top-k source's `admit` (seat 0, a free seat: the next admission rewrites it);
          * the block-table updates (`host_tier.DeviceBlockTables.apply`) of every row count
            bucket up to S rows per table: the current rows sent again;
          * the hot-state updates (`hisparse_jax.state.warm_hot_updates`) for invalidations of
            up to max_pages blocks;
          * the transfer worker's spill copies (`mirror_group_fn`, else `mirror_fn`) of every
            row-list bucket up to `max_spill_pages` pages per plan (the coordinator's spill
            budget), every row -1 (skipped), into every layer's pool. Restores are planned
            only with prefix caching (`EngineConfig.enable_prefix_caching`); with it, the
            restore copies (`restore_fn`) of every row-list bucket up to every device block's
            rows, every row -1, the chunk prefill at every length a hit's rest can take (up to
            max_model_len - 1 without prefill_chunk_size) and the page index-key copies (read
            and written back unchanged at seat 0) are compiled too; with prefix_hit_pages
            "stage", the staged chunk prefill ("prefill_chunk_staged") at the chunk prefill's
            lengths, with null host pages (it stages nothing).
        """
        cfg, S = self.cfg, self.cfg.max_num_reqs
        warmed: dict[str, list[Any]] = collections.defaultdict(list)
        for name, residency in self._reachable_variants() if decode else ():
            jax.block_until_ready(self._decode(residency, *self._idle_inputs()))
            warmed["decode"].append(name)
        chunk = self.config.prefill_chunk_size
        kinds = [kind for kind in ("prefill", "prefill_chunk", "prefill_chunk_staged")
                 if kind in self.jitted]
        for kind in kinds:
            longest = (cfg.max_model_len - 1 if kind == "prefill" or chunk is None
                       else min(chunk, cfg.max_model_len - 1))
            for T in sorted({self.prefill_length(n) for n in range(1, longest + 1)}):
                null_pages = np.zeros(cfg.max_pages, np.int32)
                if kind == "prefill":
                    token, _ = self._prefill(np.zeros(T, np.int32), 1, S,
                                             np.full(T, -1, np.int32), 0.0, 0, 0, 0)
                else:  # staged: null host pages too (stages nothing)
                    token, _ = self._prefill_chunk(
                        np.zeros(T, np.int32), 0, 1, S, null_pages, 0.0, 0, 0,
                        host_pages=null_pages if kind == "prefill_chunk_staged" else None)
                jax.block_until_ready(token)
                warmed[kind].append(T)
        if self._read_page_keys is not None:  # prefix caching: a page's keys, out and in
            keys = self.read_page_keys(0, [0])
            self.write_page_keys(0, [(0, keys[0])])  # seat 0 is free: its rows unchanged
        if self.topk_source is not None:
            self.topk_state = self.topk_source.admit(self.topk_state, 0, 0, 1)
        current = self.tables.as_numpy()
        for size in _pow2_sizes(_TABLE_BUCKET, pow2_bucket(S, _TABLE_BUCKET)):
            rows = np.arange(min(size, S), dtype=np.int32)
            self.tables.apply(TableUpdate(**{g: TableRows(rows, current[g][rows])
                                             for g in ("src", "res", "hot")}))
            warmed["table_rows"].append(size)
        if self.residency.reads_host:
            warm_hot_updates(self.cache.kv.hot, block_size=cfg.block_size,
                             max_blocks=cfg.max_pages)
            # A deferred hot update that a reader applies itself (the `cache` property).
            self._hot_deferred = pack_hot_updates(None, HOT_FOLD_ROWS, HOT_FOLD_WIDTH)
            jax.block_until_ready(self.cache.kv.hot)
            warmed["invalidation_widths"] = _pow2_sizes(invalidation_width(1),
                                                        invalidation_width(cfg.max_pages))
            warmed["spill_rows"] = self._warm_spills(max_spill_pages)
            if self.config.enable_prefix_caching:
                warmed["restore_rows"] = self._warm_restores()
        jax.block_until_ready(self._device_arrays())
        self.warmed = dict(warmed)
        return warmed["decode"] + [(kind, T) for kind in kinds for T in warmed[kind]]

    def _reachable_variants(self) -> list[tuple[str, Residency]]:
        out = []
        if not self.residency.reads_host or self.residency.resident_fast_path:
            out.append(("decode_fast", AllResident()))
        if self.residency.reads_host:
            out.append(("decode_hot", self.residency))
        return out

    def _warm_spills(self, max_spill_pages: int) -> list[int]:
        """The spill copies of every row-list bucket (`host_tier/worker/transfer.py`: row
        lists padded with -1 to a power of two >= its MIN_ROWS_BUCKET); returns the sizes."""
        pool, mirror = self.host_pool, self.transfers.mirror_fn
        group = getattr(self.transfers, "mirror_group_fn", None)
        sharding = self.transfers.index_sharding
        top = pow2_bucket(max_spill_pages * self.cfg.block_size, _SPILL_BUCKET)
        for size in _pow2_sizes(_SPILL_BUCKET, top):
            rows = jax.device_put(np.full(size, -1, np.int32), sharding)
            if group is not None:
                for i, new in enumerate(group(self.cache.kv.caches, pool.arrays, rows, rows)):
                    pool.replace_array(i, new)
                continue
            for i, kv in enumerate(self.cache.kv.caches):
                pool.replace_layer(i, mirror(kv, pool.layer(i), rows, rows))
        jax.block_until_ready(pool.arrays)
        return _pow2_sizes(_SPILL_BUCKET, top)

    def _warm_restores(self) -> list[int]:
        """The restore copies (`restore_fn`) of every row-list bucket a plan can carry (prefix
        hits: at most every device block's rows), every row -1 (skipped), into every layer's
        cache; returns the sizes."""
        pool, restore = self.host_pool, self.transfers.restore_fn
        sharding = self.transfers.index_sharding
        cfg = self.cfg
        most = min(cfg.max_num_reqs * cfg.max_pages, cfg.num_gpu_blocks) * cfg.block_size
        sizes = _pow2_sizes(_SPILL_BUCKET, pow2_bucket(most, _SPILL_BUCKET))
        for size in sizes:
            rows = jax.device_put(np.full(size, -1, np.int32), sharding)
            placed = [c.sharding for c in self.cache.kv.caches]
            self._set_caches([restore(pool.layer(i), c, rows, rows)
                              for i, c in enumerate(self.cache.kv.caches)], placed)
        jax.block_until_ready(self.cache.kv.caches)
        return sizes

    # ------------------------------------------------------------------ jitted steps

    def _wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        counts = self.trace_counts

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            counts[name] += 1  # runs once per trace
            return fn(*args, **kwargs)

        traced.__name__ = traced.__qualname__ = name  # chex tells the variants apart by name

        if self.config.max_traces is not None:
            import chex

            traced = chex.assert_max_traces(traced, n=self.config.max_traces)
        return traced

    def _placed_outputs(self) -> dict[str, Any]:
        """jit keywords that keep the outputs on `device` when it is a sharding (a mesh shard:
        the partitioner would otherwise shard a cache like the tensor-parallel parameters)."""
        if isinstance(self.device, jax.sharding.Sharding):
            return {"out_shardings": self.device}
        return {}

    def _jit_decode(self, name: str) -> Callable[..., Any]:
        """`decode_fn` jitted with its six per-row inputs (`_idle_inputs`) packed into one
        int32 array: one host-to-device copy per step instead of six (each a fixed cost of
        tens of microseconds on a GPU host). With `feeds_back` (async scheduling) a seventh,
        prev_index int32[S], picks rows whose token is the previous step's device token
        (`prev_tokens`, an extra argument: the step reads it without a host round trip).
        Last in the packed array, the block tables' deferred rows (`TABLE_FOLD_ROWS` per
        table, `DeviceBlockTables.take_deferred`) and the deferred hot updates
        (`HOT_FOLD_ROWS`, `pack_hot_updates`), applied to the tables (donated) and the hot
        states before the step reads them: the step returns (tokens, cache, aux, tables),
        aux["to_host"] the tokens and the hit / miss sums in one int32 array."""
        step = self._wrap(self.decode_fn(), name)
        block_size = self.cfg.block_size
        specs = [(a.shape, a.dtype) for a in self._idle_inputs()]
        feeds_back = self.feeds_back
        if feeds_back:  # prev_index int32[S] (`_decode`)
            specs.append(((self.cfg.max_num_reqs,), np.dtype(np.int32)))

        def packed_step(params, cache, inputs, tables, host_pools, key, topk_state,
                        prev_tokens=None):
            parts, at = [], 0
            for shape, dtype in specs:
                size = math.prod(shape)
                part = inputs[at:at + size].reshape(shape)
                parts.append(part if dtype == np.int32
                             else jax.lax.bitcast_convert_type(part, dtype))
                at += size
            if feeds_back:  # a row's token from the previous step's device tokens
                prev_index = parts.pop()
                taken = prev_tokens[jnp.maximum(prev_index, 0)]
                parts[0] = jnp.where(prev_index >= 0, taken, parts[0])
            table_size = table_update_size(tables, TABLE_FOLD_ROWS)
            tables = set_rows(tuple(tables), inputs[at:at + table_size], size=TABLE_FOLD_ROWS)
            kv = cache.kv
            if kv.hot:  # the deferred hot resets / invalidations (`HOT_FOLD_ROWS`)
                hot = hot_updates(kv.hot, inputs[at + table_size:], block_size=block_size,
                                  num_rows=HOT_FOLD_ROWS)
                cache = dataclasses.replace(cache, kv=dataclasses.replace(kv, hot=hot))
            tokens, positions, state_rows, temperature, seeds, steps = parts
            out, cache, aux = step(params, cache, tokens, positions, state_rows, tables,
                                   host_pools, temperature, key, seeds, topk_state, steps)
            # What the host reads of the step, as one array (one copy: `collect_decode`).
            aux["to_host"] = jnp.concatenate(
                [x.reshape(-1).astype(jnp.int32) for x in jax.tree.leaves(out)]
                + [jnp.stack([aux["hits"].sum(), aux["misses"].sum()]).astype(jnp.int32)])
            return out, cache, aux, tables

        return jax.jit(packed_step, donate_argnames=("cache", "tables"))

    def decode_fn(self) -> Callable[..., Any]:
        """The decode step before `jax.jit`: (params, cache, tokens, positions, state_rows,
        tables, host_pools, temperature, key, seeds, topk_state, steps) -> (tokens, cache,
        aux); the cache's residency picks the variant. With speculation: `verify_fn`."""
        if self.num_speculative_tokens:
            return self.verify_fn()
        forward = self._model_decode()

        def step(params, cache, tokens, positions, state_rows, tables, host_pools, temperature,
                 key, seeds, topk_state, steps):
            keys = token_keys(key, seeds, steps + 1)  # token i = len(generated) is sampled
            _, logits, cache, aux = forward(params, cache, tokens, positions, state_rows, tables,
                                            host_pools, topk_state, steps)
            aux.pop("hidden", None)
            return sample(logits, temperature, keys), cache, aux

        return step

    def _model_decode(self) -> Callable[..., Any]:
        """The model's decode over flat batch rows, shared by `decode_fn` and `verify_fn`:
        (params, cache, tokens, positions, state_rows, tables, host_pools, topk_state, steps,
        rows_per_request=1) -> (model, logits, cache, aux); `steps`: each row's decode steps
        since the prefill (the top-k source's clock)."""
        graphdef, treedef, ec = self.graphdef, self._params_treedef, self.config
        source = self.topk_source

        def forward(params, cache, tokens, positions, state_rows, tables, host_pools,
                    topk_state, steps, rows_per_request=1):
            src, res, hot = tables
            kv = CacheBatch.from_tables(state_rows, positions, src=src, res=res, hot=hot,
                                        host_pools=host_pools, rows_per_request=rows_per_request)
            topk = (None if source is None
                    else source.select(topk_state, state_rows, positions, steps))
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            logits, cache, aux = model.decode(
                cache, DecodeBatch(tokens, kv, topk), attention_backend=ec.attention_backend,
                collect_attention=ec.collect_attention)
            return model, logits, cache, aux

        return forward

    def verify_fn(self) -> Callable[..., Any]:
        """The speculative decode step before `jax.jit`: the arguments of `decode_fn` with
        tokens and positions int32[S, r] (r = 1 + k: a request's last token and its drafts,
        position -1 past them) -> ((tokens int32[S, r], counts int32[S], drafts int32[S, k]),
        cache, aux).

        All S * r rows run as one decode batch (`CacheBatch.rows_per_request` = r). Row i of a
        request samples its token i (the key decoding without speculation uses for it);
        draft i + 1 is accepted when row i sampled it (or, with a source's acceptance_rate,
        with that probability), and the run of accepted drafts ends at the first rejection.
        A request emits its a accepted drafts and the token of row a: counts = a + 1. Rows
        past a wrote rows of rejected positions: the next step writes those positions again
        before any row reads them (its first row is position a + 1 of this step's). Then the
        draft source drafts the next step's tokens from row a (`DraftSource.device_drafts`;
        zeros for a host-side source)."""
        forward, draft = self._model_decode(), self.draft
        k = self.num_speculative_tokens
        r = 1 + k
        rate = draft.acceptance_rate

        def step(params, cache, tokens, positions, state_rows, tables, host_pools, temperature,
                 key, seeds, topk_state, steps):
            S = state_rows.shape[0]
            col = jnp.arange(r, dtype=jnp.int32)
            row_steps = (steps[:, None] + col).reshape(-1)  # decode steps since the prefill
            keys = token_keys(key, jnp.repeat(seeds, r), row_steps + 1)
            model, logits, cache, aux = forward(
                params, cache, tokens.reshape(-1), positions.reshape(-1),
                jnp.repeat(state_rows, r), tables, host_pools, topk_state, row_steps,
                rows_per_request=r)
            hidden = aux.pop("hidden", None)
            sampled = sample(logits, jnp.repeat(temperature, r), keys).reshape(S, r)
            drafts, present = tokens[:, 1:], positions[:, 1:] >= 0
            if rate is None:
                right = drafts == sampled[:, :-1]
            else:
                u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 0xACC)))(keys)
                right = u.reshape(S, r)[:, :-1] < rate
            accepted = jnp.sum(jnp.cumprod(right & present, axis=1), axis=1).astype(jnp.int32)
            padded = jnp.concatenate([drafts, jnp.zeros((S, 1), jnp.int32)], 1)
            out = jnp.where(col[None, :] < accepted[:, None], padded, sampled)
            last = jnp.take_along_axis(out, accepted[:, None], 1)[:, 0]
            if draft.on_device:
                hidden = hidden.reshape(S, r, -1)
                h = jnp.take_along_axis(hidden, accepted[:, None, None], 1)[:, 0]
                nxt = draft.device_drafts(model, h, last, k).astype(jnp.int32)
            else:
                nxt = jnp.zeros((S, k), jnp.int32)
            return (out, accepted + 1, nxt), cache, aux

        return step

    def _jit_prefill(self) -> Callable[..., Any]:
        graphdef, treedef, ec = self.graphdef, self._params_treedef, self.config

        def prefill(params, cache, tokens, length, state_row, write_rows, temperature, key,
                    seed, token_index):
            params = jax.tree.unflatten(treedef, params)
            keys = token_keys(key, seed[None], token_index[None])
            model = nnx.merge(graphdef, params)
            logits, cache, aux = model.prefill(
                cache, tokens, length, state_row, write_rows,
                attention_backend=ec.attention_backend, collect_attention=ec.collect_attention)
            return sample(logits[None], temperature[None], keys)[0], cache, aux

        return jax.jit(self._wrap(prefill, "prefill"), donate_argnames=("cache",),
                       **self._placed_outputs())

    def _jit_prefill_chunk(self, *, staged: bool = False) -> Callable[..., Any]:
        """The chunk prefill; `staged`: the variant that also takes the host block-table row
        and the host pools (`Transformer.prefill_chunk` staging)."""
        graphdef, treedef, ec = self.graphdef, self._params_treedef, self.config

        def prefill_chunk(params, cache, tokens, start, length, state_row, pages, temperature,
                          key, seed, token_index, host_pages=None, host_pools=()):
            keys = token_keys(key, seed[None], token_index[None])
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            logits, cache, aux = model.prefill_chunk(
                cache, tokens, start, length, state_row, pages, host_pages=host_pages,
                host_pools=tuple(host_pools), attention_backend=ec.attention_backend,
                collect_attention=ec.collect_attention)
            return sample(logits[None], temperature[None], keys)[0], cache, aux

        name = "prefill_chunk_staged" if staged else "prefill_chunk"
        return jax.jit(self._wrap(prefill_chunk, name), donate_argnames=("cache",),
                       **self._placed_outputs())

    def _jit_synthetic_prefill(self) -> Callable[..., Any]:
        mc = self.spec
        num_layers, width = mc.num_layers, mc.row_width
        base = jax.random.PRNGKey(self.config.seed)
        with_keys = self.topk_source is None  # the model's indexer selects: give it keys

        def random_rows(key: jax.Array, pos: jax.Array, shape: int | tuple[int, ...]
                        ) -> jax.Array:
            keys = jax.vmap(lambda p: jax.random.fold_in(key, p))(pos)
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            return jax.vmap(lambda k: jax.random.normal(k, shape))(keys)

        def prefill(params, cache, tokens, length, state_row, rows_at, temperature, key,
                    seed, token_index, request_index):
            del params, temperature, key, seed, token_index
            T = tokens.shape[0]
            req_key = jax.random.fold_in(base, request_index)
            pos = jnp.arange(T, dtype=jnp.int32)
            kv = cache.kv
            for layer in range(num_layers):
                kv = kv.write_rows(layer, rows_at,
                                   random_rows(jax.random.fold_in(req_key, layer), pos, width))
            index_keys = list(cache.index_keys)
            if with_keys:  # unit-normal per-seat values (an indexer's keys are layer-normed)
                for g, keys in enumerate(index_keys):
                    cols = jnp.where(pos < length, pos, keys.shape[1])  # padding: dropped
                    rows = random_rows(jax.random.fold_in(req_key, num_layers + g), pos,
                                       keys.shape[2:])
                    index_keys[g] = keys.at[state_row, cols].set(rows.astype(keys.dtype),
                                                                 mode="drop")
            return tokens[length - 1], DecodeCache(kv, tuple(index_keys)), {}

        return jax.jit(self._wrap(prefill, "prefill"), donate_argnames=("cache",),
                       **self._placed_outputs())

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, index-key caches and hot state on the device."""
        leaves = jax.tree.leaves(self.params) + jax.tree.leaves(self.cache)
        return int(sum(x.nbytes for x in leaves))
