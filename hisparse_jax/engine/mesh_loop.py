"""The mesh engine's step loops (`MeshEngine`, `mesh.py`): `MeshSyncLoop` collects each mesh
decode step at once, `MeshAsyncLoop` one step later, as `loops.SyncLoop` / `loops.AsyncLoop`
do for one scheduler / runner pair.

A mesh step is the one step path (`step.execute`) over every local data shard's `StepPart`
(each an ordinary `Scheduler` / `Runner` pair) around one mesh-wide decode step
(`MeshDecode`): the waiting requests are routed (`MeshEngine.route`), each shard's scheduler
runs its pass (admissions, prefill chunks, decode batch), every shard's plan state and
restores reach its devices, the decode step of every shard's batch is dispatched, then each
shard's prefills (whole prompts or chunks, `Runner.prefill_chunk`, on the shard's devices)
run while it computes.

Asynchronous scheduling (`MeshAsyncLoop`): the mesh decode step t + 1 is dispatched before
step t is collected, each shard's rows of it fed step t's sampled tokens on the devices
(`MeshDecode.dispatch`'s `prev`; with speculation they continue from step t's accepted
counts and on-device drafts, while each shard's scheduler reserves for every outcome, as
`loops.AsyncLoop` does; a host draft source collects step t first); a stop token is
learned a step late and the row dropped; an exception, or a step with no decode anywhere,
collects step t first (a drain), exactly as `AsyncLoop` does per pair. With several
processes every process takes the same decisions: a mesh decode step is dispatched whenever
any process has a decode request (the small all-gather of `MeshSyncLoop._dispatch`), so a
step is in flight on every process or on none, and every process drains at the same step.

Prefix caching is per data shard: each shard's coordinator publishes its own pages into
its own host pool, and its `PageKeys` keeps their index keys (`ShardPageKeys` routes the
step path's calls by runner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np

from hisparse_jax.cache import AllResident
from hisparse_jax.engine.loops import (
    AsyncLoop,
    land_after_failure,
    recover_in_flight,
    set_fed_token_ids,
)
from hisparse_jax.engine.mesh_step import MeshPending
from hisparse_jax.engine.page_keys import PageKeys
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import Runner
from hisparse_jax.engine.step import (
    OpenStep,
    PrefillLostDevice,
    StepContext,
    StepPart,
    execute,
    raise_notes,
    recover_parts,
)
from pallas_kernels import _compat


class ShardPageKeys:
    """Prefix caching's index keys of every local data shard: the step path's calls
    (`PageKeys.load` / `stage`, which name the runner) go to the `PageKeys` of that runner's
    shard; `prune` prunes each. A page's keys live in its own shard's store only."""

    def __init__(self, by_runner: dict[Runner, PageKeys]) -> None:
        self.by_runner = by_runner

    def load(self, req: Request, runner: Runner) -> None:
        self.by_runner[runner].load(req, runner)

    def stage(self, req: Request, num_written: int, runner: Runner) -> None:
        self.by_runner[runner].stage(req, num_written, runner)

    def prune(self) -> None:
        for keys in self.by_runner.values():
            keys.prune()


@dataclasses.dataclass
class MeshFlight:
    """A dispatched mesh decode step whose tokens are not collected yet (async scheduling).

    Attributes:
      pending: the mesh step (its device tokens feed the next step).
      parts: every local shard's part of its step (everything ran but the collection).
      batches: per shard index, its requests whose tokens are not recorded yet.
      fed: per shard index, requests of it whose fed token was the previous step's device
        token, with that token's index in `generated` (the shard's manager holds a
        placeholder for it until then).
    """

    pending: MeshPending
    parts: list[StepPart]
    batches: dict[int, list[Request]]
    fed: dict[int, list[tuple[Request, int]]]

    def ids(self, shard: int) -> frozenset[Hashable]:
        """The ids of data shard `shard`'s requests in this step that still run (each
        shard's pass counts only its own requests in flight, as `AsyncLoop`'s pass does; a
        request the previous step's collection finished, e.g. by length after accepted
        drafts, is no longer the shard's)."""
        return frozenset(r.request_id for r in self.batches.get(shard, ())
                         if r.finish_reason is None)


