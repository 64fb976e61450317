"""Asynchronous scheduling with speculative decoding: step t + 1 is planned and dispatched
before step t's accepted counts reach the host, and the output equals decoding without
speculation (the synchronous, one-shot, all-resident engine: `AllResidentReference`).

Drafts that the device makes (`DeviceScriptedDraft`: right or wrong as a pattern says, per
request: all / none / alternating / random; `MTPDraft`) let the next step continue on the
device; a host draft source (`ScriptedDraft`) makes each step collect first. The workloads mix
prompt lengths, arrivals, stop tokens that fire at chosen tokens, `max_new_tokens` that ends
in the middle of an accepted run, sampled and greedy requests, in every residency mode, under
HiSparse pool pressure, with chunked prefill and fp8 rows; failures are injected as in
`tests/test_engine_async.py`.
"""

from __future__ import annotations

import functools
import itertools
import json
import random

import numpy as np
import pytest

from hisparse_jax import models
from hisparse_jax.draft_sources import (
    AcceptanceRateDraft,
    DeviceScriptedDraft,
    MTPDraft,
    ScriptedDraft,
)
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from host_tier import Coordinator
from tests.engine_reference import AllResidentReference, assert_idle

MAX_LEN = 64
SIZES = dict(max_seats=3, max_model_len=MAX_LEN, block_size=4)


@functools.cache
def model_of(config: str = "tiny"):
    return models.init_model(models.get_config(config, mtp_layers=1), seed=0)


@functools.cache
def reference_of(config: str = "tiny", kv_format: str = "bf16") -> AllResidentReference:
    """The synchronous all-resident engine without speculation (one per model and format)."""
    return AllResidentReference(model_of(config), sizes=Sizes(**SIZES), kv_format=kv_format,
                                prefill=PrefillPolicy(bucket=MAX_LEN), compilation_cache=False)


def _request(seed: int, n: int, max_new_tokens: int, temperature: float = 0.0,
             arrive: int = 0) -> dict:
    prompt = np.random.default_rng(500 + seed).integers(0, 512, n).tolist()
    return dict(prompt=tuple(prompt), max_new_tokens=max_new_tokens, temperature=temperature,
                stop_token_ids=frozenset(), seed=seed, arrive=arrive)


class _Spec:
    """What `AllResidentReference` reads of a request."""

    def __init__(self, r: dict) -> None:
        self.prompt, self.max_new_tokens = r["prompt"], r["max_new_tokens"]
        self.temperature, self.stop_token_ids = r["temperature"], r["stop_token_ids"]
        self.sampling_seed = r["seed"]


def reference(reqs: list[dict], config: str = "tiny", kv_format: str = "bf16"):
    ref = reference_of(config, kv_format)
    return [ref(_Spec(r)) for r in reqs]


def workload(stop_at: dict[int, int] | None = None, config: str = "tiny",
             kv_format: str = "bf16") -> list[dict]:
    """Six requests of 2 to 50 prompt tokens arriving over three steps, two of them sampled;
    request 0 (all drafts right) ends with max_new_tokens = 7 in the middle of an accepted
    run, request 5 at max_model_len (max_new_tokens None); `stop_at`: request -> the index
    of its output token that becomes its stop token."""
    reqs = [_request(0, 9, 7), _request(1, 30, 12, arrive=1), _request(2, 2, 14, 0.9),
            _request(3, 21, 11, arrive=2), _request(4, 38, 9, 0.8, arrive=1),
            _request(5, 50, None, arrive=3)]
    if stop_at:
        plain = reference(reqs, config, kv_format)
        for i, at in stop_at.items():
            reqs[i]["stop_token_ids"] = frozenset({plain[i][1][at]})
    return reqs


PATTERNS = {0: lambda j: True, 1: lambda j: False, 2: lambda j: j % 2 == 0}


def accept(seed: int, j: int) -> bool:
    """Sampling seed -> its drafts' pattern: all, none, alternating, else random."""
    if seed % 4 in PATTERNS:
        return PATTERNS[seed % 4](j)
    return random.Random(seed * 4099 + j).random() < 0.6


def scripted(reqs: list[dict], config: str = "tiny", kv_format: str = "bf16", *,
             device: bool = True):
    """Drafts of the reference outputs (without stop tokens: drafts past a stop are never
    verified), right or wrong as `accept` says."""
    plain = reference([{**r, "stop_token_ids": frozenset()} for r in reqs], config, kv_format)
    known = {r["seed"]: out[1] for r, out in zip(reqs, plain, strict=True)}
    if device:
        return DeviceScriptedDraft(known, accept)
    return ScriptedDraft(known, accept)


