"""`Engine`: continuous-batching decode of a `hisparse_jax.nn.Transformer` with the host tier.

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

For benchmarks at long contexts the top-k can come from a `hisparse_jax.topk_sources`
source instead of the indexer, and `synthetic_prefill` writes deterministic random KV rows
instead of running the model over the prompt; decode always runs the model.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.metrics import Metrics, StepClock, summarise
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.residency import NoTransfers, StaticResidency
from hisparse_jax.engine.runner import PendingDecode, Runner, variant_name
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.nn import Transformer
from hisparse_jax.ops import mirror_rows, restore_rows
from host_tier import Coordinator, DeviceBlockTables, HostPool, TransferEngine


class Engine:
    """Continuous-batching decode with the HiSparse host tier (or all-resident).

    Usage::

        engine = Engine(nn.init_model("tiny"), EngineConfig(...))
        engine.add_request([1, 2, 3], max_new_tokens=16)
        outputs = engine.run()            # {request_id: Request}
        print(engine.summary())
    """

    def __init__(self, model: Transformer, config: EngineConfig | None = None, *,
                 host_pool: Any = None) -> None:
        """Args:
          model: the model (its parameters are split off and committed to the device).
          config: serving knobs (default `EngineConfig()`).
          host_pool: an existing `host_tier.HostPool` to use (and not close): e.g. one pool
            shared by engines that run one after another, instead of pinning a new pool per
            engine. Its block count replaces `config.num_host_blocks` (ignored when
            all-resident).
        """
        config = EngineConfig() if config is None else config
        config.validate()
        self.model_config = mc = model.cfg
        self.config = ec = config
        self.device = device = jax.devices()[0]
        self.residency = residency = ec.residency
        if not residency.reads_host:
            host_pool = None
        elif host_pool is not None:
            want = (mc.num_layers, ec.block_size, mc.row_width, np.dtype(mc.kv_dtype))
            have = (host_pool.num_layers, host_pool.block_size, host_pool.row_width,
                    host_pool.dtype)
            if have != want or host_pool.closed:
                raise ValueError(f"Engine host_pool must be an open HostPool of (layers, "
                                 f"block_size, row_width, dtype) = {want}, got {have}")
        self.hs_config = cfg = ec.hisparse_config(
            mc, num_host_blocks=None if host_pool is None else host_pool.num_blocks)
        self.row_bytes = cfg.row_bytes
        self.metrics = Metrics()
        self._clock = StepClock(self.metrics)
        self._owns_pool = False
        if residency.reads_host:
            manager = Coordinator.from_config(cfg, enable_prefix_caching=False,
                                              offload_all=ec.naive_offload)
            self._owns_pool = host_pool is None
            host_pool = host_pool or HostPool.from_config(cfg, num_layers=mc.num_layers,
                                                           device=device)
            transfers = TransferEngine(host_pool, mirror_fn=mirror_rows,
                                       restore_fn=restore_rows)
        else:
            manager, transfers = StaticResidency(cfg), NoTransfers()
        self.host_pool = host_pool
        self.runner = Runner(model, ec, cfg, residency,
                             tables=DeviceBlockTables.from_config(cfg, device=device),
                             transfers=transfers, host_pool=host_pool, device=device)
        self.scheduler = Scheduler(manager, transfers, cfg, residency, self.metrics)
        self._ids = itertools.count()

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
        """Traces per jitted step ("prefill", "decode_fast", "decode_hot")."""
        return self.runner.trace_counts

    @property
    def num_gpu_blocks(self) -> int:
        return self.hs_config.num_gpu_blocks

    @property
    def mode(self) -> str:
        """"all-resident", "naive-offload" or "hisparse"."""
        return self.residency.name

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int,
                    temperature: float = 0.0, stop_token_ids: Sequence[int] = (),
                    request_id: Hashable | None = None) -> Hashable:
        """Queues a request; returns its id. Stops at `max_new_tokens`, at a stop token (kept
        in the output) or at `max_model_len` tokens."""
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise ValueError("add_request: prompt must not be empty")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt):
            raise ValueError(f"add_request: token ids must be in [0, "
                             f"{self.model_config.vocab_size})")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(f"add_request: prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len={self.config.max_model_len}")
        if max_new_tokens < 1:
            raise ValueError("add_request: max_new_tokens must be >= 1")
        index = next(self._ids)
        rid = index if request_id is None else request_id
        self.scheduler.waiting.append(Request(rid, prompt, int(max_new_tokens), index,
                                              float(temperature),
                                              frozenset(int(t) for t in stop_token_ids)))
        return rid

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
        self.scheduler.deliver(wait=True)
        self.metrics.wall_seconds += time.perf_counter() - t0
        return dict(self.finished)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """One scheduler pass and model step; returns the requests that finished in it.

        The plan runs in order (tables -> hot updates -> restores -> forward -> spills); the
        decode step is dispatched first, the prefills run while it computes, the spills and
        the worker reports run on the host, and the sampled tokens are waited for last.
        """
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return []
        self.metrics.steps += 1
        runner = self.runner
        runner.before_forward(scheduled.plan)
        pending = (runner.dispatch_decode(scheduled.decode, scheduled.residency)
                   if scheduled.decode else None)
        finished = []
        for req in scheduled.admitted:
            finished += self._prefill(req)
        runner.after_forward(scheduled.plan)
        self.scheduler.deliver()
        if pending is not None:
            finished = self._collect(pending) + finished
        return finished

    def _prefill(self, req: Request) -> list[Request]:
        view = self.scheduler.manager.view(req.request_id)
        token, attention, seconds, variant = self.runner.prefill(
            req, np.asarray(view.resident_blocks, np.int64))
        self._clock.account(variant, seconds, "prefill_seconds")
        self.metrics.prefills += 1
        self.metrics.prompt_tokens += req.num_tokens
        self.scheduler.start(req)
        if attention is not None:
            req.attention.append(attention)
        return [req] if self.scheduler.record(req, token) else []

    def _collect(self, pending: PendingDecode) -> list[Request]:
        result = self.runner.collect_decode(pending)
        reqs = pending.requests
        if self._clock.account(variant_name(pending.residency), result.seconds,
                               "decode_seconds"):
            self._clock.decode_tokens += len(reqs)
        self.metrics.record_decode(fast=not pending.residency.reads_host, hits=result.hits,
                                   misses=result.misses,
                                   index_group_size=self.model_config.index_group_size,
                                   row_bytes=self.row_bytes)
        finished = []
        for req in reqs:
            if result.attention is not None:
                req.attention.append(result.attention[:, req.seat])
            if self.scheduler.record(req, int(result.tokens[req.seat])):
                finished.append(req)
        return finished

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
        return summarise(self.metrics, self._clock, mode=self.mode,
                         requests_finished=len(self.finished),
                         stats=self.scheduler.manager.stats, device_bytes=self.device_bytes(),
                         device_allocator_bytes=self.allocator_bytes_in_use(),
                         host_bytes=self.host_bytes(), gpu_blocks=self.num_gpu_blocks)

    def close(self) -> None:
        """Waits for every copy into the host pool; closes the pool if the engine made it."""
        self.scheduler.deliver(wait=True)  # no copy into the pool outlives the engine
        if self._owns_pool:
            self.host_pool.close()
