"""`MeshEngine`: one decode engine over a JAX mesh: data-parallel attention with a host tier
per data shard, tensor-parallel dense projections and MLP (`docs/mesh.md`).

The mesh has two axes, `DATA` ("data", D shards) and `MODEL` ("model", M devices per shard).

  * Requests are partitioned across the data axis. Data shard d owns max_seats / D seats, its
    device KV pool (`num_gpu_blocks` per layer), its hot states, its block tables, its index
    keys and top-k state, and its own pinned host pool (`num_host_blocks`) with its own
    `host_tier.Coordinator` and `TransferEngine`: an ordinary single-engine set of parts
    (`Scheduler`, manager, `Runner`) whose arrays live on the shard's M devices (replicated
    over them: the latent KV row is shared by every head, so each tensor-parallel rank reads
    all of it). Block ids and state rows are local to the shard.
  * The parameters are placed once over the whole mesh: replicated over "data"; the dense
    kernels (`nnx.Linear`: q/kv/o projections, MLP, indexer, LM head) and the embedding split
    on their output dim, the absorbed MLA up-projections on their head dim, over "model"
    (`param_specs`). Each shard's runner reads zero-copy views of them.
  * The decode step is ONE `jax.jit` over the whole mesh: the single-device step
    (`Runner.decode_fn`) under `shard_map` with "data" manual (each shard runs the attention,
    residency resolve and host gathers of its own seats; the Pallas kernels see one shard)
    and "model" left to the partitioner, which splits the projections and MLP by the
    parameters' shardings. Its operands are global arrays assembled without copies from the
    shards' arrays (concatenated on their leading axis, sharded over "data"), and its
    outputs are split back the same way.
  * Per-shard work runs on the shard's devices: block-table and hot-state updates, restores
    and spills (the plan of the shard's coordinator), and prefills (one request at a time).
  * Admission is balanced: a waiting request goes to the data shard with the most free seats,
    then the most free device blocks, then the lowest index (deterministic).

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
import functools
import itertools
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hisparse_jax.cache import AllResident, Residency
from hisparse_jax.engine import compile_cache
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.engine import (
    Engine,
    _OpenStep,
    _raise_notes,
    checked_config,
    recover_parts,
)
from hisparse_jax.engine.metrics import CompileWatch, Metrics, StepClock
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import (
    Runner,
    _with_residency,
    fill_decode_inputs,
    variant_name,
)
from hisparse_jax.engine.sampler import base_key
from hisparse_jax.engine.scheduler import ScheduledStep, Scheduler
from hisparse_jax.engine.static_residency import NoTransfers, StaticResidency
from hisparse_jax.models.protocol import ServedModel
from hisparse_jax.ops import mirror_rows, restore_rows
from host_tier import Coordinator, DeviceBlockTables, HostPool, TransferEngine
from host_tier.sizes import is_int
from pallas_kernels import _compat

DATA, MODEL = "data", "model"


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


def _path_name(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def param_specs(model: Any, model_size: int) -> list[P]:
    """The `PartitionSpec` over `MODEL` of each parameter leaf of `model` (`jax.tree.flatten`
    order of its `nnx.State`): the dim the model's `tensor_parallel_dim(path, shape)` names
    is split (`hisparse_jax.models.ServedModel`); every leaf is replicated when it names none
    or the model has no such method (the partitioner picks the activations' layout, so the
    float rounding may differ from one device: `docs/mesh.md`).

    Raises:
      ValueError: `model_size` does not divide a dim it splits (naming the parameter).
    """
    _, params = nnx.split(model)
    rule = getattr(model, "tensor_parallel_dim", None)
    specs = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _path_name(path)
        axis = None if rule is None else rule(name, tuple(leaf.shape))
        if axis is None:
            specs.append(P())
            continue
        if leaf.shape[axis] % model_size:
            raise ValueError(f"the mesh's model axis ({model_size}) must divide dim {axis} of "
                             f"parameter {name} {tuple(leaf.shape)} (its tensor-parallel split)")
        spec = [None] * leaf.ndim
        spec[axis] = MODEL
        specs.append(P(*spec))
    return specs


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


def _from_host(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array of the same value on every process (each fills its own devices)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def _view(x: jax.Array, sharding: NamedSharding, shape: tuple[int, ...]) -> jax.Array:
    """The part of global array `x` on `sharding`'s devices as an array of `shape` under
    `sharding` (no copy)."""
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [by_device[d] for d in sharding.mesh.devices.flat])


class _MeshQueue:
    """The `Scheduler` face the `Engine` methods it inherits talk to (`add_request`,
    `cancel`, `run`): the engine's queue of requests not yet routed, and the union of the
    shards' schedulers."""

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
        return bool(self.waiting) or any(s.has_work for s in self._schedulers())

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
    """What the inherited `Engine` methods ask of the residency manager: the capacity rule
    (every shard has the same sizes) and the summed counters."""

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


