"""`Engine`: continuous-batching decode of a served model with the host tier.

The model is any Flax NNX module implementing `hisparse_jax.models.ServedModel`; the engine
reads its `spec` (`ModelSpec`) and calls its methods, and knows no model class.

The engine composes its parts; one engine step is one scheduler pass and one model step:

  * `Scheduler` (`scheduler.py`): queues, admission under pressure, preemption, stop
    conditions; it asks the residency manager for the step's plan and residency;
  * the residency manager: the host tier's `Coordinator` (HiSparse; naive offload with
    `offload_all`) or `StaticResidency` (`residency.py`, all-resident), behind one API;
  * `Runner` (`runner.py`): the device arrays, the jitted steps (one per residency variant),
    the plan's execution through the transfer worker (`TransferEngine` or `NoTransfers`);
  * `Metrics` / `StepClock` (`metrics.py`), `Request` (`request.py`), sampling
    (`sampler.py`), `EngineConfig` (`config.py`).

Every mode runs the same step path; the modes differ only in the manager and in the
KV-cache handle's residency type (`hisparse_jax.cache`). `all_resident=True` keeps every KV
row on the device with no host tier at all (the baseline and the exactness reference);
`naive_offload=True` is the other baseline (every row read from host, no hot-region reuse).
HiSparse steps whose scheduled requests have every context page resident run the
`AllResident` variant (upstream `all_context_pages_resident`), which never touches the host
tier.

With `EngineConfig.enable_prefix_caching` the coordinator publishes durable pages and a
request whose prompt starts with published pages prefills only the rest (a chunk from its first
uncached position); the hit pages are made resident before the step (or, with
`prefix_hit_pages="stage"`, stay host-only and each chunk stages the rows it selects:
`docs/semantics.md`, prefill staging) and their index keys come from the engine's
`IndexKeyStore` (`prefix_keys.py`), filled when a page seals and dropped with the published
page (`docs/semantics.md`, prefix reuse in the engine). In the all-resident mode the same
flag is seat reuse (`StaticResidency`): a finished request's state row keeps its rows and a
later prompt extending them prefills only the rest, its rows and index keys already in place.

For benchmarks at long contexts the top-k can come from a `hisparse_jax.topk_sources`
source instead of the indexer, and `synthetic_prefill` writes deterministic random KV rows
instead of running the model over the prompt; decode always runs the model.

Request lifecycle (requests are transactions: whatever one request does wrong, the engine
keeps serving the others and loses none of their work):

  * `add_request` checks everything before queueing (ValueError naming the argument and the
    rule): a new id, token ids in [0, vocab), a non-empty prompt, prompt + max_new_tokens <=
    max_model_len, max_new_tokens >= 1 (or None: until max_model_len), a finite temperature
    >= 0, stop token ids in the vocab; `host_tier.CapacityError` (a ValueError) with the
    residency manager's reason when the pools could never hold the request even alone.
  * A request whose admission or prefill (any chunk of it, with
    `EngineConfig.prefill_chunk_size`) fails is released (its blocks, transfers and seat;
    its hot row is reset at the seat's next admission) and finishes with
    finish_reason="error" and `Request.error`; so does a request that can never make
    progress, or whose page restore the worker reports failed. The step goes on.
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

Asynchronous scheduling (`EngineConfig.async_scheduling`, `_step_async`): each `step()`
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
import dataclasses
import functools
import itertools
import math
import numbers
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from hisparse_jax.engine import compile_cache
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.metrics import CompileWatch, Metrics, StepClock, summarise
from hisparse_jax.engine.prefix_keys import IndexKeyStore
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import DecodeResult, PendingDecode, Runner, variant_name
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.engine.static_residency import NoTransfers, StaticResidency
from hisparse_jax.models.protocol import ModelSpec, ServedModel, check_served_model
from hisparse_jax.ops import mirror_rows, mirror_rows_group, restore_rows
from host_tier import CapacityError, Coordinator, DeviceBlockTables, HostPool, TransferEngine
from host_tier.plan import StepPlan
from host_tier.scheduler.prefix_cache import page_hash
from host_tier.sizes import is_int


@dataclasses.dataclass
class _OpenStep:
    """How far the engine step in progress got (what a failure must undo or close)."""

    pass_open: bool = True  # the scheduler pass began (a mesh shard's may not have)
    plan: StepPlan | None = None
    state_applied: bool = False  # the plan's tables and hot updates are on the device
    restores_handed: bool = False  # the worker has the plan's restores
    spills_handed: bool = False  # the worker has the plan's spills
    culprit: Request | None = None  # a request whose prefill lost the device arrays
    culprit_error: str = ""


@dataclasses.dataclass
class _Flight:
    """A dispatched decode step whose tokens are not collected yet (async scheduling).

    Attributes:
      pending: the runner's handle (its device tokens feed the next step).
      st: how far its engine step got (everything ran but the collection).
      decode: its requests whose tokens are not recorded yet (`Scheduler.collected`).
      fed: requests of it whose fed token was the previous step's device token, with that
        token's index in `generated` (the manager holds a placeholder for it until then).
    """

    pending: PendingDecode
    st: _OpenStep
    decode: list[Request]
    fed: list[tuple[Request, int]]

    @property
    def ids(self) -> frozenset[Hashable]:
        return frozenset(req.request_id for req in self.decode)


class _PrefillLostDevice(Exception):
    """A prefill failed and took the device arrays with it (handled inside `step`)."""


def checked_config(who: str, model: Any, config: EngineConfig | None) -> EngineConfig:
    """The config an engine constructor (`who`) runs with (default `EngineConfig()`),
    validated against itself and the model; ValueError naming `who` and the rule."""
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise ValueError(f"{who} config must be an EngineConfig, got {type(config).__name__}")
    spec = check_served_model(who, model)
    config.validate()
    config.check_model(spec)
    return config


def _token_ids(what: str, values: Any, vocab: int) -> tuple[int, ...]:
    """`values` (a sequence or other iterable of ints) as a tuple of token ids in [0, vocab);
    ValueError naming `what` otherwise."""
    arr = None
    if not isinstance(values, (str, bytes)):
        try:
            arr = np.asarray(values if isinstance(values, (Sequence, np.ndarray))
                             else list(values))
        except (TypeError, ValueError):
            pass
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"add_request: {what} must be a sequence of int token ids, got "
                         f"{values!r:.80}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = next(int(t) for t in arr.tolist() if not 0 <= t < vocab)
        raise ValueError(f"add_request: token ids of {what} must be in [0, {vocab}) (the "
                         f"model's vocab), got {bad}")
    return tuple(arr.tolist())


def recover_parts(scheduler: Scheduler, runner: Runner, metrics: Metrics, st: _OpenStep
                  ) -> list[str]:
    """Makes one scheduler / runner pair consistent after a step failed part-way (module
    docstring: `Engine`'s, or one data shard's of the mesh engine, `mesh.py`): preempts the
    failed step's batch, requeues admissions whose prefill did not run, closes the manager's
    pass and applies its state, reports transfers the worker never got as failed, rebuilds
    lost device arrays. Each part runs even when an earlier one fails; returns their
    failures as notes."""
    manager = scheduler.manager
    notes: list[str] = []

    def attempt(what: str, fn: Callable[[], Any]) -> bool:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recovery goes on; the note says what failed
            notes.append(f"Engine recovery: {what} failed: {type(e).__name__}: {e}")
            return False
        return True

    # 1. The requests whose step did not complete: nothing they did is kept (recompute; a
    # request between prefill chunks restarts its prefill).
    for req in list(scheduler.pass_decode):
        attempt(f"preempting request {req.request_id!r}", lambda r=req: scheduler.preempt(r))
    for pending, again in ((scheduler.pass_chunks, scheduler.preempt),
                           (scheduler.pass_admitted, scheduler.requeue)):
        for req in reversed(list(pending)):
            if req is st.culprit:
                attempt("failing the request",
                        lambda r=req: scheduler.fail(r, st.culprit_error))
            else:
                attempt(f"putting request {req.request_id!r} back in the queue",
                        lambda r=req, again=again: again(r))

    # 2. Close the manager's pass (now without those requests): its table rows and hot
    # updates may concern requests that keep running, so they reach the device.
    def close_pass() -> None:
        st.plan = manager.build_plan()

    if st.plan is None and st.pass_open:
        attempt("closing the scheduler pass", close_pass)
    lost = runner.device_state_lost()
    if not lost and st.plan is not None and not st.state_applied:
        lost = not attempt("applying the plan's tables and hot updates",
                           lambda: runner.apply_plan_state(st.plan))
    # 3. Transfers the worker never got: failed (spills go back to dirty, restores fail
    # their request).
    failed: list[int] = []
    if st.plan is not None:
        if not st.restores_handed:
            failed += [r.transfer_id for r in st.plan.restores]
        if not st.spills_handed:
            failed += [t.transfer_id for t in st.plan.spills]
    if failed:
        attempt("reporting unsent transfers as failed",
                lambda: manager.on_transfers(failed=failed))
    # 4. Device arrays lost: rebuild them; every running request is recomputed.
    if lost or runner.device_state_lost():
        for req in list(scheduler.running.values()):
            attempt(f"preempting request {req.request_id!r}",
                    lambda r=req: scheduler.preempt(r))
        attempt("rebuilding the device state",
                lambda: runner.reset_device_state(manager.tables.full_update()))
        if getattr(manager, "enable_prefix_caching", False):
            # Device copies of published pages are zeros now (and host pool layers may be).
            attempt("dropping the prefix cache", manager.drop_prefix_cache)
        metrics.device_resets += 1
    scheduler.pass_decode, scheduler.pass_admitted, scheduler.pass_chunks = [], [], []
    return notes


def _raise_notes(notes: list[str], error: BaseException | None) -> None:
    """Adds the recovery's `notes` to `error`; without one, raises them (RuntimeError)."""
    if error is not None:
        for note in notes:
            error.add_note(note)
    elif notes:
        raise RuntimeError("; ".join(notes))


