"""Seat reuse: prefix caching in the all-resident mode (`StaticResidency(reuse_seats=True)`).

A state row freed by a finished request keeps its written rows; a later prompt that starts
with them (the next turn of a conversation) is admitted into that row and prefills only the
rest, reading the kept KV rows and index keys in place. Checked here:

  * the manager's rule, against a plain-Python model of it: reused tokens = the kept rows
    matching the prompt in whole pages, at most len(prompt) - 1; the longest match wins, else
    a row keeping nothing, else the row kept longest ago; a preempted / cancelled / aborted
    request keeps nothing; `cached_tokens` equals what `admit` reuses;
  * the engine: multi-turn conversations, more conversations than seats, one-shot and
    chunked prefill: greedy tokens equal an all-resident engine's without reuse, the tokens
    reused are the model's, and a device reset forgets every kept row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax import models
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import AllResident, Engine, EngineConfig, PrefillPolicy, Sizes, Speculative
from hisparse_jax.engine.static_residency import StaticResidency
from tests.engine_reference import AllResidentReference, assert_idle
from tests.test_engine_prefix import _tokens

MAX_LEN = 64
B = 4
SIZES = dict(max_seats=2, max_model_len=MAX_LEN, block_size=B, prefill_bucket=MAX_LEN)
GEN = 6
# float32 KV rows: a reused seat reads the rows its last turn's decode steps wrote, the
# reference recomputes them in its prefill; stored as bf16 the two can round apart by an ulp
# and flip a near-tie of the indexer's top-k (seen: tiny, 3 turns, seed 1087: the reference
# decoded a different second token; with float32 rows both decode the reused seat's tokens).
# What these tests check, which rows are reused and read, does not depend on the row dtype.
MODEL = dataclasses.replace(models.get_config("tiny"), kv_dtype="float32")


def tiny_model():
    return models.init_model(MODEL, seed=0)


# --------------------------------------------------------------------------- the manager


def _manager(seats: int = 3) -> StaticResidency:
    return StaticResidency(_cfg(seats), reuse_seats=True)


def _cfg(seats: int) -> HiSparseConfig:
    return HiSparseConfig(top_k=4, hot_size=8, block_size=B, max_num_reqs=seats,
                          max_model_len=MAX_LEN, num_gpu_blocks=1 + seats * (MAX_LEN // B))


class _Model:
    """The seat-reuse rule in plain Python: free rows with what they keep, oldest first."""

    def __init__(self, seats: int) -> None:
        self.free = list(range(seats))
        self.kept: dict[int, list[int]] = {}

    def pick(self, prompt: list[int]) -> tuple[int, int]:
        best, row = 0, None
        for r, kept in self.kept.items():  # oldest first: a tie keeps the older row
            common = len(os.path.commonprefix([kept, prompt]))
            reused = min(common // B * B, len(prompt) - 1)
            if reused > best:
                best, row = reused, r
        if row is None:
            empty = [r for r in self.free if r not in self.kept]
            row = min(empty) if empty else next(iter(self.kept))
        return best, row


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_manager_reuses_what_its_rule_says(data):
    seats = data.draw(st.integers(1, 3), label="seats")
    manager, model = _manager(seats), _Model(seats)
    # A few base conversations; prompts extend or cut them so matches happen often.
    bases = [_tokens(s, 40) for s in range(3)]
    running: dict[int, tuple[int, list[int], int]] = {}  # rid -> (row, tokens, written)
    for rid in range(data.draw(st.integers(1, 14), label="requests")):
        while len(running) == seats or (running and data.draw(st.booleans(), label="leave")):
            leaving = data.draw(st.sampled_from(sorted(running)), label="who")
            how = data.draw(st.sampled_from(["finish", "preempt", "cancel", "abort"]))
            row, tokens, written = running.pop(leaving)
            getattr(manager, how)(leaving)
            model.free.append(row)
            model.kept.pop(row, None)
            if how == "finish" and written:
                model.kept[row] = tokens[:written]
        base = data.draw(st.sampled_from(bases), label="base")
        cut = data.draw(st.integers(1, 40), label="cut")
        prompt = base[:cut] + _tokens(1000 + rid, data.draw(st.integers(0, 6), label="tail"))
        want = model.pick(prompt)
        assert manager.cached_tokens(prompt) == want[0]
        assert manager.admission_need(prompt) == (want[0], -(-len(prompt) // B))
        admitted = manager.admit(rid, prompt)
        assert (admitted.num_cached_tokens, admitted.state_row) == want
        assert admitted.num_scheduled_tokens == len(prompt) - want[0]
        model.free.remove(want[1])
        model.kept.pop(want[1], None)
        manager.build_plan()  # the prompt's rows are written
        tokens, written = list(prompt), len(prompt)
        steps = data.draw(st.integers(0, 4), label="decode steps")
        for step in range(steps):
            token = 7 + step
            manager.schedule(rid, new_token_ids=[token])
            tokens.append(token)
            # The last step may stay in the open pass (the request leaves before its plan).
            if step < steps - 1 or data.draw(st.booleans(), label="plan"):
                manager.build_plan()
                written = len(tokens)
        running[rid] = (want[1], tokens, written)


def test_the_manager_forgets_everything_on_a_device_reset():
    manager = _manager(2)
    prompt = _tokens(3, 20)
    manager.admit("a", prompt)
    manager.build_plan()
    manager.finish("a")
    assert manager.cached_tokens(prompt + [1, 2]) == 20
    manager.drop_prefix_cache()
    assert manager.cached_tokens(prompt + [1, 2]) == 0
    assert manager.admit("b", prompt).num_cached_tokens == 0


def test_without_reuse_nothing_is_kept():
    manager = StaticResidency(_cfg(2))
    prompt = _tokens(4, 20)
    manager.admit("a", prompt)
    manager.build_plan()
    manager.finish("a")
    assert manager.cached_tokens(prompt + [1]) == 0
    assert manager.admit("b", prompt + [1]).num_cached_tokens == 0


# --------------------------------------------------------------------------- the engine


def _reuse_engine(chunk=None) -> Engine:
    return Engine(tiny_model(), EngineConfig(residency=AllResident(),
                                             prefill=PrefillPolicy(prefix_caching=True,
                                                                   chunk_size=chunk,
                                                                   bucket=MAX_LEN),
                                             sizes=Sizes(max_seats=2, max_model_len=MAX_LEN,
                                                         block_size=B)))


@pytest.fixture(scope="module")
def reference():
    with contextlib.closing(AllResidentReference(tiny_model(),
                                                 sizes=Sizes(max_seats=2, max_model_len=MAX_LEN,
                                                             block_size=B),
                                                 prefill=PrefillPolicy(bucket=MAX_LEN))) as ref:
        yield ref


@pytest.fixture(scope="module", params=[None, 5], ids=["one-shot", "chunk-5"])
def engine(request):
    """All-resident with seat reuse: one-shot prefill, or chunks of 5 tokens."""
    with contextlib.closing(_reuse_engine(request.param)) as engine:
        yield engine


def _run_turn(engine, prompts: dict[int, list[int]]):
    """Submits every conversation's prompt at once, runs them to the end: {conv: output},
    prompt tokens reused in all."""
    hits = engine.metrics.prefix_hit_tokens
    computed = engine.metrics.prompt_tokens
    rids = {c: engine.add_request(p, max_new_tokens=GEN) for c, p in prompts.items()}
    done = engine.run()
    outs = {c: done[rid] for c, rid in rids.items()}
    for out in outs.values():
        assert out.finish_reason == "length", out.error
    reused = engine.metrics.prefix_hit_tokens - hits
    assert engine.metrics.prompt_tokens - computed == sum(map(len, prompts.values())) - reused
    return outs, reused


@settings(max_examples=5, deadline=None)
@given(conversations=st.integers(1, 3), turns=st.integers(2, 3), first=st.integers(3, 16),
       user=st.integers(1, 6), seed=st.integers(0, 2 ** 16))
def test_conversations_decode_what_all_resident_decodes(engine, reference, conversations,
                                                        turns, first, user, seed):
    convs = {c: _tokens(seed + c, first) for c in range(conversations)}
    for turn in range(turns):
        prompts = {c: convs[c] + _tokens(seed + 100 * (turn + 1) + c, user) for c in convs}
        if len(prompts[0]) + GEN > MAX_LEN:
            break
        outs, reused = _run_turn(engine, prompts)
        for c, out in outs.items():
            assert (out.finish_reason, out.generated) == reference(out)
            convs[c] = prompts[c] + list(out.generated)
        if turn and conversations <= SIZES["max_seats"]:
            # Each conversation's seat kept its last turn: the prompt and all but the last
            # generated token were written, reused in whole pages.
            written = [len(p) - user - 1 for p in prompts.values()]
            assert reused == sum(w // B * B for w in written)
        assert_idle(engine)


def test_more_conversations_than_seats_reuse_only_what_the_free_rows_kept(reference):
    engine = _reuse_engine()
    try:
        a, b, c = (_tokens(s, 13) for s in (20, 21, 22))
        outs, reused = _run_turn(engine, {0: a, 1: b, 2: c})
        assert reused == 0
        # Two rows: conversation 2 took the row conversation 0 or 1 freed first; the rows
        # keep conversation 2's turn and one of the other two.
        kept = engine.scheduler.manager._kept
        assert len(kept) == 2
        nexts = {i: p + list(outs[i].generated) + _tokens(30 + i, 3)
                 for i, p in enumerate((a, b, c))}
        hits = [engine.scheduler.manager.cached_tokens(p) for p in nexts.values()]
        assert sum(h > 0 for h in hits) == 2 and hits[2] > 0
        # One at a time, the kept ones first: each takes its own row; the last one's prompt
        # matches nothing and takes the row kept longest ago.
        for i in sorted(nexts, key=lambda i: hits[i] == 0):
            outs, reused = _run_turn(engine, {i: nexts[i]})
            assert reused == hits[i]
            assert (outs[i].finish_reason, outs[i].generated) == reference(outs[i])
    finally:
        engine.close()


def test_a_device_reset_forgets_the_kept_rows(reference, monkeypatch):
    from tests.test_engine_lifecycle import lose_the_device_in_a_prefill

    engine = _reuse_engine()
    try:
        first = _tokens(90, 22)
        outs, _ = _run_turn(engine, {0: first})
        nxt = first + list(outs[0].generated) + _tokens(91, 3)
        assert engine.scheduler.manager.cached_tokens(nxt) > 0
        lose_the_device_in_a_prefill(engine, monkeypatch, _tokens(92, 10), GEN)
        outs, reused = _run_turn(engine, {0: nxt})
        assert reused == 0
        assert (outs[0].finish_reason, outs[0].generated) == reference(outs[0])
    finally:
        engine.close()


@pytest.mark.parametrize("kwargs, match", [
    (lambda: dict(async_scheduling=True), None),
    (lambda: dict(speculative=Speculative(num_tokens=1)), None),
    (lambda: dict(prefill=PrefillPolicy(prefix_caching=True, prefix_hit_pages="stage")),
     "EngineConfig.prefill.prefix_hit_pages='stage' needs the HiSparse mode"),
])
def test_seat_reuse_config_is_checked(kwargs, match):
    # Seat reuse composes with asynchronous scheduling and speculation (rows are kept by
    # their known token ids: tests/test_engine_compose_prefix.py).
    kwargs = {"residency": AllResident(), "prefill": PrefillPolicy(prefix_caching=True),
              **kwargs()}
    if match is None:
        assert EngineConfig(**kwargs).prefill.prefix_caching
        return
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_warmup_compiles_what_seat_reuse_reaches(reference):
    # One-shot prefill: a reused seat's rest of the prompt runs as a chunk ("prefill_chunk");
    # no served step compiles after warmup.
    from hisparse_jax.engine.metrics import CompileWatch

    engine = _reuse_engine()
    try:
        engine.warmup()
        assert {"prefill", "prefill_chunk"} <= set(engine.runner.warmed)
        CompileWatch.start()
        compiles = CompileWatch.count
        first = _tokens(60, 17)
        outs, _ = _run_turn(engine, {0: first})
        outs, reused = _run_turn(engine, {0: first + list(outs[0].generated) + _tokens(61, 4)})
        assert reused > 0
        assert CompileWatch.count == compiles, "a served step compiled"
        assert (outs[0].finish_reason, outs[0].generated) == reference(outs[0])
    finally:
        engine.close()
