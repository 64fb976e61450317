"""Requests are transactions: what one bad request (or one failing step) does to the engine.

One HiSparse engine under pressure serves every test of this module (it is drained and
checked for leaks after each); one all-resident engine computes the reference tokens of each
request (same prompt, limits, temperature and sampling seed: sampling keys are per request,
so sampled tokens compare too).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from hisparse_jax import models
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    HiSparse,
    PrefillPolicy,
    Sizes,
    Tuning,
)
from hisparse_jax.ops import _registry
from host_tier import CapacityError, Coordinator, HostPool
from tests.engine_reference import AllResidentReference, assert_idle

MAX_LEN = 48
# 27 usable device blocks: three 12-page requests need 36 plus hot regions of 8.
PRESSURE = dict(num_gpu_blocks=28)


@functools.cache
def tiny_model():
    return models.init_model("tiny", seed=0)


def _prompt(i, n):
    return np.random.default_rng(100 + i).integers(0, 512, n).tolist()


@pytest.fixture(scope="module")
def reference():
    """request -> (finish_reason, tokens) of an all-resident engine serving it."""
    ref = AllResidentReference(tiny_model(),
                               sizes=Sizes(max_seats=3, max_model_len=MAX_LEN, block_size=4),
                               prefill=PrefillPolicy(bucket=MAX_LEN))
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def shared():
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=4, **PRESSURE),
                                               prefill=PrefillPolicy(bucket=MAX_LEN)))
    yield engine
    engine.close()


@pytest.fixture
def engine(shared):
    """The shared engine, idle; drained and checked for leaks afterwards."""
    assert_idle(shared)
    yield shared
    _drain(shared)
    shared.scheduler.deliver(wait=True)
    assert_idle(shared)


def assert_matches_reference(engine, reference, rids):
    for rid in rids:
        req = engine.finished[rid]
        assert req.finish_reason in ("stop", "length", "max_model_len"), (rid, req.error)
        assert (req.finish_reason, req.generated) == reference(req), rid


def _mixed(engine, n=5, start=0):
    """n requests: long and short prompts, greedy and sampled."""
    return [engine.add_request(_prompt(start + i, 8 + 6 * i), max_new_tokens=10,
                               temperature=0.0 if i % 2 else 0.8) for i in range(n)]


# ------------------------------------------------------------------ add_request


def test_add_request_checks_everything_before_queueing(engine, reference):
    a = engine.add_request([1, 2, 3], max_new_tokens=2, request_id="a")
    bad = [
        (dict(prompt=[1], request_id="a"), "request_id 'a' names a waiting"),
        (dict(prompt=[]), "prompt must not be empty"),
        (dict(prompt=[512]), r"token ids of prompt must be in \[0, 512\)"),
        (dict(prompt=[-1]), "token ids of prompt"),
        (dict(prompt=[1.5]), "prompt must be a sequence of int token ids"),
        (dict(prompt="abc"), "prompt must be a sequence of int token ids"),
        (dict(prompt=[True]), "prompt must be a sequence of int token ids"),
        (dict(prompt=[5, True]), r"prompt must be a sequence of int token ids in \[0, 512\) "
                                 r"\(bools are not token ids\)"),
        (dict(prompt=(np.True_, 3)), "prompt must be a sequence of int token ids"),
        (dict(prompt=[1], stop_token_ids=[2, False]),
         "stop_token_ids must be a sequence of int token ids"),
        (dict(prompt=[1] * MAX_LEN), "leaves no room under max_model_len=48"),
        (dict(prompt=[1] * 40, max_new_tokens=9), r"= 49 exceeds max_model_len=48"),
        (dict(prompt=[1], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(prompt=[1], max_new_tokens=2.0), "max_new_tokens must be an int >= 1"),
        (dict(prompt=[1], temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(prompt=[1], temperature=float("nan")), "temperature must be a finite"),
        (dict(prompt=[1], temperature=float("inf")), "temperature must be a finite"),
        (dict(prompt=[1], stop_token_ids=[600]), "token ids of stop_token_ids"),
        (dict(prompt=[1], stop_token_ids=5), "stop_token_ids must be a sequence of int"),
        (dict(prompt=[1], stop_token_ids="ab"), "stop_token_ids must be a sequence of int"),
        (dict(prompt=[1], request_id=["unhashable"]), "request_id must be hashable"),
        (dict(prompt=[1], seed=-1), "seed must be an int in"),
    ]
    for kwargs, match in bad:
        kwargs.setdefault("max_new_tokens", 2)
        with pytest.raises(ValueError, match=match):
            engine.add_request(**kwargs)
    assert [r.request_id for r in engine.waiting] == [a]  # nothing else was queued
    # Automatic ids never take an explicit one; explicit ids never take a used one.
    explicit = engine.add_request([1], max_new_tokens=1, request_id=7)
    autos = [engine.add_request([1], max_new_tokens=1) for _ in range(9)]
    assert explicit == 7 and 7 not in autos and len(set(autos)) == 9
    with pytest.raises(ValueError, match="names a waiting"):
        engine.add_request([1], max_new_tokens=1, request_id=autos[0])
    engine.step()  # "a" runs now, and still may not be reused
    assert "a" in engine.running
    with pytest.raises(ValueError, match="names a waiting, running or finished"):
        engine.add_request([1], max_new_tokens=1, request_id="a")
    engine.run()
    with pytest.raises(ValueError, match="names a waiting, running or finished"):
        engine.add_request([1], max_new_tokens=1, request_id="a")  # finished
    assert_matches_reference(engine, reference, [a, explicit, *autos])


def test_capacity_error_for_a_request_the_pools_can_never_hold():
    # A host pool of 6 usable blocks holds prompts of up to 24 tokens (generated pages may
    # stay on the device); a device pool of 13 usable blocks cannot grant a 20-token request
    # its hot region (5 pages + 1 new + 8); the all-resident layout holds anything up to
    # max_model_len. Nothing is queued for a refused request.
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=4, num_host_blocks=7),
                                               prefill=PrefillPolicy(bucket=MAX_LEN)))
    with pytest.raises(CapacityError, match="host pool: the prompt needs 7 host blocks"):
        engine.add_request([1] * 25, max_new_tokens=2)
    engine.add_request([1] * 24, max_new_tokens=20)  # its generated pages may stay pinned
    assert len(engine.waiting) == 1
    engine.close()
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=4, num_gpu_blocks=14),
                                               prefill=PrefillPolicy(bucket=MAX_LEN)))
    with pytest.raises(CapacityError, match="device pool: alone, the request asks for its hot"):
        engine.add_request([1] * 20, max_new_tokens=None)
    engine.add_request([1] * 10, max_new_tokens=6)
    assert len(engine.waiting) == 1
    engine.close()
    static = Engine(tiny_model(), EngineConfig(residency=AllResident(),
                                               sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=4),
                                               prefill=PrefillPolicy(bucket=MAX_LEN)))
    static.add_request([1] * 40, max_new_tokens=8)
    assert static.scheduler.manager.capacity_error(40, 49) is not None


# ------------------------------------------------------------------ EngineConfig


@pytest.mark.parametrize("kwargs, match", [
    (lambda: dict(sizes=Sizes(block_size=0)),
     "EngineConfig.sizes.block_size must be a positive int"),
    (lambda: dict(sizes=Sizes(max_model_len=-4)),
     "EngineConfig.sizes.max_model_len must be a positive int"),
    (lambda: dict(sizes=Sizes(max_model_len=1)),
     r"EngineConfig.sizes.max_model_len must be >= 2 \(a request needs at least one prompt "
     r"token and one generated token\), got 1"),
    (lambda: dict(sizes=Sizes(max_seats=0)),
     "EngineConfig.sizes.max_seats must be a positive int"),
    (lambda: dict(prefill=PrefillPolicy(bucket=0)),
     "EngineConfig.prefill.bucket must be a positive int"),
    (lambda: dict(sizes=Sizes(max_seats=2.0)),
     "EngineConfig.sizes.max_seats must be a positive int"),
    (lambda: dict(sizes=Sizes(hot_size=0)),
     "EngineConfig.sizes.hot_size must be a positive int or None"),
    (lambda: dict(sizes=Sizes(hot_size=40000)), "EngineConfig.sizes.hot_size must be <= 32768"),
    (lambda: dict(sizes=Sizes(num_gpu_blocks=1)),
     "EngineConfig.sizes.num_gpu_blocks must be an int >= 2"),
    (lambda: dict(sizes=Sizes(num_host_blocks=True)),
     "EngineConfig.sizes.num_host_blocks must be an int >= 2"),
    (lambda: dict(debug=Debug(max_traces=0)),
     "EngineConfig.debug.max_traces must be a positive int"),
    (lambda: dict(seed=-1),
     r"EngineConfig.seed must be an int in \[0, 2\*\*32\)"),
    (lambda: dict(seed="0"), "EngineConfig.seed must be an int"),
    (lambda: dict(residency="all_resident"),
     r"EngineConfig.residency must be HiSparse\(\), AllResident\(\) or NaiveOffload\(\)"),
    (lambda: dict(compilation_cache=None),
     "EngineConfig.compilation_cache must be a bool"),
    (lambda: dict(tuning=Tuning(pack_host_layers=2)),
     "EngineConfig.tuning.pack_host_layers must be a bool"),
    (lambda: dict(residency=HiSparse(per_row="yes")),
     "EngineConfig.residency.per_row must be a bool"),
    (lambda: dict(topk_source=object()), "EngineConfig.topk_source must be a"),
    (lambda: dict(tuning=Tuning(ops="bogus")),
     r"EngineConfig.tuning.ops must be one of \('reference'"),
    (lambda: dict(tuning=Tuning(attention=3)),
     "EngineConfig.tuning.attention must be a str or None"),
    (lambda: dict(tuning=Tuning(ops="mosaic_gpu")),
     "EngineConfig.tuning.ops='mosaic_gpu' has no "
                                     "implementation of resolve_residency"),
])
def test_engine_config_is_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs())


def test_engine_config_aliases_and_the_checks_that_need_the_model_or_platform(monkeypatch):
    with pytest.warns(DeprecationWarning, match="'pallas' is deprecated"):
        assert EngineConfig(tuning=Tuning(attention="pallas")).tuning.attention_backend == "triton"
    with pytest.raises(ValueError, match=r"EngineConfig.sizes.hot_size must be >= \(1 \+ "
                                         r"EngineConfig.speculative.num_tokens\) \* the "
                                         r"model's top_k \(1 x 16"):
        Engine(tiny_model(), EngineConfig(sizes=Sizes(hot_size=8)))
    calls = []

    def unsupported(op, backend, *args, **kwargs):
        calls.append((op, backend, [getattr(a, "shape", None) for a in args]))
        return "no such device here" if backend == "triton" else None

    monkeypatch.setattr(_registry, "unsupported", unsupported)
    with pytest.raises(ValueError, match="EngineConfig.tuning.attention='triton' cannot run "
                                         "on this platform: no such device here"):
        Engine(tiny_model(), EngineConfig(tuning=Tuning(attention="triton"),
                                          sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                      block_size=4),
                                          prefill=PrefillPolicy(bucket=MAX_LEN)))
    # The decode call's shapes: q [S, h, W], KV rows [blocks * B, W], rows [S, top_k].
    mc = tiny_model().cfg
    assert calls[0][2] == [(3, mc.num_heads, mc.row_width),
                           (EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                     block_size=4),
                                         prefill=PrefillPolicy(bucket=MAX_LEN)
                                         ).hisparse_config(mc).num_gpu_blocks * 4,
                            mc.row_width), (3, mc.top_k)]
    with pytest.raises(ValueError, match="EngineConfig.tuning.ops='triton' cannot run "
                                         "resolve_residency on this platform"):
        Engine(tiny_model(), EngineConfig(tuning=Tuning(ops="triton"),
                                          sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                      block_size=4),
                                          prefill=PrefillPolicy(bucket=MAX_LEN)))
    Engine(tiny_model(), EngineConfig(tuning=Tuning(ops="triton"), residency=AllResident(),
                                      sizes=Sizes(max_seats=3, max_model_len=MAX_LEN, block_size=4),
                                      prefill=PrefillPolicy(bucket=MAX_LEN)))


def test_host_memory_is_checked_before_any_per_block_structure():
    # 10**9 host blocks of the tiny model: refused by the host pool's RAM check, at once.
    with pytest.raises(ValueError, match="EngineConfig.sizes.num_host_blocks=1000000000.*RAM"):
        Engine(tiny_model(), EngineConfig(sizes=Sizes(num_host_blocks=10 ** 9, max_seats=3,
                                                      max_model_len=MAX_LEN, block_size=4),
                                          prefill=PrefillPolicy(bucket=MAX_LEN)))


# ------------------------------------------------------------------ failures of one request


def test_a_failing_admission_or_prefill_finishes_only_that_request(engine, reference,
                                                                    monkeypatch):
    manager, runner = engine.scheduler.manager, engine.runner
    admit, prefill = manager.admit, runner.prefill

    def failing_admit(rid, tokens, **kw):
        if rid == "bad-admit":
            raise RuntimeError("admission exploded")
        return admit(rid, tokens, **kw)

    def failing_prefill(req, blocks):
        if req.request_id == "bad-prefill":
            raise RuntimeError("prefill exploded")
        return prefill(req, blocks)

    monkeypatch.setattr(manager, "admit", failing_admit)
    monkeypatch.setattr(runner, "prefill", failing_prefill)
    good = _mixed(engine, 2)
    engine.add_request(_prompt(9, 20), max_new_tokens=5, request_id="bad-admit")
    engine.add_request(_prompt(10, 30), max_new_tokens=5, request_id="bad-prefill")
    good += _mixed(engine, 3, start=2)
    done, raised = _drain(engine)
    assert not raised
    assert {"bad-admit", "bad-prefill", *good} <= {r.request_id for r in done}
    for rid, what in (("bad-admit", "admission exploded"), ("bad-prefill", "prefill exploded")):
        req = engine.finished[rid]
        assert req.finish_reason == "error" and what in req.error and not req.generated
    assert manager.stats["aborts"] >= 1
    assert_matches_reference(engine, reference, good)


def test_cancel_waiting_and_running_requests(engine, reference):
    rids = _mixed(engine, 5)
    engine.step()
    engine.step()
    running, waiting = next(iter(engine.running)), engine.waiting[-1].request_id
    partial = list(engine.running[running].generated)
    assert engine.cancel(running) and engine.cancel(waiting)
    assert engine.finished[running].finish_reason == "cancelled"
    assert engine.finished[running].generated == partial
    assert engine.finished[waiting].finish_reason == "cancelled"
    assert not engine.cancel(running)  # already finished
    with pytest.raises(ValueError, match="no request has request_id 'nope'"):
        engine.cancel("nope")
    with pytest.raises(ValueError, match="cancel: request_id must be hashable, got list"):
        engine.cancel([1])
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"run: max_steps must be an int >= 0 or None"):
            engine.run(max_steps=bad)
    engine.run()
    assert_matches_reference(engine, reference, [r for r in rids if r not in (running, waiting)])
    assert engine.summary()["finish_reasons"]["cancelled"] >= 2


# ------------------------------------------------------------------ failing steps


def _failing_once(fn, *, after_call=False, at=3):
    """`fn` that raises on its `at`-th call: before calling it, or after (its donated
    arguments are then gone). `wrapped.fired` says whether it did."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        wrapped.calls += 1
        if wrapped.calls == at and not after_call:
            wrapped.fired = True
            raise RuntimeError("injected failure")
        out = fn(*args, **kwargs)
        if wrapped.calls == at:
            jax.block_until_ready(out)
            wrapped.fired = True
            raise RuntimeError("injected failure")
        return out

    wrapped.calls, wrapped.fired = 0, False
    return wrapped


