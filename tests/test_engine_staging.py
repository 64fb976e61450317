"""Prefill staging of prefix hits (`EngineConfig.prefix_hit_pages="stage"`).

A prefix hit's pages without a device copy stay host-only (no restore, no resident block);
each prefill chunk of the request stages the rows its query rows select from them
(`Transformer.prefill_chunk` with host pages, `stage_prefill_rows`), and the request decodes
through its hot region afterwards. Greedy tokens equal those of an all-resident engine
without prefix caching (`tests/test_engine_prefix.py`'s reference) for whole-page and
mid-page hits, copy-on-write, several chunk sizes and pool pressure; every test checks that
rows were staged and that no prefix restore ran, so it fails if the restore path runs.
Warmup of the staged variant: `tests/test_engine_prefix.py`
(`test_warmup_compiles_what_prefix_hits_reach`).
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.engine import Engine, EngineConfig
from tests.engine_reference import AllResidentReference
from tests.test_engine_prefix import (
    HIT_CASES,
    SIZES,
    B,
    _assert_keys_match_published,
    _assert_same,
    _serve,
    _tokens,
    check_hit_case,
    check_shared_prefix,
    tiny_model,
)

# 27 usable device blocks, 40 host blocks: fillers take the device blocks of the prefix's
# published pages, so a later hit finds no device copy to adopt and reads host pages.
PRESSURE = dict(num_gpu_blocks=28, num_host_blocks=41)


@pytest.fixture(scope="module")
def reference():
    ref = AllResidentReference(tiny_model(), **SIZES)
    yield ref
    ref.close()


def _engine(chunk, **kwargs):
    return Engine(tiny_model(), EngineConfig(
        enable_prefix_caching=True, prefix_hit_pages="stage", prefill_chunk_size=chunk,
        **{**PRESSURE, **kwargs}, **SIZES))


def _evict_device_copies(engine, reference, seed):
    """Serves fillers that reuse every free device block (the published pages' copies)."""
    fillers = [engine.add_request(_tokens(seed + i, 30), max_new_tokens=10) for i in range(3)]
    done = engine.run()
    for rid in fillers:
        _assert_same(done[rid], reference)


@pytest.fixture(scope="module", params=[None, 5, 8], ids=["one-shot", "chunk-5", "chunk-8"])
def engine(request):
    engine = _engine(request.param)
    yield engine
    engine.close()


@HIT_CASES  # whole pages, a shared part ending mid-page, copy-on-write
def test_a_staged_hit_decodes_what_all_resident_decodes(engine, reference, shared, tail,
                                                        expect):
    m, stats = engine.metrics, engine.scheduler.manager.stats
    before = {}

    def evict(engine, seed):
        _evict_device_copies(engine, reference, seed + 2)
        before.update(staged=m.staged_rows_host, hot_steps=m.decode_steps - m.fast_steps)

    check_hit_case(engine, reference, shared, tail, expect, between=evict)
    assert m.staged_rows_host > before["staged"]  # read from host pages by staging
    assert stats["prefix_restores"] == 0  # never restored whole pages
    # It decodes with host-only pages: through its hot region.
    assert m.decode_steps - m.fast_steps > before["hot_steps"]
    summary = engine.summary()
    assert summary["staged_rows_host"] == m.staged_rows_host
    # The tiny model has index groups of one layer: bytes of one row per staged row.
    assert summary["staged_bytes_host"] == m.staged_rows_host * engine.row_bytes
    _assert_keys_match_published(engine)


def test_multi_turn_stages_the_first_turn(reference):
    engine = _engine(6)
    try:
        prompt = _tokens(17, 14)
        turn1, _ = _serve(engine, prompt)
        _assert_same(turn1, reference)
        _evict_device_copies(engine, reference, 60)
        prompt2 = [*prompt, *turn1.generated, *_tokens(18, 6)]
        turn2, reused = _serve(engine, prompt2)
        assert reused == (len(prompt) + 8 - 1) // B * B
        _assert_same(turn2, reference)
        assert engine.metrics.staged_rows_host > 0
        assert engine.scheduler.manager.stats["prefix_restores"] == 0
    finally:
        engine.close()


@pytest.fixture(scope="module")
def staged_engine():
    """A chunked staging engine under pool pressure (hypothesis examples share it)."""
    with contextlib.closing(_engine(7)) as engine:
        yield engine


@given(shared=st.integers(4, 30), tail=st.integers(1, 10), seed=st.integers(0, 2 ** 16))
@settings(max_examples=5, deadline=None)
def test_any_staged_prefix_decodes_what_all_resident_decodes(staged_engine, reference, shared,
                                                             tail, seed):
    def evict(engine):
        _evict_device_copies(engine, reference, seed + 2)

    check_shared_prefix(staged_engine, reference, shared, tail, seed, between=evict)
    assert staged_engine.scheduler.manager.stats["prefix_restores"] == 0
