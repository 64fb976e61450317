"""Asynchronous scheduling (`EngineConfig.async_scheduling`): the same tokens as the
synchronous engine, with step t + 1 dispatched before step t is collected.

Sampling keys are per request, so a request's tokens do not depend on the batch it ran in:
an async engine's tokens compare to a synchronous engine's of the same config serving the
same requests, and a request with stop tokens to that engine's output without them cut at
the first stop token (which picks stop tokens that fire at chosen steps). The workloads
mix arrivals while others run, cancels, sampled and greedy requests, the HiSparse mode
under pool pressure (spills, hot misses, preemptions), all-resident and chunked prefill.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax import models
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    HiSparse,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from hisparse_jax.engine.mesh import MeshEngine
from host_tier import Coordinator
from tests.engine_reference import assert_idle

MAX_LEN = 48
# 27 usable device blocks: three 12-page requests need 36 plus hot regions of 8.
KINDS = {  # the residency, and the sizes and prefill fields that change
    "hisparse": dict(sizes=dict(num_gpu_blocks=28)),
    "all-resident": dict(residency=AllResident()),
    "chunked": dict(sizes=dict(num_gpu_blocks=28), prefill=dict(chunk_size=8, bucket=8)),
}


@functools.cache
def tiny_model():
    return models.init_model("tiny", seed=0)


@functools.cache
def engine_of(kind: str, async_scheduling: bool) -> Engine:
    """One engine per (kind, async) for the module (each test leaves it idle)."""
    kind = KINDS[kind]
    return Engine(tiny_model(), EngineConfig(
        sizes=Sizes(max_seats=3, max_model_len=MAX_LEN, block_size=4, **kind.get("sizes", {})),
        prefill=PrefillPolicy(**{"bucket": MAX_LEN, **kind.get("prefill", {})}),
        residency=kind.get("residency", HiSparse()), async_scheduling=async_scheduling))


_ids = itertools.count()


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(1000 + seed).integers(0, 512, n).tolist()


def serve(engine, requests, *, cancels=(), check=True):
    """Runs `requests` (dicts: prompt, max_new_tokens, temperature, stop_token_ids, seed,
    arrive: the step before which it is added) and `cancels` ((step, index): cancel request
    `index` before that step); returns [(finish_reason, generated)] in request order."""
    rids = [None] * len(requests)
    step = 0
    while engine.has_work or any(r is None for r in rids):
        for i, r in enumerate(requests):
            if rids[i] is None and r["arrive"] <= step:
                rids[i] = engine.add_request(
                    r["prompt"], max_new_tokens=r["max_new_tokens"],
                    temperature=r["temperature"], stop_token_ids=r["stop_token_ids"],
                    seed=r["seed"], request_id=("req", next(_ids)))
        for at, i in cancels:
            if at == step and rids[i] is not None:
                engine.cancel(rids[i])
        engine.step()
        step += 1
        if check and isinstance(engine.scheduler.manager, Coordinator):
            engine.scheduler.manager.check_invariants()
        assert step < 1000, "no progress"
    assert engine.drain() == []
    if check:
        assert_idle(engine)
    return [(engine.finished[rid].finish_reason, list(engine.finished[rid].generated))
            for rid in rids]


def cut_at_stop(out, stops):
    """A request's output with `stops` from its output without stop tokens."""
    reason, generated = out
    for i, token in enumerate(generated):
        if token in stops:
            return "stop", generated[:i + 1]
    return reason, generated


def _workload(draw, n):
    reqs = []
    for i in range(n):
        reqs.append(dict(
            prompt=_prompt(draw(st.integers(0, 10 ** 6)), draw(st.integers(2, 30))),
            max_new_tokens=draw(st.integers(1, 12)),
            temperature=draw(st.sampled_from([0.0, 0.0, 0.9])),
            stop_token_ids=(), seed=i, arrive=draw(st.integers(0, 6))))
    return reqs


