"""Prefix caching composed with asynchronous scheduling and with speculative decoding.

Pages seal, hash and publish only when their tokens are known:

  * asynchronous scheduling: a step's newest token is on the device when the next step is
    scheduled; the residency manager counts it as a placeholder (`schedule_batch(
    num_placeholders=...)`) and no page holding one is hashed, published or kept for seat
    reuse until the engine sets its id (`set_token_ids`, when the step is collected);
  * speculation: draft rows are lookahead rows, never counted as tokens, so a rejected
    draft's row never seals, publishes, spills or has its index keys kept; accepted drafts
    count once recorded.

Checked here, one-shot and chunked, under HiSparse pool pressure (hit pages restored, or
staged), and in the all-resident mode (seat reuse): multi-turn conversations (a turn's prompt
is the last turn's prompt + its output + new tokens, conversations share a system prompt, a
prompt served twice), greedy and sampled, with stop tokens; every request's tokens equal
those of the synchronous, one-shot, all-resident engine without prefix caching or
speculation (`AllResidentReference`); prefix hits happen; every published page (kept row) is
named by the tokens it holds. A prompt that matches a page only under the placeholder id, or
only with a rejected draft's token, reuses nothing of that page. The coordinator's own rules
are checked on it directly. KV rows are float32: a reused row written by a decode step and the
reference's recomputed one round alike (`tests/test_engine_seat_reuse.py`, bf16 note).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax import models
from hisparse_jax.draft_sources import ScriptedDraft
from hisparse_jax.engine import (
    AllResident,
    Engine,
    EngineConfig,
    HiSparse,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from hisparse_jax.engine.scheduler import PENDING_TOKEN
from hisparse_jax.engine.static_residency import StaticResidency
from host_tier import Coordinator
from host_tier.scheduler.prefix_cache import page_hash
from tests.engine_reference import AllResidentReference, assert_idle

MAX_LEN = 64
B = 4
SEATS = 3
MODEL = dataclasses.replace(models.get_config("tiny", mtp_layers=1), kv_dtype="float32")
# HiSparse under pool pressure: requests ask for hot regions, unpin and lose pages, and prefix
# hits find host-only pages (restored, or staged). Speculation's hot regions hold a step's
# (1 + k) * top_k rows.
PRESSURE = {"async": dict(num_gpu_blocks=28, num_host_blocks=60),
            "spec": dict(num_gpu_blocks=28, num_host_blocks=60, hot_size=48)}


@functools.cache
def tiny_model():
    return models.init_model(MODEL, seed=0)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 512, n).tolist()


@pytest.fixture(scope="module")
def reference():
    ref = AllResidentReference(tiny_model(),
                               sizes=Sizes(max_seats=SEATS, max_model_len=MAX_LEN, block_size=B),
                               prefill=PrefillPolicy(bucket=MAX_LEN))
    yield ref
    ref.close()


class _Drafts(ScriptedDraft):
    """Drafts from the reference output of each request (looked up by what it is, not by its
    add_request index: turns are added as earlier ones finish); `accept(i, j)` says whether
    the draft of generated token j of the request with index i is right, else it is
    `reject_token(right token)`."""

    def __init__(self, accept, reject_token=lambda t: (t + 1) % 512):
        super().__init__({}, accept)
        self.known: dict = {}
        self.reject_token = reject_token

    def known_tokens(self, request):
        return self.known.get(_key(request), [])

    def propose(self, request, num_tokens):
        ref = self.known_tokens(request)
        return [0 if j >= len(ref) else ref[j] if self.accept(request.index, j)
                else self.reject_token(ref[j])
                for j in range(request.live, request.live + num_tokens)]


def _key(req):
    return (tuple(req.prompt), req.max_new_tokens, req.temperature,
            frozenset(req.stop_token_ids), req.sampling_seed)


def _random_accept(i: int, j: int) -> bool:
    return random.Random(i * 7919 + j).random() < 0.55


def _engine(feature: str, kind: str, chunk: int | None, *, accept=_random_accept,
            k: int = 2, **reject):
    """A serving engine with prefix caching and `feature` ("async": async scheduling;
    "spec": k scripted drafts a step), `kind` "pressure" / "stage" (HiSparse under pool
    pressure, hit pages restored / staged), "roomy" (HiSparse, every page fits) or "resident"
    (all-resident: seat reuse); prefill chunks of `chunk` tokens (None: one shot)."""
    sizes = dict(max_seats=SEATS, max_model_len=MAX_LEN, block_size=B)
    if kind in ("pressure", "stage"):
        sizes.update(PRESSURE[feature])
    draft = _Drafts(accept, **reject) if feature == "spec" else None
    return Engine(tiny_model(), EngineConfig(
        sizes=Sizes(**sizes), residency=AllResident() if kind == "resident" else HiSparse(),
        prefill=PrefillPolicy(prefix_caching=True, chunk_size=chunk, bucket=MAX_LEN,
                              prefix_hit_pages="stage" if kind == "stage" else "restore"),
        speculative=Speculative(num_tokens=k, draft=draft) if draft is not None else None,
        async_scheduling=feature == "async", compilation_cache=False))


def converse(engine, reference, conversations):
    """Serves `conversations` (each a list of turns: dicts with `new` tokens, `gen`,
    `temperature`, `seed`, optional `stop`); a conversation's next turn is added once its
    last one finished (its prompt: the last prompt + its output + `new`), others running.
    Each finished request must equal the reference; returns them all."""
    draft = engine.config.draft
    history = [[] for _ in conversations]
    turn = [0] * len(conversations)
    running: dict[int, object] = {}
    done = []
    while True:
        for c, turns in enumerate(conversations):
            if c in running or turn[c] == len(turns):
                continue
            t = turns[turn[c]]
            want = types.SimpleNamespace(
                prompt=tuple(history[c] + t["new"]), max_new_tokens=t["gen"],
                temperature=t["temperature"], stop_token_ids=frozenset(t.get("stop", ())),
                sampling_seed=t["seed"])
            if draft is not None:
                draft.known[_key(want)] = reference(want)[1]
            running[c] = engine.add_request(
                list(want.prompt), max_new_tokens=t["gen"], temperature=t["temperature"],
                stop_token_ids=t.get("stop", ()), seed=t["seed"])
        if not running:
            break
        try:
            engine.step()
        except RuntimeError as e:  # an injected failure: the engine recovered
            assert "injected failure" in str(e)
        for c, rid in list(running.items()):
            out = engine.finished.get(rid)
            if out is None:
                continue
            assert out.error is None, out.error
            assert (out.finish_reason, out.generated) == reference(out), (c, turn[c])
            history[c] = [*out.prompt, *out.generated]
            turn[c] += 1
            done.append(out)
            del running[c]
    engine.drain()
    return done


def _mix(seed: int, *, conversations: int = 3, turns: int = 3):
    """Conversations sharing a two-page system prompt, greedy and sampled; the last one
    asks the first one's first prompt (the same prompt twice), then goes its own way."""
    rng = random.Random(seed)
    system = _tokens(seed, 2 * B)
    firsts = [system + _tokens(seed * 100 + c, rng.randint(3, 7))
              for c in range(max(conversations - 1, 1))]
    firsts = [*firsts, firsts[0]][:conversations]
    return [[dict(new=firsts[c] if t == 0 else _tokens(seed * 100 + 10 * c + t,
                                                       rng.randint(2, 5)),
                  gen=rng.randint(5, 8), temperature=(0.0, 0.8)[(c + t) % 2],
                  seed=1000 * seed + 10 * c + t) for t in range(turns)]
            for c in range(conversations)]


