"""`MeshEngine`: one decode engine over a JAX mesh: data-parallel attention with a host tier
per data shard, tensor-parallel dense projections and MLP (`docs/mesh.md`).

The mesh has two axes, `DATA` ("data", D shards) and `MODEL` ("model", M devices per shard).

  * Requests are partitioned across the data axis. Data shard d owns max_seats / D seats, its
    device KV pool (`num_gpu_blocks` per layer), its hot states, its block tables, its index
    keys and top-k state, and its own pinned host pool (`num_host_blocks`) with its own
    `host_tier.Coordinator` and `TransferEngine`: an ordinary single-engine set of parts
    (`Scheduler`, manager, `Runner`) whose arrays live on the shard's M devices (replicated
    over them: the latent KV row is shared by every head, so each tensor-parallel rank reads
    all of it). Block ids and state rows are local to the shard. The engine composes them:
    each step runs the one step path (`step.execute`) over the shards that scheduled
    something, around one mesh-wide decode step.
  * The parameters are placed once over the whole mesh: replicated over "data"; over
    "model", each split on the dim the model's `tensor_parallel_dim` names (the synthetic
    model: dense kernels and the embedding on their output dim, the absorbed MLA
    up-projections on their head dim; `param_specs`); arrays already placed so (e.g.
    `from_pretrained(..., mesh=)`) are used as they are. Each shard's runner reads
    zero-copy views of them and runs the model's `for_mesh(shard devices, "model")` when
    it has one (a DSA model's experts split over "model": `docs/mesh.md`).
  * The decode step is ONE `jax.jit` over the whole mesh (`MeshDecode`, `mesh_step.py`):
    the single-device step under `shard_map` with "data" manual and "model" left to the
    partitioner; its operands are global arrays assembled without copies from the shards'
    arrays, and its outputs are split back the same way.
  * Per-shard work runs on the shard's devices: block-table and hot-state updates, restores
    and spills (the plan of the shard's coordinator), and prefills (one request at a time;
    with `EngineConfig.prefill.chunk_size` one chunk per request and step, the shard's
    scheduler cutting them as the single engine's does, its `max_tokens_per_step` budget per
    shard).
  * The step loop (`mesh_loop.py`) is the single engine's, over every shard's part:
    synchronous, or with `EngineConfig.async_scheduling` the mesh decode step t + 1
    dispatched before step t is collected, fed step t's device tokens.
  * Prefix caching (`EngineConfig.prefill.prefix_caching`) is per data shard: a shard
    publishes its pages into its own host pool and keeps their index keys (`PageKeys`), and
    a prompt reuses only the pages of the shard it runs on (all-resident: seat reuse within
    the shard).
  * Admission is balanced: a waiting request goes to the data shard with a free seat whose
    published pages hold the longest prefix of its prompt (prefix caching), then the most
    free seats, then the most free device blocks, then the lowest index (deterministic).
  * Speculation (`EngineConfig.speculative`): the mesh decode step is the single engine's
    verify step per shard; each shard's scheduler plans its requests' drafts. With async
    scheduling a shard's rows of step t + 1 continue step t's requests from its accepted
    counts and on-device drafts on the devices (`step_builder.feed_previous`), or a host
    draft source collects step t first, as the single engine's `AsyncLoop` does.

Sampling keys depend only on (seed, request sampling seed, token index), never on the batch
(`hisparse_jax/engine/sampler.py`), so greedy and sampled tokens equal the single-device
engine's for the same requests added in the same order, up to the float rounding of the
tensor-parallel and per-shard matmuls (`docs/mesh.md` says what is compared).

Several processes (`jax.distributed`): every process builds the same mesh and engine and adds
the same requests in the same order; a data shard's devices must all belong to one process,
which drives that shard. Requests are routed at `add_request` round-robin over the shards (no
process knows the others' free capacity) and a process keeps only its own shards' requests;
`run` / `step` are collective (every process calls them; the decode step runs the mode's
host-reading variant whenever any process needs it, agreed through a small all-gather).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax.engine import compile_cache
from hisparse_jax.engine import warmup as _warmup
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.engine import residency_parts
from hisparse_jax.engine.front import (
    EngineFront,
    Intake,
    check_idle,
    checked_config,
    run_steps,
)
from hisparse_jax.engine.mesh_loop import MeshAsyncLoop, MeshSyncLoop, ShardPageKeys
from hisparse_jax.engine.mesh_step import DATA, MODEL, MeshDecode, from_host, view
from hisparse_jax.engine.metrics import CompileWatch, Metrics, StepClock
from hisparse_jax.engine.page_keys import PageKeys
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import Runner
from hisparse_jax.engine.sampler import base_key
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.engine.step import StepContext
from hisparse_jax.engine.warmup import reachable_variants
from hisparse_jax.models.protocol import ServedModel, partition_specs
from host_tier import DeviceBlockTables, HostPool
from host_tier.sizes import is_int
from pallas_kernels import _compat

__all__ = ["DATA", "MODEL", "MeshEngine", "make_mesh", "param_specs"]


def make_mesh(mesh_shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "model") mesh of shape `mesh_shape` = (D, M) over `devices` (default: every
    device), ordered by (process, id) so that a data shard's M devices are consecutive devices
    of one process where the counts allow.

    Raises:
      ValueError: mesh_shape is not two positive ints whose product is the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if (not isinstance(mesh_shape, (tuple, list)) or len(mesh_shape) != 2
            or not all(is_int(n) and n >= 1 for n in mesh_shape)):
        raise ValueError(f"mesh_shape must be (data, model), two positive ints, got "
                         f"{mesh_shape!r}")
    D, M = (int(n) for n in mesh_shape)
    if D * M != len(devices):
        raise ValueError(f"mesh_shape={D}x{M} needs data * model = {D * M} devices, there are "
                         f"{len(devices)}")
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object).reshape(D, M), (DATA, MODEL))


def _placed(leaf: Any, sharding: NamedSharding) -> jax.Array:
    """Parameter `leaf` under `sharding`: the array itself when it is placed so already
    (e.g. `from_pretrained(..., mesh=)`: nothing copied or gathered), moved on the devices
    when it is a global array placed otherwise, else built from its host value."""
    if isinstance(leaf, jax.Array):
        if leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return leaf
        if not leaf.is_fully_addressable:
            return jax.device_put(leaf, sharding)
    return from_host(np.asarray(leaf), sharding)


def _for_mesh(model: ServedModel, mesh: Mesh) -> ServedModel:
    """The model a data shard's runner runs on its devices (`mesh`, axis `MODEL`): the
    model's `for_mesh(mesh, MODEL)` (expert parallelism of a DSA model) when it has one."""
    hook = getattr(model, "for_mesh", None)
    return model if hook is None else hook(mesh, MODEL)


