"""Prefill staging of prefix hits (`EngineConfig.prefill.prefix_hit_pages="stage"`).

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
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax import models
from hisparse_jax.cache import AllResident, HiSparseKVCache
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import Engine, EngineConfig, PrefillPolicy, Sizes
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
# test_engine_prefix's SIZES as groups.
GROUPS = dict(sizes=Sizes(max_seats=SIZES["max_seats"], max_model_len=SIZES["max_model_len"],
                          block_size=B),
              prefill=PrefillPolicy(bucket=SIZES["prefill_bucket"]))


@pytest.fixture(scope="module")
def reference():
    ref = AllResidentReference(tiny_model(), **GROUPS)
    yield ref
    ref.close()


def _engine(chunk, **sizes):
    """A staging engine of prefill chunks of `chunk` under PRESSURE (`sizes`: changes)."""
    return Engine(tiny_model(), EngineConfig(
        prefill=dataclasses.replace(GROUPS["prefill"], prefix_caching=True,
                                    prefix_hit_pages="stage", chunk_size=chunk),
        sizes=dataclasses.replace(GROUPS["sizes"], **{**PRESSURE, **sizes})))


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


def _first_then_evict(engine, reference, prompt, seed):
    """Serves `prompt` (nothing reused; decodes what all-resident decodes), then fillers that
    take its pages' device copies; returns the served request."""
    out, reused = _serve(engine, prompt)
    assert reused == 0
    _assert_same(out, reference)
    _evict_device_copies(engine, reference, seed)
    return out


def _assert_staged_not_restored(engine):
    assert engine.metrics.staged_rows_host > 0
    assert engine.scheduler.manager.stats["prefix_restores"] == 0


def test_multi_turn_stages_the_first_turn(reference):
    with contextlib.closing(_engine(6)) as engine:
        prompt = _tokens(17, 14)
        turn1 = _first_then_evict(engine, reference, prompt, 60)
        prompt2 = [*prompt, *turn1.generated, *_tokens(18, 6)]
        turn2, reused = _serve(engine, prompt2)
        assert reused == (len(prompt) + 8 - 1) // B * B
        _assert_same(turn2, reference)
        _assert_staged_not_restored(engine)


def test_concurrent_staged_hits_under_pressure(reference):
    # Two hit requests and a filler admitted together, chunked, in a tight device pool: the
    # hits prefill by staging while others hold the device blocks, then decode through their
    # hot regions.
    with contextlib.closing(_engine(5)) as engine:
        first = _tokens(120, 24)
        _first_then_evict(engine, reference, first, 121)
        prompts = [first[:22] + _tokens(125, 6), first[:13] + _tokens(126, 9), _tokens(127, 28)]
        hits = engine.metrics.prefix_hit_requests
        ids = [engine.add_request(p, max_new_tokens=10) for p in prompts]
        done = engine.run()
        for rid in ids:
            _assert_same(done[rid], reference)
        assert [done[rid].num_cached for rid in ids] == [20, 12, 0]
        assert engine.metrics.prefix_hit_requests - hits == 2
        _assert_staged_not_restored(engine)
        _assert_keys_match_published(engine)


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


# --------------------------------------------------------------------------- the model


