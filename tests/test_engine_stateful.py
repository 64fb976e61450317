"""Stateful test of the engine: random interleavings of good and bad requests, cancels, steps
under pool pressure, and faults injected into the transfer path and the steps.

Rules add good requests (greedy and sampled, some with 40 stop tokens, some until
max_model_len, explicit and automatic ids), each bad request of the lifecycle rules (a
duplicate id, an out-of-vocab token, prompt + max_new_tokens past max_model_len, a prompt
the host pool can never hold: `CapacityError`), cancel waiting and running requests, and run
steps, some with a fault armed: a spill copy into the host pool that raises (the worker
reports it failed), a decode step that raises (before its call, or after it: its donated
device arrays are then lost and rebuilt), a prefill that raises (before or after its call:
its request fails alone). Pools: 3 seats, requests of up to 42 tokens (11 pages of 4 rows);
a device pool of 15 usable blocks with hot regions of 4 (waits, hot regions, unpinning,
lost pages, preemptions); a host pool of 10 usable blocks.

After every rule: the coordinator's invariants; no pass left open; every request added is in
exactly one of waiting / running / finished (none lost); running requests hold their seats
in the coordinator (distinct state rows); every request that finished with stop / length /
max_model_len has exactly the tokens an all-resident engine gives it (computed lazily in one
shared engine: sampling keys are per request, so temperature > 0 compares too); a request
fails ("error") only when a fault hit it; when the engine is idle and the worker drained,
every device and host block and every seat is free. At teardown the faults are disarmed, the
engine is drained (every request finishes) and checked idle.

`SpeculativeEngineMachine` runs the same rules with 2 draft tokens per step, drafted from the
reference's tokens (each right with probability 0.6): lookahead rows, union residency,
rejected drafts, and replay after preemptions, still with the all-resident tokens; its
reference decodes 3 (1 + k) rows per step, as many as the engine verifies (the model's
arithmetic per row is then the same; with 3 rows a near-tie could round the other way).

Both engines are built once per test session and drained between examples (construction and
compilation are the cost). CI runs a small budget; a long run:
  HISPARSE_ENGINE_STATEFUL_EXAMPLES=200 HISPARSE_ENGINE_STATEFUL_STEPS=60 pytest -m slow \
      tests/test_engine_stateful.py
"""

from __future__ import annotations

import functools
import itertools
import os
import random

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from hisparse_jax import models
from hisparse_jax.draft_sources import ScriptedDraft
from hisparse_jax.engine import Engine, EngineConfig, PrefillPolicy, Sizes, Speculative
from host_tier import CapacityError
from tests.engine_reference import AllResidentReference, assert_idle

VOCAB = 512
MAX_LEN = 42
SIZES = dict(max_seats=3, max_model_len=MAX_LEN, block_size=4, prefill_bucket=MAX_LEN)
DEVICE_BLOCKS = 16  # 15 usable for 3 seats of up to 7 pages and hot regions of 4 blocks
HOST_BLOCKS = 11  # 10 usable: 40 rows; a prompt of 41 tokens never fits
GOOD_PROMPT = MAX_LEN - 2  # the longest prompt (or recompute after a preemption) it holds
_EXPLICIT_IDS = itertools.count()  # explicit ids stay unique across examples (one engine)


