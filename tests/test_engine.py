"""The decode engine: HiSparse under pressure decodes exactly what all-resident decodes.

The tiny config on the CPU, with a device pool small enough that the coordinator spills,
unpins and loses pages and requests read through their hot regions; greedy tokens must match
the all-resident run bit for bit and per-layer attention outputs to bf16 rounding.
"""

from __future__ import annotations

import functools

import chex
import jax
import numpy as np
import pytest

from hisparse_jax import cache as cache_module
from hisparse_jax import models
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    HiSparse,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Tuning,
)
from hisparse_jax.topk_sources import DriftTopK, TraceTopK, record
from pallas_kernels._compat import jit_cache_size
from tests.engine_runs import run_prompts

MAX_LEN = 96
PROMPTS = [np.random.default_rng(i).integers(0, 512, 40 + 5 * i).tolist() for i in range(6)]
GEN = 28


@functools.cache
def tiny_model():
    return models.init_model("tiny", seed=0)


def _run(*, sizes=(), prefill=(), debug=(), tuning=(), **config):
    """The prompts on a fresh engine: 4 seats of MAX_LEN tokens, pages of 4, prompts padded
    to MAX_LEN, attention kept, one trace per jitted step. `sizes` / `prefill` / `debug` /
    `tuning`: the fields of those groups that change; `config`: other EngineConfig fields."""
    return run_prompts(
        tiny_model(), PROMPTS, max_new_tokens=GEN,
        sizes=Sizes(**{**dict(max_seats=4, max_model_len=MAX_LEN, block_size=4), **dict(sizes)}),
        prefill=PrefillPolicy(**{"bucket": MAX_LEN, **dict(prefill)}),
        debug=Debug(**{"collect_attention": True, "max_traces": 1, **dict(debug)}),
        tuning=Tuning(**dict(tuning)), **config)


@pytest.fixture(scope="module")
def all_resident():
    engine, out = _run(residency=AllResident())
    yield engine, out
    engine.close()


@pytest.fixture(scope="module")
def pressured():
    engine, out = _run(sizes=dict(num_gpu_blocks=44))
    yield engine, out
    engine.close()