def _published_by_real_tokens(engine, outs):
    """Every published page (HiSparse) is named by the tokens of some request's rows; every
    kept row (seat reuse) holds a prefix of some request's tokens."""
    manager = engine.scheduler.manager
    if isinstance(manager, StaticResidency):
        seqs = [[*o.prompt, *o.generated] for o in outs]
        for kept in manager._kept.values():
            kept = kept.tolist()
            assert any(s[:len(kept)] == kept for s in seqs), kept
        return
    real = set()
    for o in outs:
        tokens, parent = [*o.prompt, *o.generated], None
        for p in range(len(tokens) // B):
            parent = page_hash(parent, tokens[p * B:(p + 1) * B])
            real.add(parent)
    published = set(manager.host_pool.published_blocks().values())
    assert published and published <= real


def _check_run(engine, outs, *, kind):
    s = engine.summary()
    assert s["prefix_hit_requests"] > 0 and s["prefix_hit_tokens"] > 0, s
    if kind in ("pressure", "stage"):  # the host tier worked, and hits read host pages
        assert s["unpinned_pages"] > 0, s
        if kind == "stage":  # (a staged hit's hot region comes with its admission)
            assert s["staged_rows_host"] > 0 and s["prefix_restored_pages"] == 0, s
        else:
            assert s["hot_grants"] > 0 and s["prefix_restored_pages"] > 0, s
    if engine.config.num_speculative_tokens:
        assert 0 < s["accepted_tokens"] < s["draft_tokens"], s  # drafts kept and rejected
    if engine.config.async_scheduling:
        assert s["dropped_rows"] > 0 or not any(o.finish_reason == "stop" for o in outs)
    _published_by_real_tokens(engine, outs)
    assert_idle(engine)


CASES = pytest.mark.parametrize("kind, chunk", [
    ("pressure", None), ("stage", 5), ("resident", 5)],
    ids=["pressure-one-shot", "stage-chunk-5", "resident-chunk-5"])


@CASES
def test_async_multi_turn_decodes_what_all_resident_decodes(reference, kind, chunk):
    engine = _engine("async", kind, chunk)
    try:
        convs = _mix(1)
        convs[0][1]["stop_at"] = 3
        outs = converse(engine, reference, _stops_from_reference(convs, reference))
        assert any(o.finish_reason == "stop" for o in outs)
        _check_run(engine, outs, kind=kind)
    finally:
        engine.close()


@CASES
def test_speculative_multi_turn_decodes_what_all_resident_decodes(reference, kind, chunk):
    engine = _engine("spec", kind, chunk)
    try:
        convs = _mix(2)
        convs[1][1]["stop_at"] = 4
        outs = converse(engine, reference, _stops_from_reference(convs, reference))
        _check_run(engine, outs, kind=kind)
    finally:
        engine.close()


def _stops_from_reference(convs, reference):
    """A turn with `stop_at` j stops at the token its reference output (without stops)
    emits at index j (the first time that token appears)."""
    history = [[] for _ in convs]
    for c, conv in enumerate(convs):
        for t in conv:
            want = types.SimpleNamespace(prompt=tuple(history[c] + t["new"]),
                                         max_new_tokens=t["gen"],
                                         temperature=t["temperature"],
                                         stop_token_ids=frozenset(), sampling_seed=t["seed"])
            out = reference(want)[1]
            j = t.pop("stop_at", None)
            if j is not None:
                t["stop"] = (out[j],)
                out = out[:out.index(out[j]) + 1]
            history[c] = [*want.prompt, *out]
    return convs


@pytest.mark.parametrize("feature", ["async", "spec"])
def test_failed_steps_recover_and_decode_what_all_resident_decodes(reference, feature):
    """Decode steps that fail (injected, three times) preempt their batch (asynchronous: the
    step in flight is collected first, then the failed one recovered); the requests replay,
    and prefix hits, publications and tokens are as without failures."""
    engine = _engine(feature, "pressure", 5)
    calls = {"n": 0}
    for name, step in list(engine.runner.jitted.items()):
        if name.startswith("decode"):
            def failing(*args, _step=step, **kwargs):
                calls["n"] += 1
                if calls["n"] in (9, 23, 40):
                    raise RuntimeError("injected failure")
                return _step(*args, **kwargs)
            engine.runner.jitted[name] = failing
    try:
        convs = _mix(3)
        convs[2][1]["stop_at"] = 2
        outs = converse(engine, reference, _stops_from_reference(convs, reference))
        assert engine.metrics.preemptions > 0 and engine.metrics.replayed_tokens > 0
        _check_run(engine, outs, kind="pressure")
    finally:
        engine.close()


# --------------------------------------------------------------------------- no wrong page


def _serve(engine, prompt, gen):
    """Serves one greedy request alone; returns it and the prompt tokens its prefill reused."""
    hits = engine.metrics.prefix_hit_tokens
    rid = engine.add_request(prompt, max_new_tokens=gen)
    out = engine.run()[rid]
    assert out.finish_reason == "length", out.error
    return out, engine.metrics.prefix_hit_tokens - hits


def _page_final(num_prompt: int, generated: list[int]) -> list[int]:
    """Indices j of `generated` whose token is the last of a page (position prompt + j)."""
    return [j for j in range(len(generated)) if (num_prompt + j) % B == B - 1]


@pytest.mark.parametrize("kind", ["roomy", "resident"])
def test_an_async_placeholder_never_names_a_page(reference, kind):
    """An asynchronous step's newest token is a placeholder (`PENDING_TOKEN`) for the
    manager until collected. A prompt that matches a first turn only where its page-final
    tokens are replaced by the placeholder reuses nothing past the first of them; the real
    continuation of another first turn reuses every written page, as the synchronous engine
    does. (Two first turns: a kept seat serves one later request.)"""
    engine = _engine("async", kind, None)
    transfers = engine.scheduler.transfers
    poll = transfers.poll
    # Every copy completes before its step's reports are delivered: a page sealed by the
    # newest token completes while that token is still a placeholder.
    transfers.poll = lambda wait=False: poll(wait=True)
    try:
        served = []
        for seed, tail in ((71, PENDING_TOKEN), (74, None)):
            prompt = _tokens(seed, 9)
            first, reused = _serve(engine, prompt, 12)
            assert reused == 0
            assert (first.finish_reason, first.generated) == reference(first)
            if tail is None:  # the real continuation
                nxt = [*prompt, *first.generated, *_tokens(seed + 1, 3)]
                bound = expect = (len(prompt) + len(first.generated) - 1) // B * B
            else:
                finals = [j for j in _page_final(len(prompt), first.generated)
                          if first.generated[j] != tail]
                fake = list(first.generated)
                for j in finals:
                    fake[j] = tail
                nxt = [*prompt, *fake, *_tokens(seed + 1, 3)]
                bound, expect = (len(prompt) + finals[0]) // B * B, None
            out, reused = _serve(engine, nxt, 6)
            assert reused <= bound and reused == (expect if expect is not None else reused)
            assert (out.finish_reason, out.generated) == reference(out)
            served += [first, out]
        _published_by_real_tokens(engine, served)
        assert_idle(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["roomy", "resident"])
def test_a_rejected_draft_never_names_a_page(reference, kind):
    """Every draft of a page-final token is wrong (rejected): its row was written by the
    step that verified it, at the page's last position. A prompt carrying that draft token
    there reuses nothing of the page (it was never sealed with it); the real continuation
    of another first turn reuses it."""
    finals = set(_page_final(9, list(range(14))))
    engine = _engine("spec", kind, None, accept=lambda i, j: j not in finals, k=3)
    draft = engine.config.draft
    try:
        served = []
        for seed, fake in ((81, True), (84, False)):
            prompt = _tokens(seed, 9)
            want = types.SimpleNamespace(prompt=tuple(prompt), max_new_tokens=14,
                                         temperature=0.0, stop_token_ids=frozenset(),
                                         sampling_seed=seed)
            draft.known[_key(want)] = reference(want)[1]
            rid = engine.add_request(prompt, max_new_tokens=14, seed=seed)
            first = engine.run()[rid]
            assert (first.finish_reason, first.generated) == reference(first)
            assert 0 < first.num_accepted < first.num_drafted
            j = min(finals)
            tokens = list(first.generated)
            if fake:
                tokens[j] = draft.reject_token(tokens[j])
            out, reused = _serve(engine, [*prompt, *tokens, *_tokens(seed + 1, 2)], 6)
            if fake:
                assert reused <= (len(prompt) + j) // B * B
            else:
                assert reused > len(prompt) + j
            assert (out.finish_reason, out.generated) == reference(out)
            served += [first, out]
        _published_by_real_tokens(engine, served)
        assert_idle(engine)
    finally:
        engine.close()


# --------------------------------------------------------------------------- random mixes


@pytest.fixture(scope="module")
def mix_engines():
    """One chunked engine per feature under pool pressure (hit pages restored), kept for the
    examples (each leaves it idle)."""
    engines = {feature: (_engine(feature, "pressure", 6), []) for feature in ("async", "spec")}
    yield engines  # feature -> (engine, the requests it served)
    for engine, _ in engines.values():
        engine.close()


@settings(max_examples=8, deadline=None)
@given(feature=st.sampled_from(["async", "spec"]), seed=st.integers(0, 2 ** 16),
       conversations=st.integers(1, 3), turns=st.integers(1, 3),
       stop=st.none() | st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 4)))
