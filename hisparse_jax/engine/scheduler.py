"""`Scheduler`: the request queues, admission under pressure, preemption and stop conditions.

One scheduler pass per engine step (host side; it talks only to the residency manager and
the transfer worker's reports):

  1. the transfer worker's reports (spills enqueued / completed) go to the manager;
  2. running requests are scheduled (their last sampled token is written this step; a
     request between prefill chunks gets its next chunk instead);
  3. waiting requests are admitted while seats (state rows) are free and a hot region's worth
     of device blocks stays free after the admission (`manager.hot_blocks`; 0 when the
     manager has no hot regions); when it would not, the manager is asked to make room
     (`request_room`) and admission stops for this pass. A request is admitted with its
     whole prompt, or with its first chunk under `EngineConfig.prefill.chunk_size` (chunks
     of at most that many tokens, within the step's `prefill.max_tokens_per_step`: requests
     already prefilling first, then admissions in queue order; a request samples its first
     token after its last chunk). With prefix caching (`EngineConfig.prefill.prefix_caching`)
     the prompt tokens the manager reuses from published pages are not scheduled: the
     request starts with `num_prefilled = num_cached`;
  4. when nothing can run: wait for copies in flight, or preempt the most recently admitted
     request that had to wait (recompute: it re-enters the queue with its generated tokens);
     a preempted request is recomputed by replay: its prompt is prefilled again (a request
     preempted between chunks restarts its prefill from the first chunk) and its
     generated tokens are fed back one decode step each (their outputs known, not sampled
     again), which repeats the original computation bit for bit (a prefill over prompt and
     generated tokens would not: a batched matmul of another shape rounds differently, and a
     near-tie can flip a token);
  5. the plan is built, and the step's residency chosen: `AllResident` when the mode allows
     it and every scheduled request's pages are resident (the fast path), else the mode's.

Requests are transactions. A request whose admission raises, or that can never make progress
(a lone request that stalls, a waiting request an idle engine cannot admit, a page restore
the worker reports failed), is released (`manager.abort`) and finished with
finish_reason="error" and `Request.error`; the others go on. The scheduler keeps the
requests of the open pass (`pass_decode`, `pass_admitted`, `pass_chunks`) until the engine
has run their step, so that an engine step that fails half-way can put them back (`preempt`,
`requeue`).

The manager is a `host_tier.Coordinator` (HiSparse, naive offload) or a
`hisparse_jax.engine.static_residency.StaticResidency` (all-resident); the worker a
`host_tier.TransferEngine` or `NoTransfers`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable
from typing import Any

from hisparse_jax.cache import AllResident, Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.draft_sources import host_drafts
from hisparse_jax.engine.metrics import Metrics
from hisparse_jax.engine.request import Request
from host_tier.plan import StepPlan

PENDING_TOKEN = 0
"""The token id the residency manager gets for a token still on the device (asynchronous
scheduling), named a placeholder (`schedule_batch(num_placeholders=...)`: no page holding it
is hashed, published or kept for reuse) until the engine sets the real one
(`set_token_ids`)."""


def token_limit(req: Request, max_model_len: int) -> int:
    """The generated tokens `req` ends with at most: `max_new_tokens`, or what max_model_len
    leaves after its prompt."""
    return (req.max_new_tokens if req.max_new_tokens is not None
            else max_model_len - len(req.prompt))


def drafts_verified(req: Request, draft_rows: int, max_model_len: int) -> int:
    """The drafts a decode step of `req` verified, of its `draft_rows` filled on the host,
    with `req.live` the tokens it had when the step ran: those that verify a token within
    its limit. A continued step's rows were filled as if the step before it accepted no
    draft, and the device drops those past the limit (`step_builder.continue_speculation`);
    any other step's rows all count (`_drafts` capped them already)."""
    return max(0, min(draft_rows, token_limit(req, max_model_len) - 1 - req.live))