class MeshSyncLoop:
    """One mesh step = one pass per shard, the plans executed around one mesh decode step,
    the step collected (module docstring). `engine`: the `MeshEngine` (its local `shards`,
    `decoder`, `route`, `multi_process`)."""

    flight = None  # nothing is ever left in flight

    def __init__(self, ctx: StepContext, engine: Any) -> None:
        self.ctx, self.engine, self.decoder = ctx, engine, engine.decoder

    def step(self) -> None:
        """One step; after an exception every local shard is recovered
        (`step.recover_parts`) and the exception propagates (a prefill that lost a shard's
        device arrays only fails its own request)."""
        parts = self._parts()
        try:
            _, pending, _ = self._execute(parts, None)
            if pending is not None:
                self.decoder.collect(self.ctx, pending)
            self.prune()
        except PrefillLostDevice:
            self.recover(parts, None)
        except BaseException as e:
            self.recover(parts, e)
            raise

    def drain(self) -> bool:
        """Nothing to collect: False."""
        return False

    def _parts(self) -> list[StepPart]:
        return [StepPart(sh.scheduler, sh.runner, OpenStep(pass_open=False))
                for sh in self.engine.shards]

    def prune(self) -> None:
        """Drops the staged index keys of requests that can no longer publish them (prefix
        caching, every local shard: `PageKeys.prune`)."""
        if self.ctx.prefix is not None:
            self.ctx.prefix.prune()

    def _execute(self, parts: list[StepPart], prev: MeshFlight | None
                 ) -> tuple[list[StepPart], MeshPending | None, dict[int, list]]:
        """Routes the queue, opens each shard's pass (`prev`: the mesh step in flight, whose
        requests count one token more) and executes the plans of the shards that scheduled
        something around the mesh decode step (`step.execute`). Returns those parts, the
        dispatched step (None: no process decodes) and the requests fed `prev`'s device
        tokens, by shard."""
        self.engine.route()
        ahead = {sh.index: prev.ids(sh.index) if prev is not None else frozenset()
                 for sh in self.engine.shards}
        index = {id(sh.scheduler): sh.index for sh in self.engine.shards}
        scheduled = [part for part in parts
                     if part.schedule(ahead[index[id(part.scheduler)]]) is not None]
        decode = {index[id(p.scheduler)]: p.scheduled.decode for p in scheduled}
        here = {d: frozenset(r.request_id for r in reqs if r.request_id in ahead[d])
                for d, reqs in decode.items()}
        fed = {d: [(r, r.live) for r in reqs if r.request_id in here[d] and not r.replaying]
               for d, reqs in decode.items()}
        # Step t's tokens go in whenever it is in flight (on every process alike: its
        # dispatch was agreed); `here` picks the rows that read them.
        pending = execute(self.ctx, scheduled, lambda: self._dispatch(
            scheduled, decode, None if prev is None else prev.pending, here))
        if any(part.scheduled.admitted for part in scheduled):
            self.decoder.topk_global = None  # their prefills admitted them into top-k states
        return scheduled, pending, fed

    def _dispatch(self, scheduled: list[StepPart], decode: dict[int, list[Request]],
                  prev: MeshPending | None, ahead: dict[int, frozenset]
                  ) -> MeshPending | None:
        """The mesh decode step of the shards' decode requests, run whenever any process
        has one; the mode's host-reading variant whenever any shard needs it (agreed by
        every process: one small all-gather)."""
        decoding = [p.scheduled for p in scheduled if p.scheduled.decode]
        flags = np.array([bool(decoding), any(s.residency.reads_host for s in decoding)],
                         np.int32)
        if self.engine.multi_process:
            flags = np.any(_compat.process_allgather(flags), axis=0)
        if scheduled or flags[0]:
            self.ctx.metrics.steps += 1
        if not flags[0]:
            return None
        residency = self.engine.residency if flags[1] else AllResident()
        return self.decoder.dispatch(decode, residency, prev=prev, ahead=ahead)

    def recover(self, parts: list[StepPart], error: BaseException | None) -> None:
        """`recover_parts` per local data shard (the failed step's batch of every shard
        preempted, its admissions requeued, its manager pass closed, unsent transfers
        reported failed, lost device arrays rebuilt); the recovery's failures become notes
        of `error` (raised as a RuntimeError without one). With several processes it runs
        on each process's own shards only (`docs/mesh.md`)."""
        notes: list[str] = []
        for sh, part in zip(self.engine.shards, parts, strict=True):
            notes += [f"data shard {sh.index}: {n}" for n in
                      recover_parts(sh.scheduler, sh.runner, self.ctx.metrics, part.st)]
        self.decoder.topk_global = None  # a shard's top-k state may have been rebuilt
        raise_notes(notes, error)


