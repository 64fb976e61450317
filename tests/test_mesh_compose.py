"""Serving features composed on the mesh engine (`docs/mesh.md`): asynchronous scheduling,
chunked prefill, prefix caching (per data shard) and speculation (with async scheduling
too: the next mesh step continues the drafts on the devices), on 2x1 and 2x2 meshes of
virtual CPU devices, under HiSparse pool pressure and all-resident.

One subprocess (`tests/_mesh_worker.py compose`: the device count is fixed before jax
starts) serves a multi-turn mix per combination: four conversations whose second turn (the
first turn's prompt + generated tokens + new tokens) arrives once the first finished, among
single requests arriving later, greedy and sampled. Every request's tokens must equal the
synchronous, one-shot, all-resident single-device engine's (`AllResidentReference`). The
asynchronous 2x2 engine then serves the mix again with failures injected once each.
"""

from __future__ import annotations

import json

import pytest

from tests.test_mesh_engine import _wait, _worker

COMBINATIONS = [
    "2x1:pressured:prefix:chunk",
    "2x2:all_resident:prefix",
    "2x1:all_resident:async:chunk:warmup",
    "2x2:pressured:async:faults",
    "2x2:pressured:async:chunk:prefix",  # all three
    "2x1:all_resident:async:chunk:prefix",  # all three
    "2x2:pressured:scripted:chunk",
    "2x1:all_resident:mtp",
    "2x1:pressured:async:mtp",  # step t + 1 continues step t's MTP drafts on the devices
    "2x2:all_resident:async:devdraft:prefix:chunk",  # on-device drafts, all four features
    "2x1:all_resident:async:scripted",  # host drafts: each step collects before planning
]
ALL_THREE = [c for c in COMBINATIONS if {"async", "chunk", "prefix"} <= set(c.split(":"))]


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    out = tmp_path_factory.mktemp("compose") / "compose.json"
    _wait(_worker("compose", out, *COMBINATIONS), timeout=1200)
    return json.loads(out.read_text())


def _served(composed, *features):
    """The combinations served (not refused by `EngineConfig`) with every one of `features`."""
    return {spec: run for spec, run in composed.items()
            if "refused" not in run and set(features) <= set(spec.split(":"))}


def test_every_combination_decodes_the_reference_tokens(composed):
    served = _served(composed)
    assert set(composed) == set(COMBINATIONS)
    # Only `EngineConfig`'s own rules may refuse a combination, never the mesh engine.
    assert set(COMBINATIONS) - set(served) <= set(ALL_THREE)
    for spec, run in served.items():
        assert run["mismatches"] == {}, spec
        assert len(run["finish_reasons"]) == 10, spec  # 4 conversations x 2 turns, 2 single
        assert set(run["finish_reasons"].values()) == {"length"}, spec
        assert run["summary"]["replay_mismatches"] == 0, spec
        assert set(run["traces"].values()) == {1}, spec  # one trace per mesh decode variant
        assert set(run["shards"].values()) == {0, 1}, spec  # both data shards served


def test_all_three_features_together(composed):
    refused = {spec: composed[spec]["refused"] for spec in ALL_THREE
               if "refused" in composed[spec]}
    if refused:
        # The single engine's rule (async scheduling with prefix caching), not the mesh's.
        assert all("MeshEngine" not in why and "async_scheduling" in why
                   for why in refused.values()), refused
        pytest.skip(f"EngineConfig refuses async scheduling with prefix caching: {refused}")
    for spec in ALL_THREE:
        assert composed[spec]["summary"]["prefix_hit_tokens"] > 0, spec
        assert composed[spec]["summary"]["drains"] > 0, spec


def test_prefixes_are_reused_within_their_data_shard(composed):
    runs = _served(composed, "prefix")
    assert runs
    for spec, run in runs.items():
        s = run["summary"]
        assert s["prefix_hit_tokens"] > 0 and s["prefix_hit_requests"] > 0, spec
        turns = [k for k in run["num_cached"] if k.endswith("+")]
        hits = [k for k in turns if run["num_cached"][k] > 0]
        assert hits, spec  # a second turn reused its first turn's pages
        for k in hits:  # on the shard that served its first turn
            assert run["shards"][k] == run["shards"][k[:-1]], (spec, k)
    # All-resident seat reuse: admission routes each second turn to the shard whose free
    # row keeps its first turn's rows, so every second turn reuses them.
    run = composed["2x2:all_resident:prefix"]
    assert all(run["num_cached"][f"c{i}+"] > 0 for i in range(4)), run["num_cached"]