def drafts_ahead(req: Request, k: int, block_size: int, max_model_len: int
                 ) -> tuple[list[int], int]:
    """The placeholder drafts and the lookahead rows of step t + 1 of `req`, whose
    speculative step t is in flight (async scheduling) and not its last on the host's
    knowledge (`live` + 1 < its limit). Step t verified d drafts (`drafts_verified`, known)
    and accepts an a in [0, d] the host does not know: step t + 1 writes its last token at
    position prompt + live + a, then up to c drafts, where d + c < block_size (so that its
    lookahead rows open at most one page; with block_size > 2k, c = k as without async), the
    device derives tokens and positions (`step_builder.continue_speculation`). The manager
    counts one pending token (token live: final after step t + 1 whatever a is), and the
    lookahead reserves the rows of every outcome: up to position prompt + live + la."""
    live, limit = req.live, token_limit(req, max_model_len)
    d = drafts_verified(req, len(req.step_drafts), max_model_len)
    c = max(0, min(k, block_size - 1 - d, limit - live - 2))
    return [PENDING_TOKEN] * c, max(d, min(d + c, limit - live - 2))


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """What one model step runs.

    Attributes:
      plan: the manager's plan (tables, hot updates, restores, spills) for the worker.
      decode: running requests decoding one token each (their seats are their state rows).
      admitted: requests admitted in this pass, to prefill (their first chunk: `chunk`).
      residency: how the decode step finds rows (`AllResident` on the fast path).
      chunks: running requests between prefill chunks, to prefill their next `chunk`.
    """

    plan: StepPlan
    decode: list[Request]
    admitted: list[Request]
    residency: Residency
    chunks: list[Request] = dataclasses.field(default_factory=list)