def make_engine(k: int, draft, *, config: str = "tiny", sizes: dict | None = None,
                **fields) -> Engine:
    return Engine(model_of(config), EngineConfig(
        sizes=Sizes(**{**SIZES, **(sizes or {})}), async_scheduling=True,
        prefill=fields.pop("prefill", PrefillPolicy(bucket=MAX_LEN)),
        speculative=Speculative(num_tokens=k, draft=draft), compilation_cache=False, **fields))


_ids = itertools.count()


def serve(engine: Engine, reqs: list[dict], cancels: dict[int, int] | None = None
          ) -> list[tuple[str, list[int]]]:
    """Serves `reqs` (each added before step `arrive`; `cancels`: step -> the request
    cancelled before it); [(finish_reason, generated)]."""
    rids = [None] * len(reqs)
    step = 0
    while engine.has_work or any(r is None for r in rids):
        for i, r in enumerate(reqs):
            if rids[i] is None and r["arrive"] <= step:
                rids[i] = engine.add_request(
                    list(r["prompt"]), max_new_tokens=r["max_new_tokens"],
                    temperature=r["temperature"], stop_token_ids=r["stop_token_ids"],
                    seed=r["seed"], request_id=("asp", next(_ids)))
        if (cancels or {}).get(step) is not None:
            engine.cancel(rids[cancels[step]])
        engine.step()
        step += 1
        if isinstance(engine.scheduler.manager, Coordinator):
            engine.scheduler.manager.check_invariants()
        assert step < 500, "no progress"
    assert engine.drain() == []
    assert_idle(engine)
    return [(engine.finished[rid].finish_reason, list(engine.finished[rid].generated))
            for rid in rids]


def check_speculated(engine: Engine) -> None:
    """Drafts were verified and accepted, and decode steps overlapped (a few drains only)."""
    m = engine.metrics
    assert m.draft_tokens > m.accepted_tokens > 0
    assert engine.summary()["tokens_per_request_step"] > 1.0
    assert m.replay_mismatches == 0
    assert m.drains < m.steps / 3, (m.drains, m.steps)


