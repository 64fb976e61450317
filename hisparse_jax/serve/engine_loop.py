"""`EngineLoop`: the one thread that owns an `Engine`, and the requests handed to it.

The engine is not thread-safe; every call on it (add_request, step, cancel, drain, close)
runs on this thread. Other threads talk to it through a `queue.SimpleQueue` of commands:
`submit(job)` (a new request; refused with `QueueFull` when `capacity` requests are already
in the server, or `Draining` once `begin_drain` was called or the loop has ended),
`cancel(request_id)` and `cancel_all()`. After every engine step the loop diffs each live
request's `Request.generated` against what it already reported and hands each job one
`Update` (the new token ids, and the finish reason once it finished) through the job's
`sink`, which must be safe to call from this thread (the server's sinks post into its
event loop).

Lifecycle of a job, as its sink sees it: one `Update(accepted=True)` (or one with `rejected`,
the engine's ValueError message, and nothing after), then updates with tokens, the last one
with `finish_reason` (the engine's: stop, length, max_model_len, cancelled, error; `error`
holds the message of an error). A step that raises is left to the engine's recovery (its
batch is preempted and replayed: no token is lost); after `max_step_failures` failing steps
in a row every live job is finished with "error" and the loop serves on. A preempted request
may briefly hold fewer tokens than were reported (its last token is sampled again by the
replay, with the same key): nothing is reported until it has more.

The loop measures through a `LoopObserver` (the server's Prometheus collectors), called on
this thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

from hisparse_jax.engine import Engine, Request

log = logging.getLogger("hisparse_jax.serve")


class QueueFull(Exception):
    """The server holds `capacity` requests already (retry later)."""


class Draining(Exception):
    """The server is shutting down and takes no new request."""


@dataclasses.dataclass
class Update:
    """What happened to one job since its last update (module docstring: the order)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    accepted: bool = False
    rejected: str | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """A request handed to the loop: the engine's add_request arguments, its id, the `sink`
    that receives its updates (called on the loop thread) and its arrival time
    (`time.monotonic()`, for the latency metrics). The loop keeps its progress: `req` (the
    engine's Request once added), `sent` (tokens reported), first / last token times."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int | None
    temperature: float
    seed: int | None
    stop_token_ids: tuple[int, ...]
    sink: Callable[[Update], None]
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    req: Request | None = None
    sent: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class LoopObserver:
    """The loop's measurement hooks (no-ops here; the server's metrics override them). Each
    runs on the loop thread."""

    def on_step(self, engine: Engine, seconds: float, failed: bool) -> None:
        """After an engine step (its wall `seconds`; `failed`: it raised)."""

    def on_state(self, engine: Engine, pending: int) -> None:
        """After the loop changed what runs (`pending`: submitted, not yet in the engine)."""

    def on_tokens(self, job: Job, count: int, now: float) -> None:
        """`count` new tokens of `job` were reported at `now` (before its times move)."""

    def on_finish(self, job: Job, reason: str, now: float) -> None:
        """`job` finished with the engine's `reason` (or was rejected: "rejected")."""