def lose_the_device_in_a_prefill(engine, monkeypatch, prompt, max_new_tokens):
    """Serves `prompt` with a prefill that raises after its call (its donated device arrays
    are gone): the request fails and the engine rebuilds its device state once."""
    monkeypatch.setitem(engine.runner.jitted, "prefill",
                        _failing_once(engine.runner.jitted["prefill"], after_call=True, at=1))
    resets = engine.metrics.device_resets
    rid = engine.add_request(prompt, max_new_tokens=max_new_tokens)
    assert engine.run()[rid].finish_reason == "error"
    assert engine.metrics.device_resets == resets + 1


def _drain(engine, *, max_steps=500):
    """Steps until no work; returns (finished requests, exceptions raised by steps)."""
    done, raised = [], []
    for _ in range(max_steps):
        if not engine.has_work:
            return done, raised
        try:
            done += engine.step()
        except RuntimeError as e:
            raised.append(e)
        if isinstance(engine.scheduler.manager, Coordinator):
            engine.scheduler.manager.check_invariants()
        assert not engine.scheduler.pass_decode and not engine.scheduler.pass_admitted
    raise AssertionError(f"no progress after {max_steps} steps: {len(engine.running)} running, "
                         f"{len(engine.waiting)} waiting")


@pytest.mark.parametrize("after_call", [False, True], ids=["before", "device-arrays-lost"])
def test_a_failing_decode_step_preempts_its_batch_and_the_next_step_works(
        engine, reference, monkeypatch, after_call):
    wrappers = []
    for name in ("decode_fast", "decode_hot"):
        wrappers.append(_failing_once(engine.runner.jitted[name], after_call=after_call))
        monkeypatch.setitem(engine.runner.jitted, name, wrappers[-1])
    rids = _mixed(engine, 5)
    resets, preemptions = engine.metrics.device_resets, engine.metrics.preemptions
    _, raised = _drain(engine)
    fired = sum(w.fired for w in wrappers)
    assert fired >= 1 and len(raised) == fired
    assert all("injected failure" in str(e) for e in raised)
    assert engine.metrics.preemptions > preemptions  # the failed steps' batches
    assert engine.metrics.device_resets - resets == (fired if after_call else 0)
    assert_matches_reference(engine, reference, rids)