def param_specs(model: Any, model_size: int) -> list[P]:
    """The `PartitionSpec` over `MODEL` of each parameter leaf of `model` (`jax.tree.flatten`
    order of its `nnx.State`): the dim the model's `tensor_parallel_dim(path, shape)` names
    is split (`hisparse_jax.models.ServedModel`); every leaf is replicated when it names none
    or the model has no such method (the partitioner picks the activations' layout, so the
    float rounding may differ from one device: `docs/mesh.md`). The rule of
    `hisparse_jax.models.protocol.partition_specs`, which `from_pretrained(..., mesh=)`
    places by.

    Raises:
      ValueError: `model_size` does not divide a dim it splits (naming the parameter).
    """
    return partition_specs(model, model_size, MODEL)


@dataclasses.dataclass
class _Shard:
    """One data shard's parts (its arrays live on `devices`, replicated over them)."""

    index: int
    devices: tuple[jax.Device, ...]
    sharding: NamedSharding  # replicated over the shard's devices
    runner: Runner
    scheduler: Scheduler
    host_pool: Any
    owns_pool: bool
    page_keys: PageKeys | None = None  # prefix caching with a host tier: its pages' keys


class _MeshQueue:
    """The mesh engine's `Scheduler` face (what `Intake`, `cancel` and `run` talk to): the
    queue of requests not yet routed, and the union of the shards' schedulers."""

    def __init__(self, engine: MeshEngine) -> None:
        self.engine = engine
        self.waiting: collections.deque[Request] = collections.deque()
        self.cancelled: dict[Hashable, Request] = {}
        self.cancelled_now: list[Request] = []  # cancelled from the queue since the step
        self.manager = _MeshManager(engine)

    def _schedulers(self) -> list[Scheduler]:
        return [sh.scheduler for sh in self.engine.shards]

    @property
    def running(self) -> dict[Hashable, Request]:
        return {k: v for s in self._schedulers() for k, v in s.running.items()}

    @property
    def finished(self) -> dict[Hashable, Request]:
        out = dict(self.cancelled)
        for s in self._schedulers():
            out.update(s.finished)
        return out

    @property
    def newly_finished(self) -> list[Request]:
        """The requests finished since the step began (queue cancellations, then the
        shards'); setting it (to []) clears every shard's list."""
        return self.cancelled_now + [r for s in self._schedulers() for r in s.newly_finished]

    @newly_finished.setter
    def newly_finished(self, value: list[Request]) -> None:
        self.cancelled_now = list(value)
        for s in self._schedulers():
            s.newly_finished = []

    @property
    def has_work(self) -> bool:
        """Whether a request waits or runs (on any process: a collective when several)."""
        local = bool(self.waiting) or any(s.has_work for s in self._schedulers())
        if not self.engine.multi_process:
            return local
        return bool(np.any(_compat.process_allgather(np.array([local], np.int32))))

    def knows(self, request_id: Hashable) -> bool:
        return (request_id in self.engine.known_ids
                or any(s.knows(request_id) for s in self._schedulers()))

    def submit(self, req: Request) -> None:
        engine = self.engine
        engine.known_ids.add(req.request_id)
        if engine.multi_process:
            shard = req.index % engine.num_data_shards  # round-robin: every process agrees
            local = {sh.index: sh for sh in engine.shards}
            if shard in local:
                local[shard].scheduler.submit(req)
            return
        self.waiting.append(req)

    def cancel(self, request_id: Hashable) -> bool:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.finish_reason = "cancelled"
                self.cancelled[request_id] = req
                self.cancelled_now.append(req)
                return True
        for s in self._schedulers():
            if s.knows(request_id):
                return s.cancel(request_id)
        if request_id in self.engine.known_ids:
            return False  # another process's request
        raise ValueError(f"cancel: no request has request_id {request_id!r}")

    def deliver(self, *, wait: bool = False) -> None:
        for s in self._schedulers():
            s.deliver(wait=wait)


