"""What `Engine` and `MeshEngine` share at their doors: the configuration and model checks
(`checked_config`), request validation and queueing (`Intake`), the request API and state
properties over those (`EngineFront`), the run loop (`run_steps`) and the warm-up guard
(`check_idle`). Each engine composes these with its own parts: `EngineFront` reads only
what both build (`scheduler`, `_intake`, `spec`, `hs_config`, `residency`, `metrics`,
`_clock`, `row_bytes`, `device_bytes()`, `host_bytes()`)."""

from __future__ import annotations

import collections
import itertools
import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.metrics import summarise
from hisparse_jax.engine.request import Request
from hisparse_jax.models.protocol import ModelSpec, check_served_model
from host_tier import CapacityError
from host_tier.sizes import is_int


def checked_config(who: str, model: Any, config: EngineConfig | None
                   ) -> tuple[EngineConfig, ModelSpec]:
    """The config an engine constructor (`who`) runs with (default `EngineConfig()`),
    validated against itself and the model, and the model's spec; ValueError naming `who`
    and the rule (the model must implement `hisparse_jax.models.ServedModel`)."""
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise ValueError(f"{who} config must be an EngineConfig, got {type(config).__name__}")
    spec = check_served_model(who, model)
    config.validate()
    config.check_model(spec)
    return config, spec


_BOOLS = frozenset({bool, np.bool_})


def token_ids(what: str, values: Any, vocab: int) -> tuple[int, ...]:
    """`values` (a sequence or other iterable of ints) as a tuple of token ids in [0, vocab);
    ValueError naming `what` otherwise."""
    arr = seq = None
    if not isinstance(values, (str, bytes)):
        try:
            seq = values if isinstance(values, (Sequence, np.ndarray)) else list(values)
            arr = np.asarray(seq)
        except (TypeError, ValueError):
            pass
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"add_request: {what} must be a sequence of int token ids, got "
                         f"{values!r:.80}")
    if not isinstance(seq, np.ndarray) and not _BOOLS.isdisjoint(map(type, seq)):
        # numpy makes ints of [5, True]: a bool among ints is caught here.
        raise ValueError(f"add_request: {what} must be a sequence of int token ids in "
                         f"[0, {vocab}) (bools are not token ids), got {values!r:.80}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = next(int(t) for t in arr.tolist() if not 0 <= t < vocab)
        raise ValueError(f"add_request: token ids of {what} must be in [0, {vocab}) (the "
                         f"model's vocab), got {bad}")
    return tuple(arr.tolist())


class Intake:
    """Validates requests (`Engine.add_request`'s rules) and hands them to `scheduler` (a
    `Scheduler`, or the mesh engine's queue: `knows`, `submit`, `manager.capacity_error`)."""

    def __init__(self, scheduler: Any, vocab_size: int, config: EngineConfig) -> None:
        self.scheduler, self.vocab_size, self.config = scheduler, vocab_size, config
        self._auto_ids = itertools.count()
        self._num_added = 0

    def add(self, prompt: Sequence[int], *, max_new_tokens: int | None, temperature: float,
            stop_token_ids: Iterable[int], request_id: Hashable | None, seed: int | None
            ) -> Hashable:
        """`Engine.add_request`: checks every argument, then queues; returns the id."""
        vocab = self.vocab_size
        prompt = token_ids("prompt", prompt, vocab)
        total = self._total_tokens(prompt, max_new_tokens)
        if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool)
                or not math.isfinite(temperature) or temperature < 0):
            raise ValueError(f"add_request: temperature must be a finite number >= 0, got "
                             f"{temperature!r}")
        stops = frozenset(token_ids("stop_token_ids", stop_token_ids, vocab))
        if seed is not None and (not is_int(seed) or not 0 <= seed < 2 ** 32):
            raise ValueError(f"add_request: seed must be an int in [0, 2**32) or None, got "
                             f"{seed!r}")
        request_id = self._request_id(request_id)
        # Admitted with its prompt (again after a preemption: it replays its tokens), then one
        # token per step; its last sampled token is never written: total - 1 tokens at most.
        reason = self.scheduler.manager.capacity_error(
            len(prompt), total - 1, num_lookahead_tokens=self._lookahead())
        if reason is not None:
            raise CapacityError(f"add_request: the request can never be served: {reason}")
        index = self._num_added
        self._num_added += 1
        self.scheduler.submit(Request(
            request_id, prompt, None if max_new_tokens is None else int(max_new_tokens), index,
            float(temperature), stops, seed=None if seed is None else int(seed)))
        return request_id

    def _lookahead(self) -> int:
        """Draft rows a step of one request may write past its counted tokens: k, or with
        asynchronous scheduling up to 2k (the step in flight's drafts and the next step's),
        within one page."""
        ec = self.config
        k = ec.num_speculative_tokens
        return min(2 * k, ec.sizes.block_size - 1) if ec.async_scheduling else k

    def _total_tokens(self, prompt: tuple[int, ...], max_new_tokens: int | None) -> int:
        """The request's most tokens (prompt + new, or max_model_len); ValueError when the
        prompt is empty or the lengths break max_model_len."""
        L = self.config.sizes.max_model_len
        if not prompt:
            raise ValueError("add_request: prompt must not be empty")
        if len(prompt) >= L:
            raise ValueError(f"add_request: prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len={L}")
        if max_new_tokens is None:
            return L
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"add_request: max_new_tokens must be an int >= 1 or None, got "
                             f"{max_new_tokens!r}")
        total = len(prompt) + int(max_new_tokens)
        if total > L:
            raise ValueError(f"add_request: prompt ({len(prompt)} tokens) + max_new_tokens "
                             f"({max_new_tokens}) = {total} exceeds max_model_len={L} "
                             "(max_new_tokens=None generates until max_model_len)")
        return total

    def _request_id(self, request_id: Hashable | None) -> Hashable:
        """The new request's id: `request_id` when hashable and unknown, else a fresh int."""
        scheduler = self.scheduler
        if request_id is None:
            request_id = next(self._auto_ids)
            while scheduler.knows(request_id):  # an explicit id took it
                request_id = next(self._auto_ids)
            return request_id
        try:
            hash(request_id)
        except TypeError:
            raise ValueError(f"add_request: request_id must be hashable, got "
                             f"{type(request_id).__name__}") from None
        if scheduler.knows(request_id):
            raise ValueError(f"add_request: request_id {request_id!r} names a waiting, "
                             "running or finished request; ids must be unique")
        return request_id