def test_pressure_spills_and_reads_hot_regions(composed):
    runs = _served(composed, "pressured")
    assert runs
    for spec, run in runs.items():
        assert run["summary"]["spilled_pages"] > 0, spec
        assert run["summary"]["hot_lookups"] > 0, spec
        assert run["traces"] == {"decode_fast": 1, "decode_hot": 1}, spec


def test_async_steps_overlap_and_drain(composed):
    runs = _served(composed, "async")
    assert len(runs) >= 2
    for spec, run in runs.items():
        assert run["summary"]["drains"] > 0, spec  # a step with no decode collected the last
        assert run["foreign_in_flight"] == 0, spec  # a shard's pass: its own steps in flight
    # `warmup()` compiled the mesh decode step that reads the previous step's device tokens
    # and every chunk prefill: no served step compiled.
    assert composed["2x1:all_resident:async:chunk:warmup"]["served_compiles"] == 0


def test_async_failures_finish_only_their_request(composed):
    # One request's prefill raising (it fails alone), shard 0's pass raising while it plans,
    # shard 1's collection raising (the next step already dispatched on its tokens) and the
    # mesh decode call raising after the call (every shard's donated caches lost): each step
    # raises once, the engine recovers, every other request decodes the reference tokens.
    faults = composed["2x2:pressured:async:faults"]["faults"]
    raised = "\n".join(faults["raised"])
    for what in ("shard 0's plan", "shard 1's collection", "the mesh decode call, after the call"):
        assert raised.count(f"injected failure: {what}") == 1, (what, faults["raised"])
    assert faults["failed"] == {"c2": "prefill failed: RuntimeError: prefill exploded"}
    assert faults["mismatches"] == []
    assert faults["device_resets"] == 2  # both shards' caches, rebuilt
    assert faults["preemptions"] > 0 and faults["replay_mismatches"] == 0


def test_speculation_on_the_mesh(composed):
    scripted = composed["2x2:pressured:scripted:chunk"]["summary"]
    assert 0 < scripted["accepted_tokens"] < scripted["draft_tokens"]
    assert scripted["tokens_per_request_step"] > 1.0  # several tokens per request and step
    mtp = composed["2x1:all_resident:mtp"]["summary"]  # the model's own drafts, on device
    assert mtp["draft_tokens"] > 0


def test_async_speculation_on_the_mesh(composed):
    # Step t + 1 dispatched before step t's accepted counts reach the host: its rows
    # continue from step t's outputs on the devices (MTP drafts, and scripted device drafts
    # right or wrong, with prefix caching and chunked prefill; host drafts collect first),
    # the tokens equal the reference's (`test_every_combination_decodes_the_reference_tokens`).
    mtp = composed["2x1:pressured:async:mtp"]["summary"]
    assert mtp["draft_tokens"] > 0 and mtp["spilled_pages"] > 0
    devdraft = composed["2x2:all_resident:async:devdraft:prefix:chunk"]["summary"]
    assert 0 < devdraft["accepted_tokens"] < devdraft["draft_tokens"]
    assert devdraft["tokens_per_request_step"] > 1.0
    assert devdraft["prefix_hit_tokens"] > 0
    # A host draft source proposes from accepted tokens: every mesh decode step is collected
    # before the next one is planned (`AsyncLoop.plans_after_collecting`).
    host = composed["2x1:all_resident:async:scripted"]["summary"]
    assert 0 < host["accepted_tokens"] < host["draft_tokens"]
    assert host["drains"] == host["decode_steps"] > 0


def test_async_speculation_is_accepted():
    # The mesh engine takes async scheduling with speculation (once refused: the next mesh
    # step could not continue a step whose accepted counts were still on the devices).
    from hisparse_jax import models
    from hisparse_jax.engine import EngineConfig, Sizes, Speculative
    from hisparse_jax.engine.mesh import MeshEngine

    model = models.init_model(models.get_config("tiny", mtp_layers=1), seed=0)
    engine = MeshEngine(model, EngineConfig(
        sizes=Sizes(max_seats=2, max_model_len=32, block_size=4), async_scheduling=True,
        speculative=Speculative(num_tokens=2), compilation_cache=False), mesh_shape=(1, 1))
    engine.close()