def record_decode(scheduler: Scheduler, metrics: Metrics, reqs: list[Request],
                  result: DecodeResult, batch: list[Request] | None = None) -> None:
    """Hands each request of a collected decode step (in batch order) its tokens
    (`Scheduler.record`, up to a stop), its next drafts and its acceptance counts. A request
    that finished since the step was dispatched (async scheduling: a stop learned a step
    late, a cancel, a failed restore) gets nothing: its row is dropped. `batch`: the list
    the step's requests are collected from (`Scheduler.collected`).

    The result's arrays become Python lists once (indexing numpy per token cost more than the
    recording itself at hundreds of requests). A function of its own, so that
    `bench/host_step.py` times it without a device.
    """
    counts, tokens = result.counts.tolist(), result.tokens.tolist()
    drafts = result.drafts.tolist() if result.drafts is not None else None
    attention = result.attention
    collected, record = scheduler.collected, scheduler.record
    for req in reqs:
        collected(req, batch)
        if req.finish_reason is not None:
            continue
        seat = req.seat
        count = counts[seat]
        if req.step_drafts:
            metrics.draft_tokens += len(req.step_drafts)
            metrics.accepted_tokens += count - 1
            req.num_drafted += len(req.step_drafts)
            req.num_accepted += count - 1
        if drafts is not None:
            req.drafts = drafts[seat]
        row = tokens[seat]
        for i in range(count):
            if attention is not None and not req.replaying:
                req.attention.append(attention[:, seat, i])
            if record(req, row[i]):
                break