class MeshAsyncLoop(MeshSyncLoop):
    """Mesh decode step t + 1 launched before step t is collected (module docstring;
    `loops.AsyncLoop.step` states the rules, which hold per data shard)."""

    def __init__(self, ctx: StepContext, engine: Any) -> None:
        super().__init__(ctx, engine)
        self.flight: MeshFlight | None = None  # the mesh decode step in flight
        self.collected_at: float | None = None  # when the last one was collected

    # A host draft source proposes from accepted tokens: step t is collected before step
    # t + 1 is planned (the same rule on every process: the config is the same).
    plans_after_collecting = AsyncLoop.plans_after_collecting
    drain = AsyncLoop.drain  # collects the mesh step in flight (`_land`); False when none

    def step(self) -> None:
        """Launches step t + 1 while step t (`flight`) runs, then collects step t. On an
        exception step t is collected first (its tokens kept), then every shard's part of
        step t + 1 is recovered as a synchronous step's is; a failed collection recovers
        step t and the step launched after it (`_land`). With speculation each shard's rows
        of step t continue in step t + 1 from step t's outputs on the devices (its accepted
        counts and drafts, `MeshDecode.dispatch`), or with a host draft source step t is
        collected first (`plans_after_collecting`)."""
        if self.plans_after_collecting:
            self.drain()
        prev, self.flight = self.flight, None
        parts = self._parts()
        try:
            flight = self._launch(parts, prev)
        except BaseException as e:
            late = self._land_after_failure(prev, e)
            for sh in self.engine.shards:  # requests finished by step t's tokens: not recovered
                sched = sh.scheduler
                sched.pass_decode = [r for r in sched.pass_decode
                                     if sched.running.get(r.request_id) is r]
            if isinstance(e, PrefillLostDevice):
                self.recover(parts, late)
                if late is not None:
                    raise late from None
                return
            self.recover(parts, e)
            raise
        self.flight = flight
        if prev is not None:
            if flight is None:
                self.ctx.metrics.drains += 1
            self._land(prev, flight)
        self.prune()

    def _launch(self, parts: list[StepPart], prev: MeshFlight | None) -> MeshFlight | None:
        """The step up to the collection, `prev` feeding the new decode step; returns the
        new step in flight (None: no process decodes)."""
        _, pending, fed = self._execute(parts, prev)
        if pending is None:
            return None
        batches = {}
        for sh in self.engine.shards:  # each shard's batch is the flight's now
            batches[sh.index], sh.scheduler.pass_decode = sh.scheduler.pass_decode, []
        return MeshFlight(pending, parts, batches, fed)

    def _land(self, flight: MeshFlight, newer: MeshFlight | None = None) -> None:
        """Collects `flight` and sets, in each shard's manager, the real ids of the tokens
        `newer` (the step launched after it) was fed on the devices. When the collection
        fails, `flight` and `newer` are recovered and the exception propagates."""
        try:  # steps overlap: each one's time runs from the last collection
            self.collected_at = self.decoder.collect(
                self.ctx, flight.pending, batches=flight.batches, since=self.collected_at)
        except BaseException as e:
            self.flight = None
            self._recover_flights([flight, *([newer] if newer is not None else [])], e)
            raise
        if newer is None:
            return
        for sh in self.engine.shards:
            fed = newer.fed.get(sh.index)
            if fed:
                set_fed_token_ids(sh.scheduler.manager, fed)

    def _land_after_failure(self, prev: MeshFlight | None, error: BaseException
                            ) -> BaseException | None:
        """Collects `prev` after the next step's launch raised `error` (`land_after_failure`)."""
        return land_after_failure(self, prev, error, "MeshEngine")

    def _recover_flights(self, flights: list[MeshFlight], error: BaseException) -> None:
        """Recovers mesh decode steps in flight whose collection failed: per local shard,
        `loops.recover_in_flight` over its requests of them. Notes go on `error`."""
        notes: list[str] = []
        for i, sh in enumerate(self.engine.shards):
            batches = [flight.batches.get(sh.index, []) for flight in flights]
            notes += [f"data shard {sh.index}: {n}" for n in recover_in_flight(
                sh.scheduler, sh.runner, self.ctx.metrics, batches, flights[-1].parts[i].st)]
        self.decoder.topk_global = None
        raise_notes(notes, error)