@functools.cache
def _grouped_steps():
    """The tiny model with one index group of both layers (the second layer reads the
    leader's staged rows), its jitted chunk prefill (staged when host pages are given) and a
    fresh all-resident cache of two state rows (the request uses row 1)."""
    mc = models.get_config("tiny", index_group_size=2)
    graphdef, state = nnx.split(models.init_model(mc, seed=1))
    cfg = HiSparseConfig(top_k=mc.top_k, hot_size=mc.top_k, block_size=B, max_num_reqs=2,
                         row_width=mc.row_width, kv_dtype=mc.kv_dtype,
                         max_model_len=SIZES["max_model_len"],
                         num_gpu_blocks=1 + 2 * SIZES["max_model_len"] // B)

    def fresh():
        kv = HiSparseKVCache.create(cfg, num_layers=mc.num_layers, residency=AllResident(),
                                    index_group_size=mc.index_group_size)
        return models.DecodeCache(kv, tuple(jnp.zeros((2, cfg.max_model_len, mc.index_dim),
                                                  mc.kv_dtype) for _ in range(mc.num_groups)))

    @jax.jit
    def chunk(cache, tokens, start, length, pages, host_pages=None, host_pools=()):
        return nnx.merge(graphdef, state).prefill_chunk(
            cache, tokens, start, length, jnp.int32(1), pages, host_pages=host_pages,
            host_pools=host_pools, collect_attention=True)

    return fresh, chunk


@settings(max_examples=5, deadline=None)
@given(start=st.integers(B, 36), k=st.integers(1, 11), seed=st.integers(0, 99))
def test_a_staged_chunk_computes_what_the_resident_chunk_computes(pinned_host, start, k, seed):
    # Chunk [start, start + k) after an all-resident first chunk [0, start): once with every
    # page resident, once with the pages before start's page host-only (their device blocks
    # zeroed, their rows in the host pool): the same logits, attention and written rows.
    fresh, chunk = _grouped_steps()
    rng = np.random.default_rng(seed)
    n = SIZES["max_model_len"]
    prompt = rng.integers(0, 512, start + k).astype(np.int32)
    pages = rng.permutation(np.arange(1, 1 + 2 * n // B))[:n // B].astype(np.int32)
    first = np.zeros(n, np.int32)
    first[:start] = prompt[:start]
    _, cache, _ = chunk(fresh(), first, jnp.int32(0), jnp.int32(start), pages)
    padded = np.zeros(16, np.int32)
    padded[:k] = prompt[start:]
    hot = jax.tree.map(jnp.copy, cache)
    want_logits, want, want_aux = chunk(hot, padded, jnp.int32(start), jnp.int32(k), pages)

    host_only = np.arange(n // B) < start // B
    host_pages = np.where(np.arange(n // B) < (start + k + B - 1) // B,
                          1 + rng.permutation(n // B), 0).astype(np.int32)
    pools, caches, pools_np = [], [], []
    for layer_cache in cache.kv.caches:
        rows = np.asarray(layer_cache)
        pool = np.zeros((1 + n // B, *rows.shape[1:]), rows.dtype)
        pool[host_pages[host_only]] = rows[pages[host_only]]
        pools.append(jax.device_put(pool, pinned_host))
        pools_np.append(pool)
        rows = rows.copy()
        rows[pages[host_only]] = 0  # the host-only pages' device copies are gone
        caches.append(jnp.asarray(rows))
    cold = dataclasses.replace(cache, kv=dataclasses.replace(cache.kv, caches=tuple(caches)))
    res = np.where(host_only, 0, pages).astype(np.int32)
    logits, got, aux = chunk(jax.tree.map(jnp.copy, cold), padded, jnp.int32(start),
                             jnp.int32(k), res, host_pages, tuple(pools))
    # The pool packed (both layers of the group side by side in one array) stages the same.
    packed = (jax.device_put(np.concatenate(pools_np, axis=-1), pinned_host),)
    packed_logits, _, packed_aux = chunk(cold, padded, jnp.int32(start), jnp.int32(k), res,
                                         host_pages, packed)
    np.testing.assert_array_equal(np.asarray(packed_logits), np.asarray(logits))
    assert int(packed_aux["staged_rows_host"]) == int(aux["staged_rows_host"])
    # The same staged chunk with every page resident copies the same distinct rows, all
    # device to device; with the early pages host-only exactly those pages' rows come from host.
    _, _, resident_aux = chunk(hot, padded, jnp.int32(start), jnp.int32(k), pages, host_pages,
                               tuple(pools))
    assert int(resident_aux["staged_rows_host"]) == 0
    assert int(aux["staged_rows_host"]) > 0
    assert (int(aux["staged_rows_host"]) + int(aux["staged_rows_device"])
            == int(resident_aux["staged_rows_device"]))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want_logits))
    np.testing.assert_array_equal(np.asarray(aux["attention"], np.float32),
                                  np.asarray(want_aux["attention"], np.float32))
    written = pages[np.arange(start, start + k) // B] * B + np.arange(start, start + k) % B
    for got_kv, want_kv in zip(got.kv.caches, want.kv.caches, strict=True):
        np.testing.assert_array_equal(
            np.asarray(got_kv.reshape(-1, got_kv.shape[-1])[written], np.float32),
            np.asarray(want_kv.reshape(-1, want_kv.shape[-1])[written], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_blocks", [None, 450], ids=["roomy", "pressure"])
def test_gpu_multiturn_staging_decodes_what_no_reuse_decodes(tmp_path, gpu_blocks):
    """dsv32-2l on the GPU kernels: 4 conversations of 3 turns (an 8,192-token first prompt,
    then 1,024 user and 32 generated tokens a turn; chunks of 2,048), HiSparse with staged
    prefix hits against HiSparse without reuse, with every conversation's pages fitting the
    device pool and on 450 blocks (63% of the last turn's pages: hits find pages on host):
    greedy tokens identical, rows staged from host, each later turn computing only its new
    tokens. (The first staging version diverged here: its dense copy of T * top_k rows passed
    the Triton attention kernel's 2^31-element limit.)"""
    from bench import multiturn

    out = tmp_path / "mt.json"
    args = ["--conversations", "4", "--first-prompt", "8192", "--turns", "3",
            "--user-tokens", "1024", "--gen-tokens", "32", "--prefill-chunk-size", "2048",
            "--ttft-from-turn", "1", "--modes", "hisparse-reuse,hisparse",
            "--prefix-hit-pages", "stage", "--no-warmup", "--no-plot", "--output", str(out)]
    if gpu_blocks:
        args += ["--gpu-blocks", str(gpu_blocks)]
    assert multiturn.main(args) == 0
    record = json.loads(out.read_text())
    assert record["ratios"]["tokens_identical_to_hisparse"]
    reuse = next(r for r in record["results"] if r["mode"] == "hisparse-reuse")
    for turn in reuse["turns"][1:]:
        assert turn["prompt_tokens_computed"] <= 4 * (1024 + 32 + 64), turn
    if gpu_blocks:
        assert reuse["staged_bytes_h2d"] > 0


def test_staged_hits_are_admitted_for_the_blocks_they_take():
    # A staged hit takes device blocks for the rest of its prompt and a hot region, not for
    # its host-only hit pages: two second turns (27 pages, 25 of them hit) on 49 usable
    # blocks are admitted in one step. Counting every prompt page (27 + the 8-block
    # watermark) the second one waited for the first to unpin.
    engine = Engine(tiny_model(), EngineConfig(prefill=PrefillPolicy(prefix_caching=True,
                                                                     prefix_hit_pages="stage",
                                                                     chunk_size=16, bucket=128),
                                               sizes=Sizes(num_gpu_blocks=50, num_host_blocks=200,
                                                           max_seats=2, max_model_len=128,
                                                           block_size=B)))
    reference = AllResidentReference(tiny_model(),
                                     sizes=Sizes(max_seats=2, max_model_len=128, block_size=B),
                                     prefill=PrefillPolicy(bucket=128))
    try:
        firsts = [_tokens(1, 100), _tokens(2, 100)]
        ids = [engine.add_request(p, max_new_tokens=4) for p in firsts]
        out = engine.run()
        seconds = [p + list(out[rid].generated) + _tokens(3 + i, 3)
                   for i, (p, rid) in enumerate(zip(firsts, ids, strict=True))]
        waits, hits = engine.metrics.waits, engine.metrics.prefix_hit_tokens
        ids = [engine.add_request(p, max_new_tokens=4) for p in seconds]
        engine.step()
        assert {r.request_id for r in engine.running.values()} == set(ids)
        assert engine.metrics.waits == waits
        done = engine.run()
        assert engine.metrics.prefix_hit_tokens - hits == 2 * 100  # 25 whole pages each
        assert engine.metrics.staged_rows_host + engine.metrics.staged_rows_device > 0
        for rid in ids:
            _assert_same(done[rid], reference)
    finally:
        engine.close()
        reference.close()