class Scheduler:
    """Queues and admission (module docstring).

    Args:
      manager: the residency manager (Coordinator API: admit / schedule_batch / build_plan /
        finish / cancel / preempt / abort / view / all_pages_resident / request_room /
        on_transfers / has_pending_transfers / failed_requests / capacity_error /
        admission_need, `in`, `device_pool.num_free`, `hot_blocks`, `stats`).
      transfers: the transfer worker (`poll`, `num_in_flight`).
      cfg: sizes (max_num_reqs seats, block_size, max_model_len, num_gpu_blocks).
      residency: the mode's residency type.
      metrics: counters updated here (waits, preemptions, generated_tokens).
      draft: the `DraftSource` (None without speculation).
      vocab_size: the model's vocabulary (host drafts must be token ids below it).
      prefill_chunk_size: prompt tokens per prefill chunk, at most (None: one shot).
      max_prefill_tokens: prompt tokens prefilled per step, at most (None: no limit).

    Attributes:
      waiting: requests to admit, in order (preempted requests re-enter at the front).
      running: admitted requests whose prefill (its first chunk, with chunked prefill) ran,
        in admission order.
      finished: every finished request, by id (whatever its finish reason).
      pass_decode / pass_admitted / pass_chunks: the requests of the open pass whose step
        has not completed yet (decode tokens not recorded / first prefill chunk not run / next
        prefill chunk not run).
    """

    def __init__(self, manager: Any, transfers: Any, cfg: HiSparseConfig,
                 residency: Residency, metrics: Metrics, *, draft: Any = None,
                 vocab_size: int | None = None, prefill_chunk_size: int | None = None,
                 max_prefill_tokens: int | None = None) -> None:
        self.manager = manager
        self.num_speculative_tokens = cfg.num_speculative_tokens
        self.draft = draft  # the DraftSource (None without speculation)
        self.vocab_size = vocab_size
        self.transfers = transfers
        self.cfg = cfg
        self.residency = residency
        self.metrics = metrics
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[Hashable, Request] = {}  # admission order
        self.finished: dict[Hashable, Request] = {}
        self.pass_decode: list[Request] = []
        self.pass_admitted: list[Request] = []
        self.pass_chunks: list[Request] = []
        self.prefill_chunk_size = prefill_chunk_size
        self.max_prefill_tokens = max_prefill_tokens
        self._budget: int | None = None  # prompt tokens the open pass may still prefill
        self.newly_finished: list[Request] = []  # since the engine last took them
        self._unfinished: dict[Hashable, Request] = {}  # waiting, admitted or running

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def knows(self, request_id: Hashable) -> bool:
        """Whether `request_id` names a waiting, running or finished request."""
        return request_id in self._unfinished or request_id in self.finished

    def submit(self, req: Request) -> None:
        """Queues a validated request (its id is new)."""
        self._unfinished[req.request_id] = req
        self.waiting.append(req)

    def deliver(self, *, wait: bool = False) -> None:
        """Hands the worker's transfer reports to the manager (`wait`: for every copy)."""
        report = self.transfers.poll(wait=wait)
        if report:
            self.manager.on_transfers(report)

    def schedule(self, in_flight: frozenset[Hashable] = frozenset()) -> ScheduledStep | None:
        """One scheduler pass; None when nothing runs this step.

        `in_flight` (asynchronous scheduling, `EngineConfig.async_scheduling`): the ids of the
        requests whose decode step is dispatched but not collected. Each counts one more
        token than it recorded: its pending token, which the manager gets as a placeholder
        (`PENDING_TOKEN`, named in `num_placeholders`; the engine sets the real id when it
        arrives, `set_token_ids`) unless it is a replayed (known) one. One that will have
        finished by then on the host's knowledge (`max_new_tokens`, max_model_len) is not
        scheduled; a stop token is learned a step late (the engine drops the extra row).
        With requests in flight, a pass that schedules nothing returns None without
        preempting or failing anyone (the engine collects the step in flight first)."""
        manager, m = self.manager, self.metrics
        self.pass_decode, self.pass_admitted, self.pass_chunks = [], [], []
        self._budget = self.max_prefill_tokens
        self.deliver()
        self._finish_failed_restores()
        decode, chunks, waited = self.pass_decode, self.pass_chunks, []
        running = list(self.running.values())
        # `not req.prefilling`, inlined (a property call per request and step).
        decoding = [req for req in running if req.num_prefilled >= len(req.prompt)]
        if in_flight:
            decoding = [req for req in decoding
                        if req.request_id not in in_flight or not self._last_in_flight(req)]
        decoding, drafts, lookahead = self._step_drafts(decoding, in_flight)
        new_tokens, pending = self._decode_tokens(decoding, in_flight)
        # One manager call for every decoding request (the per-request calls cost more host
        # time than the scheduling itself at hundreds of requests).
        results = manager.schedule_batch([req.request_id for req in decoding], new_tokens,
                                          lookahead, **pending)
        if not self.num_speculative_tokens and not any(results):  # every request scheduled
            no_drafts = drafts[0] if drafts else []
            for req, tokens in zip(decoding, new_tokens, strict=True):
                req.counted += len(tokens)
                req.step_drafts = no_drafts
            decode += decoding
        else:
            for req, req_drafts, tokens, result in zip(decoding, drafts, new_tokens, results,
                                                       strict=True):
                if result is None:
                    req.counted, req.step_drafts = req.counted + len(tokens), req_drafts
                    decode.append(req)
                else:
                    waited.append(req)
        # Then requests between prefill chunks: their next one, if the budget leaves room.
        for req in running if len(decoding) < len(running) else ():
            if not req.prefilling:
                continue
            n = self._next_chunk(req)
            if not n:
                continue
            if manager.schedule(req.request_id, num_tokens=n) is None:
                self._take_chunk(req, n)
                chunks.append(req)
            else:
                waited.append(req)
        m.waits += len(waited)
        admitted = self._admit()
        if not decode and not admitted and not chunks:
            if not in_flight:
                self._when_idle(waited)
            return None
        plan = manager.build_plan()
        residency = self.residency
        if residency.resident_fast_path and all(
                manager.all_pages_resident(req.request_id) for req in decode):
            residency = AllResident()
        return ScheduledStep(plan, list(decode), list(admitted), residency, list(chunks))

    def _last_in_flight(self, req: Request) -> bool:
        """Whether the in-flight step of `req` produces its last token (known on the host:
        `max_new_tokens` or max_model_len tokens; a stop token is not known yet)."""
        after = max(len(req.generated), req.live + 1)  # generated tokens once it is recorded
        return ((req.max_new_tokens is not None and after >= req.max_new_tokens)
                or len(req.prompt) + after >= self.cfg.max_model_len)

    def _decode_tokens(self, decoding: list[Request], in_flight: frozenset[Hashable]
                       ) -> tuple[list[list[int]], dict[str, list[int]]]:
        """The new tokens each of `decoding` hands the manager in this pass, and the
        keyword arguments of `schedule_batch` that name its placeholders: with a step in
        flight, a pending token is one (no page holding it is hashed or published before
        the engine sets its id, `set_token_ids`)."""
        if not in_flight:
            return [req.generated[req.counted:req.live] for req in decoding], {}
        tokens = [self._known_tokens(req, req.request_id in in_flight) for req in decoding]
        pending = [int(req.request_id in in_flight and req.live >= len(req.generated))
                   for req in decoding]
        return tokens, {"num_placeholders": pending}

    @staticmethod
    def _known_tokens(req: Request, in_flight: bool) -> list[int]:
        """The tokens `req` hands the manager in this pass: those recorded since it last
        counted, and with a step `in_flight` its pending token (known when replayed, else
        `PENDING_TOKEN`)."""
        tokens = req.generated[req.counted:req.live]
        if in_flight:
            live = req.live
            tokens.append(req.generated[live] if live < len(req.generated) else PENDING_TOKEN)
        return tokens

    def _next_chunk(self, req: Request) -> int:
        """Prompt tokens `req`'s next prefill computes: the rest of its prompt, at most
        `prefill_chunk_size` and what the step's budget leaves (0: none this step)."""
        limits = (self.prefill_chunk_size, self._budget)
        return min([len(req.prompt) - req.num_prefilled,
                    *(limit for limit in limits if limit is not None)])

    def _take_chunk(self, req: Request, n: int) -> None:
        """`req`'s prefill computes `n` prompt tokens this step (spent from the budget)."""
        req.chunk = n
        if self._budget is not None:
            self._budget -= n

    def _step_drafts(self, decoding: list[Request], in_flight: frozenset[Hashable]
                     ) -> tuple[list[Request], list[list[int]], list[int] | None]:
        """The decoding requests that run this pass, each with the drafts its step verifies
        and its lookahead rows (without speculation: none, lookahead None). One whose
        speculative step is in flight continues it on the device (`drafts_ahead`) unless
        that step replays known tokens or its drafts come from the host (both need the
        step's accepted count on the host): it sits this pass out. One whose host draft
        source broke its rule has failed (`_drafts`)."""
        k = self.num_speculative_tokens
        if not k:
            return decoding, [[]] * len(decoding), None
        kept, drafts, lookahead = [], [], []
        for req in decoding:
            if req.request_id not in in_flight:
                d = self._drafts(req)
                if d is None:
                    continue
                la = len(d)
            elif req.replaying or not self.draft.on_device:
                continue
            else:
                d, la = drafts_ahead(req, k, self.cfg.block_size, self.cfg.max_model_len)
            kept.append(req)
            drafts.append(d)
            lookahead.append(la)
        return kept, drafts, lookahead

    def _drafts(self, req: Request) -> list[int] | None:
        """The draft tokens `req`'s next step verifies: up to num_speculative_tokens, fewer
        when its last tokens are near (the step emits at most len + 1 tokens and writes no row
        past the last token it will feed); while it replays, its known tokens. None when a
        host draft source breaks its rule for it (`draft_sources.host_drafts`): the request
        has failed (finish_reason "error"), the others go on."""
        n = min(self.num_speculative_tokens,
                token_limit(req, self.cfg.max_model_len) - 1 - req.live)
        if n <= 0:
            return []
        if req.replaying:
            return req.generated[req.live:req.live + n]
        if self.draft.on_device:
            return req.drafts[:n]
        try:
            return host_drafts(self.draft, req, n, self.vocab_size)
        except ValueError as e:
            self.fail(req, str(e))
            return None

    def _admit(self) -> list[Request]:
        manager, hot_blocks = self.manager, self.manager.hot_blocks
        admitted = self.pass_admitted
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_num_reqs:
            req = self.waiting[0]
            n = self._next_chunk(req)
            if not n:
                break  # the step's prefill budget is spent
            # A prefix hit: the reused tokens are not computed (at most the rest is scheduled).
            # `need`: the device blocks the request holds once its prompt is in.
            cached, need = manager.admission_need(req.prompt)
            n = min(n, len(req.prompt) - cached)
            # Admission keeps a hot region's worth of blocks free while others run, so a
            # running request that crosses the watermark can get its hot region (and start
            # unpinning) instead of stalling until someone is preempted.
            if (self.running or admitted) and manager.device_pool.num_free - need < hot_blocks:
                self.metrics.waits += 1
                # Running requests move to hot regions and unpin pages until it fits.
                manager.request_room(need + hot_blocks)
                break
            try:
                result = manager.admit(req.request_id, req.prompt, num_new_tokens=n)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.waiting.popleft()
                self.fail(req, f"admission failed: {type(e).__name__}: {e}")
                continue
            if not hasattr(result, "state_row"):  # Wait
                self.metrics.waits += 1
                break
            manager.request_room(0)
            self.waiting.popleft()
            req.seat = result.state_row
            req.num_cached = req.num_prefilled = result.num_cached_tokens
            req.key_pages = req.num_cached // self.cfg.block_size  # published already
            self._take_chunk(req, n)
            admitted.append(req)
        return admitted

    def _when_idle(self, waited: list[Request]) -> None:
        if self.manager.has_pending_transfers() or self.transfers.num_in_flight:
            self.deliver(wait=True)  # completions free blocks
        elif waited and len(self.running) == 1:
            # Re-admitting it would replay the same stall forever.
            self.fail(waited[0], (
                "a lone request cannot hold its pages plus a hot region in the device pool "
                f"({self.cfg.num_gpu_blocks} blocks, hot region {self.cfg.hot_blocks}); raise "
                "num_gpu_blocks"))
        elif waited:
            self.preempt(waited[-1])
        elif self.waiting:
            self.fail(self.waiting.popleft(), (
                "the request cannot be admitted into an idle engine; raise num_gpu_blocks / "
                "num_host_blocks"))

    def _finish_failed_restores(self) -> None:
        """Requests whose page restore the worker reported failed (the manager's
        `failed_requests`): their device rows cannot be trusted, they finish with an error."""
        for rid in self.manager.failed_requests():
            req = self.running.get(rid)
            if req is not None:
                self.fail(req, "a page restore from the host pool failed")

    def start(self, req: Request) -> None:
        """A prefill chunk of `req` ran (the whole prompt without chunking): its `chunk`
        tokens are computed, and an admitted request is running (between chunks or
        decoding)."""
        if req in self.pass_admitted:
            self.pass_admitted.remove(req)
            self.running[req.request_id] = req
        else:
            self.pass_chunks.remove(req)
        req.num_prefilled += req.chunk

    def record(self, req: Request, token: int) -> bool:
        """Records a sampled token; finishes the request (True) when a stop condition holds:
        a stop token (kept), `max_new_tokens`, or `max_model_len` tokens. While the request
        replays, the token is one it generated before: the known one is kept (a different
        draw counts in `metrics.replay_mismatches`)."""
        generated = req.generated
        if req.live < len(generated):  # replaying (`Request.replaying`, inlined: per token)
            self.metrics.replayed_tokens += 1
            self.metrics.replay_mismatches += token != generated[req.live]
            req.live += 1
            return False
        generated.append(token)
        req.live += 1
        self.metrics.generated_tokens += 1
        if token in req.stop_token_ids:
            reason = "stop"
        elif req.max_new_tokens is not None and len(generated) >= req.max_new_tokens:
            reason = "length"
        elif len(req.prompt) + len(generated) >= self.cfg.max_model_len:  # req.num_tokens
            reason = "max_model_len"
        else:
            return False
        self.manager.finish(req.request_id)
        self._finish(req, reason)
        return True

    def fail(self, req: Request, message: str) -> None:
        """Finishes `req` with finish_reason "error" and `error=message`, releasing what it
        holds (`manager.abort`: nothing it computed is published) wherever it is: waiting
        (the caller took it off the queue), admitted in the open pass, or running."""
        if req.request_id in self.manager:
            self.manager.abort(req.request_id)
        for pending in (self.pass_admitted, self.pass_chunks):
            if req in pending:
                pending.remove(req)
        self._finish(req, "error", message)

    def cancel(self, request_id: Hashable) -> bool:
        """Cancels a waiting or running request (finish_reason "cancelled"); False when it
        already finished. Raises ValueError for an unknown id. Call it between steps."""
        req = self._unfinished.get(request_id)
        if req is None:
            if request_id in self.finished:
                return False
            raise ValueError(f"cancel: no request has request_id {request_id!r}")
        if request_id in self.running:
            self.manager.cancel(request_id)
        else:
            self.waiting.remove(req)
        self._finish(req, "cancelled")
        return True

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        self.running.pop(req.request_id, None)
        self._unfinished.pop(req.request_id, None)
        self.finished[req.request_id] = req
        self.newly_finished.append(req)

    def collected(self, req: Request, batch: list[Request] | None = None) -> None:
        """A request of the decode batch (`batch`; default the open pass's `pass_decode`) had
        its token recorded (or dropped: it finished since the step was dispatched)."""
        (self.pass_decode if batch is None else batch).remove(req)

    def preempt(self, req: Request) -> None:
        """Recompute preemption: the request re-enters the queue with its generated tokens
        (its rows are not reused: it replays them, module docstring); its last sampled token
        is sampled again by the replay (with its own key: the same token comes back). A
        request between prefill chunks has sampled nothing in this admission: its tokens are
        unchanged and it restarts its prefill."""
        self.manager.preempt(req.request_id)
        del self.running[req.request_id]
        for pending in (self.pass_decode, self.pass_chunks):
            if req in pending:
                pending.remove(req)
        if not req.prefilling:
            req.generated.pop()
            if req.attention:
                req.attention.pop()
            self.metrics.generated_tokens -= 1
        self._back_to_queue(req)

    def requeue(self, req: Request) -> None:
        """An admitted request whose prefill did not run goes back to the front of the queue
        (released like a preemption; its tokens are unchanged)."""
        self.manager.preempt(req.request_id)
        self.pass_admitted.remove(req)
        self._back_to_queue(req)

    def _back_to_queue(self, req: Request) -> None:
        """A released request re-enters the queue at the front, to be admitted afresh."""
        req.live = req.counted = req.num_prefilled = req.num_cached = req.key_pages = 0
        req.drafts, req.step_drafts = [], []
        req.num_preemptions += 1
        self.metrics.preemptions += 1
        req.seat = -1
        self.waiting.appendleft(req)