def test_hisparse_under_pressure_matches_all_resident(all_resident, pressured):
    base_engine, base = all_resident
    engine, out = pressured
    s = engine.summary()
    # The pool really was under pressure: every host-tier mechanism ran.
    assert s["spilled_pages"] > 0 and s["unpinned_pages"] > 0 and s["lost_pages"] > 0, s
    assert s["hot_grants"] > 0 and engine.metrics.hot_misses > 0, s
    assert engine.metrics.hot_hits > 0, s
    assert s["decode_steps"] > s["fast_path_steps"] > 0, s
    assert s["bytes_moved_h2d"] == s["rows_moved_h2d"] * 96 * 2
    for a, b in zip(base, out, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.generated == b.generated, f"request {a.request_id}"
        assert len(a.attention) == len(b.attention) == GEN
        for t, (x, y) in enumerate(zip(a.attention, b.attention, strict=True)):
            np.testing.assert_allclose(
                np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2 ** -7, atol=2 ** -7,
                err_msg=f"request {a.request_id}, token {t}: per-layer attention differs")
    assert base_engine.summary()["rows_moved_h2d"] == 0


@functools.cache
def _grouped_runs():
    """The tiny model with both layers in one index group, all-resident and under pressure
    with the host pool packed (the group's layers side by side in one array) and not."""
    model = models.init_model(models.get_config("tiny", index_group_size=2), seed=0)
    out = {}
    for name, gpu_blocks, residency, pack in (("all_resident", None, AllResident(), True),
                                              ("packed", 44, HiSparse(), True),
                                              ("per_layer", 44, HiSparse(), False)):
        engine, done = run_prompts(model, PROMPTS[:4], max_new_tokens=GEN,
                                   sizes=Sizes(max_seats=4, max_model_len=MAX_LEN, block_size=4,
                                               num_gpu_blocks=gpu_blocks),
                                   prefill=PrefillPolicy(bucket=MAX_LEN), residency=residency,
                                   tuning=Tuning(pack_host_layers=pack))
        arrays = None if engine.host_pool is None else len(engine.host_pool.arrays)
        out[name] = (engine.summary(), arrays, [r.generated for r in done])
        engine.close()
    return out


@pytest.mark.parametrize("layout", ["packed", "per_layer"])
def test_an_index_groups_layers_packed_or_not_decode_what_all_resident_decodes(layout):
    """One index group of two layers: the engine packs its host pool into one array by
    default (`pack_host_layers`), or keeps one per layer; under pressure (host reads, spills,
    lost pages) both decode exactly the all-resident tokens."""
    runs = _grouped_runs()
    summary, arrays, tokens = runs[layout]
    assert arrays == (1 if layout == "packed" else 2)
    assert summary["rows_moved_h2d"] > 0 and summary["lost_pages"] > 0, summary
    assert summary["spilled_pages"] > 0, summary
    assert tokens == runs["all_resident"][2]


def test_decode_step_compiles_once(all_resident, pressured):
    # max_traces=1 wraps every jitted function in chex.assert_max_traces(n=1): a retrace
    # would have raised during the runs above. The counters say the same.
    engine, _ = pressured
    assert dict(engine.trace_counts) == {"prefill": 1, "decode_fast": 1, "decode_hot": 1}
    assert dict(all_resident[0].trace_counts) == {"prefill": 1, "decode_fast": 1}
    # ... and each compiled once: every argument is committed to the device up front, so
    # none arrives with another placement later (which would compile again, not retrace).
    jitted = engine.runner.jitted
    assert set(jitted) == {"prefill", "decode_fast", "decode_hot"}
    assert set(all_resident[0].runner.jitted) == {"prefill", "decode_fast"}
    for fn in (jitted["decode_fast"], jitted["decode_hot"], jitted["prefill"],
               all_resident[0].runner.jitted["decode_fast"]):
        assert jit_cache_size(fn) == 1


def _run_external(source, **overrides):
    """The prompts with synthetic prefill and an external top-k source."""
    return _run(topk_source=source, prefill=dict(synthetic=True),
                debug=dict(collect_attention=False), **overrides)


def test_external_topk_modes_decode_the_same_tokens():
    # Synthetic KV rows and a drift model at 25% turnover: all-resident, HiSparse under
    # pressure and naive offload read the same rows, so greedy decoding agrees token for token.
    drift = DriftTopK(turnover=0.25, seed=2)
    base_engine, base = _run_external(drift, residency=AllResident())
    hs_engine, hs = _run_external(drift, sizes=dict(num_gpu_blocks=44))
    nv_engine, nv = _run_external(drift, sizes=dict(num_gpu_blocks=44),
                                  residency=NaiveOffload())
    for a, b, c in zip(base, hs, nv, strict=True):
        assert a.generated == b.generated == c.generated, a.request_id
    s, n = hs_engine.summary(), nv_engine.summary()
    assert s["mode"] == "hisparse" and n["mode"] == "naive-offload"
    assert s["lost_pages"] > 0 and hs_engine.metrics.hot_hits > 0, s
    # Naive offload: no step reuses a copied row, none takes the fast path, and it moves
    # more rows than HiSparse does for the same top-k.
    assert nv_engine.metrics.hot_hits == 0 and n["fast_path_steps"] == 0
    assert n["rows_moved_h2d"] > s["rows_moved_h2d"] > 0
    assert nv_engine.hs_config.hot_size == 16  # top_k rows: one step's selection
    for e in (base_engine, hs_engine, nv_engine):
        assert set(e.trace_counts) <= {"prefill", "decode_fast", "decode_hot"}
        e.close()
    # The drift model recorded as a trace and replayed: the same tokens again.
    trace = record(drift, contexts=[len(p) for p in PROMPTS], steps=GEN, num_groups=2,
                   top_k=16)
    tr_engine, tr = _run_external(TraceTopK(trace), sizes=dict(num_gpu_blocks=44))
    assert [r.generated for r in tr] == [r.generated for r in base]
    tr_engine.close()


@pytest.mark.parametrize("mode", [dict(), dict(residency=NaiveOffload())],
                         ids=["hisparse", "naive"])
def test_copies_by_looping_programs_decode_what_the_full_grid_decodes(mode):
    # `copy_programs` moves each lookup's copies (in model order) by 2 looping programs: the
    # tokens are those of the kernel's full grid. (The rows moved are not compared: they
    # depend on when the transfer worker's spills complete.)
    drift = DriftTopK(turnover=0.25, seed=3)
    runs = [_run_external(drift, sizes=dict(num_gpu_blocks=44),
                          tuning=dict(ops="triton", copy_programs=programs,
                                      copy_with_attention=False), **mode)
            for programs in (None, 2)]
    (_, want), (few, got_few) = runs
    assert [r.generated for r in got_few] == [r.generated for r in want]
    assert few.runner.cache.kv.copy_programs == 2
    for engine, _ in runs:
        assert engine.summary()["rows_moved_h2d"] > 0 and engine.metrics.hot_misses > 0
        engine.close()


@pytest.mark.parametrize("mode", [dict(), dict(residency=NaiveOffload())],
                         ids=["hisparse", "naive"])
def test_copies_beside_an_attention_decode_what_lookups_in_model_order_decode(mode,
                                                                             monkeypatch):
    # `copy_with_attention` looks group 1 up ahead and runs its copies in the launch of
    # group 0's attention (the Triton kernel in interpret mode here; by 2 programs, then the
    # default 32): the same tokens as lookups in model order with the same kernels.
    traced = []

    def spy(*args, **kw):
        traced.append((kw["backend"], kw["copy_programs"]))
        return joint(*args, **kw)

    joint = cache_module.sparse_mla_decode_with_copies
    monkeypatch.setattr(cache_module, "sparse_mla_decode_with_copies", spy)
    drift = DriftTopK(turnover=0.25, seed=3)
    runs = [_run_external(drift, sizes=dict(num_gpu_blocks=44),
                          tuning=dict(ops="triton", attention="triton",
                                      copy_with_attention=beside, copy_programs=programs),
                          **mode)
            for beside, programs in ((False, None), (True, 2), (True, None))]
    (_, want), (two, got_two), (beside, got) = runs
    for other in (got_two, got):
        assert [r.generated for r in other] == [r.generated for r in want]
    assert beside.runner.cache.kv.copy_with_attention and two.runner.cache.kv.copy_programs == 2
    assert {("triton", 2), ("triton", 32)} <= set(traced), traced  # the decode steps used it
    for engine, _ in runs:
        assert engine.summary()["rows_moved_h2d"] > 0 and engine.metrics.hot_misses > 0
        engine.close()


def test_synthetic_prefill_with_the_models_indexer():
    # Without a top-k source, synthetic prefill writes unit-normal index keys for the prompt
    # rows (the padding rows stay zero) and the model's own indexer selects from them; the
    # host tier under pressure decodes what all-resident decodes.
    base_engine, base = _run(prefill=dict(synthetic=True), debug=dict(collect_attention=False),
                             residency=AllResident())
    hs_engine, hs = _run(prefill=dict(synthetic=True), debug=dict(collect_attention=False),
                         sizes=dict(num_gpu_blocks=44))
    for a, b in zip(base, hs, strict=True):
        assert a.generated == b.generated, a.request_id
    s = hs_engine.summary()
    assert s["lost_pages"] > 0 and hs_engine.metrics.hot_misses > 0, s
    # A fresh engine, one request, before any decode step: its prompt rows carry keys.
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=2, max_model_len=MAX_LEN,
                                                           block_size=4),
                                               prefill=PrefillPolicy(bucket=MAX_LEN,
                                                                     synthetic=True),
                                               residency=AllResident()))
    engine.add_request(PROMPTS[1], max_new_tokens=1)
    engine.step()
    (req,) = engine.finished.values()
    keys = [np.asarray(k, np.float32)[req.seat] for k in engine.runner.cache.index_keys]
    n = len(PROMPTS[1])
    for k in keys:
        assert np.all(np.abs(k[:n]).sum(-1) > 0) and not np.any(k[n:]), "prompt rows only"
        assert 0.5 < k[:n].std() < 2.0
    assert not np.array_equal(keys[0][:n], keys[1][:n]), "each index group draws its own keys"
    for e in (base_engine, hs_engine, engine):
        e.close()


