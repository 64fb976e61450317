"""Stateful test of the engine: random interleavings of good and bad requests, cancels, steps
under pool pressure, and faults injected into the transfer path and the steps.

Rules add good requests (greedy and sampled, some with a stop token), each bad request of
the lifecycle rules (a duplicate id, an out-of-vocab token, prompt + max_new_tokens past
max_model_len, a prompt the host pool can never hold: `CapacityError`), cancel waiting and
running requests, run steps (a device pool of 21 blocks for 3 seats of up to 8-page requests
and 8-block hot regions: waits, hot regions, unpinning, lost pages; a host pool of 8 usable
blocks), and arm faults: spill copies into the host pool that raise (the worker reports them
failed), a decode step that raises (before its call, or after it: its donated device arrays
are then lost and rebuilt), a prefill that raises (its request fails alone).

After every rule: the coordinator's invariants; no pass left open; every request added is in
exactly one of waiting / running / finished (none lost); running requests hold their seats
in the coordinator (distinct state rows); every request that finished with stop / length /
max_model_len has exactly the tokens an all-resident engine gives it (computed lazily in one
shared engine: sampling keys are per request, so temperature > 0 compares too); a request
fails ("error") only when a fault hit it; when the engine is idle and the worker drained,
every device and host block and every seat is free. At teardown the faults are disarmed, the
engine is drained (every request finishes) and checked idle.

Both engines are built once per test session and drained between examples (construction and
compilation are the cost). CI runs a small budget; a long run:
  HISPARSE_ENGINE_STATEFUL_EXAMPLES=200 HISPARSE_ENGINE_STATEFUL_STEPS=60 pytest -m slow \
      tests/test_engine_stateful.py
"""

from __future__ import annotations

import functools
import itertools
import os

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hisparse_jax import nn
from hisparse_jax.engine import Engine, EngineConfig
from host_tier import CapacityError

VOCAB = 512
MAX_LEN = 40
SIZES = dict(max_seats=3, max_model_len=MAX_LEN, block_size=4, prefill_bucket=MAX_LEN)
HOST_BLOCKS = 9  # 8 usable: 32 rows; a prompt of more than 32 tokens never fits
GOOD_TOTAL = 28  # good requests hold at most 28 tokens (7 pages)
_EXPLICIT_IDS = itertools.count()  # explicit ids stay unique across examples (one engine)


class Fault:
    """Wraps a function; raises RuntimeError("injected ...") on the next `armed` calls
    (before the call, or `after` it: its donated arguments are then gone)."""

    def __init__(self, fn, name):
        self.fn, self.name = fn, name
        self.armed, self.after, self.fired = 0, False, 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if not self.armed:
            return self.fn(*args, **kwargs)
        self.armed -= 1
        self.fired += 1
        if self.after:
            jax.block_until_ready(self.fn(*args, **kwargs))
        raise RuntimeError(f"injected {self.name} failure")


@functools.cache
def engines():
    """(HiSparse engine under pressure with its faults, reference all-resident engine,
    reference cache); built once per session."""
    model = nn.init_model("tiny", seed=0)
    engine = Engine(model, EngineConfig(num_gpu_blocks=21, num_host_blocks=HOST_BLOCKS,
                                        **SIZES))
    faults = {"mirror": Fault(engine.scheduler.transfers.mirror_fn, "spill copy"),
              "prefill": Fault(engine.runner.jitted["prefill"], "prefill")}
    engine.scheduler.transfers.mirror_fn = faults["mirror"]
    engine.runner.jitted["prefill"] = faults["prefill"]
    for name in ("decode_fast", "decode_hot"):
        faults[name] = Fault(engine.runner.jitted[name], name)
        engine.runner.jitted[name] = faults[name]
    reference = Engine(model, EngineConfig(all_resident=True, **SIZES))
    return engine, faults, reference, {}


def reference_tokens(req):
    _, _, reference, cache = engines()
    key = (req.prompt, req.max_new_tokens, req.temperature, req.stop_token_ids,
           req.sampling_seed)
    if key not in cache:
        rid = reference.add_request(req.prompt, max_new_tokens=req.max_new_tokens,
                                    temperature=req.temperature,
                                    stop_token_ids=req.stop_token_ids, seed=req.sampling_seed)
        out = reference.run()[rid]
        cache[key] = (out.finish_reason, list(out.generated))
    return cache[key]


