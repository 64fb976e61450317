"""The engine's jitted steps, built from static facts only (`StepBuilder`: a model's graph
and spec, the sizes, the serving knobs in; jitted functions out). No device state lives
here: the runner (`runner.py`) holds the arrays and calls these functions.

  * The decode step is ONE `jax.jit` per residency variant over fixed shapes (N = max_seats
    batch rows; padding rows have state row -1), with the cache donated: "decode_fast"
    (`AllResident`: top-k positions through the resident table, no host pools passed) and,
    for modes with a host tier, "decode_hot" (the mode's residency: resolve, copy the misses,
    attend). Its per-row inputs, the block tables' deferred rows and the deferred hot
    updates travel as one packed int32 array (`jit_decode`).
  * The prefill ("prefill") is one jit per padded prompt length: the model's `prefill` over
    the prompt, or the synthetic prefill (deterministic random KV rows, a function of
    request, layer and position, written straight into the caches; the first generated
    token is the prompt's last token). With `EngineConfig.prefill.chunk_size` it is
    "prefill_chunk" instead, one jit per padded chunk length: the model's `prefill_chunk`
    over one chunk of a prompt, the earlier chunks' rows read through the request's resident
    pages. With `prefill.prefix_caching` there is "prefill_chunk" besides "prefill" (the rest
    of a prompt after its prefix hit), and jitted copies of a batch of pages' per-seat
    arrays out of and into a seat (`jit_page_keys`). With `prefill.prefix_hit_pages="stage"`
    there is "prefill_chunk_staged" too: the chunk prefill of a request with host-only
    earlier pages, which also takes the host block-table row and the host pools.
  * Sampling draws with per-request keys (`hisparse_jax.engine.sampler.token_keys`): the
    steps take the engine's base key, each row's sampling seed and the index of the token it
    samples.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.cache import AllResident, CacheBatch, Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.sampler import sample, token_keys
from hisparse_jax.index_groups import layer_rows
from hisparse_jax.models.protocol import DecodeBatch, DecodeCache, ModelSpec
from hisparse_jax.state import hot_updates
from host_tier.worker.device_tables import set_rows, table_update_size

TABLE_FOLD_ROWS = 16
"""Block-table rows per table that a decode step applies inside its own executable (a
plan's table update of at most this many rows per table is deferred to the next decode
step; a larger one is applied by its own call, `DeviceBlockTables.defer`)."""

HOT_FOLD_ROWS, HOT_FOLD_WIDTH = 16, 8
"""A plan's hot resets and invalidations that a decode step applies inside its own
executable: at most HOT_FOLD_ROWS resets and invalidated rows, each of at most
HOT_FOLD_WIDTH host blocks (the typical step under pressure: a few pages spilled, one block
each); a larger update is applied by its own call (`apply_hot_updates`)."""


def variant_name(residency: Residency) -> str:
    """The decode step variant of a residency: "decode_fast" (reads no host rows) or
    "decode_hot"."""
    return "decode_hot" if residency.reads_host else "decode_fast"


def idle_inputs(max_seats: int, num_speculative_tokens: int) -> tuple[np.ndarray, ...]:
    """Decode inputs with every batch row padding (tokens, positions, state_rows,
    temperature, seeds, steps); tokens and positions int32[S, 1 + k] when speculating."""
    S, k = max_seats, num_speculative_tokens
    shape = (S, 1 + k) if k else (S,)
    return (np.zeros(shape, np.int32), np.full(shape, -1, np.int32),
            np.full(S, -1, np.int32), np.zeros(S, np.float32), np.zeros(S, np.int32),
            np.zeros(S, np.int32))


def continue_speculation(tokens: jax.Array, positions: jax.Array, steps: jax.Array,
                         prev_index: jax.Array, draft_end: jax.Array, prev: Any
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A speculative decode step's inputs where the previous step of a request is still on
    the device (async scheduling; inside jit). Row n with prev_index[n] = p >= 0 continues
    the request of the previous step's seat p, whose accepted count a the host does not
    know yet: the host filled tokens int32[S, r], positions int32[S, r] and steps int32[S]
    as if a = 0 (row 0 at the position of the previous step's first emitted token, then up
    to r - 1 draft rows, -1 past them); here row 0 takes the previous step's last emitted
    token, rows 1.. its next drafts, and every present position and the step index move by
    a. A draft row whose position reaches draft_end[n] (the position of the request's last
    generated token: a row there would verify a token past it) is dropped (position -1),
    as the host drops it when it knows the count (`Scheduler._drafts`). Other rows are
    returned as they are. `prev`: the previous verify step's (tokens int32[S, r], counts
    int32[S], drafts int32[S, r - 1])."""
    out, counts, drafts = prev
    on = prev_index >= 0
    src = jnp.maximum(prev_index, 0)
    a = jnp.where(on, counts[src] - 1, 0)
    last = jnp.take_along_axis(out[src], a[:, None], 1)
    tokens = jnp.where(on[:, None], jnp.concatenate([last, drafts[src]], 1), tokens)
    moved = jnp.where(positions >= 0, positions + a[:, None], positions)
    draft_row = jnp.arange(positions.shape[1]) > 0
    past = on[:, None] & draft_row[None, :] & (moved >= draft_end[:, None])
    return tokens, jnp.where(past, -1, moved), steps + a


