"""The engine's step loops over one scheduler / runner pair: `SyncLoop` collects each decode
step at once, `AsyncLoop` one step later. Both run the one step path (`step.execute`).

Asynchronous scheduling (`EngineConfig.async_scheduling`, `AsyncLoop.step`): each step
schedules and dispatches decode step t + 1 (fed step t's sampled tokens on the device)
before it collects step t; a stop token is learned a step late and the request's extra row
dropped; an exception, or a pass with nothing to schedule, drains the step in flight first
(`docs/semantics.md`, asynchronous scheduling).

With speculation, step t's accepted counts stay on the device too: a request of step t
continues in step t + 1 from step t's outputs (its last emitted token, positions moved by
its accepted count, the on-device source's next drafts: `step_builder.continue_speculation`)
while the host counts it as if step t accepted nothing and reserves lookahead rows for every
outcome (`scheduler.drafts_ahead`), catching up when step t is collected. A host draft
source needs the accepted tokens to propose: then each step collects first
(`AsyncLoop.plans_after_collecting`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from hisparse_jax.engine.metrics import Metrics
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import PendingDecode, Runner
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.engine.step import (
    OpenStep,
    PrefillLostDevice,
    StepContext,
    StepPart,
    collect,
    execute,
    raise_notes,
    recover_parts,
)


class SyncLoop:
    """One engine step = one scheduler pass, the plan executed, the decode step collected."""

    flight = None  # nothing is ever left in flight

    def __init__(self, ctx: StepContext, scheduler: Scheduler, runner: Runner) -> None:
        self.ctx, self.scheduler, self.runner = ctx, scheduler, runner

    def step(self) -> None:
        """One step; after an exception the pair is recovered (`step.recover_parts`) and the
        exception propagates (a prefill that lost the device arrays only fails its own
        request)."""
        part = StepPart(self.scheduler, self.runner, OpenStep())
        try:
            scheduled = part.schedule()
            if scheduled is None:
                return
            self.ctx.metrics.steps += 1
            dispatch = self.runner.dispatch_decode
            pending = execute(self.ctx, [part], lambda: dispatch(
                scheduled.decode, scheduled.residency) if scheduled.decode else None)
            if pending is not None:
                collect(self.ctx, part, pending)
            if self.ctx.prefix is not None:
                self.ctx.prefix.prune()
        except PrefillLostDevice:
            self.recover(part.st, None)
        except BaseException as e:
            self.recover(part.st, e)
            raise

    def drain(self) -> bool:
        """Nothing to collect: False."""
        return False

    def recover(self, st: OpenStep, error: BaseException | None) -> None:
        """Makes the pair consistent after a step failed part-way; the recovery's failures
        become notes of `error` (raised as a RuntimeError without one)."""
        raise_notes(recover_parts(self.scheduler, self.runner, self.ctx.metrics, st), error)


@dataclasses.dataclass
class Flight:
    """A dispatched decode step whose tokens are not collected yet (async scheduling).

    Attributes:
      pending: the runner's handle (its device tokens feed the next step).
      part: its step's part (everything ran but the collection).
      decode: its requests whose tokens are not recorded yet (`Scheduler.collected`).
      fed: requests of it whose fed token was the previous step's device token, with that
        token's index in `generated` (the manager holds a placeholder for it until then).
    """

    pending: PendingDecode
    part: StepPart
    decode: list[Request]
    fed: list[tuple[Request, int]]

    @property
    def ids(self) -> frozenset[Hashable]:
        return frozenset(req.request_id for req in self.decode)


class AsyncLoop(SyncLoop):
    """Decode step t + 1 launched before step t is collected (module docstring)."""

    def __init__(self, ctx: StepContext, scheduler: Scheduler, runner: Runner) -> None:
        super().__init__(ctx, scheduler, runner)
        self.flight: Flight | None = None  # the decode step in flight
        self.collected_at: float | None = None  # when the last one was collected

    def step(self) -> None:
        """Launches step t + 1 while step t (`flight`) runs on the device, then collects step
        t. Step t's sampled tokens stay on the device and feed its requests' rows of step
        t + 1 (`Runner.dispatch_decode`'s `prev`); a row whose token the host knows (the
        first decode after a prefill, a replayed token, a request not in step t) takes the
        host's. A request that step t finishes by length is not scheduled again (known on
        the host); one whose step t samples a stop token was (learned a step late): its row
        of step t + 1 is dropped (`record_decode`), never emitted. A pass that schedules
        nothing while step t is in flight preempts and fails no one: step t is collected and
        the next call schedules as the synchronous engine does (a drain). On an exception
        the engine drains too: step t is collected first (its tokens kept), then step t + 1
        is recovered as a synchronous step is; a failed collection recovers step t and the
        step launched after it. With a host draft source, step t is collected before step
        t + 1 is planned (`plans_after_collecting`)."""
        if self.plans_after_collecting:
            self.drain()
        prev, self.flight = self.flight, None
        part = StepPart(self.scheduler, self.runner, OpenStep())
        try:
            flight = self._launch(part, prev)
        except BaseException as e:
            late = self._land_after_failure(prev, e)
            sched = self.scheduler  # requests finished by step t's tokens: not recovered
            sched.pass_decode = [r for r in sched.pass_decode
                                 if sched.running.get(r.request_id) is r]
            if isinstance(e, PrefillLostDevice):
                self.recover(part.st, late)
                if late is not None:
                    raise late from None
                return
            self.recover(part.st, e)
            raise
        self.flight = flight
        if prev is None:
            return
        if flight is None:
            self.ctx.metrics.drains += 1
        self._land(prev, flight)

    @property
    def plans_after_collecting(self) -> bool:
        """Speculation with drafts from the host (`DraftSource.on_device` False): a host
        source proposes from the accepted tokens, which only the collection of the step in
        flight brings, so each step collects it before planning the next (a synchronous
        step, counted in `metrics.drains`; the caller's work between `step()` calls still
        overlaps the device)."""
        draft = self.ctx.config.draft
        return draft is not None and not draft.on_device

    def drain(self) -> bool:
        """Collects the decode step in flight; False when there was none."""
        flight, self.flight = self.flight, None
        if flight is None:
            return False
        self.ctx.metrics.drains += 1
        self._land(flight)
        return True

    def _launch(self, part: StepPart, prev: Flight | None) -> Flight | None:
        """The step up to the collection, with `prev` (the decode step in flight, if any)
        feeding the new decode step; returns the new step in flight (None: no decode)."""
        ahead = prev.ids if prev is not None else frozenset()
        scheduled = part.schedule(ahead)
        if scheduled is None:
            return None
        self.ctx.metrics.steps += 1
        decode, fed, here = scheduled.decode, [], frozenset()
        if decode:
            here = frozenset(req.request_id for req in decode if req.request_id in ahead)
            fed = [(req, req.live) for req in decode
                   if req.request_id in here and not req.replaying]
        dispatch = self.runner.dispatch_decode
        pending = execute(self.ctx, [part], lambda: dispatch(
            decode, scheduled.residency, prev=prev.pending if here else None,
            ahead=here) if decode else None)
        if pending is None:
            return None
        sched = self.scheduler
        flight = Flight(pending, part, sched.pass_decode, fed)
        sched.pass_decode = []  # the step's batch is the flight's now
        return flight

    def _land(self, flight: Flight, newer: Flight | None = None) -> None:
        """Collects the decode step `flight` and sets the real ids of the tokens `newer` (the
        step launched after it) was fed on the device (`Coordinator.set_token_ids`). When the
        collection fails, `flight` and `newer` are recovered (`_recover_flights`) and the
        exception propagates."""
        try:  # steps overlap: each one's time runs from the last collection
            self.collected_at = collect(self.ctx, flight.part, flight.pending,
                                        batch=flight.decode, since=self.collected_at)
        except BaseException as e:
            self.flight = None
            self._recover_flights([flight, *([newer] if newer is not None else [])], e)
            raise
        if newer is not None and newer.fed:
            set_fed_token_ids(self.scheduler.manager, newer.fed)

    def _land_after_failure(self, prev: Flight | None, error: BaseException
                            ) -> BaseException | None:
        """Collects `prev` after the next step's launch raised `error` (`land_after_failure`)."""
        return land_after_failure(self, prev, error, "Engine")

    def _recover_flights(self, flights: list[Flight], error: BaseException) -> None:
        """Recovers decode steps in flight whose collection failed (`recover_in_flight`
        over their requests not collected yet; their steps ran everything else). Notes go
        on `error`."""
        raise_notes(recover_in_flight(self.scheduler, self.runner, self.ctx.metrics,
                                      [flight.decode for flight in flights],
                                      flights[-1].part.st), error)