def test_random_multi_turn_mixes_decode_what_all_resident_decodes(reference, mix_engines,
                                                                  feature, seed, conversations,
                                                                  turns, stop):
    engine, served = mix_engines[feature]
    convs = _mix(seed, conversations=conversations, turns=turns)
    if stop is not None:  # (conversation, turn, index of its output that is a stop token)
        c, t, j = stop
        convs[c % conversations][t % turns]["stop_at"] = j
    served += converse(engine, reference, _stops_from_reference(convs, reference))
    _published_by_real_tokens(engine, served)
    assert_idle(engine)


# --------------------------------------------------------------------------- the managers


def _coordinator(**kwargs):
    return Coordinator(block_size=B, num_gpu_blocks=16, num_host_blocks=20, hot_blocks=2,
                       max_num_reqs=4, max_model_len=32, **kwargs)


def _complete(coord, plan):
    ids = [s.transfer_id for s in plan.spills]
    coord.on_transfers(enqueued=ids + [r.transfer_id for r in plan.restores], completed=ids)
    coord.check_invariants()


def test_the_coordinator_publishes_a_placeholder_page_once_its_id_is_set():
    coord = _coordinator()
    published = []
    coord.listen(on_publish=lambda rid, page, h: published.append((rid, page, h)))
    coord.admit("a", [5, 6, 7])
    _complete(coord, coord.build_plan())
    # The token at index 3 is on the device: page 0 seals, spills and its copy completes,
    # but it is not hashed nor published until its id is set.
    assert coord.schedule_batch(["a"], [[0]], num_placeholders=[1]) == [None]
    plan = coord.build_plan()
    assert [s.device_block for s in plan.spills] == [coord.view("a").resident_blocks[0]]
    _complete(coord, plan)
    record = coord._requests["a"]
    assert record.placeholders == {3} and not published and not record.page_hashes
    assert coord.cached_tokens([5, 6, 7, 0, 1]) == 0
    with pytest.raises(AssertionError, match="page 0 holds a placeholder token id"):
        coord.prefix_cache.page_hash(record, 0)
    coord.set_token_ids([("a", 3, 8)])
    assert published == [("a", 0, page_hash(None, [5, 6, 7, 8]))]
    assert coord.cached_tokens([5, 6, 7, 8, 1]) == 4 and coord.cached_tokens([5, 6, 7, 0, 1]) == 0
    coord.check_invariants()
    # A request that finishes with a placeholder (a stop learned a step late) publishes
    # the pages before it only.
    coord.schedule("a", new_token_ids=[9, 10, 11, 12], num_placeholders=1)
    _complete(coord, coord.build_plan())
    coord.finish("a")
    assert [page for _, page, _ in published] == [0]
    coord.check_invariants()