def test_a_failing_scheduler_pass_is_closed_and_the_next_step_works(engine, reference,
                                                                     monkeypatch):
    manager = engine.scheduler.manager
    monkeypatch.setattr(manager, "build_plan", _failing_once(manager.build_plan, at=4))
    rids = _mixed(engine, 5)
    _, raised = _drain(engine)
    assert len(raised) == 1 and "injected failure" in str(raised[0])
    assert_matches_reference(engine, reference, rids)


def test_a_failing_prefill_that_loses_the_device_arrays_fails_only_its_request(
        engine, reference, monkeypatch):
    prefill = engine.runner.jitted["prefill"]
    monkeypatch.setitem(engine.runner.jitted, "prefill", _failing_once(prefill, after_call=True,
                                                                       at=4))
    rids = _mixed(engine, 6)
    done, raised = _drain(engine)
    assert not raised  # the prefill's request fails alone
    failed = [r for r in done if r.finish_reason == "error"]
    assert len(failed) == 1 and "injected failure" in failed[0].error
    assert engine.metrics.device_resets >= 1
    assert_matches_reference(engine, reference, [r for r in rids if r != failed[0].request_id])


def test_a_failing_spill_copy_is_retried_and_loses_nothing(engine, reference, monkeypatch):
    transfers = engine.scheduler.transfers
    assert transfers.mirror_group_fn is not None  # the engine's spills: one call per plan
    monkeypatch.setattr(transfers, "mirror_group_fn",
                        _failing_once(transfers.mirror_group_fn, at=2))
    rids = _mixed(engine, 5)
    _, raised = _drain(engine)
    assert not raised and transfers.mirror_group_fn.fired  # the worker reports it failed
    assert_matches_reference(engine, reference, rids)