def run_steps(engine: Any, on_step: Callable[[Any], None] | None, max_steps: int | None
              ) -> None:
    """Steps `engine` while it has work (at most `max_steps` steps, an int >= 0 or None: no
    limit), calling `on_step(engine)` after each, then drains it; ValueError for another
    `max_steps`, before any step."""
    if max_steps is not None and (not is_int(max_steps) or max_steps < 0):
        raise ValueError(f"run: max_steps must be an int >= 0 or None (no limit), got "
                         f"{max_steps!r}")
    n = 0
    while engine.has_work and (max_steps is None or n < max_steps):
        engine.step()
        n += 1
        if on_step is not None:
            on_step(engine)
    engine.drain()


def check_idle(who: str, running: dict) -> None:
    """RuntimeError when requests run (warm-up must come before serving, or between)."""
    if running:
        raise RuntimeError(f"{who}.warmup: {len(running)} requests are running; call it "
                           "before serving or when none runs")


class EngineFront:
    """The request API and state properties `Engine` and `MeshEngine` share (module
    docstring: the attributes it reads)."""

    _closed = False  # set by the engine's close(): no request is taken after it

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (the engine takes no request then)."""
        return self._closed

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
        """Whether a request waits or runs (the mesh engine: on any process, a collective)."""
        return self.scheduler.has_work

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
          RuntimeError: the engine is closed.
        """
        if self._closed:
            raise RuntimeError("add_request: the engine is closed (close() was called); the "
                               "rule: requests go to an open engine")
        return self._intake.add(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                stop_token_ids=stop_token_ids, request_id=request_id,
                                seed=seed)

    def cancel(self, request_id: Hashable) -> bool:
        """Cancels a waiting or running request: it finishes with finish_reason "cancelled"
        (its tokens so far kept) and releases everything it holds. Returns False when it had
        already finished. Call it between steps (e.g. from `run`'s `on_step`).

        Raises:
          ValueError: no request has this id (or it is not hashable: no id is).
        """
        try:
            hash(request_id)
        except TypeError:
            raise ValueError(f"cancel: request_id must be hashable, got "
                             f"{type(request_id).__name__}") from None
        return self.scheduler.cancel(request_id)

    @staticmethod
    def allocator_bytes_in_use() -> int | None:
        """The device allocator's bytes in use (GPU), None where the backend does not say."""
        try:
            stats = jax.devices()[0].memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory stats
            return None
        return None if not stats else stats.get("bytes_in_use")

    def summary(self) -> dict[str, Any]:
        """Derived figures of the run so far (`hisparse_jax.engine.metrics.summarise`)."""
        reasons = collections.Counter(r.finish_reason for r in self.finished.values())
        cfg = self.hs_config
        return summarise(self.metrics, self._clock, mode=self.mode,
                         requests_finished=len(self.finished), finish_reasons=reasons,
                         stats=self.scheduler.manager.stats, device_bytes=self.device_bytes(),
                         device_allocator_bytes=self.allocator_bytes_in_use(),
                         host_bytes=self.host_bytes(), gpu_blocks=self.num_gpu_blocks,
                         kv_format=cfg.kv_format, row_bytes=self.row_bytes,
                         host_bytes_per_request=cfg.host_bytes_per_request(self.spec.num_layers))