def test_a_placeholder_set_before_the_copy_completes_publishes_with_it():
    coord = _coordinator()
    published = []
    coord.listen(on_publish=lambda rid, page, h: published.append(page))
    coord.admit("a", [5, 6, 7])
    _complete(coord, coord.build_plan())
    coord.schedule("a", new_token_ids=[0], num_placeholders=1)
    plan = coord.build_plan()
    coord.set_token_ids([("a", 3, 8)])
    assert not published  # its host copy has not completed
    _complete(coord, plan)
    assert published == [0] and coord.cached_tokens([5, 6, 7, 8, 1]) == 4


@pytest.mark.parametrize("call, match", [
    (lambda c: c.schedule("a", new_token_ids=[1], num_placeholders=2),
     r"schedule: num_placeholders must be an int in \[0, 1\]"),
    (lambda c: c.schedule("a", new_token_ids=[1], num_placeholders=True),
     "schedule: num_placeholders must be an int"),
    (lambda c: c.schedule_batch(["a"], [[1]], num_placeholders=[-1]),
     r"schedule_batch\[0\]: num_placeholders must be an int in \[0, 1\]"),
    (lambda c: c.schedule_batch(["a"], [[1]], num_placeholders=[1, 0]),
     "schedule_batch: num_placeholders has 2 entries, new_token_ids 1"),
])
def test_num_placeholders_is_checked_before_anything_changes(call, match):
    coord = _coordinator()
    coord.admit("a", [5, 6, 7])
    coord.build_plan()
    with pytest.raises(ValueError, match=match):
        call(coord)
    assert list(coord._requests["a"].token_ids) == [5, 6, 7]
    assert coord.schedule("a", new_token_ids=[1]) is None


def test_seat_reuse_keeps_rows_by_their_real_ids_up_to_a_placeholder():
    from hisparse_jax.config import HiSparseConfig

    cfg = HiSparseConfig(top_k=4, hot_size=8, block_size=B, max_num_reqs=2,
                         max_model_len=MAX_LEN, num_gpu_blocks=1 + 2 * (MAX_LEN // B))
    manager = StaticResidency(cfg, reuse_seats=True)
    prompt = list(range(1, 8))
    manager.admit("a", prompt)
    manager.build_plan()
    manager.schedule_batch(["a"], [[0]], num_placeholders=[1])
    manager.build_plan()
    manager.set_token_ids([("a", 7, 40)])
    manager.schedule("a", new_token_ids=[0], num_placeholders=1)  # learned a stop late
    manager.build_plan()
    manager.finish("a")
    # Rows 0..7 kept (prompt + the set id), not row 8 (a placeholder): two whole pages.
    assert manager.cached_tokens([*prompt, 40, 0, 1]) == 8
    assert manager.cached_tokens([*prompt, 0, 1]) == 4
    with pytest.raises(ValueError, match="set_token_ids.0.: request_id 'b' is not admitted"):
        manager.set_token_ids([("b", 0, 1)])