class Fault:
    """Wraps functions; while armed, the next call of any of them raises RuntimeError
    ("injected ...") once: before the call, or `after` it (its donated arguments are then
    gone; `lose` drops what it returned too)."""

    def __init__(self, name, lose=None):
        self.name, self.lose = name, lose
        self.armed, self.after, self.fired = False, False, 0
        self.hit = []  # the first argument of each call that raised

    def wrap(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if not self.armed:
                return fn(*args, **kwargs)
            self.armed = False
            self.fired += 1
            self.hit.append(args[0] if args else None)
            if self.after:
                jax.block_until_ready(fn(*args, **kwargs))
                if self.lose is not None:
                    self.lose()
            raise RuntimeError(f"injected {self.name} failure")

        return wrapped


class ReferenceDraft(ScriptedDraft):
    """Drafts from the all-resident reference's tokens for the same request (computed when
    first asked), each right with probability 0.6 (fixed by the request's index and the
    token's), else wrong: exact-match acceptance keeps only the right ones."""

    def __init__(self, reference):
        super().__init__({}, lambda i, j: random.Random(i * 7919 + j).random() < 0.6)
        self.reference_of = reference

    def known_tokens(self, request):
        return self.reference_of(request)[1]


@functools.cache
def engines(speculative_tokens=0):
    """(HiSparse engine under pressure, its faults, the all-resident reference); built once
    per session (per number of speculative tokens: with k > 0 drafts come from the
    reference, right or wrong at random, and the hot regions hold 1 + k steps' top-k)."""
    model = models.init_model("tiny", seed=0)
    k = speculative_tokens
    # The reference decodes as many rows per step as the speculative engine verifies (3 seats
    # of 1 + k rows): a matmul of another row count rounds differently, and a near-tie of the
    # random model then flips a token (seen: logits 3.08814 / 3.08804 for two tokens).
    reference = AllResidentReference(
        model, sizes=Sizes(max_model_len=MAX_LEN, block_size=4,
                           max_seats=SIZES["max_seats"] * (1 + k)),
        prefill=PrefillPolicy(bucket=MAX_LEN))
    spec = {} if not k else dict(speculative=Speculative(num_tokens=k,
                                                         draft=ReferenceDraft(reference)))
    engine = Engine(model, EngineConfig(sizes=Sizes(num_gpu_blocks=DEVICE_BLOCKS + 8 * k,
                                                    hot_size=16 * (1 + k),
                                                    num_host_blocks=HOST_BLOCKS, max_seats=3,
                                                    max_model_len=MAX_LEN, block_size=4),
                                        prefill=PrefillPolicy(bucket=MAX_LEN), **spec))
    runner, transfers = engine.runner, engine.scheduler.transfers

    def lose_cache():  # the prefill's new cache is installed: delete it (a lost device)
        jax.tree.map(lambda a: a.delete(), runner.cache)

    faults = {"spill": Fault("spill copy"), "decode": Fault("decode"),
              "prefill": Fault("prefill", lose=lose_cache)}
    transfers.mirror_group_fn = faults["spill"].wrap(transfers.mirror_group_fn)  # spills
    runner.prefill = faults["prefill"].wrap(runner.prefill)  # called with the request first
    for name in ("decode_fast", "decode_hot"):
        runner.jitted[name] = faults["decode"].wrap(runner.jitted[name])
    return engine, faults, reference


good_requests = st.lists(st.tuples(
    st.integers(1, GOOD_PROMPT),  # prompt length
    st.one_of(st.none(), st.integers(1, 12)),  # max_new_tokens (capped at max_model_len)
    st.booleans(),  # sampled (temperature 0.8) or greedy
    st.booleans(),  # 40 random stop tokens
    st.integers(0, 2 ** 16),  # the seed of the prompt and stop tokens
    st.booleans(),  # an explicit request id
), min_size=1, max_size=3)


class EngineMachine(RuleBasedStateMachine):
    speculative_tokens = 0

    def __init__(self):
        super().__init__()
        self.engine, self.faults, self.reference = engines(self.speculative_tokens)
        self.manager = self.engine.scheduler.manager
        # The previous example drained the engine, unless it failed: then cancel what it left.
        for fault in self.faults.values():
            fault.armed = False
        for rid in [*self.engine.running, *(r.request_id for r in self.engine.waiting)]:
            self.engine.cancel(rid)
        assert_idle(self.engine)
        self.added = {}  # request id -> Request
        self.checked = set()  # finished request ids already compared with the reference

    # ------------------------------------------------------------------ requests

    @initialize(requests=good_requests)
    def start(self, requests):
        self.add_good_requests(requests)

    @rule(requests=good_requests)
    def add_good_requests(self, requests):
        for n, new, sampled, stop, seed, explicit in requests:
            rng = np.random.default_rng(seed)
            prompt = rng.integers(0, VOCAB, n).tolist()
            rid = self.engine.add_request(
                prompt, max_new_tokens=None if new is None else min(new, MAX_LEN - n),
                temperature=0.8 if sampled else 0.0,
                stop_token_ids=rng.integers(0, VOCAB, 40).tolist() if stop else (),
                request_id=f"explicit-{next(_EXPLICIT_IDS)}" if explicit else None)
            assert rid not in self.added
            self.added[rid] = self.engine.waiting[-1]
            assert self.added[rid].request_id == rid

    @rule(kind=st.sampled_from(["duplicate id", "out of vocab", "too long", "never fits"]),
          n=st.integers(1, MAX_LEN - 1), extra=st.integers(0, 10 ** 6))
    def add_bad_request(self, kind, n, extra):
        kwargs = dict(max_new_tokens=1)
        if kind == "duplicate id":
            if not self.added:
                return
            kwargs["request_id"] = list(self.added)[extra % len(self.added)]
            error, match, prompt = ValueError, "names a waiting, running or finished", [1]
        elif kind == "out of vocab":
            bad = [VOCAB, VOCAB + extra % 100, -1 - extra % 3][extra % 3]
            error, match, prompt = ValueError, "token ids of prompt", [1] * (n % 20) + [bad]
        elif kind == "too long":
            kwargs["max_new_tokens"] = MAX_LEN - n + 1 + extra % 8
            error, match, prompt = ValueError, "exceeds max_model_len", [1] * n
        else:  # a prompt of more pages than the host pool's usable blocks
            error, match = CapacityError, "host pool"
            prompt = [1] * (GOOD_PROMPT + 1)
        before = (len(self.engine.waiting), len(self.engine.running), len(self.engine.finished))
        with pytest.raises(error, match=match):
            self.engine.add_request(prompt, **kwargs)
        assert before == (len(self.engine.waiting), len(self.engine.running),
                          len(self.engine.finished))

    @rule(running=st.booleans(), which=st.integers(0, 10 ** 6))
    def cancel(self, running, which):
        e = self.engine
        ids = list(e.running) if running else [r.request_id for r in e.waiting]
        if not ids:
            return
        rid = ids[which % len(ids)]
        assert e.cancel(rid)
        assert e.finished[rid].finish_reason == "cancelled" and rid not in self.manager
        assert rid not in e.running and not e.cancel(rid)

    # ------------------------------------------------------------------ steps and faults

    @rule(n=st.integers(1, 8),
          fault=st.sampled_from([None, "spill", "decode", "decode-lost", "prefill",
                                 "prefill-lost"]))
    def steps(self, n, fault):
        if fault is not None:
            f = self.faults[fault.split("-")[0]]
            f.armed, f.after = True, fault.endswith("lost")
        for _ in range(n):
            try:
                self.engine.step()
            except RuntimeError as e:
                # Only a decode step raises (a spill copy or a prefill fails alone).
                assert "injected decode" in str(e), e

    # ------------------------------------------------------------------ invariants

    @invariant()
    def coordinator_consistent_and_no_pass_left_open(self):
        self.manager.check_invariants()
        sched = self.engine.scheduler
        assert not sched.pass_decode and not sched.pass_admitted

    @invariant()
    def no_request_lost_and_seats_distinct(self):
        e = self.engine
        where = {}
        for place, ids in (("waiting", [r.request_id for r in e.waiting]),
                           ("running", list(e.running)), ("finished", list(e.finished))):
            for rid in ids:
                if rid in self.added:
                    assert rid not in where, (rid, where[rid], place)
                    where[rid] = place
        assert set(where) == set(self.added)
        seats = [self.manager.view(rid).state_row for rid in e.running]
        assert seats == [e.running[rid].seat for rid in e.running]
        assert len(set(seats)) == len(seats)

    @invariant()
    def finished_requests_have_the_all_resident_tokens(self):
        failed_prefills = {id(req) for req in self.faults["prefill"].hit}
        for rid, req in self.added.items():
            if rid in self.checked or req.finish_reason is None:
                continue
            self.checked.add(rid)
            if req.finish_reason in ("stop", "length", "max_model_len"):
                want = self.reference(req)
                assert (req.finish_reason, req.generated) == want, (
                    rid, req.num_preemptions, req.temperature, len(req.prompt),
                    req.finish_reason, req.generated, want)
            elif req.finish_reason == "error":  # only the request whose prefill failed
                assert id(req) in failed_prefills and "injected prefill" in req.error, req.error

    @invariant()
    def idle_engine_holds_nothing(self):
        if not self.engine.has_work:
            assert_idle(self.engine)

    def teardown(self):
        for fault in self.faults.values():
            fault.armed = False
        e, idle = self.engine, 0
        while e.has_work:  # every step makes progress, or a few steps later one does
            progress = (e.metrics.generated_tokens, len(e.finished), e.metrics.prefills)
            e.step()
            idle = idle + 1 if progress == (e.metrics.generated_tokens, len(e.finished),
                                            e.metrics.prefills) else 0
            assert idle < 100, "the engine stopped making progress"
        self.finished_requests_have_the_all_resident_tokens()
        self.idle_engine_holds_nothing()
        assert all(r.finish_reason is not None for r in self.added.values())


class SpeculativeEngineMachine(EngineMachine):
    """The same rules with 2 draft tokens per step (lookahead rows, union residency,
    rejected drafts, replay of accepted ones after a preemption)."""

    speculative_tokens = 2


def _run(examples: int, steps: int, machine=EngineMachine) -> None:
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


def test_engine_state_machine():
    _run(examples=12, steps=30)


def test_speculative_engine_state_machine():
    _run(examples=8, steps=30, machine=SpeculativeEngineMachine)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HISPARSE_ENGINE_STATEFUL_EXAMPLES"),
                    reason="long run: set HISPARSE_ENGINE_STATEFUL_EXAMPLES (and "
                           "HISPARSE_ENGINE_STATEFUL_STEPS)")
def test_engine_state_machine_long():
    _run(examples=int(os.environ["HISPARSE_ENGINE_STATEFUL_EXAMPLES"]),
         steps=int(os.environ.get("HISPARSE_ENGINE_STATEFUL_STEPS", "60")))