def feed_previous(tokens: jax.Array, positions: jax.Array, steps: jax.Array,
                  prev_index: jax.Array, draft_end: jax.Array | None, prev: Any
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An async decode step's (tokens, positions, steps) with the rows whose previous step is
    still on the device fed from its outputs (inside jit; shared by `StepBuilder.jit_decode`
    and the mesh engine's step, per data shard). prev_index int32[S]: a row's seat in the
    previous step, -1: the host's inputs stand. Without speculation (draft_end None) `prev`
    is that step's sampled tokens int32[S] and such a row takes its seat's token; with
    speculation `continue_speculation` (draft_end int32[S], `prev` the verify step's
    outputs)."""
    if draft_end is not None:
        return continue_speculation(tokens, positions, steps, prev_index, draft_end, prev)
    taken = prev[jnp.maximum(prev_index, 0)]
    return jnp.where(prev_index >= 0, taken, tokens), positions, steps


@dataclasses.dataclass(frozen=True, eq=False)
class StepBuilder:
    """Builds one engine's jitted steps (module docstring) from static facts.

    Attributes:
      graphdef / treedef: the model's `nnx.split` graph and the tree structure of its
        parameter leaves (the steps take the leaves, `jax.tree.flatten` order).
      spec: the model's `ModelSpec`.
      cfg: the engine's sizes (`HiSparseConfig`).
      config: the serving knobs (backends, buckets, speculation, async scheduling, ...).
      topk_source / draft: the bound external top-k source and draft source (or None).
      device: where the steps' outputs live (a device, or a sharding: a mesh data shard).
      trace_counts: traces per step name, counted while tracing.
    """

    graphdef: Any
    treedef: Any
    spec: ModelSpec
    cfg: HiSparseConfig
    config: EngineConfig
    topk_source: Any
    draft: Any
    device: Any
    trace_counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    @property
    def feeds_back(self) -> bool:
        """Async scheduling: the decode step takes the previous step's device tokens."""
        return self.config.async_scheduling

    def build(self, residency: Residency) -> dict[str, Callable[..., Any]]:
        """The jitted steps of an engine of `residency`'s mode, by name: "decode_fast" and
        the mode's decode variant, and the prefill variants the config reaches."""
        ec = self.config
        jitted = {variant_name(v): self.jit_decode(variant_name(v))
                  for v in dict.fromkeys([AllResident(), residency])}
        if ec.prefill.chunk_size is not None or ec.prefill.prefix_caching:
            # With prefix caching a one-shot engine prefills the rest of a hit prompt as one
            # chunk from its first uncached position.
            jitted["prefill_chunk"] = self.jit_prefill_chunk()
        if ec.stages_prefix_hits:
            # A chunk of a request with host-only earlier pages stages the rows it selects.
            jitted["prefill_chunk_staged"] = self.jit_prefill_chunk(staged=True)
        if ec.prefill.chunk_size is None:
            jitted["prefill"] = (self.jit_synthetic_prefill() if ec.prefill.synthetic
                                 else self.jit_prefill())
        return jitted

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """`fn` counting its traces in `trace_counts[name]` (and, with
        `EngineConfig.debug.max_traces`, failing past that many: chex)."""
        counts = self.trace_counts

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            counts[name] += 1  # runs once per trace
            return fn(*args, **kwargs)

        traced.__name__ = traced.__qualname__ = name  # chex tells the variants apart by name

        if self.config.debug.max_traces is not None:
            import chex

            traced = chex.assert_max_traces(traced, n=self.config.debug.max_traces)
        return traced

    def placed_outputs(self) -> dict[str, Any]:
        """jit keywords that keep the outputs on `device` when it is a sharding (a mesh shard:
        the partitioner would otherwise shard a cache like the tensor-parallel parameters)."""
        if isinstance(self.device, jax.sharding.Sharding):
            return {"out_shardings": self.device}
        return {}

    def jit_decode(self, name: str) -> Callable[..., Any]:
        """`decode_fn` jitted with its six per-row inputs (`idle_inputs`) packed into one
        int32 array: one host-to-device copy per step instead of six (each a fixed cost of
        tens of microseconds on a GPU host). With `feeds_back` (async scheduling) a seventh,
        prev_index int32[S], picks rows whose token is the previous step's device token
        (`prev_tokens`, an extra argument: the step reads it without a host round trip);
        with speculation an eighth, draft_end int32[S], and those rows continue the previous
        step's request on the device (`continue_speculation`).
        Last in the packed array, the block tables' deferred rows (`TABLE_FOLD_ROWS` per
        table, `DeviceBlockTables.take_deferred`) and the deferred hot updates
        (`HOT_FOLD_ROWS`, `pack_hot_updates`), applied to the tables (donated) and the hot
        states before the step reads them: the step returns (tokens, cache, aux, tables),
        aux["to_host"] the tokens, the hit / miss sums and the rows moved (each miss counted
        once per layer of its index group: `layer_rows`) in one int32 array."""
        step = self.wrap(self.decode_fn(), name)
        block_size = self.cfg.block_size
        specs = [(a.shape, a.dtype) for a in idle_inputs(self.cfg.max_num_reqs,
                                                         self.num_speculative_tokens)]
        feeds_back, group_layers = self.feeds_back, self.spec.group_layers
        speculative = bool(self.num_speculative_tokens)
        if feeds_back:  # prev_index int32[S], and draft_end int32[S] (`Runner.run_decode`)
            specs += [((self.cfg.max_num_reqs,), np.dtype(np.int32))] * (1 + speculative)

        def packed_step(params, cache, inputs, tables, host_pools, key, topk_state,
                        prev_tokens=None):
            parts, at = [], 0
            for shape, dtype in specs:
                size = math.prod(shape)
                part = inputs[at:at + size].reshape(shape)
                parts.append(part if dtype == np.int32
                             else jax.lax.bitcast_convert_type(part, dtype))
                at += size
            if feeds_back:  # rows fed by the previous step's device outputs
                draft_end = parts.pop() if speculative else None
                prev_index = parts.pop()
                parts[0], parts[1], parts[5] = feed_previous(
                    parts[0], parts[1], parts[5], prev_index, draft_end, prev_tokens)
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
            rows = layer_rows(aux["misses"], group_layers, what='decode aux["misses"]')
            aux["to_host"] = jnp.concatenate(
                [x.reshape(-1).astype(jnp.int32) for x in jax.tree.leaves(out)]
                + [jnp.stack([aux["hits"].sum(), aux["misses"].sum(), rows]
                             ).astype(jnp.int32)])
            return out, cache, aux, tables

        return jax.jit(packed_step, donate_argnames=("cache", "tables"))

    def decode_fn(self) -> Callable[..., Any]:
        """The decode step before `jax.jit`: (params, cache, tokens, positions, state_rows,
        tables, host_pools, temperature, key, seeds, topk_state, steps) -> (tokens, cache,
        aux); the cache's residency picks the variant. With speculation: `verify_fn`."""
        if self.num_speculative_tokens:
            return self.verify_fn()
        forward = self.model_decode()

        def step(params, cache, tokens, positions, state_rows, tables, host_pools, temperature,
                 key, seeds, topk_state, steps):
            keys = token_keys(key, seeds, steps + 1)  # token i = len(generated) is sampled
            _, logits, cache, aux = forward(params, cache, tokens, positions, state_rows, tables,
                                            host_pools, topk_state, steps)
            aux.pop("hidden", None)
            return sample(logits, temperature, keys), cache, aux

        return step

    def model_decode(self) -> Callable[..., Any]:
        """The model's decode over flat batch rows, shared by `decode_fn` and `verify_fn`:
        (params, cache, tokens, positions, state_rows, tables, host_pools, topk_state, steps,
        rows_per_request=1) -> (model, logits, cache, aux); `steps`: each row's decode steps
        since the prefill (the top-k source's clock)."""
        graphdef, treedef, ec = self.graphdef, self.treedef, self.config
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
                cache, DecodeBatch(tokens, kv, topk), attention_backend=ec.tuning.attention_backend,
                collect_attention=ec.debug.collect_attention)
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
        draft source drafts the next step's tokens from row a (`DraftSource.device_drafts_at`;
        zeros for a host-side source)."""
        forward, draft = self.model_decode(), self.draft
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
                # `last` is generated token steps + 1 + accepted: the drafts follow it.
                nxt = draft.device_drafts_at(model, h, last, k, seeds=seeds,
                                             index=steps + accepted + 2).astype(jnp.int32)
            else:
                nxt = jnp.zeros((S, k), jnp.int32)
            return (out, accepted + 1, nxt), cache, aux

        return step

    def jit_prefill(self) -> Callable[..., Any]:
        graphdef, treedef, ec = self.graphdef, self.treedef, self.config

        def prefill(params, cache, tokens, length, state_row, write_rows, temperature, key,
                    seed, token_index):
            params = jax.tree.unflatten(treedef, params)
            keys = token_keys(key, seed[None], token_index[None])
            model = nnx.merge(graphdef, params)
            logits, cache, aux = model.prefill(
                cache, tokens, length, state_row, write_rows,
                attention_backend=ec.tuning.attention_backend,
                collect_attention=ec.debug.collect_attention)
            return sample(logits[None], temperature[None], keys)[0], cache, aux

        return jax.jit(self.wrap(prefill, "prefill"), donate_argnames=("cache",),
                       **self.placed_outputs())

    def jit_prefill_chunk(self, *, staged: bool = False) -> Callable[..., Any]:
        """The chunk prefill; `staged`: the variant that also takes the host block-table row
        and the host pools (`ServedModel.prefill_chunk` staging)."""
        graphdef, treedef, ec = self.graphdef, self.treedef, self.config

        def prefill_chunk(params, cache, tokens, start, length, state_row, pages, temperature,
                          key, seed, token_index, host_pages=None, host_pools=()):
            keys = token_keys(key, seed[None], token_index[None])
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
            logits, cache, aux = model.prefill_chunk(
                cache, tokens, start, length, state_row, pages, host_pages=host_pages,
                host_pools=tuple(host_pools), attention_backend=ec.tuning.attention_backend,
                collect_attention=ec.debug.collect_attention)
            return sample(logits[None], temperature[None], keys)[0], cache, aux

        name = "prefill_chunk_staged" if staged else "prefill_chunk"
        return jax.jit(self.wrap(prefill_chunk, name), donate_argnames=("cache",),
                       **self.placed_outputs())

    def jit_synthetic_prefill(self) -> Callable[..., Any]:
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

        return jax.jit(self.wrap(prefill, "prefill"), donate_argnames=("cache",),
                       **self.placed_outputs())

    def jit_page_keys(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """Jitted reads and writes of the per-seat arrays (`DecodeCache.index_keys`) at the
        positions of a batch of pages (B positions each, at a state row; page -1: none): one
        compile each, whatever the pages."""
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
