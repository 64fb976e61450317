"""`MeshDecode`: the mesh engine's one decode step over every data shard (`mesh.py`).

The decode step is ONE `jax.jit` over the whole mesh: the single-device step
(`StepBuilder.decode_fn`) under `shard_map` with "data" manual (each shard runs the
attention, residency resolve and host gathers of its own seats; the Pallas kernels see one
shard) and "model" left to the partitioner, which splits the projections and MLP by the
parameters' shardings. Its operands are global arrays assembled without copies from the
shards' arrays (concatenated on their leading axis, sharded over "data"), and its outputs
are split back the same way: each shard's runner gets its part of the new caches, and each
shard's requests their tokens (`MeshPending.collect`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax.cache import Residency
from hisparse_jax.engine.device_state import with_residency
from hisparse_jax.engine.metrics import CompileWatch
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import fill_decode_inputs
from hisparse_jax.engine.step import StepContext
from hisparse_jax.engine.step_builder import StepBuilder, variant_name
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
    arrays), when it was dispatched and the compile count then."""

    decode: dict[int, list[Request]]
    residency: Residency
    tokens: jax.Array
    aux: dict[str, jax.Array]
    started: float
    compiles: int


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
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self.jitted: dict[str, Any] = {}
        self.topk_global: Any = None  # the shards' top-k states, stacked (after admissions)
        self.key = from_host(np.asarray(jax.device_get(base_key)), NamedSharding(mesh, P()))

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
        """A host-built [D * seats] array, sharded over "data" (each process fills the
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

        def body(params, cache, tokens, positions, state_rows, tables, host_pools,
                 temperature, key, seeds, topk_state, steps):
            counts[name] += 1  # once per trace
            topk_state = jax.tree.map(lambda x: x[0], topk_state)
            return fn(params, cache, tokens, positions, state_rows, tables, host_pools,
                      temperature, key, seeds, topk_state, steps)

        d = P(DATA)
        aux = {"hits": d, "misses": d}
        if self.builder.config.debug.collect_attention:
            aux["attention"] = P(None, DATA)
        mapped = _compat.shard_map(
            body, mesh=self.mesh, in_specs=(P(), d, d, d, d, d, d, d, P(), d, d, d),
            out_specs=(d, d, aux), manual_axes=(DATA,))
        # Outputs replicated over "model" (the partitioner would shard them like the
        # parameters): the shards' arrays stay whole on each of their devices.
        placed = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), (d, d, aux))
        self.jitted[name] = jitted = jax.jit(mapped, donate_argnums=(1,), out_shardings=placed)
        return jitted

    def dispatch(self, decode: dict[int, list[Request]], residency: Residency) -> MeshPending:
        """Launches the mesh decode step of `residency`'s variant for each shard's `decode`
        requests (state rows local to the shard)."""
        S = self.seats
        n = self.num_data_shards * S
        tokens, positions, seeds, steps = (np.zeros(n, np.int32) for _ in range(4))
        state_rows = np.full(n, -1, np.int32)
        temperature = np.zeros(n, np.float32)
        inputs = (tokens, positions, state_rows, temperature, seeds, steps)
        for d, reqs in decode.items():
            fill_decode_inputs(reqs, inputs, offset=d * S)
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        next_tokens, aux = self.run(residency, *inputs)
        return MeshPending(decode, residency, next_tokens, aux, t0, compiles)

    def run(self, residency: Residency, tokens: np.ndarray, positions: np.ndarray,
            state_rows: np.ndarray, temperature: np.ndarray, seeds: np.ndarray,
            steps: np.ndarray) -> tuple[jax.Array, dict]:
        """The mesh decode step of `residency`'s variant on host-built [D * seats] operands;
        the shards' runners get the new caches. Returns (sampled tokens, aux)."""
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
        host = [self._host_array(a) for a in (tokens, positions, state_rows)]
        next_tokens, cache, aux = self._jit(residency)(
            self.params, cache, *host, tables, pools, self._host_array(temperature), self.key,
            self._host_array(seeds), self._topk_state(), self._host_array(steps))
        leaves, treedef = jax.tree.flatten(cache)
        for sh in self.shards:
            local = [view(x, sh.sharding, (x.shape[0] // self.num_data_shards, *x.shape[1:]))
                     for x in leaves]
            sh.runner.cache = jax.tree.unflatten(treedef, local)
        return next_tokens, aux

    def _local_blocks(self, x: jax.Array) -> dict[int, np.ndarray]:
        """The blocks of global array `x` (split over "data") of the local shards."""
        by_device = {s.device: s.data for s in x.addressable_shards}
        return {sh.index: np.asarray(by_device[sh.devices[0]]) for sh in self.shards}

    def collect(self, ctx: StepContext, pending: MeshPending) -> None:
        """Waits for a mesh decode step and records each shard's tokens with its scheduler."""
        decode, residency, aux = pending.decode, pending.residency, pending.aux
        tokens = self._local_blocks(pending.tokens)
        hits = sum(int(b.sum()) for b in self._local_blocks(aux["hits"]).values())
        missed = self._local_blocks(aux["misses"]).values()
        misses = sum(int(b.sum()) for b in missed)
        # Each miss is copied into every layer of its index group (a shard's block: the
        # model's per-group misses).
        rows = sum(int(layer_rows(b, ctx.spec.group_layers, what='decode aux["misses"]'))
                   for b in missed)
        attention = self._local_blocks(aux["attention"]) if "attention" in aux else None
        seconds = time.perf_counter() - pending.started
        reqs = [r for rs in decode.values() for r in rs]
        if ctx.clock.account(variant_name(residency), seconds, "decode_seconds",
                             compiled=CompileWatch.count != pending.compiles):
            ctx.clock.decode_tokens += len(reqs)
        ctx.metrics.record_decode(fast=not residency.reads_host, hits=hits, misses=misses,
                                  rows=rows, row_bytes=ctx.row_bytes)
        for sh in self.shards:
            for req in decode.get(sh.index, ()):
                sh.scheduler.collected(req)
                if attention is not None and not req.replaying:
                    req.attention.append(attention[sh.index][:, req.seat])
                sh.scheduler.record(req, int(tokens[sh.index][req.seat]))