def tokens(draw_len, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, draw_len).tolist()


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine, self.faults, _, _ = engines()
        self.manager = self.engine.scheduler.manager
        assert not self.engine.has_work
        self.added = {}  # request id -> Request
        self.checked = set()  # finished request ids compared with the reference
        self.hit_by_fault = set()  # ids a prefill fault may have failed
        self.prefills_before = self.faults["prefill"].fired
        self.decode_raises = 0

    # ------------------------------------------------------------------ requests

    @rule(n=st.integers(1, GOOD_TOTAL - 1), new=st.integers(1, 12), sampled=st.booleans(),
          stop=st.booleans(), seed=st.integers(0, 2 ** 16), explicit=st.booleans())
    def add_good_request(self, n, new, sampled, stop, seed, explicit):
        new = min(new, GOOD_TOTAL - n)
        prompt = tokens(n, seed)
        rid = self.engine.add_request(
            prompt, max_new_tokens=new, temperature=0.8 if sampled else 0.0,
            stop_token_ids=[prompt[0]] if stop else (),
            request_id=f"explicit-{next(_EXPLICIT_IDS)}" if explicit else None)
        assert rid not in self.added
        self.added[rid] = self._find(rid)

    @rule(which=st.integers(0, 10 ** 6))
    @precondition(lambda self: self.added)
    def add_duplicate_id(self, which):
        rid = list(self.added)[which % len(self.added)]
        self._rejected(ValueError, "names a waiting, running or finished request",
                       [1, 2, 3], request_id=rid)

    @rule(bad=st.sampled_from([VOCAB, VOCAB + 7, -1]), n=st.integers(1, 10))
    def add_out_of_vocab_token(self, bad, n):
        self._rejected(ValueError, "token ids of prompt", [1] * n + [bad])

    @rule(n=st.integers(1, MAX_LEN - 1), extra=st.integers(1, 8))
    def add_too_long_request(self, n, extra):
        self._rejected(ValueError, "exceeds max_model_len", [1] * n,
                       max_new_tokens=MAX_LEN - n + extra)

    @rule(n=st.integers(4 * (HOST_BLOCKS - 1) + 1, MAX_LEN - 1))
    def add_request_that_never_fits(self, n):
        self._rejected(CapacityError, "host pool", [1] * n, max_new_tokens=1)

    def _rejected(self, error, match, prompt, **kwargs):
        kwargs.setdefault("max_new_tokens", 2)
        before = (len(self.engine.waiting), len(self.engine.running), len(self.engine.finished))
        with pytest.raises(error, match=match):
            self.engine.add_request(prompt, **kwargs)
        assert before == (len(self.engine.waiting), len(self.engine.running),
                          len(self.engine.finished))

    @rule(which=st.integers(0, 10 ** 6))
    @precondition(lambda self: self.engine.waiting)
    def cancel_waiting(self, which):
        req = self.engine.waiting[which % len(self.engine.waiting)]
        assert self.engine.cancel(req.request_id)
        assert req.finish_reason == "cancelled" and req.request_id not in self.engine.running

    @rule(which=st.integers(0, 10 ** 6))
    @precondition(lambda self: self.engine.running)
    def cancel_running(self, which):
        rid = list(self.engine.running)[which % len(self.engine.running)]
        assert self.engine.cancel(rid) and rid not in self.manager
        assert self.engine.finished[rid].finish_reason == "cancelled"
        assert not self.engine.cancel(rid)

    # ------------------------------------------------------------------ steps and faults

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            admitted = {r.request_id for r in self.engine.waiting}
            prefill_fired = self.faults["prefill"].fired
            try:
                self.engine.step()
            except RuntimeError as e:
                assert "injected decode" in str(e), e
                self.decode_raises += 1
            if self.faults["prefill"].fired != prefill_fired:
                self.hit_by_fault |= admitted

    @rule(calls=st.integers(1, 3))
    def fail_spill_copies(self, calls):
        self.faults["mirror"].armed = calls

    @rule(after=st.booleans(), variant=st.sampled_from(["decode_fast", "decode_hot"]))
    def fail_a_decode_step(self, after, variant):
        fault = self.faults[variant]
        fault.armed, fault.after = 1, after

    @rule(after=st.booleans())
    def fail_a_prefill(self, after):
        fault = self.faults["prefill"]
        fault.armed, fault.after = 1, after

    # ------------------------------------------------------------------ invariants

    @invariant()
    def coordinator_consistent_and_no_pass_left_open(self):
        self.manager.check_invariants()
        sched = self.engine.scheduler
        assert not sched.pass_decode and not sched.pass_admitted

    @invariant()
    def no_request_lost(self):
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
        for rid, req in self.added.items():
            if rid in self.checked or req.finish_reason is None:
                continue
            self.checked.add(rid)
            if req.finish_reason in ("stop", "length", "max_model_len"):
                assert (req.finish_reason, req.generated) == reference_tokens(req), rid
            elif req.finish_reason == "error":
                assert rid in self.hit_by_fault and "injected prefill" in req.error, req.error

    @invariant()
    def idle_engine_holds_nothing(self):
        if self.engine.has_work:
            return
        self.engine.scheduler.deliver(wait=True)
        m = self.manager
        assert not m.request_ids and not m.has_pending_transfers()
        assert m.device_pool.num_free == m.device_pool.num_usable
        assert m.host_pool.num_free == m.host_pool.num_usable

    def teardown(self):
        for fault in self.faults.values():
            fault.armed = 0
        for _ in range(1000):
            if not self.engine.has_work:
                break
            self.engine.step()
        assert not self.engine.has_work, "the engine did not drain"
        self.finished_requests_have_the_all_resident_tokens()
        self.idle_engine_holds_nothing()
        assert all(r.finish_reason is not None for r in self.added.values())

    def _find(self, rid):
        return next(r for r in self.engine.waiting if r.request_id == rid)


def _run(examples: int, steps: int) -> None:
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


def test_engine_state_machine():
    _run(examples=int(os.environ.get("HISPARSE_ENGINE_STATEFUL_EXAMPLES_CI", "8")), steps=25)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HISPARSE_ENGINE_STATEFUL_EXAMPLES"),
                    reason="long run: set HISPARSE_ENGINE_STATEFUL_EXAMPLES (and "
                           "HISPARSE_ENGINE_STATEFUL_STEPS)")
def test_engine_state_machine_long():
    _run(examples=int(os.environ["HISPARSE_ENGINE_STATEFUL_EXAMPLES"]),
         steps=int(os.environ.get("HISPARSE_ENGINE_STATEFUL_STEPS", "60")))