def test_engine_config_validation():
    with pytest.raises(ValueError, match="EngineConfig.residency must be HiSparse"):
        Engine(tiny_model(), EngineConfig(residency="all_resident"))
    with pytest.raises(ValueError, match="TopKSource"):
        Engine(tiny_model(), EngineConfig(topk_source=object()))
    for bad in (0, -1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="EngineConfig.tuning.copy_programs must be a "
                                             "positive"):
            EngineConfig(tuning=Tuning(copy_programs=bad))
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="EngineConfig.tuning.copy_with_attention must be "
                                             "a bool"):
            EngineConfig(tuning=Tuning(copy_with_attention=bad))
    # The default: copies beside an attention.
    assert EngineConfig().tuning.copy_with_attention is True


def test_fast_path_stop_tokens_and_temperature(all_resident):
    # A pool that holds every context: no request needs a hot region, every step takes the
    # fast path, nothing moves from host, and the greedy tokens are the same. The same run
    # checks the per-request stop conditions and temperature sampling.
    base = all_resident[1]
    chex.clear_trace_counter()
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=4, max_model_len=MAX_LEN,
                                                           block_size=4),
                                               prefill=PrefillPolicy(bucket=MAX_LEN),
                                               debug=Debug(max_traces=1), seed=1))
    stop = base[0].generated[3]
    first = base[0].generated.index(stop)
    r_stop = engine.add_request(PROMPTS[0], max_new_tokens=GEN, stop_token_ids=[stop])
    r_hot = engine.add_request(PROMPTS[1], max_new_tokens=10, temperature=1.0)
    r_cap = engine.add_request(PROMPTS[2], max_new_tokens=None)  # until max_model_len
    r_same = [engine.add_request(p, max_new_tokens=GEN) for p in PROMPTS[3:]]
    out = engine.run()
    s = engine.summary()
    assert s["fast_path_steps"] == s["decode_steps"] > 0
    assert s["rows_moved_h2d"] == 0 and s["hot_grants"] == 0 and s["hot_lookups"] == 0
    assert "decode_hot" not in engine.trace_counts
    assert [out[r].generated for r in r_same] == [r.generated for r in base[3:]]
    assert out[r_stop].finish_reason == "stop"
    assert out[r_stop].generated == base[0].generated[:first + 1]
    assert out[r_hot].finish_reason == "length" and len(out[r_hot].generated) == 10
    assert all(0 <= t < 512 for t in out[r_hot].generated)
    assert out[r_hot].generated != base[1].generated[:10]  # sampled, not greedy
    assert out[r_cap].finish_reason == "max_model_len"
    assert len(out[r_cap].tokens) == MAX_LEN
    assert out[r_cap].generated[:GEN] == base[2].generated
    engine.close()