# HiSparse under pool pressure: 33 usable device blocks for three requests of up to 12
# pages, hot regions of 12 (the smallest for k = 2: (1 + k) top_k rows).
PRESSURE = dict(num_gpu_blocks=34, hot_size=48)
# (model config, k, EngineConfig fields): every mode, pool pressure, chunks, fp8 rows.
KINDS = {
    "all-resident-k1": ("tiny", 1, dict(residency=AllResident())),
    "all-resident-k3": ("tiny", 3, dict(residency=AllResident())),
    "hisparse-k2": ("tiny", 2, dict(sizes=PRESSURE)),
    "naive-offload-k2": ("tiny", 2, dict(residency=NaiveOffload(),
                                         sizes=dict(num_gpu_blocks=34))),
    "chunked-k2": ("tiny", 2, dict(sizes=PRESSURE,
                                   prefill=PrefillPolicy(bucket=8, chunk_size=8))),
    "fp8-hisparse-k2": ("tiny576", 2, dict(kv_format="fp8_ds_mla", sizes=PRESSURE)),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_async_speculation_equals_decoding_without_speculation(kind):
    """Every accept pattern, stop tokens that fire at chosen tokens (requests 1 and 3: a stop
    learned a step late drops the next step's row), max_new_tokens reached mid-run."""
    config, k, fields = KINDS[kind]
    kv_format = fields.get("kv_format", "bf16")
    reqs = workload({1: 5, 3: 2}, config, kv_format)
    want = reference(reqs, config, kv_format)
    assert sum(reason == "stop" for reason, _ in want) == 2
    engine = make_engine(k, scripted(reqs, config, kv_format), config=config, **fields)
    try:
        assert serve(engine, reqs) == want
        check_speculated(engine)
        assert engine.metrics.dropped_rows > 0  # finishes learned a step late
        if not kind.startswith("all-resident"):  # the host tier really worked
            stats = engine.scheduler.manager.stats
            assert stats["spills"] > 0 and stats["lost_pages"] > 0, stats
            assert engine.metrics.hot_misses > 0
    finally:
        engine.close()


def test_async_mtp_drafts_are_exact_under_pressure():
    """The model's own MTP module drafts on the device (rarely right, randomly initialised);
    HiSparse under pool pressure; same tokens as decoding without speculation, and a
    request cancelled mid-run keeps a prefix of them."""
    reqs = workload({4: 3})
    engine = make_engine(2, MTPDraft(), sizes=PRESSURE)
    try:
        got, want = serve(engine, reqs, cancels={6: 1}), reference(reqs)
        assert got[1][0] == "cancelled" and got[1][1] == want[1][1][:len(got[1][1])]
        assert got[:1] + got[2:] == want[:1] + want[2:]
        assert engine.metrics.draft_tokens > 0
        assert engine.scheduler.manager.stats["unpinned_pages"] > 0
        assert engine.metrics.drains < engine.metrics.steps / 3
    finally:
        engine.close()


def test_async_acceptance_rate_draft_equals_its_synchronous_run():
    """`AcceptanceRateDraft` (its output is not the model's) decides each draft by the
    token's key: with pages wider than 2k rows the asynchronous engine verifies the same
    drafts per step as the synchronous one, so tokens and counts are equal."""
    reqs = workload()
    outs = []
    for async_scheduling in (False, True):
        engine = Engine(model_of(), EngineConfig(
            sizes=Sizes(**{**SIZES, "block_size": 8}), residency=AllResident(),
            prefill=PrefillPolicy(bucket=MAX_LEN), async_scheduling=async_scheduling,
            speculative=Speculative(num_tokens=2, draft=AcceptanceRateDraft(0.7)),
            compilation_cache=False))
        outs.append((serve(engine, reqs), engine.metrics.draft_tokens,
                     engine.metrics.accepted_tokens))
        engine.close()
    assert outs[0] == outs[1]
    assert outs[1][2] > 0


def test_async_with_a_host_draft_source_collects_before_planning():
    """A host source proposes from the accepted tokens: each step collects the one in flight
    first (`metrics.drains`), and the output is exact."""
    reqs = workload({3: 4})
    engine = make_engine(2, scripted(reqs, device=False), sizes=PRESSURE)
    try:
        assert engine._loop.plans_after_collecting
        assert serve(engine, reqs) == reference(reqs)
        m = engine.metrics
        assert m.accepted_tokens > 0 and m.decode_steps > 0
        assert m.drains >= m.decode_steps  # every decode step collected before the next
    finally:
        engine.close()


def test_async_speculation_dispatches_the_next_step_before_collecting_the_last():
    """The overlap: each decode step is dispatched, fed by the previous step's device outputs
    (tokens, accepted counts, drafts), before that step is collected; `warmup` compiles the
    step (fed or not: one trace), so no served step compiles."""
    reqs = [_request(0, 5, 12), _request(3, 7, 12)]  # all right; random
    engine = make_engine(2, scripted(reqs), residency=AllResident(),
                         debug=Debug(max_traces=1))
    engine.warmup()
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
        assert serve(engine, reqs) == reference(reqs)
    finally:
        del runner.dispatch_decode, runner.collect_decode
        engine.close()
    dispatches = [(i, p, fed) for i, (what, p, fed) in enumerate(events) if what == "dispatch"]
    collected = {id(p): i for i, (what, p, _) in enumerate(events) if what == "collect"}
    assert len(dispatches) == len(collected) >= 4
    assert engine.metrics.accepted_tokens > 0
    for (_, a, _), (at, _, fed) in itertools.pairwise(dispatches):
        assert at < collected[id(a)] and fed
    assert engine.trace_counts["decode_fast"] == 1 and engine.metrics.compile_seconds == 0


def test_e2e_bench_runs_async_speculation(tmp_path):
    """`bench/e2e_decode.py --async-scheduling --speculative-tokens K` runs (and its flag
    rules refuse what the engine would)."""
    from bench import e2e_decode

    with pytest.raises(SystemExit, match="--speculative-tokens must be in"):
        e2e_decode.main(["--config", "tiny", "--block-size", "4", "--speculative-tokens", "4",
                         "--no-plot"])
    with pytest.raises(SystemExit, match="--acceptance-rate needs"):
        e2e_decode.main(["--config", "tiny", "--acceptance-rate", "0.5", "--no-plot"])
    out = tmp_path / "e2e.json"
    assert e2e_decode.main([
        "--config", "tiny", "--context", "256", "--gen-budget", "64", "--block-size", "16",
        "--concurrency", "3", "--modes", "hisparse", "--turnover-sweep", "",
        "--warmup-steps", "2", "--measure-steps", "4", "--rounds", "1", "--async-scheduling",
        "--speculative-tokens", "2", "--output", str(out), "--no-plot"]) == 0
    record = json.loads(out.read_text())
    assert record["config"]["async_scheduling"] and record["config"]["speculative_tokens"] == 2
    for r in record["results"]:
        assert r["tokens_per_request_step"] > 1.0 and r["measured_steps"] == 4, r


@pytest.mark.parametrize("where", ["prefill", "decode", "collect", "plan"])
def test_async_speculation_failures_leave_the_others_exact(where, monkeypatch):
    """As `tests/test_engine_async.py`'s failure test, with speculation under pool pressure:
    a prefill that raises fails its request alone; a decode step whose dispatch raises
    (losing the device arrays), a plan that raises, or a collection that raises (the next
    step already dispatched on the device's counts) drains and recovers; the requests are
    recomputed by replay and every other request ends as without speculation."""
    from tests.test_engine_lifecycle import _failing_once

    reqs = [_request(50 + i, 6 + 5 * i, 10, arrive=i) for i in range(5)]
    for i, r in enumerate(reqs):
        r["seed"] = i  # accept patterns by request: all, none, alternating, random, all
    want = reference(reqs)
    engine = make_engine(2, scripted(reqs), sizes=PRESSURE)
    bad = 2
    try:
        if where == "prefill":
            prefill = engine.runner.prefill

            def failing_prefill(req, blocks):
                if req.seed == bad:
                    raise RuntimeError("prefill exploded")
                return prefill(req, blocks)

            monkeypatch.setattr(engine.runner, "prefill", failing_prefill)
            got = serve(engine, reqs)
            assert got[bad][0] == "error" and not got[bad][1]
            assert [g for i, g in enumerate(got) if i != bad] == [
                w for i, w in enumerate(want) if i != bad]
            return
        if where == "decode":
            for name in ("decode_fast", "decode_hot"):
                monkeypatch.setitem(engine.runner.jitted, name, _failing_once(
                    engine.runner.jitted[name], after_call=True, at=5))
        elif where == "collect":
            monkeypatch.setattr(engine.runner, "collect_decode",
                                _failing_once(engine.runner.collect_decode, at=5))
        else:
            manager = engine.scheduler.manager
            monkeypatch.setattr(manager, "build_plan", _failing_once(manager.build_plan, at=7))
        raised = []
        real_step = engine.step

        def step():
            try:
                return real_step()
            except RuntimeError as e:
                raised.append(e)
                return []

        monkeypatch.setattr(engine, "step", step)
        got = serve(engine, reqs)
        m = engine.metrics
        assert raised and all("injected failure" in str(e) for e in raised)
        assert m.preemptions > 0 and m.replayed_tokens > 0 and not m.replay_mismatches
        assert (m.device_resets > 0) == (where == "decode")
        assert got == want
        assert m.accepted_tokens > 0
    finally:
        engine.close()


def test_async_speculation_counts_catch_up_with_the_real_token_ids():
    """The coordinator counts a continued request as if its step in flight accepted no
    draft (one placeholder token, at index prompt + live) and catches up when that step is
    collected: after each engine step its history is the prompt and the generated tokens up
    to the first one of the step in flight, with the real ids (every draft is right here, so
    the host's count lags the request's)."""
    reqs = [_request(0, 6, 20)]
    engine = make_engine(2, scripted(reqs), sizes=PRESSURE)
    manager = engine.scheduler.manager
    rid = engine.add_request(list(reqs[0]["prompt"]), max_new_tokens=20, seed=0)
    lagged = 0
    try:
        engine.step()  # the prefill
        engine.step()  # decode step 1 in flight
        for _ in range(3):
            engine.step()
            req = engine.running[rid]
            (fed, live), = engine._loop.flight.fed
            assert fed is req
            history = list(manager._requests[rid].token_ids)
            assert history == [*req.prompt, *req.generated[:live + 1]]
            lagged += len(history) < len(req.prompt) + len(req.generated)
        assert lagged
        engine.run()
        assert engine.finished[rid].generated == reference(reqs)[0][1]
        assert_idle(engine)
    finally:
        engine.close()
