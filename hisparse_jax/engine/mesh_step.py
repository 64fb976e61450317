"""`MeshDecode`: the mesh engine's one decode step over every data shard (`mesh.py`).

The decode step is ONE `jax.jit` over the whole mesh: the single-device step
(`StepBuilder.decode_fn`, the verify step with speculation) under `shard_map` with "data"
manual (each shard runs the attention, residency resolve and host gathers of its own seats;
the Pallas kernels see one shard) and "model" left to the partitioner, which splits the
projections and MLP by the parameters' shardings. Its operands are global arrays assembled
without copies from the shards' arrays (concatenated on their leading axis, sharded over
"data"), and its outputs are split back the same way: each shard's runner gets its part of
the new caches, and each shard's requests their tokens (`collect`).

As in `StepBuilder.jit_decode`, each shard packs what the host reads of the step (its
tokens, and drafts and counts with speculation; its hit / miss sums and rows moved) into one
int32 array, aux["to_host"] ([D * n], sharded over "data"): a shard's block is unpacked by
its own runner (`Runner.collect_decode`), so a shard's result is exactly what the single
engine's runner reads of its own step. With asynchronous scheduling the step also takes
prev_index (int32[D * seats], a row's local seat in the previous step, -1: the host's
inputs), with speculation draft_end (int32[D * seats], `fill_decode_inputs`), and that
step's outputs (`MeshPending.tokens`, still on the devices: the sampled tokens, or the verify
step's tokens, accepted counts and next drafts); each shard feeds its rows from its own
block of them as the single engine's step does (`step_builder.feed_previous`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax.cache import Residency
from hisparse_jax.engine.device_state import no_prev_tokens, with_residency
from hisparse_jax.engine.metrics import CompileWatch
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import DecodeResult, PendingDecode, fill_decode_inputs
from hisparse_jax.engine.step import StepContext, record_decode
from hisparse_jax.engine.step_builder import (
    StepBuilder,
    feed_previous,
    idle_inputs,
    variant_name,
)
from hisparse_jax.index_groups import layer_rows
from pallas_kernels import _compat

DATA, MODEL = "data", "model"


def from_host(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array of the same value on every process (each fills its own devices)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def view(x: jax.Array, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The part of global array `x` on `sharding`'s devices as an array of `shape` under
    `sharding` (no copy)."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [by_device[d] for d in sharding.mesh.devices.flat])


@dataclasses.dataclass(frozen=True)
class MeshPending:
    """A dispatched mesh decode step: its requests by data shard, its outputs (global
    arrays: `tokens` the sampled tokens, int32[D * seats] by row, or with speculation the
    verify step's (tokens, counts, drafts), which the next step reads with async
    scheduling), when it was dispatched, the compile count then, and with speculation the
    draft rows the host filled (int[D * seats], `PendingDecode.draft_rows`)."""

    decode: dict[int, list[Request]]
    residency: Residency
    tokens: Any
    aux: dict[str, jax.Array]
    started: float
    compiles: int
    draft_rows: np.ndarray | None = None


class MeshDecode:
    """The mesh-wide decode step of one `MeshEngine` (module docstring).

    Args:
      mesh: the ("data", "model") mesh.
      shards: the local data shards (`index`, `devices`, `sharding`, `runner`, `scheduler`).
      builder: a `StepBuilder` of one shard's sizes (its `decode_fn` runs per shard).
      params: the parameter leaves placed over the whole mesh.
      base_key: the engine's sampling base key (`sampler.base_key`), replicated over the
        mesh here.
    """

    def __init__(self, mesh: Mesh, shards: Sequence[Any], builder: StepBuilder,
                 params: list[jax.Array], base_key: jax.Array) -> None:
        self.mesh, self.shards, self.builder, self.params = mesh, shards, builder, params
        self.num_data_shards = mesh.shape[DATA]
        self.seats = builder.cfg.max_num_reqs  # per data shard
        self.num_speculative_tokens = builder.num_speculative_tokens
        self.feeds_back = builder.feeds_back  # async scheduling
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self.jitted: dict[str, Any] = {}
        self.topk_global: Any = None  # the shards' top-k states, stacked (after admissions)
        self.key = from_host(np.asarray(jax.device_get(base_key)), NamedSharding(mesh, P()))
        self.no_prev_tokens = (jax.tree.map(self._host_array, no_prev_tokens(
            self.num_data_shards * self.seats, self.num_speculative_tokens))
                               if self.feeds_back else None)

    def _global(self, parts: Sequence[jax.Array], *, memory_kind: str | None = None
                ) -> jax.Array:
        """The local shards' arrays (one per shard, in `shards` order, each replicated over
        its shard's devices) as one global array concatenated on axis 0 and sharded over
        "data" (no copy)."""
        shape = (self.num_data_shards * parts[0].shape[0], *parts[0].shape[1:])
        sharding = NamedSharding(self.mesh, P(DATA), memory_kind=memory_kind)
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [s.data for x in parts for s in x.addressable_shards])

    def _global_tree(self, trees: Sequence[Any]) -> Any:
        return jax.tree.map(lambda *xs: self._global(xs), *trees)

    def _host_array(self, values: np.ndarray) -> jax.Array:
        """A host-built [D * seats, ...] array, sharded over "data" (each process fills the
        blocks of its own shards)."""
        return from_host(values, NamedSharding(self.mesh, P(DATA)))

    def _topk_state(self) -> Any:
        if self.shards[0].runner.topk_state is None:
            return None
        if self.topk_global is None:
            self.topk_global = self._global_tree(
                [jax.tree.map(lambda x: x[None], sh.runner.topk_state) for sh in self.shards])
        return self.topk_global

    def _jit(self, residency: Residency) -> Any:
        name = variant_name(residency)
        if name in self.jitted:
            return self.jitted[name]
        fn, counts = self.builder.decode_fn(), self.trace_counts
        group_layers = self.builder.spec.group_layers

        def body(params, cache, tokens, positions, state_rows, tables, host_pools,
                 temperature, key, seeds, topk_state, steps, *prev):
            counts[name] += 1  # once per trace
            topk_state = jax.tree.map(lambda x: x[0], topk_state)
            if prev:  # async: rows fed by this shard's block of the previous step's outputs
                prev_index, prev_out = prev[0], prev[-1]
                draft_end = prev[1] if len(prev) == 3 else None  # speculation
                tokens, positions, steps = feed_previous(
                    tokens, positions, steps, prev_index, draft_end, prev_out)
            out, cache, aux = fn(params, cache, tokens, positions, state_rows, tables,
                                 host_pools, temperature, key, seeds, topk_state, steps)
            # What the host reads of this shard's step, as one array (`jit_decode`'s layout).
            rows = layer_rows(aux["misses"], group_layers, what='decode aux["misses"]')
            host = {"to_host": jnp.concatenate(
                [x.reshape(-1).astype(jnp.int32) for x in jax.tree.leaves(out)]
                + [jnp.stack([aux["hits"].sum(), aux["misses"].sum(), rows]
                             ).astype(jnp.int32)])}
            if "attention" in aux:
                host["attention"] = aux["attention"]
            return out, cache, host

        d = P(DATA)
        aux = {"to_host": d}
        if self.builder.config.debug.collect_attention:
            aux["attention"] = P(None, DATA)
        extra = (d,) * (2 + bool(self.num_speculative_tokens)) if self.feeds_back else ()
        mapped = _compat.shard_map(
            body, mesh=self.mesh, in_specs=(P(), d, d, d, d, d, d, d, P(), d, d, d, *extra),
            out_specs=(d, d, aux), manual_axes=(DATA,))
        # Outputs replicated over "model" (the partitioner would shard them like the
        # parameters): the shards' arrays stay whole on each of their devices.
        placed = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), (d, d, aux))
        self.jitted[name] = jitted = jax.jit(mapped, donate_argnums=(1,), out_shardings=placed)
        return jitted

    def idle_inputs(self) -> tuple[np.ndarray, ...]:
        """Decode inputs of the whole mesh, every row padding (`step_builder.idle_inputs`
        of D * seats rows)."""
        return idle_inputs(self.num_data_shards * self.seats, self.num_speculative_tokens)

    def dispatch(self, decode: dict[int, list[Request]], residency: Residency, *,
                 prev: MeshPending | None = None,
                 ahead: dict[int, frozenset[Hashable]] | None = None) -> MeshPending:
        """Launches the mesh decode step of `residency`'s variant for each shard's `decode`
        requests (state rows local to the shard). Async scheduling: `prev` is the mesh step
        still in flight and `ahead[d]` shard d's requests of it scheduled again; their rows
        are fed from `prev`'s outputs on the devices where the host does not know them
        (`fill_decode_inputs`; with speculation they continue `prev`'s drafts,
        `step_builder.continue_speculation`), as `Runner.dispatch_decode` does."""
        S, rows = self.seats, self.num_data_shards * self.seats
        inputs = self.idle_inputs()
        prev_index = np.full(rows, -1, np.int32) if self.feeds_back else None
        spec = self.num_speculative_tokens
        draft_end = np.zeros(rows, np.int32) if self.feeds_back and spec else None
        for d, reqs in decode.items():
            fill_decode_inputs(reqs, inputs, offset=d * S,
                               ahead=(ahead or {}).get(d, frozenset()), prev_index=prev_index,
                               draft_end=draft_end, max_model_len=self.builder.cfg.max_model_len)
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        next_tokens, aux = self.run(residency, inputs, prev_index=prev_index,
                                    draft_end=draft_end,
                                    prev_tokens=None if prev is None else prev.tokens)
        draft_rows = (inputs[1][:, 1:] >= 0).sum(1) if spec else None
        return MeshPending(decode, residency, next_tokens, aux, t0, compiles, draft_rows)

    def run(self, residency: Residency, inputs: tuple[np.ndarray, ...], *,
            prev_index: np.ndarray | None = None, prev_tokens: Any = None,
            draft_end: np.ndarray | None = None) -> tuple[Any, dict]:
        """The mesh decode step of `residency`'s variant on host-built [D * seats] operands
        (`idle_inputs`' layout); the shards' runners get the new caches. With async
        scheduling `prev_index` (default every row -1), with speculation `draft_end`
        (default zeros: read only for fed rows), and `prev_tokens` (a previous step's
        `MeshPending.tokens`; default zeros). Returns (sampled tokens, aux)."""
        tokens, positions, state_rows, temperature, seeds, steps = inputs
        runners = [sh.runner for sh in self.shards]
        cache = self._global_tree([with_residency(r.cache, residency) for r in runners])
        tables = tuple(self._global([getattr(r.tables, g) for r in runners])
                       for g in ("src", "res", "hot"))
        pools: tuple[jax.Array, ...] = ()
        if residency.reads_host:
            pools = tuple(self._global(list(shards),
                                       memory_kind=runners[0].host_pool.sharding.memory_kind)
                          for shards in zip(*(r.host_pool.arrays for r in runners),
                                            strict=True))
        extra: tuple[jax.Array, ...] = ()
        if self.feeds_back:
            if prev_index is None:
                prev_index = np.full(len(state_rows), -1, np.int32)
            extra = (self._host_array(prev_index),)
            if self.num_speculative_tokens:
                extra += (self._host_array(np.zeros(len(state_rows), np.int32)
                                           if draft_end is None else draft_end),)
            extra += (self.no_prev_tokens if prev_tokens is None else prev_tokens,)
        host = [self._host_array(a) for a in (tokens, positions, state_rows)]
        next_tokens, cache, aux = self._jit(residency)(
            self.params, cache, *host, tables, pools, self._host_array(temperature), self.key,
            self._host_array(seeds), self._topk_state(), self._host_array(steps), *extra)
        leaves, treedef = jax.tree.flatten(cache)
        for sh in self.shards:
            sh.runner.cache = jax.tree.unflatten(treedef, [self._local(x, sh) for x in leaves])
        return next_tokens, aux

    def _local(self, x: jax.Array, shard: Any, axis: int = 0) -> jax.Array:
        """Data shard `shard`'s block of global array `x` (split over "data" on `axis`), on
        the shard's devices (no copy)."""
        shape = list(x.shape)
        shape[axis] //= self.num_data_shards
        return view(x, shard.sharding, tuple(shape))

    def results(self, pending: MeshPending, *, since: float | None = None
                ) -> dict[int, DecodeResult]:
        """Each local shard's `DecodeResult` of a mesh decode step: its block of the step's
        outputs, unpacked by its own runner (`Runner.collect_decode`; waits for it)."""
        out = {}
        for sh in self.shards:
            aux = {"to_host": self._local(pending.aux["to_host"], sh)}
            if "attention" in pending.aux:
                aux["attention"] = self._local(pending.aux["attention"], sh, axis=1)
            tokens = jax.tree.map(lambda x, sh=sh: self._local(x, sh), pending.tokens)
            S, d = self.seats, sh.index
            draft_rows = (None if pending.draft_rows is None
                          else pending.draft_rows[d * S:(d + 1) * S])
            out[d] = sh.runner.collect_decode(PendingDecode(
                pending.decode.get(d, []), pending.residency, pending.started, tokens, aux,
                pending.compiles, draft_rows), since=since)
        return out

    def collect(self, ctx: StepContext, pending: MeshPending, *,
                batches: dict[int, list[Request]] | None = None,
                since: float | None = None) -> float:
        """Waits for a mesh decode step and records each shard's tokens with its scheduler,
        as `step.collect` does for one pair: the step counted once (its time, hits, misses,
        rows moved, emitted tokens, dropped rows), then per shard the index keys of pages
        its rows sealed kept (prefix caching: `ctx.prefix`) and its requests' tokens
        recorded (`record_decode`; `batches[d]`: the list shard d's requests are collected
        from, default its open pass's). Returns when the tokens reached the host."""
        results = self.results(pending, since=since)
        collected_at = time.perf_counter()
        metrics, clock = ctx.metrics, ctx.clock
        live = {d: [r for r in pending.decode.get(d, ()) if r.finish_reason is None]
                for d in results}
        everyone = sum(len(pending.decode.get(d, ())) for d in results)
        metrics.dropped_rows += everyone - sum(map(len, live.values()))
        emitted = sum(int(results[d].counts[[r.seat for r in reqs]].sum())
                      for d, reqs in live.items())
        if clock.account(variant_name(pending.residency),
                         max((r.seconds for r in results.values()), default=0.0),
                         "decode_seconds",
                         compiled=any(r.compiled for r in results.values())):
            clock.decode_tokens += emitted
        metrics.record_decode(fast=not pending.residency.reads_host,
                              hits=sum(r.hits for r in results.values()),
                              misses=sum(r.misses for r in results.values()),
                              rows=sum(r.rows_moved for r in results.values()),
                              row_bytes=ctx.row_bytes)
        metrics.decode_request_steps += sum(map(len, live.values()))
        metrics.decode_emitted += emitted
        B = ctx.config.sizes.block_size
        for sh in self.shards:
            if ctx.prefix is not None:
                # Before the tokens are recorded (`step.collect`: a request that finishes
                # now may publish its last pages after its seat is reused).
                for req in live[sh.index]:
                    if (len(req.prompt) + req.live) // B > req.key_pages:
                        ctx.prefix.stage(req, len(req.prompt) + req.live, sh.runner)
            record_decode(sh.scheduler, metrics, pending.decode.get(sh.index, []),
                          results[sh.index], None if batches is None else batches[sh.index])
        return collected_at