# ------------------------------------------------------------------ one engine per pool


def test_a_host_pool_serves_one_live_engine_until_it_closes(reference):
    """Two live engines on one pool would write each other's host rows: the second is
    refused before any work; once the owner closes, the pool serves a new engine. A closed
    engine takes no request; a closed pool is refused as closed."""
    config = EngineConfig(sizes=Sizes(max_seats=3, max_model_len=MAX_LEN, block_size=4,
                                      **PRESSURE), prefill=PrefillPolicy(bucket=MAX_LEN))
    spec = tiny_model().spec
    pool = HostPool(num_layers=spec.num_layers, block_size=4,
                    row_width=config.stored_row(spec)[0], dtype=config.stored_row(spec)[1],
                    num_blocks=64, layers_per_array=config.host_layers_per_array(spec))
    rule = (r"Engine host_pool is in use by another live engine; the rule: a HostPool serves "
            r"one engine at a time, until that engine's close\(\)")
    first = Engine(tiny_model(), config, host_pool=pool)
    own = Engine(tiny_model(), config)
    try:
        for taken in (pool, own.host_pool):
            with pytest.raises(ValueError, match=rule):
                Engine(tiny_model(), config, host_pool=taken)
        rids = _mixed(first, 3)
        first.run()
        assert_matches_reference(first, reference, rids)
    finally:
        first.close()
        own.close()
    with pytest.raises(RuntimeError, match=r"add_request: the engine is closed"):
        first.add_request([1, 2], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"Engine host_pool is closed; it must be an open "):
        Engine(tiny_model(), config, host_pool=own.host_pool)
    second = Engine(tiny_model(), config, host_pool=pool)  # the owner closed: free again
    try:
        rids = _mixed(second, 5)
        second.run()
        assert_matches_reference(second, reference, rids)
    finally:
        second.close()
    assert not pool.closed  # the engines did not make it: they leave it open
    pool.close()


def test_readme_request_example_runs_as_documented():
    """The README's request example (warm-up, add, cancel, run) does what its text says."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("### Requests, finish reasons, cancel", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code.replace("print(", "_ = ("), "README.md", "exec"), namespace)
    done, rid = namespace["done"], namespace["rid"]
    assert done[rid].finish_reason == "cancelled" and done[rid].generated == []
    assert done[rid].error is None