@st.composite
def workloads(draw):
    """Requests, stop steps (None: no stop token) and cancels."""
    n = draw(st.integers(1, 6))
    reqs = _workload(draw, n)
    stop_at = [draw(st.one_of(st.none(), st.integers(0, 11))) for _ in range(n)]
    cancels = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(0, n - 1)), max_size=2))
    return reqs, stop_at, cancels


def check_against_sync(kind, reqs, stop_at, cancels):
    sync, asyn = engine_of(kind, False), engine_of(kind, True)
    plain = serve(sync, reqs)  # no stop tokens, no cancels
    for r, at, out in zip(reqs, stop_at, plain, strict=True):
        if at is not None and at < len(out[1]):
            r["stop_token_ids"] = (out[1][at],)
    want = [cut_at_stop(out, r["stop_token_ids"]) for r, out in zip(reqs, plain, strict=True)]
    got = serve(asyn, reqs, cancels=cancels)
    cancelled = {i for _, i in cancels}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i in cancelled and g[0] == "cancelled":
            assert w[1][:len(g[1])] == g[1], (i, g, w)
        else:
            assert g == w, (i, g, w)
    return want


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=6)
@given(workload=workloads())
def test_async_tokens_equal_sync(kind, workload):
    reqs, stop_at, cancels = workload
    check_against_sync(kind, reqs, stop_at, cancels)


