"""`Engine`: continuous-batching decode of a served model with the host tier.

The model is any Flax NNX module implementing `hisparse_jax.models.ServedModel`; the engine
reads its `spec` (`ModelSpec`) and calls its methods, and knows no model class.

The engine composes its parts; one engine step is one scheduler pass and one model step:

  * `Intake` (`front.py`): request validation and queueing;
  * `Scheduler` (`scheduler.py`): queues, admission under pressure, preemption, stop
    conditions; it asks the residency manager for the step's plan and residency;
  * the residency manager: the host tier's `Coordinator` (HiSparse; naive offload with
    `offload_all`) or `StaticResidency` (`static_residency.py`, all-resident), behind one
    API;
  * `Runner` (`runner.py`): the device arrays (`device_state.py`), the jitted steps (one per
    residency variant, `step_builder.py`), warm-up (`warmup.py`), with the transfer worker
    (`TransferEngine` or `NoTransfers`);
  * the step loop (`loops.py`: `SyncLoop`, or `AsyncLoop` with async scheduling) over the
    one step path (`step.py`: `execute` runs a scheduled plan);
  * `Metrics` / `StepClock` (`metrics.py`), `Request` (`request.py`), sampling
    (`sampler.py`), `EngineConfig` (`config.py`).

Every mode runs the same step path; the modes differ only in the manager and in the
KV-cache handle's residency type (`hisparse_jax.cache`, `EngineConfig.residency`).
`AllResident()` keeps every KV row on the device with no host tier at all (the baseline and
the exactness reference); `NaiveOffload()` is the other baseline (every row read from host,
no hot-region reuse).
HiSparse steps whose scheduled requests have every context page resident run the
`AllResident` variant (upstream `all_context_pages_resident`), which never touches the host
tier.

With `EngineConfig.prefill.prefix_caching` the coordinator publishes durable pages and a
request whose prompt starts with published pages prefills only the rest (a chunk from its first
uncached position); the hit pages are made resident before the step (or, with
`prefill.prefix_hit_pages="stage"`, stay host-only and each chunk stages the rows it selects:
`docs/semantics.md`, prefill staging) and their index keys come from the engine's
`IndexKeyStore` (`prefix_keys.py`, kept by `PageKeys`, `page_keys.py`), filled when a page
seals and dropped with the published page (`docs/semantics.md`, prefix reuse in the
engine). In the all-resident mode the same flag is seat reuse (`StaticResidency`): a
finished request's state row keeps its rows and a later prompt extending them prefills only
the rest, its rows and index keys already in place.

For benchmarks at long contexts the top-k can come from a `hisparse_jax.topk_sources`
source instead of the indexer, and `prefill.synthetic` writes deterministic random KV rows
instead of running the model over the prompt; decode always runs the model.

Request lifecycle (requests are transactions: whatever one request does wrong, the engine
keeps serving the others and loses none of their work):

  * `add_request` checks everything before queueing (ValueError naming the argument and the
    rule; RuntimeError once the engine is closed): a new id, int token ids (never bools) in
    [0, vocab), a non-empty prompt, prompt + max_new_tokens <=
    max_model_len, max_new_tokens >= 1 (or None: until max_model_len), a finite temperature
    >= 0, stop token ids in the vocab; `host_tier.CapacityError` (a ValueError) with the
    residency manager's reason when the pools could never hold the request even alone.
  * A request whose admission or prefill (any chunk of it, with
    `EngineConfig.prefill.chunk_size`) fails is released (its blocks, transfers and seat;
    its hot row is reset at the seat's next admission) and finishes with
    finish_reason="error" and `Request.error`; so does a request that can never make
    progress, whose page restore the worker reports failed, or whose host draft source
    breaks its rule (`draft_sources.host_drafts`). The step goes on.
  * `cancel(request_id)`: a waiting or running request finishes with "cancelled".
  * Any other exception from `step()` leaves an engine whose next `step()` works: the
    requests of the failed step's batch are preempted (recompute by replay: their tokens are
    kept and fed back, `scheduler.py`), admitted requests whose prefill did not
    run go back to the queue (and so do requests whose next prefill chunk did not run: they
    restart their prefill), the manager's pass is closed and its table / hot-state updates
    applied, the plan's transfers that never reached the worker are reported failed; when
    the device arrays were lost (donated to a failed call, or poisoned) they are rebuilt
    and every running request is preempted. Then the exception propagates (a prefill that
    lost the device arrays only fails its own request).

Asynchronous scheduling (`EngineConfig.async_scheduling`, `loops.AsyncLoop`): each `step()`
schedules and dispatches decode step t + 1 (fed step t's sampled tokens on the device) before
it collects step t; a stop token is learned a step late and the request's extra row dropped;
an exception, or a pass with nothing to schedule, drains the step in flight first
(`docs/semantics.md`, asynchronous scheduling). `run`, `drain` and `close` collect it.

Start-up: `EngineConfig.compilation_cache` turns on jax's persistent compilation cache
(`compile_cache.py`); `warmup()` compiles every shape bucket a run can reach, so that no
served step compiles.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Hashable
from typing import Any

import jax

from hisparse_jax.cache import NaiveOffload
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import compile_cache
from hisparse_jax.engine import warmup as _warmup
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.front import (
    EngineFront,
    Intake,
    check_idle,
    checked_config,
    run_steps,
)
from hisparse_jax.engine.loops import AsyncLoop, SyncLoop
from hisparse_jax.engine.metrics import CompileWatch, Metrics, StepClock
from hisparse_jax.engine.page_keys import PageKeys
from hisparse_jax.engine.prefix_keys import IndexKeyStore
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import Runner
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.engine.static_residency import NoTransfers, StaticResidency
from hisparse_jax.engine.step import StepContext
from hisparse_jax.models.protocol import ServedModel
from hisparse_jax.ops import mirror_rows, mirror_rows_group, restore_rows
from host_tier import Coordinator, DeviceBlockTables, HostPool, TransferEngine


def host_tier_coordinator(ec: EngineConfig, cfg: HiSparseConfig) -> Coordinator:
    """The host tier's `Coordinator` of `ec`'s mode over the sizes `cfg` (prefix caching,
    naive offload, resident prefix hits unless they are staged); the host tier's ValueError
    when it refuses the sizes."""
    prefix = ec.prefill.prefix_caching
    return Coordinator.from_config(
        cfg, enable_prefix_caching=prefix, offload_all=isinstance(ec.residency, NaiveOffload),
        resident_prefix_hits=prefix and not ec.stages_prefix_hits)


def residency_parts(cfg: HiSparseConfig, ec: EngineConfig, host_pool: Any, *,
                    who: str | None = "Engine", mirror_groups: bool = True
                    ) -> tuple[Any, Any]:
    """The residency manager and transfer worker of `ec`'s mode: the host tier's
    `Coordinator` and `TransferEngine` over `host_pool` when the mode reads host rows (the
    group spill copy with `mirror_groups`; a refusal's ValueError names `who`'s sizes
    unless who is None), else `StaticResidency` (seat reuse with prefix caching) and
    `NoTransfers`."""
    if not ec.residency.reads_host:
        return StaticResidency(cfg, reuse_seats=ec.prefill.prefix_caching), NoTransfers()
    try:
        manager = host_tier_coordinator(ec, cfg)
    except ValueError as e:
        if who is None:
            raise
        raise ValueError(f"{who}: EngineConfig.sizes.num_gpu_blocks={cfg.num_gpu_blocks} "
                         f"/ num_host_blocks={cfg.num_host_blocks} refused by the "
                         f"host tier: {e}") from e
    backend = ec.tuning.ops_backend
    # The host tier's row lists are valid by construction: no value check (a host sync).
    copy = {"backend": backend, "validate": False}
    groups = ({"mirror_group_fn": functools.partial(mirror_rows_group, **copy)}
              if mirror_groups else {})
    transfers = TransferEngine(
        host_pool, mirror_fn=functools.partial(mirror_rows, **copy),
        restore_fn=functools.partial(restore_rows, **copy), **groups)
    return manager, transfers


class Engine(EngineFront):
    """Continuous-batching decode with the HiSparse host tier (or all-resident).

    Usage::

        engine = Engine(models.init_model("tiny"), EngineConfig(...))
        engine.add_request([1, 2, 3], max_new_tokens=16)
        outputs = engine.run()            # {request_id: Request}
        print(engine.summary())

    `add_request`, `cancel`, `summary` and the state properties (`waiting`, `running`,
    `finished`, `has_work`, `mode`, `model_config`, `num_gpu_blocks`) are `EngineFront`'s
    (`front.py`, shared with `MeshEngine`).
    """

    def __init__(self, model: ServedModel, config: EngineConfig | None = None, *,
                 host_pool: Any = None) -> None:
        """Args:
          model: the model (`hisparse_jax.models.ServedModel`; its parameters are split off
            and committed to the device).
          config: serving knobs (default `EngineConfig()`).
          host_pool: an existing open `host_tier.HostPool` to use (and not close): e.g. one
            pool shared by engines that run one after another, instead of pinning a new pool
            per engine. A pool serves one live engine at a time (each engine allocates its
            blocks on its own): the engine claims it (`HostPool.claim`) until its `close()`;
            a pool another live engine holds is refused (ValueError). Its block count
            replaces `config.sizes.num_host_blocks` and its packing
            (`layers_per_array`, which must divide every index group's size: an array holds
            one group's layers only) `config.tuning.pack_host_layers` (ignored when
            all-resident).
        """
        self.config, self.spec = ec, spec = checked_config("Engine", model, config)
        self.compilation_cache_dir = compile_cache.enable() if ec.compilation_cache else None
        CompileWatch.start()
        self.device = device = jax.devices()[0]
        self.residency = residency = ec.residency
        host_pool = self._checked_pool(host_pool) if residency.reads_host else None
        self.hs_config = cfg = ec.hisparse_config(
            spec, num_host_blocks=None if host_pool is None else host_pool.num_blocks)
        ec.check_platform(spec, cfg)
        self.row_bytes = cfg.row_bytes
        self.metrics = Metrics()
        self._clock = StepClock(self.metrics)
        self._owns_pool = residency.reads_host and host_pool is None
        if self._owns_pool:  # the pool's RAM check runs before anything per block is built
            try:
                host_pool = HostPool.from_config(
                    cfg, num_layers=spec.num_layers, device=device,
                    layers_per_array=ec.host_layers_per_array(spec))
            except ValueError as e:
                raise ValueError(f"Engine: the host pool of EngineConfig.sizes.num_host_blocks="
                                 f"{cfg.num_host_blocks}: {e}") from e
        self.host_pool = host_pool
        try:
            manager, transfers = residency_parts(cfg, ec, host_pool)
            self.runner = Runner(model, ec, cfg, residency,
                                 tables=DeviceBlockTables.from_config(cfg, device=device),
                                 transfers=transfers, host_pool=host_pool, device=device)
        except BaseException:
            if self._owns_pool:
                host_pool.close()
            raise
        self.scheduler = Scheduler(manager, transfers, cfg, residency, self.metrics,
                                   draft=self.runner.draft, vocab_size=spec.vocab_size,
                                   prefill_chunk_size=ec.prefill.chunk_size,
                                   max_prefill_tokens=ec.prefill.max_tokens_per_step)
        self._intake = Intake(self.scheduler, spec.vocab_size, ec)
        # Prefix caching: host copies of the index keys of published pages (`page_keys.py`);
        # all-resident: seat reuse (`StaticResidency`), the keys stay in their seat.
        page_keys = None
        if ec.prefill.prefix_caching and residency.reads_host:
            page_keys = PageKeys(self.scheduler, self.runner, ec.sizes.block_size)
        self.prefix_keys: IndexKeyStore | None = None if page_keys is None else page_keys.store
        ctx = StepContext(ec, spec, self.metrics, self._clock, self.row_bytes, page_keys)
        self._loop = (AsyncLoop if ec.async_scheduling else SyncLoop)(
            ctx, self.scheduler, self.runner)
        if host_pool is not None:  # this engine's alone until close()
            host_pool.claim(self)

    def _checked_pool(self, host_pool: Any) -> Any:
        """An existing host pool `host_pool` (None: the engine makes one) when it fits the
        model and config; ValueError naming the rule otherwise."""
        if host_pool is None:
            return None
        ec, spec = self.config, self.spec
        want = (spec.num_layers, ec.sizes.block_size, *ec.stored_row(spec))
        if host_pool.closed:
            raise ValueError(f"Engine host_pool is closed; it must be an open HostPool of "
                             f"(layers, block_size, row_width, dtype) = {want}")
        if host_pool.owner is not None:
            raise ValueError("Engine host_pool is in use by another live engine; the rule: a "
                             "HostPool serves one engine at a time, until that engine's "
                             "close() (two engines would overwrite each other's host rows)")
        have = (host_pool.num_layers, host_pool.block_size, host_pool.row_width,
                host_pool.dtype)
        if have != want:
            raise ValueError(f"Engine host_pool must be an open HostPool of (layers, "
                             f"block_size, row_width, dtype) = {want}, got {have}")
        groups = spec.group_layers
        if any(n % host_pool.layers_per_array for n in groups):
            size = (f"the index group size {groups[0]}" if len(set(groups)) == 1
                    else f"every index group's size {groups}")
            raise ValueError(
                f"Engine host_pool keeps {host_pool.layers_per_array} layers per array; "
                f"the rule is a number dividing {size} (a packed array holds whole groups' "
                "layers)")
        return host_pool

    # ------------------------------------------------------------------ state

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces per jitted step ("prefill" or "prefill_chunk", "decode_fast", "decode_hot")."""
        return self.runner.trace_counts

    # ------------------------------------------------------------------ serving

    def warmup(self) -> float:
        """Compiles every shape bucket a run can reach (every decode variant, every prefill
        length up to max_model_len, the block-table and hot-state updates, the spill copies:
        `hisparse_jax.engine.warmup`), so that no served step compiles; with the persistent
        compilation cache a later process reads them back. Changes no state a request can
        see. Returns the seconds it took (also in `metrics.warmup_seconds`).

        Raises:
          RuntimeError: a request is running (call it before serving, or when none runs).
        """
        check_idle("Engine", self.running)
        t0 = time.perf_counter()
        variants = self.runner.warmup(
            max_spill_pages=_warmup.spill_budget(self.scheduler.manager))
        self._clock.mark_compiled(variants)
        seconds = time.perf_counter() - t0
        self.metrics.warmup_seconds += seconds
        return seconds

    def run(self, *, on_step: Callable[[Engine], None] | None = None,
            max_steps: int | None = None) -> dict[Hashable, Request]:
        """Steps until every request finished; returns the finished requests by id."""
        t0 = time.perf_counter()
        run_steps(self, on_step, max_steps)
        self.scheduler.deliver(wait=True)
        if self._loop.ctx.prefix is not None:
            self._loop.ctx.prefix.prune()  # finished requests whose last copies just completed
        self.metrics.wall_seconds += time.perf_counter() - t0
        return dict(self.finished)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """One scheduler pass and model step; returns the requests that finished in it
        (whatever the reason).

        The plan runs in order (tables -> hot updates -> restores -> forward -> spills:
        `step.execute`); the decode step is dispatched first, the prefills run while it
        computes, the spills and the worker reports run on the host, and the sampled tokens
        are waited for last. After an exception the engine is consistent again (module
        docstring) and the next `step()` works.

        With `EngineConfig.async_scheduling` the decode step is left in flight: a call
        schedules and dispatches step t + 1 (fed step t's tokens on the device), runs its
        prefills, then collects step t (`loops.AsyncLoop`); the requests it returns are
        those that finished meanwhile (a stop token of step t among them).
        """
        self.scheduler.newly_finished = []
        self._loop.step()
        finished, self.scheduler.newly_finished = self.scheduler.newly_finished, []
        return finished

    def drain(self) -> list[Request]:
        """Collects the decode step in flight (async scheduling; nothing otherwise), so that
        every request's tokens are recorded; returns the requests that finished in it. `run`
        and `close` drain; after an exception the engine is recovered as after `step`."""
        if self._loop.flight is None:
            return []
        self.scheduler.newly_finished = []
        self._loop.drain()
        finished, self.scheduler.newly_finished = self.scheduler.newly_finished, []
        return finished

    # ------------------------------------------------------------------ metrics

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, per-seat arrays and hot state on the device."""
        return self.runner.device_bytes()

    def host_bytes(self) -> int:
        return 0 if self.host_pool is None else int(self.host_pool.nbytes)

    def close(self) -> None:
        """Collects the decode step in flight (async scheduling), waits for every copy into
        the host pool; closes the pool if the engine made it, else frees it for another
        engine. A closed engine takes no request."""
        self._closed = True
        try:
            self.drain()
        finally:
            self.scheduler.deliver(wait=True)  # no copy into the pool outlives the engine
        if self.host_pool is not None:
            self.host_pool.release(self)
            if self._owns_pool:
                self.host_pool.close()