class MeshEngine(Engine):
    """The `Engine` over a ("data", "model") mesh (module docstring, `docs/mesh.md`).

    Usage::

        engine = MeshEngine(models.init_model("tiny"), EngineConfig(max_seats=8), mesh_shape=(2, 2))
        engine.add_request([1, 2, 3], max_new_tokens=16)
        outputs = engine.run()

    Args:
      model: the model (its parameters are placed over the mesh, `param_specs`).
      config: serving knobs. `max_seats` counts every seat of the mesh (a multiple of the data
        axis: each shard gets max_seats / D); `num_gpu_blocks` and `num_host_blocks` are per
        data shard (defaults sized for the shard's seats).
      mesh: a `jax.sharding.Mesh` with axes ("data", "model") (`make_mesh`).
      mesh_shape: (D, M) to build one over every device instead (default: (devices, 1)).

    Requests, `run`, `step`, `warmup`, `cancel`, `summary` and `close` work as on `Engine`
    (`step` and `warmup` are collective with several processes). After an exception from
    `step()` every local data shard is recovered as `Engine` recovers (`_recover`); with
    several processes only when every process raised at the same point (`docs/mesh.md`).
    """

    def __init__(self, model: ServedModel, config: EngineConfig | None = None, *,
                 mesh: Mesh | None = None, mesh_shape: Sequence[int] | None = None) -> None:
        config = checked_config("MeshEngine", model, config)
        if config.num_speculative_tokens:
            raise ValueError("MeshEngine: EngineConfig.num_speculative_tokens must be 0 (the "
                             "mesh engine does not verify drafts yet; use Engine)")
        if config.prefill_chunk_size is not None:
            raise ValueError("MeshEngine: EngineConfig.prefill_chunk_size must be None (the "
                             "mesh engine prefills in one shot; use Engine)")
        if config.async_scheduling:
            raise ValueError("MeshEngine: EngineConfig.async_scheduling must be False (the "
                             "mesh engine schedules synchronously; use Engine)")
        if config.enable_prefix_caching:
            raise ValueError("MeshEngine: EngineConfig.enable_prefix_caching must be False (the "
                             "mesh engine does not reuse published prefixes yet; use Engine)")
        self.spec = mc = model.spec
        if mesh is not None and mesh_shape is not None:
            raise ValueError("MeshEngine takes mesh or mesh_shape, not both")
        if mesh is None:
            mesh = make_mesh((len(jax.devices()), 1) if mesh_shape is None else mesh_shape)
        elif not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
            raise ValueError(f"MeshEngine mesh must be a jax.sharding.Mesh with axes "
                             f"{(DATA, MODEL)}, got {getattr(mesh, 'axis_names', mesh)!r}")
        self.mesh = mesh
        D, M = mesh.shape[DATA], mesh.shape[MODEL]
        self.num_data_shards = D
        if config.max_seats % D:
            raise ValueError(f"EngineConfig.max_seats={config.max_seats} must be a multiple of "
                             f"the mesh's data axis ({D}): each data shard owns max_seats / "
                             f"{D} seats")
        procs = [{d.process_index for d in mesh.devices[i]} for i in range(D)]
        if any(len(p) > 1 for p in procs):
            raise ValueError("MeshEngine: every data shard's devices (a row of the mesh) must "
                             "belong to one process; make the model axis at most the "
                             "devices per process")
        self.multi_process = jax.process_count() > 1
        self.config = ec = config
        self.shard_config = ec_local = dataclasses.replace(ec, max_seats=ec.max_seats // D)
        self.residency = ec.residency
        self.hs_config = cfg = ec_local.hisparse_config(mc)
        ec_local.check_platform(mc, cfg)
        _, state = nnx.split(model)
        specs = param_specs(model, M)
        self.compilation_cache_dir = compile_cache.enable() if ec.compilation_cache else None
        CompileWatch.start()
        self.device = mesh.devices.flat[0]
        self.row_bytes = cfg.row_bytes
        self.metrics = Metrics()
        self._clock = StepClock(self.metrics)
        self.params = [_from_host(np.asarray(leaf), NamedSharding(mesh, spec))
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
        self.host_pool = None
        self._auto_ids = itertools.count()
        self._num_added = 0
        self._trace_counts: collections.Counter[str] = collections.Counter()
        self._jitted: dict[str, Any] = {}
        self._topk_global: Any = None  # the shards' top-k states, stacked (after admissions)
        self._key = _from_host(np.asarray(jax.device_get(base_key(ec.seed))),
                               NamedSharding(mesh, P()))

    def _build_shard(self, model: ServedModel, d: int, devices: tuple[jax.Device, ...],
                     specs: list[P]) -> _Shard:
        ec, cfg, mc = self.shard_config, self.hs_config, self.spec
        submesh = Mesh(np.array(devices, dtype=object), (MODEL,))
        sharding = NamedSharding(submesh, P())
        params = [_view(p, NamedSharding(submesh, spec), p.shape)
                  for p, spec in zip(self.params, specs, strict=True)]
        pool, owns = None, False
        if self.residency.reads_host:
            try:
                pool = HostPool.from_config(cfg, num_layers=mc.num_layers,
                                            device=devices[0] if len(devices) == 1 else devices,
                                            layers_per_array=ec.host_layers_per_array(mc))
            except ValueError as e:
                raise ValueError(f"MeshEngine: the host pool of data shard {d} "
                                 f"(EngineConfig.num_host_blocks={cfg.num_host_blocks}): {e}"
                                 ) from e
            owns = True
        try:
            if self.residency.reads_host:
                manager = Coordinator.from_config(cfg, enable_prefix_caching=False,
                                                  offload_all=ec.naive_offload)
                transfers = TransferEngine(
                    pool, mirror_fn=functools.partial(mirror_rows, backend=ec.ops_backend),
                    restore_fn=functools.partial(restore_rows, backend=ec.ops_backend))
            else:
                manager, transfers = StaticResidency(cfg), NoTransfers()
            runner = Runner(model, ec, cfg, self.residency,
                            tables=DeviceBlockTables.from_config(cfg, device=sharding),
                            transfers=transfers, host_pool=pool, device=sharding, params=params)
        except BaseException:
            if owns:
                pool.close()
            raise
        scheduler = Scheduler(manager, transfers, cfg, self.residency, self.metrics)
        return _Shard(d, devices, sharding, runner, scheduler, pool, owns)

    # ------------------------------------------------------------------ state

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces per jitted mesh decode variant ("decode_fast", "decode_hot")."""
        return self._trace_counts

    @property
    def has_work(self) -> bool:
        """Whether a request waits or runs (on any process: a collective when several)."""
        local = self.scheduler.has_work
        if not self.multi_process:
            return local
        return bool(np.any(_compat.process_allgather(np.array([local], np.int32))))

    def _shard_count(self, shard: _Shard) -> tuple[int, int, int]:
        s = shard.scheduler
        free_seats = self.hs_config.max_num_reqs - len(s.running) - len(s.waiting)
        return free_seats, s.manager.device_pool.num_free, -shard.index

    def _route(self) -> None:
        """Hands waiting requests, in order, to the data shard with the most free seats, then
        the most free device blocks, then the lowest index, while one has a free seat."""
        queue = self.scheduler.waiting
        while queue:
            shard = max(self.shards, key=self._shard_count)
            if self._shard_count(shard)[0] <= 0:
                return
            shard.scheduler.submit(queue.popleft())

    # ------------------------------------------------------------------ one step

    def _open_step(self) -> dict[int, _OpenStep]:
        return {sh.index: _OpenStep(pass_open=False) for sh in self.shards}

    def _step(self, st: dict[int, _OpenStep]) -> None:
        """One scheduler pass per data shard and one mesh decode step (`Engine.step` runs
        it, and recovers each shard after an exception: `_recover`). Collective with
        several processes."""
        self._route()
        scheduled: dict[int, ScheduledStep] = {}
        for sh in self.shards:
            st[sh.index].pass_open = True
            step = sh.scheduler.schedule()
            if step is None:  # no pass left open
                st[sh.index].pass_open = False
                continue
            scheduled[sh.index] = step
            st[sh.index].plan = step.plan
            sh.runner.apply_plan_state(step.plan)
            st[sh.index].state_applied = True
            sh.runner.restore(step.plan)
            st[sh.index].restores_handed = True
        decoding = [s for s in scheduled.values() if s.decode]
        flags = np.array([bool(decoding), any(s.residency.reads_host for s in decoding)],
                         np.int32)
        if self.multi_process:
            flags = np.any(_compat.process_allgather(flags), axis=0)
        if scheduled or flags[0]:
            self.metrics.steps += 1
        pending = None
        if flags[0]:
            residency = self.residency if flags[1] else AllResident()
            pending = self._dispatch({d: s.decode for d, s in scheduled.items()}, residency)
        for sh in self.shards:
            step = scheduled.get(sh.index)
            if step is None:
                continue
            for req in step.admitted:
                self._topk_global = None  # the prefill admits it into its shard's top-k state
                self._prefill(req, st[sh.index], sh.scheduler, sh.runner)
            sh.runner.after_forward(step.plan)
            st[sh.index].spills_handed = True
            sh.scheduler.deliver()
        if pending is not None:
            self._collect_mesh(*pending)

    def _recover(self, st: dict[int, _OpenStep], error: BaseException | None) -> None:
        """`Engine._recover` per data shard (`recover_parts`: the failed step's batch of
        every shard preempted, its admissions requeued, its manager pass closed, unsent
        transfers reported failed, lost device arrays rebuilt). Single-process: with several
        processes it runs on each process's own shards only (`docs/mesh.md`)."""
        notes: list[str] = []
        for sh in self.shards:
            notes += [f"data shard {sh.index}: {n}" for n in
                      recover_parts(sh.scheduler, sh.runner, self.metrics, st[sh.index])]
        self._topk_global = None  # a shard's top-k state may have been rebuilt
        _raise_notes(notes, error)

    # ------------------------------------------------------------------ the mesh step

    def _global(self, parts: Sequence[jax.Array], *, memory_kind: str | None = None
                ) -> jax.Array:
        """The local shards' arrays (one per shard, in `self.shards` order, each replicated
        over its shard's devices) as one global array concatenated on axis 0 and sharded
        over "data" (no copy)."""
        shape = (self.num_data_shards * parts[0].shape[0], *parts[0].shape[1:])
        sharding = NamedSharding(self.mesh, P(DATA), memory_kind=memory_kind)
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [s.data for x in parts for s in x.addressable_shards])

    def _global_tree(self, trees: Sequence[Any]) -> Any:
        return jax.tree.map(lambda *xs: self._global(xs), *trees)

    def _host_array(self, values: np.ndarray) -> jax.Array:
        """A host-built [D * seats] array, sharded over "data" (each process fills the
        blocks of its own shards)."""
        return _from_host(values, NamedSharding(self.mesh, P(DATA)))

    def _topk_state(self) -> Any:
        if self.shards[0].runner.topk_state is None:
            return None
        if self._topk_global is None:
            self._topk_global = self._global_tree(
                [jax.tree.map(lambda x: x[None], sh.runner.topk_state) for sh in self.shards])
        return self._topk_global

    def _decode_jit(self, residency: Residency) -> Any:
        name = variant_name(residency)
        if name in self._jitted:
            return self._jitted[name]
        fn, counts = self.shards[0].runner.decode_fn(), self._trace_counts

        def body(params, cache, tokens, positions, state_rows, tables, host_pools,
                 temperature, key, seeds, topk_state, steps):
            counts[name] += 1  # once per trace
            topk_state = jax.tree.map(lambda x: x[0], topk_state)
            return fn(params, cache, tokens, positions, state_rows, tables, host_pools,
                      temperature, key, seeds, topk_state, steps)

        d = P(DATA)
        aux = {"hits": d, "misses": d}
        if self.config.collect_attention:
            aux["attention"] = P(None, DATA)
        mapped = _compat.shard_map(
            body, mesh=self.mesh, in_specs=(P(), d, d, d, d, d, d, d, P(), d, d, d),
            out_specs=(d, d, aux), manual_axes=(DATA,))
        # Outputs replicated over "model" (the partitioner would shard them like the
        # parameters): the shards' arrays stay whole on each of their devices.
        placed = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), (d, d, aux))
        self._jitted[name] = jitted = jax.jit(mapped, donate_argnums=(1,), out_shardings=placed)
        return jitted

    def _dispatch(self, decode: dict[int, list[Request]], residency: Residency
                  ) -> tuple[dict[int, list[Request]], Residency, jax.Array, dict, float, int]:
        S = self.hs_config.max_num_reqs
        n = self.num_data_shards * S
        tokens, positions, seeds, steps = (np.zeros(n, np.int32) for _ in range(4))
        state_rows = np.full(n, -1, np.int32)
        temperature = np.zeros(n, np.float32)
        inputs = (tokens, positions, state_rows, temperature, seeds, steps)
        for d, reqs in decode.items():  # state rows local to the shard
            fill_decode_inputs(reqs, inputs, offset=d * S)
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        next_tokens, aux = self._mesh_decode(residency, tokens, positions, state_rows,
                                             temperature, seeds, steps)
        return decode, residency, next_tokens, aux, t0, compiles

    def _mesh_decode(self, residency: Residency, tokens: np.ndarray, positions: np.ndarray,
                     state_rows: np.ndarray, temperature: np.ndarray, seeds: np.ndarray,
                     steps: np.ndarray) -> tuple[jax.Array, dict]:
        """The mesh decode step of `residency`'s variant on host-built [D * seats] operands;
        the shards' runners get the new caches. Returns (sampled tokens, aux)."""
        runners = [sh.runner for sh in self.shards]
        cache = self._global_tree([_with_residency(r.cache, residency) for r in runners])
        tables = tuple(self._global([getattr(r.tables, g) for r in runners])
                       for g in ("src", "res", "hot"))
        pools: tuple[jax.Array, ...] = ()
        if residency.reads_host:
            pools = tuple(self._global(list(shards),
                                       memory_kind=runners[0].host_pool.sharding.memory_kind)
                          for shards in zip(*(r.host_pool.arrays for r in runners),
                                            strict=True))
        host = [self._host_array(a) for a in (tokens, positions, state_rows)]
        next_tokens, cache, aux = self._decode_jit(residency)(
            self.params, cache, *host, tables, pools, self._host_array(temperature), self._key,
            self._host_array(seeds), self._topk_state(), self._host_array(steps))
        leaves, treedef = jax.tree.flatten(cache)
        for sh in self.shards:
            local = [_view(x, sh.sharding, (x.shape[0] // self.num_data_shards, *x.shape[1:]))
                     for x in leaves]
            sh.runner._set_cache(jax.tree.unflatten(treedef, local))
        return next_tokens, aux

    def _local_blocks(self, x: jax.Array, axis: int = 0) -> dict[int, np.ndarray]:
        """The blocks of global array `x` (split over "data" on `axis`) of the local shards."""
        by_device = {s.device: s.data for s in x.addressable_shards}
        return {sh.index: np.asarray(by_device[sh.devices[0]]) for sh in self.shards}

    def _collect_mesh(self, decode: dict[int, list[Request]], residency: Residency,
                      next_tokens: jax.Array, aux: dict, t0: float, compiles: int) -> None:
        tokens = self._local_blocks(next_tokens)
        hits = sum(int(b.sum()) for b in self._local_blocks(aux["hits"]).values())
        misses = sum(int(b.sum()) for b in self._local_blocks(aux["misses"]).values())
        attention = (self._local_blocks(aux["attention"], axis=1)
                     if "attention" in aux else None)
        seconds = time.perf_counter() - t0
        reqs = [r for rs in decode.values() for r in rs]
        if self._clock.account(variant_name(residency), seconds, "decode_seconds",
                               compiled=CompileWatch.count != compiles):
            self._clock.decode_tokens += len(reqs)
        self.metrics.record_decode(fast=not residency.reads_host, hits=hits, misses=misses,
                                   index_group_size=self.spec.index_group_size,
                                   row_bytes=self.row_bytes)
        for sh in self.shards:
            for req in decode.get(sh.index, ()):
                sh.scheduler.collected(req)
                if attention is not None and not req.replaying:
                    req.attention.append(attention[sh.index][:, req.seat])
                sh.scheduler.record(req, int(tokens[sh.index][req.seat]))

    # ------------------------------------------------------------------ the rest

    def warmup(self) -> float:
        """`Engine.warmup` for the mesh: every shard's runner compiles its prefill lengths,
        block-table, hot-state and spill buckets (`Runner.warmup`, without its own decode
        variants, which the mesh engine never calls), then each mesh decode variant the mode
        can reach runs once over the whole mesh with every seat padding (state row -1:
        writes and selects nothing), so that no served step compiles. Changes no state a
        request can see. Collective with several processes (every process calls it).
        Returns the seconds it took (also in `metrics.warmup_seconds`).

        Raises:
          RuntimeError: a request is running (call it before serving, or when none runs).
        """
        running = self.scheduler.running
        if running:
            raise RuntimeError(f"MeshEngine.warmup: {len(running)} requests are running; call "
                               "it before serving or when none runs")
        t0 = time.perf_counter()
        variants: list[Hashable] = []
        for sh in self.shards:
            variants += sh.runner.warmup(
                max_spill_pages=getattr(sh.scheduler.manager, "max_spill_pages", 1),
                decode=False)
        self._topk_global = None  # a top-k source's warmup admission rewrote a free seat
        n = self.num_data_shards * self.hs_config.max_num_reqs
        zeros = np.zeros(n, np.int32)
        for name, residency in self.shards[0].runner._reachable_variants():
            jax.block_until_ready(self._mesh_decode(
                residency, zeros, zeros, np.full(n, -1, np.int32), np.zeros(n, np.float32),
                zeros, zeros))
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
        """Waits for every copy into the host pools; closes them."""
        for sh in self.shards:
            sh.scheduler.deliver(wait=True)
            if sh.owns_pool:
                sh.host_pool.close()