def test_async_under_pressure_equals_sync_step_for_step_and_drops_late_stops():
    """Six requests through three seats of a pool too small for them: spills and hot misses
    happen, stop tokens fire at several steps (rows learned a step late are dropped); the
    same tokens as the sync engine of the same config (run with the stop tokens too).
    Preemptions (replay) are forced by failing steps: the failure test below."""
    sync, asyn = engine_of("hisparse", False), engine_of("hisparse", True)
    reqs = [dict(prompt=_prompt(i, 8 + 5 * i), max_new_tokens=10 + i % 3,
                 temperature=0.0 if i % 2 else 0.9, stop_token_ids=(), seed=i, arrive=i // 2)
            for i in range(6)]
    plain = serve(sync, reqs)
    for i, (r, out) in enumerate(zip(reqs, plain, strict=True)):
        if i % 2:
            r["stop_token_ids"] = (out[1][2 + i],)
    before = (dict(asyn.scheduler.manager.stats), asyn.metrics.hot_misses,
              asyn.metrics.dropped_rows)
    want = serve(sync, reqs)
    assert want == [cut_at_stop(o, r["stop_token_ids"]) for r, o in zip(reqs, plain, strict=True)]
    assert sum(reason == "stop" for reason, _ in want) >= 2
    got = serve(asyn, reqs)
    assert got == want
    stats, misses, dropped = before
    after = asyn.scheduler.manager.stats
    assert after["spills"] > stats.get("spills", 0)
    assert after["unpinned_pages"] > stats.get("unpinned_pages", 0)
    assert asyn.metrics.hot_misses > misses
    assert asyn.metrics.dropped_rows > dropped  # a stop learned a step late


def test_async_dispatches_the_next_step_before_collecting_the_last():
    """The overlap itself: with requests decoding, each step's decode is dispatched before
    the previous one is collected, fed by its device tokens (fails if made synchronous)."""
    engine = engine_of("all-resident", True)
    runner = engine.runner
    events = []  # (what, the PendingDecode, fed by the step in flight); keeps them alive
    dispatch, collect = runner.dispatch_decode, runner.collect_decode

    def dispatch_decode(reqs, residency, **kw):
        pending = dispatch(reqs, residency, **kw)
        events.append(("dispatch", pending, kw.get("prev") is not None))
        return pending

    def collect_decode(pending, **kw):
        events.append(("collect", pending, None))
        return collect(pending, **kw)

    runner.dispatch_decode, runner.collect_decode = dispatch_decode, collect_decode
    try:
        reqs = [dict(prompt=_prompt(i, 5), max_new_tokens=8, temperature=0.0,
                     stop_token_ids=(), seed=i, arrive=0) for i in range(2)]
        serve(engine, reqs)
    finally:
        del runner.dispatch_decode, runner.collect_decode
    dispatches = [(i, p, fed) for i, (what, p, fed) in enumerate(events) if what == "dispatch"]
    collected = {id(p): i for i, (what, p, _) in enumerate(events) if what == "collect"}
    assert len(dispatches) == len(collected) == 7  # 2 requests, 1 prefill + 7 decode tokens
    # Step t + 1 is dispatched (on step t's device tokens) before step t is collected.
    for (_, a, _), (at, _, fed) in itertools.pairwise(dispatches):
        assert at < collected[id(a)] and fed
    assert engine.metrics.decode_seconds >= 0.0


@pytest.mark.parametrize("where", ["prefill", "decode", "collect", "plan"])
def test_async_a_failing_request_or_step_leaves_the_others_exact(where, monkeypatch):
    """A prefill that raises fails its request alone; a decode step whose dispatch raises
    (losing the device arrays), or a scheduler pass whose plan raises (its requests counted
    with placeholder tokens), collects the step in flight, then recovers; a collection
    that raises (the next step already dispatched on its tokens) recovers both steps; every
    other request gets the sync engine's tokens."""
    from tests.test_engine_lifecycle import _failing_once

    sync, asyn = engine_of("hisparse", False), engine_of("hisparse", True)
    reqs = [dict(prompt=_prompt(50 + i, 6 + 5 * i), max_new_tokens=9, temperature=0.0,
                 stop_token_ids=(), seed=i, arrive=i) for i in range(5)]
    want = serve(sync, reqs)
    bad = 2
    if where == "prefill":
        prefill = asyn.runner.prefill

        def failing_prefill(req, blocks):
            if req.seed == bad:
                raise RuntimeError("prefill exploded")
            return prefill(req, blocks)

        monkeypatch.setattr(asyn.runner, "prefill", failing_prefill)
        got = serve(asyn, reqs)
        assert got[bad][0] == "error" and not got[bad][1]
        assert [g for i, g in enumerate(got) if i != bad] == [
            w for i, w in enumerate(want) if i != bad]
        return
    if where == "decode":
        for name in ("decode_fast", "decode_hot"):
            monkeypatch.setitem(asyn.runner.jitted, name, _failing_once(
                asyn.runner.jitted[name], after_call=True, at=4))
    elif where == "collect":
        monkeypatch.setattr(asyn.runner, "collect_decode",
                            _failing_once(asyn.runner.collect_decode, at=4))
    else:
        manager = asyn.scheduler.manager
        monkeypatch.setattr(manager, "build_plan", _failing_once(manager.build_plan, at=6))
    raised = []
    real_step = asyn.step

    def step():
        try:
            return real_step()
        except RuntimeError as e:
            raised.append(e)
            return []

    monkeypatch.setattr(asyn, "step", step)
    m = asyn.metrics
    resets, preemptions, replayed = m.device_resets, m.preemptions, m.replayed_tokens
    got = serve(asyn, reqs)
    assert raised and all("injected failure" in str(e) for e in raised)
    assert m.preemptions > preemptions  # recomputed by replay
    assert (m.device_resets > resets) == (where == "decode")
    assert m.replayed_tokens > replayed and not m.replay_mismatches
    assert got == want


def test_async_token_history_gets_the_real_ids():
    """The coordinator counts a token still on the device with a placeholder id; once its
    step is collected the history holds the real ids (prompt + generated so far)."""
    engine = engine_of("hisparse", True)
    manager = engine.scheduler.manager
    rid = engine.add_request(_prompt(3, 6), max_new_tokens=8, request_id=("hist", next(_ids)))
    engine.step()  # the prefill: its token reaches the history with the next pass
    for _ in range(4):
        engine.step()
        req = engine.running[rid]
        assert list(manager._requests[rid].token_ids) == [*req.prompt, *req.generated]
    assert engine._loop.flight is not None  # step t + 1 in flight, its fed token set already
    with pytest.raises(ValueError, match=r"set_token_ids\[0\]: index must be an int in"):
        manager.set_token_ids([(rid, 10 ** 6, 1)])
    with pytest.raises(ValueError, match="is not admitted"):
        manager.set_token_ids([("nope", 0, 1)])
    engine.run()
    assert engine.finished[rid].finish_reason == "length"
    assert_idle(engine)


def test_async_run_and_close_drain_the_step_in_flight():
    """`run(max_steps=...)` and `close` collect the step in flight; `warmup` compiles the
    async decode step (fed by device tokens or not, one trace), so no served step compiles."""
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=4),
                                               prefill=PrefillPolicy(bucket=MAX_LEN),
                                               residency=AllResident(), debug=Debug(max_traces=1),
                                               async_scheduling=True))
    engine.warmup()
    engine.add_request(_prompt(7, 5), max_new_tokens=6, request_id="a")
    engine.run(max_steps=3)
    assert engine._loop.flight is None
    assert len(engine.running["a"].generated) == 3  # prefill + two decode steps collected
    engine.step()
    assert engine._loop.flight is not None
    engine.close()
    assert engine._loop.flight is None and len(engine.running["a"].generated) == 4
    assert engine.trace_counts["decode_fast"] == 1 and engine.metrics.compile_seconds == 0


