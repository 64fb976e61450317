"""The one step path: a scheduled plan executed on one or more scheduler / runner pairs.

Every engine step, synchronous, asynchronous or over a mesh, runs the same sequence
(`execute`): for each part, the plan's block-table rows and hot updates, then its restores;
then the decode step is dispatched (one call: the part's own runner, or one mesh-wide
step); then each part's prefills run while it computes, its spills are handed to the worker
and the worker's reports delivered. What comes back is pending: the loops differ only in
when they collect it (`loops.py`: at once, or one step later; `mesh.py`: per data shard).

`OpenStep` records how far a part's step got; after an exception `recover_parts` makes the
pair consistent again (requests are transactions: the engine's module docstring).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.metrics import Metrics, StepClock
from hisparse_jax.engine.page_keys import PageKeys
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import DecodeResult, PendingDecode, Runner
from hisparse_jax.engine.scheduler import ScheduledStep, Scheduler, drafts_verified
from hisparse_jax.engine.step_builder import variant_name
from hisparse_jax.models.protocol import ModelSpec
from host_tier.plan import StepPlan


@dataclasses.dataclass
class OpenStep:
    """How far one part's engine step in progress got (what a failure must undo or close)."""

    pass_open: bool = True  # the scheduler pass began (a mesh shard's may not have)
    plan: StepPlan | None = None
    state_applied: bool = False  # the plan's tables and hot updates are on the device
    restores_handed: bool = False  # the worker has the plan's restores
    spills_handed: bool = False  # the worker has the plan's spills
    culprit: Request | None = None  # a request whose prefill lost the device arrays
    culprit_error: str = ""


class PrefillLostDevice(Exception):
    """A prefill failed and took the device arrays with it (handled by the step's loop)."""


@dataclasses.dataclass
class StepContext:
    """What a step's prefills and collections read and update, shared by an engine's parts.

    Attributes:
      config: the engine's serving knobs.
      spec: the model's `ModelSpec`.
      metrics / clock: the engine's counters and step clock.
      row_bytes: bytes of one stored KV row.
      prefix: prefix caching's index keys of published pages (`PageKeys`), or None.
    """

    config: EngineConfig
    spec: ModelSpec
    metrics: Metrics
    clock: StepClock
    row_bytes: int
    prefix: PageKeys | None = None


@dataclasses.dataclass
class StepPart:
    """One scheduler / runner pair's share of an engine step (the engine's only pair, or one
    mesh data shard's), with what its pass scheduled and how far it got."""

    scheduler: Scheduler
    runner: Runner
    st: OpenStep
    scheduled: ScheduledStep | None = None

    def schedule(self, ahead: frozenset = frozenset()) -> ScheduledStep | None:
        """Opens the part's scheduler pass (`Scheduler.schedule`; `ahead`: the requests of a
        decode step still in flight); None when it schedules nothing (no pass left open)."""
        self.st.pass_open = True
        self.scheduled = scheduled = self.scheduler.schedule(ahead)
        if scheduled is None:
            self.st.pass_open = False
        else:
            self.st.plan = scheduled.plan
        return scheduled


def execute(ctx: StepContext, parts: Sequence[StepPart], dispatch: Callable[[], Any]) -> Any:
    """Executes the scheduled plans of `parts` (module docstring) around `dispatch` (which
    launches the decode step and returns it pending, or None); returns what it returned."""
    for part in parts:
        plan, st, runner = part.scheduled.plan, part.st, part.runner
        runner.apply_plan_state(plan)
        st.state_applied = True
        runner.restore(plan)
        st.restores_handed = True
    pending = dispatch()
    for part in parts:
        scheduled = part.scheduled
        for req in [*scheduled.admitted, *scheduled.chunks]:
            prefill(ctx, req, part)
        part.runner.after_forward(scheduled.plan)  # the worker reports a copy that raises
        part.st.spills_handed = True
        part.scheduler.deliver()
    return pending


def prefill(ctx: StepContext, req: Request, part: StepPart) -> None:
    """Prefills admitted request `req` (its prompt, or its next `chunk` of prompt tokens with
    `EngineConfig.prefill.chunk_size`) with `part`'s manager and runner; it samples its
    first token after its last chunk. A failure fails `req` alone (PrefillLostDevice when it
    took the device arrays with it)."""
    scheduler, runner, config = part.scheduler, part.runner, ctx.config
    first = req in scheduler.pass_admitted
    try:
        view = scheduler.manager.view(req.request_id)
        blocks = np.asarray(view.resident_blocks, np.int64)
        if first and req.num_cached and ctx.prefix is not None:
            ctx.prefix.load(req, runner)  # (a reused seat has its keys in place)
        if config.prefill.chunk_size is None and not req.num_prefilled:
            out = runner.prefill(req, blocks)
        else:  # a chunk, or the rest of a prompt after its prefix hit
            # Staging: host-only hit pages are read by staging the rows a chunk selects.
            staging = ({"host_blocks": np.asarray(view.host_blocks, np.int64)}
                       if config.stages_prefix_hits else {})
            out = runner.prefill_chunk(req, blocks, req.num_prefilled, req.chunk, **staging)
            ctx.metrics.record_staged(*runner.staged_rows, row_bytes=ctx.row_bytes,
                                      host_layer_rows=runner.staged_host_layer_rows)
        token, attention, seconds, variant, compiled = out
    except Exception as e:  # noqa: BLE001 - this request fails, the others go on
        message = f"prefill failed: {type(e).__name__}: {e}"
        if runner.device_state_lost():
            part.st.culprit, part.st.culprit_error = req, message
            raise PrefillLostDevice from e
        scheduler.fail(req, message)
        return
    ctx.clock.account(variant, seconds, "prefill_seconds", compiled=compiled)
    ctx.metrics.prompt_tokens += req.chunk
    if first and req.num_cached:
        ctx.metrics.prefix_hit_tokens += req.num_cached
        ctx.metrics.prefix_hit_requests += 1
    scheduler.start(req)
    if ctx.prefix is not None:
        ctx.prefix.stage(req, req.num_prefilled, runner)
    if req.prefilling:
        return  # its next chunk runs on a later step
    ctx.metrics.prefills += 1
    if attention is not None and not req.replaying:
        req.attention.append(attention)
    scheduler.record(req, token)