class EngineLoop:
    """The engine's thread (module docstring). `capacity`: the most requests in the server
    at once (submitted and not finished); `max_step_failures`: failing steps in a row before
    every live job is failed."""

    def __init__(self, engine: Engine, *, capacity: int, observer: LoopObserver | None = None,
                 max_step_failures: int = 3) -> None:
        if capacity < 1:
            raise ValueError(f"EngineLoop capacity must be >= 1, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self.observer = observer or LoopObserver()
        self.max_step_failures = max_step_failures
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0   # submitted and not finished (guarded by _lock)
        self._pending = 0       # submitted, not yet added to the engine (guarded by _lock)
        self._draining = False
        self._closing = False   # the loop is ending: nothing is taken any more
        self._live: dict[Hashable, Job] = {}   # loop thread only
        self._failures = 0
        self._running = threading.Event()
        self._running.set()     # cleared by pause(): the loop takes commands but never steps
        self._thread = threading.Thread(target=self._run, name="hisparse-engine-loop",
                                        daemon=True)

    # ------------------------------------------------------------------ any thread

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def outstanding(self) -> int:
        """Requests submitted and not finished yet."""
        return self._outstanding

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        """Hands `job` to the engine thread; raises `Draining` or `QueueFull` instead."""
        with self._lock:
            if self._closing:
                raise Draining("the engine loop has stopped")
            if self._draining:
                raise Draining("the server is shutting down")
            if self._outstanding >= self.capacity:
                raise QueueFull(f"the server holds {self._outstanding} requests, its capacity "
                                f"(--seats + --max-queue)")
            self._outstanding += 1
            self._pending += 1
        self._commands.put(("add", job))

    def cancel(self, request_id: str) -> None:
        """Cancels a submitted request (a finished or unknown one is ignored)."""
        self._commands.put(("cancel", request_id))

    def cancel_all(self) -> None:
        """Cancels every submitted request."""
        self._commands.put(("cancel_all", None))

    def begin_drain(self) -> None:
        """From now on `submit` raises `Draining`; submitted requests go on."""
        with self._lock:
            self._draining = True

    def pause(self) -> None:
        """Test hook: the loop keeps taking commands but runs no engine step until `resume`."""
        self._running.clear()
        self._commands.put(("wake", None))

    def resume(self) -> None:
        self._running.set()
        self._commands.put(("wake", None))

    def stop(self, timeout: float | None = None) -> None:
        """Ends the loop: live jobs finish with "error" (the server stopped) and the engine is
        closed on the loop thread. Blocks until then (at most `timeout` seconds)."""
        self._running.set()
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            while True:
                if not self.engine.has_work:
                    self.engine.drain()  # a step in flight holding only dropped rows
                if not self._take_commands():
                    break
                if self._running.is_set() and self.engine.has_work:
                    self._step()
                    self._report()
        except BaseException:
            log.exception("the engine loop stopped on an unexpected error")
            raise
        finally:
            with self._lock:
                self._closing = True
            self._fail_all("the server stopped before the request finished")
            self.engine.close()

    def _take_commands(self) -> bool:
        """Runs the queued commands (blocking for one while there is nothing to step); False
        once told to stop."""
        idle = not self.engine.has_work or not self._running.is_set()
        while True:
            try:
                kind, arg = self._commands.get(block=idle)
            except queue.Empty:
                return True
            idle = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "cancel":
                self._cancel(arg)
            elif kind == "cancel_all":
                for rid in list(self._live):
                    self._cancel(rid)
            self.observer.on_state(self.engine, self._pending)
            self._report()

    def _add(self, job: Job) -> None:
        engine = self.engine
        with self._lock:
            self._pending -= 1
        try:
            rid = engine.add_request(job.prompt, max_new_tokens=job.max_new_tokens,
                                     temperature=job.temperature,
                                     stop_token_ids=job.stop_token_ids,
                                     request_id=job.request_id, seed=job.seed)
        except (ValueError, RuntimeError) as e:
            self._settle(job, "rejected")
            job.sink(Update(rejected=str(e)))
            return
        req = engine.waiting[-1]  # submit appends: the request just added
        assert req.request_id == rid
        job.req = req
        self._live[rid] = job
        job.sink(Update(accepted=True))

    def _cancel(self, request_id: Hashable) -> None:
        if request_id in self._live:
            self.engine.cancel(request_id)

    def _step(self) -> None:
        t0 = time.perf_counter()
        failed = False
        try:
            self.engine.step()
            self._failures = 0
        except Exception:  # noqa: BLE001 - the engine recovered; its batch is replayed
            failed = True
            self._failures += 1
            log.exception("engine step failed (%d in a row)", self._failures)
        self.observer.on_step(self.engine, time.perf_counter() - t0, failed)
        self.observer.on_state(self.engine, self._pending)
        if self._failures >= self.max_step_failures:
            self._failures = 0
            for rid in list(self._live):
                self.engine.cancel(rid)
                self._finish(self._live[rid], "error",
                             f"{self.max_step_failures} engine steps failed in a row")

    def _report(self) -> None:
        """One update per live job with news: new tokens, and the finish reason."""
        now = time.monotonic()
        for job in list(self._live.values()):
            req = job.req
            new = req.generated[job.sent:] if len(req.generated) > job.sent else []
            if new:
                self.observer.on_tokens(job, len(new), now)
                job.first_token_at = job.first_token_at or now
                job.last_token_at = now
                job.sent += len(new)
            if req.finish_reason is not None:
                self._finish(job, req.finish_reason, req.error, new)
            elif new:
                job.sink(Update(tokens=list(new)))

    def _finish(self, job: Job, reason: str, error: str | None = None,
                tokens: list[int] | None = None) -> None:
        self._live.pop(job.request_id, None)
        self.engine.finished.pop(job.request_id, None)  # a server runs for long: keep none
        self._settle(job, reason)
        job.sink(Update(tokens=list(tokens or []), finish_reason=reason, error=error))

    def _settle(self, job: Job, reason: str) -> None:
        with self._lock:
            self._outstanding -= 1
        self.observer.on_finish(job, reason, time.monotonic())

    def _fail_all(self, message: str) -> None:
        for job in list(self._live.values()):
            self._finish(job, "error", message)
        while True:  # submitted, never added
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    self._pending -= 1
                self._settle(arg, "rejected")
                arg.sink(Update(rejected=message))