def test_async_config_refusals():
    with pytest.raises(ValueError, match="EngineConfig.async_scheduling must be a bool"):
        EngineConfig(async_scheduling=1)


def test_async_scheduling_takes_speculation():
    """Async scheduling with MTP speculation (once refused: a step's accepted drafts are
    known only when it is collected) decodes the synchronous engine's tokens without
    speculation; `tests/test_engine_async_speculative.py` covers the combination."""
    model = models.init_model(models.get_config("tiny", mtp_layers=1), seed=0)
    outs = []
    for fields in (dict(), dict(async_scheduling=True, speculative=Speculative(num_tokens=2))):
        engine = Engine(model, EngineConfig(
            sizes=Sizes(max_seats=3, max_model_len=MAX_LEN, block_size=4),
            prefill=PrefillPolicy(bucket=MAX_LEN), residency=AllResident(), **fields))
        rids = [engine.add_request(_prompt(i, 4 + 9 * i), max_new_tokens=9,
                                   temperature=0.8 * (i % 2)) for i in range(3)]
        out = engine.run()
        outs.append([(out[r].finish_reason, out[r].generated) for r in rids])
        assert engine.config.async_scheduling == ("speculative" in fields)
        engine.close()
    assert outs[0] == outs[1]


def test_mesh_engine_schedules_asynchronously():
    """A 1x1 mesh engine with async scheduling: the sync engine's tokens, with mesh decode
    step t + 1 dispatched before step t is collected (drains counted). Meshes of several
    shards, pressure and failures: `tests/test_mesh_compose.py`."""
    engine = MeshEngine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                               block_size=4),
                                                   prefill=PrefillPolicy(bucket=MAX_LEN),
                                                   residency=AllResident(),
                                                   async_scheduling=True), mesh_shape=(1, 1))
    try:
        reqs = [dict(prompt=_prompt(80 + i, 5 + 4 * i), max_new_tokens=6 + i,
                     temperature=0.0 if i % 2 else 0.9, stop_token_ids=(), seed=i, arrive=i)
                for i in range(4)]
        want = serve(engine_of("all-resident", False), reqs)
        assert serve(engine, reqs, check=False) == want
        assert engine.metrics.drains > 0 and engine._loop.flight is None
    finally:
        engine.close()