def test_add_request_validation():
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=2, max_model_len=32,
                                                           block_size=4), residency=AllResident()))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 32, max_new_tokens=4)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([512], max_new_tokens=4)


def test_example_runs_end_to_end(capsys):
    from examples import decode

    rc = decode.main(["--requests", "5", "--prompt-len", "40", "--gen-len", "12",
                      "--max-model-len", "64", "--prefill-bucket", "64"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "[hisparse] tiny" in text and "requests finished" in text
    assert "hot-buffer hit rate" in text and "bytes moved host->device" in text


@pytest.mark.gpu
def test_gpu_scale_config_matches_all_resident():
    """The DeepSeek-V3.2 attention dimensions (2 layers) under pressure, on the GPU kernels.

    8 requests of ~3000-3500 tokens (top_k 2048) on a device pool of 400 blocks of 64 rows
    (all-resident would need 8 x 56): the watermark (pool / 10 = 40 blocks) exceeds a hot
    region (32 blocks), so requests get hot regions and unpin pages without preempting.
    """
    _gpu_scale_matches_all_resident("bf16")


@pytest.mark.gpu
def test_gpu_scale_fp8_matches_all_resident():
    """The same with fp8_ds_mla rows on both sides (uint8[656] caches and pool, the Triton
    attention kernel dequantizing; `docs/kv_format.md`): identical greedy tokens."""
    _gpu_scale_matches_all_resident("fp8_ds_mla")


def _gpu_scale_matches_all_resident(kv_format):
    model = models.init_model("dsv32-2l", seed=0)
    prompts = [np.random.default_rng(i).integers(0, 129280, 3000 + 71 * i).tolist()
               for i in range(8)]
    results = []
    for all_res in (True, False):
        ec = EngineConfig(sizes=Sizes(max_seats=8, max_model_len=4096, block_size=64,
                                      hot_size=2048, num_gpu_blocks=None if all_res else 400),
                          prefill=PrefillPolicy(bucket=4096),
                          residency=AllResident() if all_res else HiSparse(),
                          debug=Debug(collect_attention=True), kv_format=kv_format)
        engine = Engine(model, ec)
        ids = [engine.add_request(p, max_new_tokens=24) for p in prompts]
        out = engine.run()
        results.append((engine.summary(), [out[i] for i in ids]))
        engine.close()
    (_, base), (s, hs) = results
    print(s)
    assert s["kv_format"] == kv_format and s["bytes_moved_h2d"] == s["rows_moved_h2d"] * (
        656 if kv_format == "fp8_ds_mla" else 1152)
    assert s["hot_grants"] > 0 and s["rows_moved_h2d"] > 0 and s["lost_pages"] > 0, s
    for a, b in zip(base, hs, strict=True):
        assert a.generated == b.generated, (a.request_id, a.generated, b.generated)
        for x, y in zip(a.attention, b.attention, strict=True):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                       rtol=2 ** -7, atol=2 ** -7)
    assert jax.default_backend() == "gpu"


def test_sampled_tokens_are_the_same_in_every_mode(all_resident, pressured):
    # Sampling keys are per request (engine seed, request seed, token index): at temperature
    # 0.8 HiSparse under pressure draws exactly the tokens all-resident draws, whatever the
    # batches and seats. (Preempted requests draw the same tokens too:
    # tests/test_engine_lifecycle.py compares sampled tokens after forced preemptions.)
    outs = []
    for engine, _ in (all_resident, pressured):
        misses = engine.metrics.hot_misses
        ids = [engine.add_request(p, max_new_tokens=GEN, temperature=0.8, seed=100 + i)
               for i, p in enumerate(PROMPTS)]
        out = engine.run()
        outs.append([out[i].generated for i in ids])
        if engine is pressured[0]:
            assert engine.metrics.hot_misses > misses  # read through hot regions again
    assert outs[0] == outs[1]
    greedy = [r.generated for r in all_resident[1]]
    assert all(a != b for a, b in zip(outs[0], greedy, strict=True))  # sampled, not greedy
