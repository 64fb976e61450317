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
    prompt's last token).
  * A plan is executed in order: block-table rows -> hot resets / invalidations (every index
    group's hot state) -> restores (`before_forward`) -> the forward (decode, prefills) ->
    spills (`after_forward`, enqueued without waiting).

Seat = state row: batch row n of the decode step serves the request whose state row is n, so
the per-state-row tables and hot state are read without any renumbering.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
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
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.sampler import KeyStream, sample
from hisparse_jax.nn import DecodeBatch, DecodeCache, Transformer
from hisparse_jax.state import apply_hot_updates
from host_tier.plan import StepPlan
from host_tier.sizes import round_up

# Donation is a no-op on some CPU builds; the warning says nothing actionable here.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


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
    tokens: jax.Array  # int32[max_seats]
    aux: dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """A collected decode step: tokens int[max_seats] by seat, hot hits / misses summed over
    rows and groups, attention [L, max_seats, h, kv_lora] when collected."""

    tokens: np.ndarray
    hits: int
    misses: int
    attention: np.ndarray | None
    seconds: float


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
      device: where everything is committed.
    """

    def __init__(self, model: Transformer, ec: EngineConfig, cfg: HiSparseConfig,
                 residency: Residency, *, tables: Any, transfers: Any, host_pool: Any,
                 device: jax.Device) -> None:
        self.config, self.cfg, self.residency = ec, cfg, residency
        self.model_config = mc = model.cfg
        self.tables, self.transfers, self.host_pool = tables, transfers, host_pool
        self.device = device
        self.graphdef, params = nnx.split(model)
        # Plain leaves at the jit boundary: flattening an nnx.State on every call costs more
        # host time than the rest of the call's dispatch.
        leaves, self._params_treedef = jax.tree.flatten(params)
        self.params = self._put(leaves)
        # With an external top-k source the indexer never runs: no key cache to speak of.
        key_shape = ((1, 1, mc.index_dim) if ec.topk_source is not None
                     else (cfg.max_num_reqs, cfg.max_model_len, mc.index_dim))
        kv = HiSparseKVCache.create(cfg, num_layers=mc.num_layers, residency=residency,
                                    index_group_size=mc.index_group_size,
                                    ops_backend=ec.ops_backend)
        self.cache = self._put(DecodeCache(
            kv=kv, index_keys=tuple(jnp.zeros(key_shape, cfg.kv_dtype)
                                    for _ in range(mc.num_groups))))
        self.topk_source = self.topk_state = None
        if ec.topk_source is not None:
            self.topk_source = ec.topk_source.bind(num_groups=mc.num_groups, top_k=mc.top_k)
            self.topk_state = self._put(self.topk_source.init_state(
                max_seats=cfg.max_num_reqs, max_model_len=cfg.max_model_len,
                num_groups=mc.num_groups, top_k=mc.top_k))
        self.keys = KeyStream(ec.seed, device)
        self.trace_counts: collections.Counter[str] = collections.Counter()
        # The jitted steps, built once per variant: {"decode_fast", "decode_hot", "prefill"}.
        self.jitted: dict[str, Callable[..., Any]] = {}
        for variant in dict.fromkeys([AllResident(), residency]):
            self.jitted[variant_name(variant)] = self._jit_decode(variant_name(variant))
        self.jitted["prefill"] = (self._jit_synthetic_prefill() if ec.synthetic_prefill
                                  else self._jit_prefill())

    def _put(self, tree: Any) -> Any:
        """Commits a pytree of arrays to the runner's device."""
        return jax.device_put(tree, self.device)

    def _set_cache(self, cache: DecodeCache) -> None:
        """Keeps the cache under the mode's residency between steps (one prefill variant)."""
        self.cache = _with_residency(cache, self.residency)

    # ------------------------------------------------------------------ plan execution

    def before_forward(self, plan: StepPlan) -> None:
        """Table rows, hot resets / invalidations, then restores of a plan."""
        self.tables.apply(plan.tables)
        if not (plan.hot_resets or plan.hot_invalidations or plan.restores):
            return  # the common decode step: nothing else to apply
        kv = self.cache.kv
        kv = dataclasses.replace(kv, hot=tuple(
            apply_hot_updates(plan, h, block_size=self.cfg.block_size) for h in kv.hot))
        kv = dataclasses.replace(kv, caches=tuple(self.transfers.before_forward(plan,
                                                                                kv.caches)))
        self.cache = dataclasses.replace(self.cache, kv=kv)

    def after_forward(self, plan: StepPlan) -> None:
        """The plan's spills from the post-forward caches (enqueued, not waited for)."""
        self.transfers.after_forward(plan, self.cache.kv.caches)

    # ------------------------------------------------------------------ decode

    def dispatch_decode(self, reqs: list[Request], residency: Residency) -> PendingDecode:
        """Launches the decode step variant of `residency` for `reqs` (asynchronously)."""
        S = self.cfg.max_num_reqs
        tokens = np.zeros(S, np.int32)
        positions = np.zeros(S, np.int32)
        state_rows = np.full(S, -1, np.int32)
        temperature = np.zeros(S, np.float32)
        steps = np.zeros(S, np.int32)
        for req in reqs:
            tokens[req.seat] = req.generated[-1]
            positions[req.seat] = req.num_tokens - 1
            state_rows[req.seat] = req.seat
            temperature[req.seat] = req.temperature
            steps[req.seat] = len(req.generated) - 1  # decode steps since the prefill
        host_pools = self.host_pool.arrays if residency.reads_host else ()
        t0 = time.perf_counter()
        tokens, positions, state_rows, temperature, steps = self._put(
            (tokens, positions, state_rows, temperature, steps))
        tables = (self.tables.src, self.tables.res, self.tables.hot)
        cache = _with_residency(self.cache, residency)
        next_tokens, cache, aux = self.jitted[variant_name(residency)](
            self.params, cache, tokens, positions, state_rows, tables, host_pools, temperature,
            *self.keys.next(), self.topk_state, steps)
        self._set_cache(cache)
        return PendingDecode(reqs, residency, t0, next_tokens, aux)

    def collect_decode(self, pending: PendingDecode) -> DecodeResult:
        """Waits for a dispatched decode step's tokens and counters."""
        tokens, hits, misses = jax.device_get((pending.tokens, pending.aux["hits"],
                                               pending.aux["misses"]))
        seconds = time.perf_counter() - pending.started
        attention = np.asarray(pending.aux["attention"]) if "attention" in pending.aux else None
        return DecodeResult(tokens, int(hits.sum()), int(misses.sum()), attention, seconds)

    # ------------------------------------------------------------------ prefill

    def prefill(self, req: Request, res_blocks: np.ndarray
                ) -> tuple[int, np.ndarray | None, float, Hashable]:
        """Prefills an admitted request into its resident blocks `res_blocks` (int64[pages]);
        returns (sampled token, attention [L, h, kv_lora] or None, seconds, variant)."""
        ec, B = self.config, self.cfg.block_size
        tokens = req.tokens
        n = len(tokens)
        T = min(round_up(n, ec.prefill_bucket), self.cfg.max_model_len)
        padded = np.zeros(T, np.int32)
        padded[:n] = tokens
        pos = np.arange(n)
        write_rows = np.full(T, -1, np.int32)
        write_rows[:n] = res_blocks[pos // B] * B + pos % B
        if self.topk_source is not None:
            self.topk_state = self.topk_source.admit(self.topk_state, req.seat, req.index, n)
        t0 = time.perf_counter()
        args = [self.params, self.cache,
                *self._put((padded, np.int32(n), np.int32(req.seat), write_rows,
                            np.float32(req.temperature))),
                *self.keys.next()]
        if ec.synthetic_prefill:
            args.append(np.int32(req.index))
        token, cache, aux = self.jitted["prefill"](*args)
        token = int(token)
        self._set_cache(cache)
        attention = np.asarray(aux["attention"]) if "attention" in aux else None
        return token, attention, time.perf_counter() - t0, ("prefill", T)

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

    def _jit_decode(self, name: str) -> Callable[..., Any]:
        graphdef, treedef, ec = self.graphdef, self._params_treedef, self.config
        source = self.topk_source

        def step(params, cache, tokens, positions, state_rows, tables, host_pools, temperature,
                 key, counter, topk_state, steps):
            params = jax.tree.unflatten(treedef, params)
            key = jax.random.fold_in(key, counter)
            src, res, hot = tables
            kv = CacheBatch.from_tables(state_rows, positions, src=src, res=res, hot=hot,
                                        host_pools=host_pools)
            topk = (None if source is None
                    else source.select(topk_state, state_rows, positions, steps))
            model = nnx.merge(graphdef, params)
            logits, cache, aux = model.decode(
                cache, DecodeBatch(tokens, kv, topk), attention_backend=ec.attention_backend,
                collect_attention=ec.collect_attention)
            return sample(logits, temperature, key), cache, aux

        return jax.jit(self._wrap(step, name), donate_argnames=("cache",))

    def _jit_prefill(self) -> Callable[..., Any]:
        graphdef, treedef, ec = self.graphdef, self._params_treedef, self.config

        def prefill(params, cache, tokens, length, state_row, write_rows, temperature, key,
                    counter):
            params = jax.tree.unflatten(treedef, params)
            key = jax.random.fold_in(key, counter)
            model = nnx.merge(graphdef, params)
            logits, cache, aux = model.prefill(
                cache, tokens, length, state_row, write_rows,
                attention_backend=ec.attention_backend, collect_attention=ec.collect_attention)
            return sample(logits[None], temperature[None], key)[0], cache, aux

        return jax.jit(self._wrap(prefill, "prefill"), donate_argnames=("cache",))

    def _jit_synthetic_prefill(self) -> Callable[..., Any]:
        num_layers, width = self.model_config.num_layers, self.model_config.row_width
        base = jax.random.PRNGKey(self.config.seed)

        def prefill(params, cache, tokens, length, state_row, rows_at, temperature, key,
                    counter, request_index):
            del params, state_row, temperature, key, counter
            T = tokens.shape[0]
            req_key = jax.random.fold_in(base, request_index)
            pos = jnp.arange(T, dtype=jnp.int32)
            kv = cache.kv
            for layer in range(num_layers):
                layer_key = jax.random.fold_in(req_key, layer)
                keys = jax.vmap(lambda p, k=layer_key: jax.random.fold_in(k, p))(pos)
                rows = jax.vmap(lambda k: jax.random.normal(k, (width,)))(keys)
                kv = kv.write_rows(layer, rows_at, rows)
            return tokens[length - 1], dataclasses.replace(cache, kv=kv), {}

        return jax.jit(self._wrap(prefill, "prefill"), donate_argnames=("cache",))

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, index-key caches and hot state on the device."""
        leaves = jax.tree.leaves(self.params) + jax.tree.leaves(self.cache)
        return int(sum(x.nbytes for x in leaves))