class _MeshManager:
    """What the engine's front asks of the residency manager: the capacity rule (every
    shard has the same sizes) and the summed counters."""

    def __init__(self, engine: MeshEngine) -> None:
        self.engine = engine

    def capacity_error(self, num_prompt_tokens: int, max_total_tokens: int, *,
                       num_lookahead_tokens: int = 0) -> str | None:
        shard = self.engine.shards[0]
        return shard.scheduler.manager.capacity_error(
            num_prompt_tokens, max_total_tokens, num_lookahead_tokens=num_lookahead_tokens)

    @property
    def stats(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for sh in self.engine.shards:
            total.update(sh.scheduler.manager.stats)
        return total


class MeshEngine(EngineFront):
    """The `Engine` over a ("data", "model") mesh (module docstring, `docs/mesh.md`).

    Usage::

        engine = MeshEngine(models.init_model("tiny"),
                            EngineConfig(sizes=Sizes(max_seats=8)), mesh_shape=(2, 2))
        engine.add_request([1, 2, 3], max_new_tokens=16)
        outputs = engine.run()

    Args:
      model: the model (`hisparse_jax.models.ServedModel`; its parameters are placed over the
        mesh, `param_specs`).
      config: serving knobs. `max_seats` counts every seat of the mesh (a multiple of the data
        axis: each shard gets max_seats / D); `num_gpu_blocks` and `num_host_blocks` are per
        data shard (defaults sized for the shard's seats).
      mesh: a `jax.sharding.Mesh` with axes ("data", "model") (`make_mesh`).
      mesh_shape: (D, M) to build one over every device instead (default: (devices, 1)).

    Requests, `run`, `step`, `drain`, `warmup`, `cancel`, `summary` and `close` work as on
    `Engine` (`step` and `warmup` are collective with several processes). After an exception from
    `step()` every local data shard is recovered as `Engine` recovers (`step.recover_parts`);
    with several processes only when every process raised at the same point (`docs/mesh.md`).
    """

    host_pool = None  # each data shard has its own (`shards`)
    _loop: MeshSyncLoop | None = None  # the step loop (set once the shards are built)

    def __init__(self, model: ServedModel, config: EngineConfig | None = None, *,
                 mesh: Mesh | None = None, mesh_shape: Sequence[int] | None = None) -> None:
        config, spec = checked_config("MeshEngine", model, config)
        self.spec = spec
        self.mesh = mesh = _checked_mesh(mesh, mesh_shape)
        D, M = mesh.shape[DATA], mesh.shape[MODEL]
        self.num_data_shards = D
        if config.sizes.max_seats % D:
            raise ValueError(f"EngineConfig.sizes.max_seats={config.sizes.max_seats} must be a "
                             f"multiple of the mesh's data axis ({D}): each data shard owns "
                             f"max_seats / {D} seats")
        procs = [{d.process_index for d in mesh.devices[i]} for i in range(D)]
        if any(len(p) > 1 for p in procs):
            raise ValueError("MeshEngine: every data shard's devices (a row of the mesh) must "
                             "belong to one process; make the model axis at most the devices "
                             "per process")
        self.multi_process = jax.process_count() > 1
        self.config = ec = config
        self.shard_config = ec_local = dataclasses.replace(
            ec, sizes=dataclasses.replace(ec.sizes, max_seats=ec.sizes.max_seats // D))
        self.residency = ec.residency
        self.hs_config = cfg = ec_local.hisparse_config(spec)
        ec_local.check_platform(spec, cfg)
        specs = param_specs(model, M)
        _, state = nnx.split(model)
        self.compilation_cache_dir = compile_cache.enable() if ec.compilation_cache else None
        CompileWatch.start()
        self.device = mesh.devices.flat[0]
        self.row_bytes = cfg.row_bytes
        self.metrics = Metrics()
        self._clock = StepClock(self.metrics)
        self.params = [_placed(leaf, NamedSharding(mesh, spec))
                       for leaf, spec in zip(jax.tree.leaves(state), specs, strict=True)]
        self.known_ids: set[Hashable] = set()
        self.shards: list[_Shard] = []
        try:
            for d in range(D):
                devices = tuple(mesh.devices[d])
                if devices[0].process_index == jax.process_index():
                    self.shards.append(self._build_shard(model, d, devices, specs))
        except BaseException:
            self.close()
            raise
        self.scheduler = _MeshQueue(self)
        self._intake = Intake(self.scheduler, spec.vocab_size, ec)
        page_keys = {sh.runner: sh.page_keys for sh in self.shards if sh.page_keys is not None}
        ctx = StepContext(ec_local, spec, self.metrics, self._clock, self.row_bytes,
                          ShardPageKeys(page_keys) if page_keys else None)
        self.decoder = MeshDecode(mesh, self.shards, self.shards[0].runner.builder, self.params,
                                  base_key(ec.seed))
        self._loop = (MeshAsyncLoop if ec.async_scheduling else MeshSyncLoop)(ctx, self)

    def _build_shard(self, model: ServedModel, d: int, devices: tuple[jax.Device, ...],
                     specs: list[P]) -> _Shard:
        ec, cfg, spec = self.shard_config, self.hs_config, self.spec
        submesh = Mesh(np.array(devices, dtype=object), (MODEL,))
        sharding = NamedSharding(submesh, P())
        params = [view(p, NamedSharding(submesh, s), p.shape)
                  for p, s in zip(self.params, specs, strict=True)]
        pool, owns = None, False
        if self.residency.reads_host:
            try:
                pool = HostPool.from_config(cfg, num_layers=spec.num_layers,
                                            device=devices[0] if len(devices) == 1 else devices,
                                            layers_per_array=ec.host_layers_per_array(spec))
            except ValueError as e:
                raise ValueError(f"MeshEngine: the host pool of data shard {d} "
                                 f"(EngineConfig.sizes.num_host_blocks={cfg.num_host_blocks}): {e}"
                                 ) from e
            owns = True
        try:
            manager, transfers = residency_parts(cfg, ec, pool, who=None, mirror_groups=False)
            runner = Runner(_for_mesh(model, submesh), ec, cfg, self.residency,
                            tables=DeviceBlockTables.from_config(cfg, device=sharding),
                            transfers=transfers, host_pool=pool, device=sharding, params=params)
        except BaseException:
            if owns:
                pool.close()
            raise
        scheduler = Scheduler(manager, transfers, cfg, self.residency, self.metrics,
                              draft=runner.draft, vocab_size=spec.vocab_size,
                              prefill_chunk_size=ec.prefill.chunk_size,
                              max_prefill_tokens=ec.prefill.max_tokens_per_step)
        # Prefix caching: the shard's host copies of its published pages' index keys
        # (all-resident: seat reuse, the keys stay in their seat).
        page_keys = (PageKeys(scheduler, runner, ec.sizes.block_size)
                     if ec.prefill.prefix_caching and self.residency.reads_host else None)
        if pool is not None:  # one engine per pool (`Engine`'s host_pool rule)
            pool.claim(self)
        return _Shard(d, devices, sharding, runner, scheduler, pool, owns, page_keys)

    # ------------------------------------------------------------------ state

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces per jitted mesh decode variant ("decode_fast", "decode_hot")."""
        return self.decoder.trace_counts

    def run(self, *, on_step: Callable[[MeshEngine], None] | None = None,
            max_steps: int | None = None) -> dict[Hashable, Request]:
        """Steps until every request finished; returns the finished requests by id."""
        t0 = time.perf_counter()
        run_steps(self, on_step, max_steps)
        self.scheduler.deliver(wait=True)
        self._loop.prune()  # finished requests whose last copies just completed
        self.metrics.wall_seconds += time.perf_counter() - t0
        return dict(self.finished)

    def drain(self) -> list[Request]:
        """Collects the mesh decode step in flight (async scheduling; nothing otherwise);
        returns the requests that finished in it (`Engine.drain`). Local: no collective."""
        if self._loop is None or self._loop.flight is None:
            return []
        self.scheduler.newly_finished = []
        self._loop.drain()
        finished, self.scheduler.newly_finished = self.scheduler.newly_finished, []
        return finished

    def _shard_rank(self, shard: _Shard, req: Request) -> tuple[bool, int, int, int, int]:
        """How well `shard` takes `req` (`route`: the largest wins): whether it has a free
        seat, the prompt tokens it would reuse from its published pages (prefix caching),
        its free seats, its free device blocks, minus its index."""
        s = shard.scheduler
        free_seats = self.hs_config.max_num_reqs - len(s.running) - len(s.waiting)
        cached = (s.manager.cached_tokens(req.prompt)
                  if free_seats > 0 and self.config.prefill.prefix_caching else 0)
        return free_seats > 0, cached, free_seats, s.manager.device_pool.num_free, -shard.index

    def route(self) -> None:
        """Hands waiting requests, in order, to a data shard with a free seat while one has
        one: with prefix caching the shard whose published pages hold the longest prefix of
        the prompt (a prefix is reused only within its shard); else, and on a tie, the shard
        with the most free seats, then the most free device blocks, then the lowest index.
        Several processes route at `add_request` instead (round-robin)."""
        queue = self.scheduler.waiting
        while queue:
            req = queue[0]
            shard = max(self.shards, key=lambda sh: self._shard_rank(sh, req))
            if not self._shard_rank(shard, req)[0]:
                return
            shard.scheduler.submit(queue.popleft())

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """One scheduler pass per data shard and one mesh decode step (`Engine.step`, through
        `mesh_loop.MeshSyncLoop`, or `MeshAsyncLoop` with async scheduling: the mesh decode
        step left in flight, collected by the next call). After an exception each local
        shard is recovered (`step.recover_parts`). Collective with several processes."""
        self.scheduler.newly_finished = []
        self._loop.step()
        finished, self.scheduler.newly_finished = self.scheduler.newly_finished, []
        return finished

    # ------------------------------------------------------------------ the rest

    def warmup(self) -> float:
        """`Engine.warmup` for the mesh: every shard's runner compiles its prefill lengths,
        block-table, hot-state and spill buckets (`warmup.warm`, without its own decode
        variants, which the mesh engine never calls), then each mesh decode variant the mode
        can reach runs once over the whole mesh with every seat padding (state row -1:
        writes and selects nothing), so that no served step compiles. Changes no state a
        request can see. Collective with several processes (every process calls it).
        Returns the seconds it took (also in `metrics.warmup_seconds`).

        Raises:
          RuntimeError: a request is running (call it before serving, or when none runs).
        """
        check_idle("MeshEngine", self.scheduler.running)
        t0 = time.perf_counter()
        variants: list[Hashable] = []
        for sh in self.shards:
            variants += sh.runner.warmup(
                max_spill_pages=_warmup.spill_budget(sh.scheduler.manager),
                decode=False)
        self.decoder.topk_global = None  # a top-k source's warmup admission rewrote a seat
        for name, residency in reachable_variants(self.residency):
            jax.block_until_ready(self.decoder.run(residency, self.decoder.idle_inputs()))
            variants.append(name)
        self._clock.mark_compiled(variants)
        seconds = time.perf_counter() - t0
        self.metrics.warmup_seconds += seconds
        return seconds

    def device_bytes(self) -> int:
        """Bytes of parameters (each device's share, summed) and every shard's caches, index
        keys and hot states (one copy per shard)."""
        params = sum(s.data.nbytes for p in self.params for s in p.addressable_shards)
        caches = sum(x.nbytes for sh in self.shards for x in jax.tree.leaves(sh.runner.cache))
        return int(params + caches)

    def host_bytes(self) -> int:
        return int(sum(sh.host_pool.nbytes for sh in self.shards if sh.host_pool is not None))

    def close(self) -> None:
        """Collects the mesh decode step in flight (async scheduling), waits for every copy
        into the host pools; closes them. A closed engine takes no request."""
        self._closed = True
        try:
            self.drain()
        finally:
            for sh in self.shards:  # no copy into a pool outlives the engine
                sh.scheduler.deliver(wait=True)
        for sh in self.shards:
            if sh.host_pool is not None:
                sh.host_pool.release(self)
            if sh.owns_pool:
                sh.host_pool.close()


def _checked_mesh(mesh: Mesh | None, mesh_shape: Sequence[int] | None) -> Mesh:
    """The engine's mesh: `mesh`, or one of `mesh_shape` (default (devices, 1)) over every
    device; ValueError for both, or a mesh of other axes."""
    if mesh is not None and mesh_shape is not None:
        raise ValueError("MeshEngine takes mesh or mesh_shape, not both")
    if mesh is None:
        mesh = make_mesh((len(jax.devices()), 1) if mesh_shape is None else mesh_shape)
    elif not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"MeshEngine mesh must be a jax.sharding.Mesh with axes "
                         f"{(DATA, MODEL)}, got {getattr(mesh, 'axis_names', mesh)!r}")
    return mesh