def recover_in_flight(scheduler: Scheduler, runner: Runner, metrics: Metrics,
                      batches: list[list[Request]], st: OpenStep) -> list[str]:
    """`recover_parts` of one scheduler / runner pair over the requests of decode steps in
    flight whose collection failed (`batches`, oldest first: those still running, each
    once; `st`: how far the newest step got); the open pass's lists are kept, less the
    requests that no longer run. Returns the recovery's notes (`AsyncLoop`, and each data
    shard of the mesh engine's asynchronous loop)."""
    sched = scheduler
    saved = sched.pass_decode, sched.pass_admitted, sched.pass_chunks
    batch, seen = [], set()
    for decode in batches:
        for req in decode:
            if sched.running.get(req.request_id) is req and id(req) not in seen:
                seen.add(id(req))
                batch.append(req)
    sched.pass_decode, sched.pass_admitted, sched.pass_chunks = batch, [], []
    try:
        return recover_parts(sched, runner, metrics, st)
    finally:
        decode, admitted, chunks = saved
        sched.pass_decode = [r for r in decode if sched.running.get(r.request_id) is r]
        sched.pass_admitted = admitted  # not running yet: recovered with their pass
        sched.pass_chunks = [r for r in chunks if sched.running.get(r.request_id) is r]


def set_fed_token_ids(manager: Any, fed: list[tuple[Request, int]]) -> None:
    """Gives the manager the real ids of the tokens a step was fed on the device (each
    request's generated token i, a placeholder until its step was collected), for the
    requests still running (`Coordinator.set_token_ids`)."""
    manager.set_token_ids([(req.request_id, len(req.prompt) + i, req.generated[i])
                           for req, i in fed if req.finish_reason is None])


def land_after_failure(loop: Any, prev: Any, error: BaseException, who: str
                       ) -> BaseException | None:
    """Collects `prev` (a step in flight of `loop`, or None) after the next step's launch
    raised `error`; when that fails too, returns its exception (recovered already by the
    loop's `_land`; noted on `error`, naming `who`)."""
    if prev is None:
        return None
    loop.ctx.metrics.drains += 1
    try:
        loop._land(prev)
    except BaseException as late:  # noqa: BLE001 - recovered; the caller re-raises
        error.add_note(f"{who}: collecting the decode step in flight failed too: "
                       f"{type(late).__name__}: {late}")
        return late
    return None