def collect(ctx: StepContext, part: StepPart, pending: PendingDecode, *,
            batch: list[Request] | None = None, since: float | None = None) -> float:
    """Collects a decode step of `part` and records its tokens (`record_decode`; `batch`:
    the list its requests are collected from, default the open pass's; `since`: the time
    its seconds run from when later than its dispatch, `Runner.collect_decode`). Returns
    when its tokens reached the host (`time.perf_counter`)."""
    runner, metrics, clock = part.runner, ctx.metrics, ctx.clock
    result = runner.collect_decode(pending, since=since)
    collected_at = time.perf_counter()
    reqs = [req for req in pending.requests if req.finish_reason is None]
    metrics.dropped_rows += len(pending.requests) - len(reqs)
    emitted = int(result.counts[[req.seat for req in reqs]].sum())
    if clock.account(variant_name(pending.residency), result.seconds, "decode_seconds",
                     compiled=result.compiled):
        clock.decode_tokens += emitted
    metrics.record_decode(fast=not pending.residency.reads_host, hits=result.hits,
                          misses=result.misses, rows=result.rows_moved,
                          row_bytes=ctx.row_bytes)
    metrics.decode_request_steps += len(reqs)
    metrics.decode_emitted += emitted
    if ctx.prefix is not None:
        # Before the tokens are recorded: a request that finishes now may publish its last
        # pages after its seat is reused (this step wrote position prompt + live - 1).
        B = ctx.config.sizes.block_size
        for req in reqs:
            if (len(req.prompt) + req.live) // B > req.key_pages:
                ctx.prefix.stage(req, len(req.prompt) + req.live, runner)
    record_decode(part.scheduler, metrics, pending.requests, result, batch)
    return collected_at


def record_decode(scheduler: Scheduler, metrics: Metrics, reqs: list[Request],
                  result: DecodeResult, batch: list[Request] | None = None) -> None:
    """Hands each request of a collected decode step (in batch order) its tokens
    (`Scheduler.record`, up to a stop), its next drafts and its acceptance counts (of the
    drafts the step verified: `scheduler.drafts_verified`). A request
    that finished since the step was dispatched (async scheduling: a stop learned a step
    late, a cancel, a failed restore) gets nothing: its row is dropped. `batch`: the list
    the step's requests are collected from (`Scheduler.collected`).

    The result's arrays become Python lists once (indexing numpy per token cost more than the
    recording itself at hundreds of requests). A function of its own, so that
    `bench/host_step.py` times it without a device.
    """
    counts, tokens = result.counts.tolist(), result.tokens.tolist()
    drafts = result.drafts.tolist() if result.drafts is not None else None
    draft_rows = result.draft_rows.tolist() if result.draft_rows is not None else None
    attention = result.attention
    collected, record = scheduler.collected, scheduler.record
    max_model_len = scheduler.cfg.max_model_len
    for req in reqs:
        collected(req, batch)
        if req.finish_reason is not None:
            continue
        seat = req.seat
        count = counts[seat]
        # (Async scheduling: `step_drafts` may be the next step's by now.)
        n = len(req.step_drafts) if draft_rows is None else draft_rows[seat]
        if n and (n := drafts_verified(req, n, max_model_len)):
            metrics.draft_tokens += n
            metrics.accepted_tokens += count - 1
            req.num_drafted += n
            req.num_accepted += count - 1
        if drafts is not None:
            req.drafts = drafts[seat]
        row = tokens[seat]
        for i in range(count):
            if attention is not None and not req.replaying:
                req.attention.append(attention[:, seat, i])
            if record(req, row[i]):
                break


def recover_parts(scheduler: Scheduler, runner: Runner, metrics: Metrics, st: OpenStep
                  ) -> list[str]:
    """Makes one scheduler / runner pair consistent after a step failed part-way (the
    engine's module docstring): preempts the failed step's batch, requeues admissions whose
    prefill did not run, closes the manager's pass and applies its state, reports transfers
    the worker never got as failed, rebuilds lost device arrays. Each part runs even when an
    earlier one fails; returns their failures as notes."""
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
        # Device copies of published pages (or kept seats) are zeros now, and host pool
        # layers may be: forget them (nothing is published without prefix caching).
        attempt("dropping the prefix cache", manager.drop_prefix_cache)
        metrics.device_resets += 1
    scheduler.pass_decode, scheduler.pass_admitted, scheduler.pass_chunks = [], [], []
    return notes


def raise_notes(notes: list[str], error: BaseException | None) -> None:
    """Adds the recovery's `notes` to `error`; without one, raises them (RuntimeError)."""
    if error is not None:
        for note in notes:
            error.add_note(note)
    elif notes:
        raise RuntimeError("; ".join(notes))
