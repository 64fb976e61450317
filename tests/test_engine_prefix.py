"""Prefix reuse in the engine (`EngineConfig.prefill.prefix_caching`).

A request whose prompt starts with pages an earlier request published prefills only the rest
of its prompt (from its first uncached position, through `Transformer.prefill_chunk`), reading
the prefix's rows through resident pages (adopted device copies, or restores of the published
host pages) and its index keys from the engine's `IndexKeyStore`. Its greedy tokens equal those
of an all-resident engine without prefix caching that prefills the whole prompt in one shot
(the reference of `tests/test_engine_chunked.py`: chunked and one-shot prefill agree in greedy
tokens for the tiny model on a CPU):

  * hits of whole pages, of a shared part that ends mid-page (its last page is not shared),
    and a copy-on-write hit (the prompt is a prefix of a published one: the last reused page
    is restored into a private page), one-shot and chunked;
  * multi-turn: the second turn's prompt is the first turn's prompt + its generated tokens +
    new user tokens; the first turn's generated pages are reused too;
  * under pool pressure (the device copies of the prefix reused by other requests): the hit
    pages are restored from the host pool;
  * the key store holds exactly the published pages' keys once the engine is idle (entries go
    with evicted pages: no unbounded growth);
  * config refusals (speculation and asynchronous scheduling compose with it:
    `tests/test_engine_compose_prefix.py`).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax import models
from hisparse_jax.engine import (
    Engine,
    EngineConfig,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from hisparse_jax.engine.mesh import MeshEngine
from hisparse_jax.engine.metrics import CompileWatch
from hisparse_jax.topk_sources import DriftTopK
from tests.engine_reference import AllResidentReference, assert_idle

MAX_LEN = 48
B = 4
SIZES = dict(max_seats=3, max_model_len=MAX_LEN, block_size=B, prefill_bucket=MAX_LEN)
GEN = 8


@functools.cache
def tiny_model():
    return models.init_model("tiny", seed=0)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, n).tolist()


@pytest.fixture(scope="module")
def reference():
    ref = AllResidentReference(tiny_model(),
                               sizes=Sizes(max_seats=3, max_model_len=MAX_LEN, block_size=B),
                               prefill=PrefillPolicy(bucket=MAX_LEN))
    yield ref
    ref.close()


@pytest.fixture(scope="module", params=[None, 5], ids=["one-shot", "chunk-5"])
def engine(request):
    """A HiSparse engine with prefix caching (one-shot prefill, or chunks of 5 tokens)."""
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     chunk_size=request.param,
                                                                     bucket=MAX_LEN),
                                               sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=B)))
    yield engine
    engine.close()


def _serve(engine, prompt, max_new_tokens=GEN):
    """Serves one request alone; returns it and the prompt tokens its prefill reused."""
    hits = engine.metrics.prefix_hit_tokens
    computed = engine.metrics.prompt_tokens
    rid = engine.add_request(prompt, max_new_tokens=max_new_tokens)
    out = engine.run()[rid]
    assert out.finish_reason == "length", out.error
    reused = engine.metrics.prefix_hit_tokens - hits
    assert engine.metrics.prompt_tokens - computed == len(prompt) - reused
    return out, reused


def _assert_same(out, reference):
    want = reference(out)
    assert (out.finish_reason, out.generated) == want


def _assert_keys_match_published(engine):
    """Idle: the key store holds the keys of exactly the published pages."""
    assert_idle(engine)
    store = engine.prefix_keys
    published = set(engine.scheduler.manager.host_pool.published_blocks().values())
    assert set(store.keys) == published == store.published
    assert not store.owners


# (shared tokens, new tail tokens or None, tokens reused) of a second prompt after a first.
HIT_CASES = pytest.mark.parametrize("shared, tail, expect", [
    (16, 7, 16),   # the shared part is whole pages
    (18, 5, 16),   # it ends mid-page: that page is not shared (its hash differs)
    (20, None, 19),  # the prompt is a published prefix: copy-on-write of its last page
], ids=["whole-pages", "mid-page", "copy-on-write"])


@HIT_CASES
def test_a_prefix_hit_decodes_what_all_resident_decodes(engine, reference, shared, tail,
                                                        expect):
    stats = engine.scheduler.manager.stats
    cow = stats["copy_on_write"]
    check_hit_case(engine, reference, shared, tail, expect)
    assert (stats["copy_on_write"] > cow) == (tail is None)
    _assert_keys_match_published(engine)


def check_hit_case(engine, reference, shared, tail, expect, between=None):
    """A `HIT_CASES` case: a 23-token prompt, then (after `between(engine, seed)`, if given)
    one sharing its first `shared` tokens (plus `tail` new ones) that reuses `expect`; both
    decode what all-resident decodes."""
    seed = 1000 * shared + (tail or 0) + (engine.config.prefill.chunk_size or 0)
    first = _tokens(seed, 23)
    second = first[:shared] + ([] if tail is None else _tokens(seed + 1, tail))
    out, reused = _serve(engine, first)
    assert reused == 0
    _assert_same(out, reference)
    if between is not None:
        between(engine, seed)
    out, reused = _serve(engine, second)
    assert reused == expect
    _assert_same(out, reference)


def test_multi_turn_reuses_the_first_turn_with_its_generated_tokens(engine, reference):
    prompt = _tokens(7 + (engine.config.prefill.chunk_size or 0), 14)
    turn1, reused = _serve(engine, prompt)
    assert reused == 0
    _assert_same(turn1, reference)
    prompt2 = [*prompt, *turn1.generated, *_tokens(8, 6)]
    turn2, reused = _serve(engine, prompt2)
    # Rows of the prompt and of all but the last generated token were written: 5 full pages.
    assert reused == (len(prompt) + GEN - 1) // B * B > len(prompt)
    _assert_same(turn2, reference)
    summary = engine.summary()
    assert summary["prefix_hit_tokens"] >= reused and summary["prefix_hit_requests"] >= 1
    _assert_keys_match_published(engine)


@pytest.mark.parametrize("chunk", [None, 6], ids=["one-shot", "chunk-6"])
def test_under_pressure_hit_pages_are_restored_from_host(reference, chunk):
    # 27 usable device blocks, 40 host blocks: the fillers reuse the prefix's device copies
    # (and evict some published host pages).
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     chunk_size=chunk,
                                                                     bucket=MAX_LEN),
                                               sizes=Sizes(num_gpu_blocks=28, num_host_blocks=41,
                                                           max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=B)))
    try:
        stats = engine.scheduler.manager.stats
        first = _tokens(31, 22)
        out, _ = _serve(engine, first)
        _assert_same(out, reference)
        fillers = [engine.add_request(_tokens(40 + i, 30), max_new_tokens=10) for i in range(3)]
        done = engine.run()
        for rid in fillers:
            _assert_same(done[rid], reference)
        adopted, restored = stats["adopted_pages"], stats["prefix_restores"]
        second = first[:20] + _tokens(32, 9)
        out, reused = _serve(engine, second)
        assert reused == 20
        _assert_same(out, reference)
        assert stats["prefix_restores"] > restored  # read back from the host pool
        assert stats["adopted_pages"] == adopted  # no device copy was left to adopt
        assert engine.summary()["prefix_restored_pages"] == stats["prefix_restores"]
        _assert_keys_match_published(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("hit_pages", ["restore", "stage"])
def test_warmup_compiles_what_prefix_hits_reach(reference, hit_pages):
    # Under pressure: hits restore pages from host (or stage their rows:
    # tests/test_engine_staging.py), copy-on-write, the rest of a hit prompt as one chunk of
    # a one-shot engine, page index-key copies; no served step compiles.
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     prefix_hit_pages=hit_pages,
                                                                     bucket=MAX_LEN),
                                               sizes=Sizes(num_gpu_blocks=28, num_host_blocks=41,
                                                           max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=B)))
    try:
        engine.warmup()
        assert {"restore_rows", "prefill", "prefill_chunk"} <= set(engine.runner.warmed)
        assert ("prefill_chunk_staged" in engine.runner.warmed) == (hit_pages == "stage")
        CompileWatch.start()
        compiles = CompileWatch.count
        first = _tokens(77, 22)
        _serve(engine, first)
        fillers = [engine.add_request(_tokens(80 + i, 30), max_new_tokens=10)
                   for i in range(3)]
        engine.run()
        outs = []
        for prompt in (first[:20] + _tokens(78, 9), first[:16]):
            out, reused = _serve(engine, prompt)
            assert reused > 0
            outs.append(out)
        stats = engine.scheduler.manager.stats
        assert stats["copy_on_write"] > 0
        if hit_pages == "stage":
            assert engine.metrics.staged_rows_host > 0 and stats["prefix_restores"] == 0
        else:
            assert stats["prefix_restores"] > 0 and engine.metrics.staged_rows_host == 0
        assert CompileWatch.count == compiles, "a served step compiled"
        for out in outs:  # the reference engine compiles: after the count
            _assert_same(out, reference)
        assert len(fillers) == 3
    finally:
        engine.close()


def test_a_device_reset_forgets_the_published_prefixes(reference, monkeypatch):
    # A prefill that loses the device arrays: they are rebuilt (zeros), so nothing published
    # before may be reused (its device copies are gone); the next prompt is computed whole.
    from tests.test_engine_lifecycle import lose_the_device_in_a_prefill

    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     bucket=MAX_LEN),
                                               sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=B)))
    try:
        first = _tokens(90, 22)
        _serve(engine, first)
        assert len(engine.prefix_keys) > 0
        lose_the_device_in_a_prefill(engine, monkeypatch, _tokens(91, 10), GEN)
        assert len(engine.prefix_keys) == 0
        out, reused = _serve(engine, first[:20] + _tokens(92, 5))
        assert reused == 0
        _assert_same(out, reference)
        _assert_keys_match_published(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def small_host_engine():
    """A chunked engine whose small host pool evicts published pages between examples."""
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     chunk_size=8, bucket=MAX_LEN),
                                               sizes=Sizes(num_host_blocks=24, max_seats=3,
                                                           max_model_len=MAX_LEN, block_size=B)))
    yield engine
    engine.close()


@settings(max_examples=6, deadline=None)
@given(shared=st.integers(1, 30), tail=st.integers(1, 10), seed=st.integers(0, 2 ** 16))
def test_any_shared_prefix_decodes_what_all_resident_decodes(small_host_engine, reference,
                                                             shared, tail, seed):
    check_shared_prefix(small_host_engine, reference, shared, tail, seed)


def check_shared_prefix(engine, reference, shared, tail, seed, between=None):
    """Serves a 30-token prompt, then (after `between(engine)`, if given) one sharing its
    first `shared` tokens plus `tail` new ones: both decode what all-resident decodes, and
    the second reuses the pages wholly inside the shared part."""
    first = _tokens(seed, 30)
    second = first[:shared] + _tokens(seed + 1, tail)
    out, _ = _serve(engine, first)
    _assert_same(out, reference)
    if between is not None:
        between(engine)
    out, reused = _serve(engine, second)
    _assert_same(out, reference)
    # The first prompt's pages are the most recently released: still published. The second
    # reuses those wholly inside the shared part (its last token is always computed); the
    # shared part is the common prefix, longer than `shared` when the first new token happens
    # to equal the first prompt's next one (seen: seeds 117 / 118, token 200).
    common = len(os.path.commonprefix([first, second]))
    assert common >= shared
    assert reused == min(common // B * B, len(second) - 1)
    _assert_keys_match_published(engine)


def test_the_key_store_drops_evicted_pages():
    # 15 usable host blocks: every request evicts published pages of earlier ones.
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     bucket=MAX_LEN),
                                               sizes=Sizes(num_host_blocks=16, max_seats=3,
                                                           max_model_len=MAX_LEN, block_size=B)))
    try:
        for i in range(4):
            _serve(engine, _tokens(500 + i, 25))
            _assert_keys_match_published(engine)
        stats = engine.scheduler.manager.stats
        assert stats["published_pages"] > len(engine.prefix_keys) > 0  # some were evicted
    finally:
        engine.close()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, match", [
    (lambda: dict(prefill=PrefillPolicy(prefix_caching=1)),
     "EngineConfig.prefill.prefix_caching must be a bool"),
    (lambda: dict(residency=NaiveOffload()),
     "EngineConfig.prefill.prefix_caching needs EngineConfig.residency other than NaiveOffload"),
    (lambda: dict(topk_source=DriftTopK()),
     "EngineConfig.prefill.prefix_caching needs the indexer"),
])
def test_prefix_config_is_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**{"prefill": PrefillPolicy(prefix_caching=True), **kwargs()})


@pytest.mark.parametrize("kwargs", [
    dict(speculative=Speculative(num_tokens=1)),
    dict(async_scheduling=True),
    dict(async_scheduling=True, prefill=PrefillPolicy(prefix_caching=True, chunk_size=8,
                                                      prefix_hit_pages="stage")),
    dict(async_scheduling=True, speculative=Speculative(num_tokens=1)),
], ids=["speculation", "async", "async-chunked-stage", "async-speculation"])
def test_prefix_caching_composes_with_speculation_and_async_scheduling(kwargs):
    # Pages publish once their tokens are known (tests/test_engine_compose_prefix.py).
    config = EngineConfig(**{"prefill": PrefillPolicy(prefix_caching=True), **kwargs})
    assert config.prefill.prefix_caching


def test_the_mesh_engine_reuses_published_prefixes(reference):
    """A 1x1 mesh engine with prefix caching: a second prompt sharing 16 tokens with a first
    reuses its shard's published pages and decodes what all-resident decodes. Meshes of
    several shards (a hit within a shard): `tests/test_mesh_compose.py`."""
    engine = MeshEngine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                         bucket=MAX_LEN),
                                                   sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                               block_size=B)),
                        mesh_shape=(1, 1))
    try:
        first = _tokens(4242, 23)
        out, reused = _serve(engine, first)
        assert reused == 0
        _assert_same(out, reference)
        out, reused = _serve(engine, first[:16] + _tokens(4243, 7))
        assert reused == 16
        _assert_same(out, reference)
    finally:
        engine.close()


def test_page_keys_move_in_batches_and_touch_only_their_pages():
    # Reads and writes of page keys go in fixed batches of `_key_pages` pages (padding pages
    # -1: read nothing, write nothing); a batch of 3 splits 7 pages into 3 calls here.
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     bucket=MAX_LEN),
                                               sizes=Sizes(max_seats=3, max_model_len=MAX_LEN,
                                                           block_size=B)))
    runner = engine.runner
    runner._key_pages = 3
    rng = np.random.default_rng(7)
    groups = len(runner.cache.index_keys)
    dim = runner.cache.index_keys[0].shape[-1]
    dtype = np.asarray(runner.cache.index_keys[0][0, :1]).dtype
    pages = [0, 1, 2, 3, 5, 8, 11]
    keys = {p: tuple(rng.standard_normal((B, dim)).astype(dtype) for _ in range(groups))
            for p in pages}
    before = [np.asarray(k).copy() for k in runner.cache.index_keys]
    runner.write_page_keys(1, [(p, keys[p]) for p in pages])
    after = [np.asarray(k) for k in runner.cache.index_keys]
    for g in range(groups):
        expect = before[g].copy()
        for p in pages:
            expect[1, p * B:(p + 1) * B] = keys[p][g]
        np.testing.assert_array_equal(after[g], expect)  # other rows and seats unchanged
    got = runner.read_page_keys(1, [11, 2, 5, 0])
    assert len(got) == 4
    for p, page_keys in zip([11, 2, 5, 0], got, strict=True):
        for g in range(groups):
            np.testing.assert_array_equal(page_keys[g], keys[p][g])
    engine.close()