class Engine:
    """Continuous-batching decode with the HiSparse host tier (or all-resident).

    Usage::

        engine = Engine(models.init_model("tiny"), EngineConfig(...))
        engine.add_request([1, 2, 3], max_new_tokens=16)
        outputs = engine.run()            # {request_id: Request}
        print(engine.summary())
    """

    # Async scheduling: the decode step in flight, and when the last one was collected
    # (class defaults: `MeshEngine` builds its own state and never has one in flight).
    _flight: _Flight | None = None
    _collected_at: float | None = None
    # Prefix caching's index-key store (`__init__` sets it; `MeshEngine` never reuses prefixes).
    prefix_keys: IndexKeyStore | None = None

    def __init__(self, model: ServedModel, config: EngineConfig | None = None, *,
                 host_pool: Any = None) -> None:
        """Args:
          model: the model (its parameters are split off and committed to the device).
          config: serving knobs (default `EngineConfig()`).
          host_pool: an existing `host_tier.HostPool` to use (and not close): e.g. one pool
            shared by engines that run one after another, instead of pinning a new pool per
            engine. Its block count replaces `config.num_host_blocks` and its packing
            (`layers_per_array`, which must divide the index group size)
            `config.pack_host_layers` (ignored when all-resident).
        """
        self.config = ec = config = checked_config("Engine", model, config)
        self.spec = mc = model.spec
        self.compilation_cache_dir = compile_cache.enable() if ec.compilation_cache else None
        CompileWatch.start()
        self.device = device = jax.devices()[0]
        self.residency = residency = ec.residency
        if not residency.reads_host:
            host_pool = None
        elif host_pool is not None:
            want = (mc.num_layers, ec.block_size, *ec.stored_row(mc))
            have = (host_pool.num_layers, host_pool.block_size, host_pool.row_width,
                    host_pool.dtype)
            if have != want or host_pool.closed:
                raise ValueError(f"Engine host_pool must be an open HostPool of (layers, "
                                 f"block_size, row_width, dtype) = {want}, got {have}")
            if mc.index_group_size % host_pool.layers_per_array:
                raise ValueError(
                    f"Engine host_pool keeps {host_pool.layers_per_array} layers per array; "
                    f"the rule is a number dividing the index group size "
                    f"{mc.index_group_size} (a packed array holds whole groups' layers)")
        self.hs_config = cfg = ec.hisparse_config(
            mc, num_host_blocks=None if host_pool is None else host_pool.num_blocks)
        ec.check_platform(mc, cfg)
        self.row_bytes = cfg.row_bytes
        self.metrics = Metrics()
        self._clock = StepClock(self.metrics)
        self._owns_pool = False
        if residency.reads_host and host_pool is None:
            # The pool's RAM check runs before anything per block is built.
            try:
                host_pool = HostPool.from_config(
                    cfg, num_layers=mc.num_layers, device=device,
                    layers_per_array=ec.host_layers_per_array(mc))
            except ValueError as e:
                raise ValueError(f"Engine: the host pool of EngineConfig.num_host_blocks="
                                 f"{cfg.num_host_blocks}: {e}") from e
            self._owns_pool = True
        self.host_pool = host_pool
        try:
            if residency.reads_host:
                try:
                    manager = Coordinator.from_config(
                        cfg, enable_prefix_caching=ec.enable_prefix_caching,
                        offload_all=ec.naive_offload,
                        resident_prefix_hits=(ec.enable_prefix_caching
                                              and not ec.stages_prefix_hits))
                except ValueError as e:
                    raise ValueError(f"Engine: EngineConfig.num_gpu_blocks={cfg.num_gpu_blocks} "
                                     f"/ num_host_blocks={cfg.num_host_blocks} refused by the "
                                     f"host tier: {e}") from e
                transfers = TransferEngine(
                    host_pool, mirror_fn=functools.partial(mirror_rows, backend=ec.ops_backend),
                    restore_fn=functools.partial(restore_rows, backend=ec.ops_backend),
                    mirror_group_fn=functools.partial(mirror_rows_group,
                                                      backend=ec.ops_backend))
            else:
                manager = StaticResidency(cfg, reuse_seats=ec.enable_prefix_caching)
                transfers = NoTransfers()
            self.runner = Runner(model, ec, cfg, residency,
                                 tables=DeviceBlockTables.from_config(cfg, device=device),
                                 transfers=transfers, host_pool=host_pool, device=device)
        except BaseException:
            if self._owns_pool:
                host_pool.close()
            raise
        self.scheduler = Scheduler(manager, transfers, cfg, residency, self.metrics,
                                   draft=self.runner.draft,
                                   prefill_chunk_size=ec.prefill_chunk_size,
                                   max_prefill_tokens=ec.max_prefill_tokens_per_step)
        self._auto_ids = itertools.count()
        self._num_added = 0
        # Prefix caching: host copies of the index keys of published pages (`prefix_keys.py`).
        self.prefix_keys: IndexKeyStore | None = None
        self._key_owners: set[Hashable] = set()  # requests that staged keys
        if ec.enable_prefix_caching and residency.reads_host:  # all-resident: seat reuse
            self.prefix_keys = IndexKeyStore()
            manager.listen(on_publish=self._on_publish,
                           on_unpublish=self.prefix_keys.on_unpublish)

    # ------------------------------------------------------------------ state

    @property
    def waiting(self) -> collections.deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> dict[Hashable, Request]:
        return self.scheduler.running

    @property
    def finished(self) -> dict[Hashable, Request]:
        return self.scheduler.finished

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def trace_counts(self) -> collections.Counter[str]:
        """Traces per jitted step ("prefill" or "prefill_chunk", "decode_fast", "decode_hot")."""
        return self.runner.trace_counts

    @property
    def model_config(self) -> ModelSpec:
        """The served model's `ModelSpec` (`spec`)."""
        return self.spec

    @property
    def num_gpu_blocks(self) -> int:
        return self.hs_config.num_gpu_blocks

    @property
    def mode(self) -> str:
        """"all-resident", "naive-offload" or "hisparse"."""
        return self.residency.name

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int | None,
                    temperature: float = 0.0, stop_token_ids: Iterable[int] = (),
                    request_id: Hashable | None = None, seed: int | None = None) -> Hashable:
        """Queues a request; returns its id. It stops at a stop token (kept in the output),
        at `max_new_tokens` new tokens, or (max_new_tokens=None) at max_model_len tokens.

        Args:
          prompt: token ids in [0, vocab), at least one, fewer than max_model_len.
          max_new_tokens: >= 1 with prompt + max_new_tokens <= max_model_len; None: until
            max_model_len tokens (finish_reason "max_model_len").
          temperature: finite, >= 0 (0: greedy).
          stop_token_ids: token ids in [0, vocab).
          request_id: any hashable not naming a waiting, running or finished request;
            None: an automatic int id (never one in use).
          seed: its sampling seed, an int in [0, 2**32) (default: its add_request order
            index): token i is drawn with a key of (EngineConfig.seed, seed, i) only.

        Raises:
          ValueError: an argument breaks its rule (nothing is queued).
          host_tier.CapacityError: the pools could never hold the request, even alone.
        """
        ec, vocab = self.config, self.spec.vocab_size
        L = ec.max_model_len
        prompt = _token_ids("prompt", prompt, vocab)
        if not prompt:
            raise ValueError("add_request: prompt must not be empty")
        if len(prompt) >= L:
            raise ValueError(f"add_request: prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len={L}")
        if max_new_tokens is None:
            total = L
        elif not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"add_request: max_new_tokens must be an int >= 1 or None, got "
                             f"{max_new_tokens!r}")
        else:
            total = len(prompt) + int(max_new_tokens)
            if total > L:
                raise ValueError(f"add_request: prompt ({len(prompt)} tokens) + max_new_tokens "
                                 f"({max_new_tokens}) = {total} exceeds max_model_len={L} "
                                 "(max_new_tokens=None generates until max_model_len)")
        if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool)
                or not math.isfinite(temperature) or temperature < 0):
            raise ValueError(f"add_request: temperature must be a finite number >= 0, got "
                             f"{temperature!r}")
        stops = frozenset(_token_ids("stop_token_ids", stop_token_ids, vocab))
        if seed is not None and (not is_int(seed) or not 0 <= seed < 2 ** 32):
            raise ValueError(f"add_request: seed must be an int in [0, 2**32) or None, got "
                             f"{seed!r}")
        scheduler = self.scheduler
        if request_id is None:
            request_id = next(self._auto_ids)
            while scheduler.knows(request_id):  # an explicit id took it
                request_id = next(self._auto_ids)
        else:
            try:
                hash(request_id)
            except TypeError:
                raise ValueError(f"add_request: request_id must be hashable, got "
                                 f"{type(request_id).__name__}") from None
            if scheduler.knows(request_id):
                raise ValueError(f"add_request: request_id {request_id!r} names a waiting, "
                                 "running or finished request; ids must be unique")
        # Admitted with its prompt (again after a preemption: it replays its tokens), then one
        # token per step; its last sampled token is never written: total - 1 tokens at most.
        reason = scheduler.manager.capacity_error(
            len(prompt), total - 1, num_lookahead_tokens=ec.num_speculative_tokens)
        if reason is not None:
            raise CapacityError(f"add_request: the request can never be served: {reason}")
        index = self._num_added
        self._num_added += 1
        scheduler.submit(Request(request_id, prompt,
                                 None if max_new_tokens is None else int(max_new_tokens), index,
                                 float(temperature), stops,
                                 seed=None if seed is None else int(seed)))
        return request_id

    def cancel(self, request_id: Hashable) -> bool:
        """Cancels a waiting or running request: it finishes with finish_reason "cancelled"
        (its tokens so far kept) and releases everything it holds. Returns False when it had
        already finished. Call it between steps (e.g. from `run`'s `on_step`).

        Raises:
          ValueError: no request has this id.
        """
        return self.scheduler.cancel(request_id)

    def warmup(self) -> float:
        """Compiles every shape bucket a run can reach (every decode variant, every prefill
        length up to max_model_len, the block-table and hot-state updates, the spill copies:
        `Runner.warmup`), so that no served step compiles; with the persistent compilation
        cache a later process reads them back. Changes no state a request can see. Returns
        the seconds it took (also in `metrics.warmup_seconds`).

        Raises:
          RuntimeError: a request is running (call it before serving, or when none runs).
        """
        if self.running:
            raise RuntimeError(f"Engine.warmup: {len(self.running)} requests are running; call "
                               "it before serving or when none runs")
        t0 = time.perf_counter()
        variants = self.runner.warmup(
            max_spill_pages=getattr(self.scheduler.manager, "max_spill_pages", 1))
        self._clock.mark_compiled(variants)
        seconds = time.perf_counter() - t0
        self.metrics.warmup_seconds += seconds
        return seconds

    def run(self, *, on_step: Callable[[Engine], None] | None = None,
            max_steps: int | None = None) -> dict[Hashable, Request]:
        """Steps until every request finished; returns the finished requests by id."""
        t0 = time.perf_counter()
        n = 0
        while self.has_work and (max_steps is None or n < max_steps):
            self.step()
            n += 1
            if on_step is not None:
                on_step(self)
        self.drain()
        self.scheduler.deliver(wait=True)
        if self.prefix_keys is not None:
            self._prune_keys()  # finished requests whose last copies just completed
        self.metrics.wall_seconds += time.perf_counter() - t0
        return dict(self.finished)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """One scheduler pass and model step; returns the requests that finished in it
        (whatever the reason).

        The plan runs in order (tables -> hot updates -> restores -> forward -> spills); the
        decode step is dispatched first, the prefills run while it computes, the spills and
        the worker reports run on the host, and the sampled tokens are waited for last.
        After an exception the engine is consistent again (module docstring) and the next
        `step()` works.

        With `EngineConfig.async_scheduling` the decode step is left in flight: a call
        schedules and dispatches step t + 1 (fed step t's tokens on the device), runs its
        prefills, then collects step t (`_step_async`); the requests it returns are those
        that finished meanwhile (a stop token of step t among them).
        """
        self.scheduler.newly_finished = []
        if self.config.async_scheduling:
            self._step_async()
        else:
            open_step = self._open_step()
            try:
                self._step(open_step)
            except _PrefillLostDevice:
                self._recover(open_step, None)
            except BaseException as e:
                self._recover(open_step, e)
                raise
        finished, self.scheduler.newly_finished = self.scheduler.newly_finished, []
        return finished

    def drain(self) -> list[Request]:
        """Collects the decode step in flight (async scheduling; nothing otherwise), so that
        every request's tokens are recorded; returns the requests that finished in it. `run`
        and `close` drain; after an exception the engine is recovered as after `step`."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        self.scheduler.newly_finished = []
        self.metrics.drains += 1
        self._land(flight)
        finished, self.scheduler.newly_finished = self.scheduler.newly_finished, []
        return finished

    def _step_async(self) -> None:
        """One asynchronous engine step: launches step t + 1 while step t (`_flight`) runs on
        the device, then collects step t.

        The rule: step t's sampled tokens stay on the device and feed its requests' rows of
        step t + 1 (`Runner.dispatch_decode`'s `prev`); a row whose token the host knows (the
        first decode after a prefill, a replayed token, a request not in step t) takes the
        host's. A request that step t finishes by length is not scheduled again (known on
        the host); one whose step t samples a stop token was (learned a step late): its row
        of step t + 1 is dropped (`record_decode`), never emitted. A pass that schedules
        nothing while step t is in flight preempts and fails no one: step t is collected and
        the next call schedules as the synchronous engine does (a drain). On an exception
        the engine drains too: step t is collected first (its tokens kept), then step t + 1
        is recovered as `step` recovers a failed step; a failed collection recovers step t
        and the step launched after it."""
        prev, self._flight = self._flight, None
        st = self._open_step()
        try:
            flight = self._launch(st, prev)
        except BaseException as e:
            late = self._land_after_failure(prev, e)
            sched = self.scheduler  # requests finished by step t's tokens: not recovered
            sched.pass_decode = [r for r in sched.pass_decode
                                 if sched.running.get(r.request_id) is r]
            if isinstance(e, _PrefillLostDevice):
                self._recover(st, late)
                if late is not None:
                    raise late from None
                return
            self._recover(st, e)
            raise
        self._flight = flight
        if prev is None:
            return
        if flight is None:
            self.metrics.drains += 1
        self._land(prev, flight)

    def _launch(self, st: _OpenStep, prev: _Flight | None) -> _Flight | None:
        """`_step` up to the collection, with `prev` (the decode step in flight, if any)
        feeding the new decode step; returns the new step in flight (None: no decode)."""
        sched, runner = self.scheduler, self.runner
        ahead = prev.ids if prev is not None else frozenset()
        scheduled = sched.schedule(ahead)
        if scheduled is None:
            return None
        self.metrics.steps += 1
        plan = scheduled.plan
        st.plan = plan
        runner.apply_plan_state(plan)
        st.state_applied = True
        runner.restore(plan)
        st.restores_handed = True
        pending, fed = None, []
        if scheduled.decode:
            decode = scheduled.decode
            here = frozenset(req.request_id for req in decode if req.request_id in ahead)
            fed = [(req, req.live) for req in decode
                   if req.request_id in here and not req.replaying]
            pending = runner.dispatch_decode(decode, scheduled.residency,
                                             prev=prev.pending if here else None, ahead=here)
        for req in [*scheduled.admitted, *scheduled.chunks]:
            self._prefill(req, st, sched, runner)
        runner.after_forward(plan)
        st.spills_handed = True
        sched.deliver()
        if pending is None:
            return None
        flight = _Flight(pending, st, sched.pass_decode, fed)
        sched.pass_decode = []  # the step's batch is the flight's now
        return flight

    def _land(self, flight: _Flight, newer: _Flight | None = None) -> None:
        """Collects the decode step `flight` and sets the real ids of the tokens `newer` (the
        step launched after it) was fed on the device (`Coordinator.set_token_ids`). When the
        collection fails, `flight` and `newer` are recovered (`_recover_flights`) and the
        exception propagates."""
        try:
            self._collect(flight.pending, flight.decode)
        except BaseException as e:
            self._flight = None
            self._recover_flights([flight, *([newer] if newer is not None else [])], e)
            raise
        if newer is not None and newer.fed:
            self.scheduler.manager.set_token_ids(
                [(req.request_id, len(req.prompt) + i, req.generated[i])
                 for req, i in newer.fed if req.finish_reason is None])

    def _land_after_failure(self, prev: _Flight | None, error: BaseException
                            ) -> BaseException | None:
        """Collects `prev` after the next step's launch raised `error`; when that fails too,
        returns its exception (recovered already; noted on `error`)."""
        if prev is None:
            return None
        self.metrics.drains += 1
        try:
            self._land(prev)
        except BaseException as late:  # noqa: BLE001 - recovered; the caller re-raises
            error.add_note(f"Engine: collecting the decode step in flight failed too: "
                           f"{type(late).__name__}: {late}")
            return late
        return None

    def _recover_flights(self, flights: list[_Flight], error: BaseException) -> None:
        """Recovers decode steps in flight whose collection failed (`recover_parts` over
        their requests not collected yet; their steps ran everything else); the open pass's
        lists are kept, less the requests that no longer run. Notes go on `error`."""
        sched = self.scheduler
        saved = sched.pass_decode, sched.pass_admitted, sched.pass_chunks
        batch, seen = [], set()
        for flight in flights:
            for req in flight.decode:
                if sched.running.get(req.request_id) is req and id(req) not in seen:
                    seen.add(id(req))
                    batch.append(req)
        sched.pass_decode, sched.pass_admitted, sched.pass_chunks = batch, [], []
        try:
            notes = recover_parts(sched, self.runner, self.metrics, flights[-1].st)
        finally:
            decode, admitted, chunks = saved
            sched.pass_decode = [r for r in decode if sched.running.get(r.request_id) is r]
            sched.pass_admitted = admitted  # not running yet: recovered with their pass
            sched.pass_chunks = [r for r in chunks if sched.running.get(r.request_id) is r]
        _raise_notes(notes, error)

    def _open_step(self) -> Any:
        """The record of how far a step got (`_OpenStep`), which `_recover` reads."""
        return _OpenStep()

    def _step(self, st: _OpenStep) -> None:
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return
        self.metrics.steps += 1
        runner, plan = self.runner, scheduled.plan
        st.plan = plan
        runner.apply_plan_state(plan)
        st.state_applied = True
        runner.restore(plan)
        st.restores_handed = True
        pending = (runner.dispatch_decode(scheduled.decode, scheduled.residency)
                   if scheduled.decode else None)
        for req in [*scheduled.admitted, *scheduled.chunks]:
            self._prefill(req, st, self.scheduler, self.runner)
        runner.after_forward(plan)  # the worker reports a copy that raises as failed
        st.spills_handed = True
        self.scheduler.deliver()
        if pending is not None:
            self._collect(pending)
        if self.prefix_keys is not None:
            self._prune_keys()

    def _prefill(self, req: Request, st: _OpenStep, scheduler: Scheduler,
                 runner: Runner) -> None:
        """Prefills admitted request `req` (its prompt, or its next `chunk` of prompt tokens
        with `EngineConfig.prefill_chunk_size`) with `scheduler`'s manager and `runner` (the
        engine's, or a mesh data shard's); it samples its first token after its last chunk."""
        first = req in scheduler.pass_admitted
        try:
            view = scheduler.manager.view(req.request_id)
            blocks = np.asarray(view.resident_blocks, np.int64)
            if first and req.num_cached and self.prefix_keys is not None:
                self._load_prefix_keys(req, runner)  # (a reused seat has its keys in place)
            if self.config.prefill_chunk_size is None and not req.num_prefilled:
                out = runner.prefill(req, blocks)
            else:  # a chunk, or the rest of a prompt after its prefix hit
                # Staging: host-only hit pages are read by staging the rows a chunk selects.
                staging = ({"host_blocks": np.asarray(view.host_blocks, np.int64)}
                           if self.config.stages_prefix_hits else {})
                out = runner.prefill_chunk(req, blocks, req.num_prefilled, req.chunk, **staging)
                self.metrics.record_staged(
                    *runner.staged_rows,
                    row_bytes=self.row_bytes * self.spec.index_group_size)
            token, attention, seconds, variant, compiled = out
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            message = f"prefill failed: {type(e).__name__}: {e}"
            if runner.device_state_lost():
                st.culprit, st.culprit_error = req, message
                raise _PrefillLostDevice from e
            scheduler.fail(req, message)
            return
        self._clock.account(variant, seconds, "prefill_seconds", compiled=compiled)
        self.metrics.prompt_tokens += req.chunk
        if first and req.num_cached:
            self.metrics.prefix_hit_tokens += req.num_cached
            self.metrics.prefix_hit_requests += 1
        scheduler.start(req)
        if self.prefix_keys is not None:
            self._stage_keys(req, req.num_prefilled, runner)
        if req.prefilling:
            return  # its next chunk runs on a later step
        self.metrics.prefills += 1
        if attention is not None and not req.replaying:
            req.attention.append(attention)
        scheduler.record(req, token)

    def _collect(self, pending: PendingDecode, batch: list[Request] | None = None) -> None:
        """Collects a decode step and records its tokens (`record_decode`; `batch`: the list
        its requests are collected from, default the open pass's)."""
        if self.config.async_scheduling:  # steps overlap: time from the last collection
            result = self.runner.collect_decode(pending, since=self._collected_at)
            self._collected_at = time.perf_counter()
        else:
            result = self.runner.collect_decode(pending)
        reqs = [req for req in pending.requests if req.finish_reason is None]
        self.metrics.dropped_rows += len(pending.requests) - len(reqs)
        emitted = int(result.counts[[req.seat for req in reqs]].sum())
        if self._clock.account(variant_name(pending.residency), result.seconds,
                               "decode_seconds", compiled=result.compiled):
            self._clock.decode_tokens += emitted
        self.metrics.record_decode(fast=not pending.residency.reads_host, hits=result.hits,
                                   misses=result.misses,
                                   index_group_size=self.spec.index_group_size,
                                   row_bytes=self.row_bytes)
        self.metrics.decode_request_steps += len(reqs)
        self.metrics.decode_emitted += emitted
        if self.prefix_keys is not None:
            # Before the tokens are recorded: a request that finishes now may publish its last
            # pages after its seat is reused (this step wrote position prompt + live - 1).
            B = self.config.block_size
            for req in reqs:
                if (len(req.prompt) + req.live) // B > req.key_pages:
                    self._stage_keys(req, len(req.prompt) + req.live, self.runner)
        record_decode(self.scheduler, self.metrics, pending.requests, result, batch)

    # ------------------------------------------------------------------ prefix caching

    def _page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The chained hashes of `req`'s first `num_pages` full pages of tokens (prompt, then
        generated), as the coordinator names its pages (`host_tier`'s `page_hash`)."""
        B, hashes = self.config.block_size, req.page_hashes
        if len(hashes) < num_pages:
            tokens = req.tokens
            while len(hashes) < num_pages:
                p = len(hashes)
                hashes.append(page_hash(hashes[-1] if hashes else None,
                                        tokens[p * B:(p + 1) * B]))
        return hashes[:num_pages]

    def _stage_keys(self, req: Request, num_written: int, runner: Runner) -> None:
        """Keeps the index keys of `req`'s pages sealed since the last call (its seat holds
        rows [0, num_written)): they may be published later (`prefix_keys.py`)."""
        pages = num_written // self.config.block_size
        if pages <= req.key_pages:
            return
        store, hashes = self.prefix_keys, self._page_hashes(req, pages)
        new = [p for p in range(req.key_pages, pages) if hashes[p] not in store]
        fresh = dict(zip(new, runner.read_page_keys(req.seat, new), strict=True)) if new else {}
        for p in range(req.key_pages, pages):  # kept already: this request may publish it too
            store.stage(req.request_id, hashes[p], fresh[p] if p in fresh else store.get(hashes[p]))
        self._key_owners.add(req.request_id)
        req.key_pages = pages

    def _on_publish(self, request_id: Hashable, page: int, h: bytes) -> None:
        """The coordinator published `page` of a request (`Coordinator.listen`): its keys are
        kept from then on; copied from its seat now if its step has not staged them yet (the
        page sealed in this step's decode, whose tokens are collected after the reports)."""
        store = self.prefix_keys
        if store.on_publish(h):
            return
        req = self.scheduler.running.get(request_id)
        if req is None or req.seat < 0:
            return  # keys unknown: a prompt hitting this page fails its prefill (never seen)
        (keys,) = self.runner.read_page_keys(req.seat, [page])
        store.stage(request_id, h, keys)
        self._key_owners.add(request_id)
        store.on_publish(h)

    def _prune_keys(self) -> None:
        """Drops the staged keys of requests that can no longer publish them."""
        running = self.scheduler.running
        gone = [rid for rid in self._key_owners if rid not in running]
        if gone:
            manager = self.scheduler.manager
            self.prefix_keys.prune(gone, manager.publishes)
            self._key_owners.difference_update(rid for rid in gone
                                               if rid not in self.prefix_keys.owners)

    def _load_prefix_keys(self, req: Request, runner: Runner) -> None:
        """Writes the index keys of `req`'s prefix hit (pages covering its `num_cached`
        tokens) into its seat, before the prefill of the rest reads them."""
        B = self.config.block_size
        pages = -(-req.num_cached // B)
        hashes = self._page_hashes(req, pages)
        keys = [self.prefix_keys.get(h) for h in hashes]
        missing = [p for p, k in enumerate(keys) if k is None]
        if missing:
            raise RuntimeError(f"prefix hit on pages {missing} whose index keys are not kept")
        runner.write_page_keys(req.seat, list(enumerate(keys)))

    def _recover(self, st: _OpenStep, error: BaseException | None) -> None:
        """Makes the engine consistent after a step failed part-way (module docstring).
        Each part runs even when an earlier one fails; their failures become notes of
        `error`."""
        _raise_notes(recover_parts(self.scheduler, self.runner, self.metrics, st), error)

    # ------------------------------------------------------------------ metrics

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, index-key caches and hot state on the device."""
        return self.runner.device_bytes()

    @staticmethod
    def allocator_bytes_in_use() -> int | None:
        """The device allocator's bytes in use (GPU), None where the backend does not say."""
        try:
            stats = jax.devices()[0].memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory stats
            return None
        return None if not stats else stats.get("bytes_in_use")

    def host_bytes(self) -> int:
        return 0 if self.host_pool is None else int(self.host_pool.nbytes)

    def summary(self) -> dict[str, Any]:
        """Derived figures of the run so far (`hisparse_jax.engine.metrics.summarise`)."""
        reasons = collections.Counter(r.finish_reason for r in self.finished.values())
        return summarise(self.metrics, self._clock, mode=self.mode,
                         requests_finished=len(self.finished), finish_reasons=reasons,
                         stats=self.scheduler.manager.stats, device_bytes=self.device_bytes(),
                         device_allocator_bytes=self.allocator_bytes_in_use(),
                         host_bytes=self.host_bytes(), gpu_blocks=self.num_gpu_blocks,
                         kv_format=self.hs_config.kv_format, row_bytes=self.row_bytes,
                         host_bytes_per_request=self.hs_config.host_bytes_per_request(
                             self.spec.num_layers))

    def close(self) -> None:
        """Collects the decode step in flight (async scheduling), waits for every copy into
        the host pool; closes the pool if the engine made it."""
        try:
            self.drain()
        finally:
            self.scheduler.deliver(wait=True)  # no copy into the pool outlives the engine
        if self._owns_pool:
            self.host_pool.close()
