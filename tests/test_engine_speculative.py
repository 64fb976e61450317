"""Speculative decoding: k draft tokens verified per step, union residency, exact outputs.

The reference is the engine without speculation (all-resident). With speculation, in every
mode, under host-tier pressure and for forced accept / reject patterns (all, none,
alternating, random, per request: `ScriptedDraft`), greedy and sampled requests emit exactly
the reference's tokens; so do the model's own MTP drafts and the per-row resolution
ablation. `AcceptanceRateDraft` accepts at its configured rate.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest

from hisparse_jax import models
from hisparse_jax.draft_sources import AcceptanceRateDraft, MTPDraft, ScriptedDraft
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    HiSparse,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from hisparse_jax.engine.mesh import MeshEngine

MAX_LEN = 96
PROMPTS = [np.random.default_rng(i).integers(0, 512, 40 + 5 * i).tolist() for i in range(6)]
GEN = 28
TEMPERATURES = [0.0, 0.0, 0.0, 0.0, 0.7, 1.0]  # requests 4, 5 sample


def _random_pattern(seed):
    """(request index, token index) -> right with probability 0.6, fixed by the seed."""
    return lambda i, j: random.Random(seed * 1_000_003 + i * 4099 + j).random() < 0.6


# Request index -> which of its drafts are right (by generated token index).
PATTERNS = {
    0: lambda j: True,  # all accepted
    1: lambda j: False,  # none
    2: lambda j: j % 2 == 0,  # alternating
}


def _accept(seed):
    rand = _random_pattern(seed)
    return lambda i, j: PATTERNS[i](j) if i in PATTERNS else rand(i, j)


@functools.cache
def tiny_model():
    return models.init_model(models.get_config("tiny", mtp_layers=1), seed=0)


def _serve(*, sizes=(), **config):
    """The prompts on a fresh engine: 4 seats of MAX_LEN tokens, pages of 4, attention kept;
    `sizes`: the Sizes fields that change, `config`: other EngineConfig fields."""
    engine = Engine(tiny_model(), EngineConfig(
        sizes=Sizes(**{**dict(max_seats=4, max_model_len=MAX_LEN, block_size=4), **dict(sizes)}),
        prefill=PrefillPolicy(bucket=MAX_LEN), debug=Debug(collect_attention=True),
        compilation_cache=False, **config))
    ids = [engine.add_request(p, max_new_tokens=GEN, temperature=t)
           for p, t in zip(PROMPTS, TEMPERATURES, strict=True)]
    out = engine.run()
    return engine, [out[i] for i in ids]


@pytest.fixture(scope="module")
def reference():
    engine, out = _serve(residency=AllResident())
    engine.close()
    return out


def _check_same(reference, engine, out):
    assert engine.metrics.replay_mismatches == 0
    for a, b in zip(reference, out, strict=True):
        assert b.finish_reason == a.finish_reason == "length"
        assert b.generated == a.generated, f"request {a.index}"
        assert len(b.attention) == GEN
        for t, (x, y) in enumerate(zip(a.attention, b.attention, strict=True)):
            np.testing.assert_allclose(x, y, rtol=2 ** -7, atol=2 ** -7,
                                       err_msg=f"request {a.index}, token {t}")


@pytest.mark.parametrize("k,mode", [(1, "hisparse"), (2, "hisparse"), (2, "all-resident"),
                                    (3, "naive-offload")])
def test_scripted_patterns_emit_exactly_the_tokens_of_decoding_without_speculation(
        reference, k, mode):
    source = ScriptedDraft({r.index: r.generated for r in reference}, _accept(k))
    kw = {"hisparse": dict(sizes=dict(num_gpu_blocks=44 + 8 * k)),
          "all-resident": dict(residency=AllResident()),
          "naive-offload": dict(residency=NaiveOffload())}[mode]
    engine, out = _serve(speculative=Speculative(num_tokens=k, draft=source), **kw)
    try:
        _check_same(reference, engine, out)
        s = engine.summary()
        if mode == "hisparse":  # the host tier really worked
            assert s["hot_grants"] > 0 and engine.metrics.hot_misses > 0, s
            assert s["lost_pages"] > 0 and s["unpinned_pages"] > 0, s
        if mode != "all-resident":
            assert engine.metrics.hot_misses > 0
        by = {r.index: r for r in out}
        # All accepted: every verified draft of request 0 was kept; none: request 1 kept none.
        assert by[0].num_drafted > 0 and by[0].num_accepted == by[0].num_drafted
        assert by[1].num_drafted > 0 and by[1].num_accepted == 0
        assert 0 < by[2].num_accepted < by[2].num_drafted
        # Fewer steps than tokens: request 0 emitted up to k + 1 tokens per step.
        assert s["tokens_per_request_step"] > 1.0
        assert s["acceptance_rate"] == engine.metrics.accepted_tokens / engine.metrics.draft_tokens
        assert engine.metrics.accepted_tokens == sum(r.num_accepted for r in out)
    finally:
        engine.close()


def test_preempted_speculative_requests_replay_exactly(reference):
    """Decode steps that fail (injected, twice, mid-run) preempt their batch; the requests are
    recomputed by replay, their known tokens fed back as drafts, and end exactly as before."""
    source = ScriptedDraft({r.index: r.generated for r in reference}, _accept(7))
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=4, max_model_len=MAX_LEN,
                                                           block_size=4, num_gpu_blocks=60),
                                               prefill=PrefillPolicy(bucket=MAX_LEN),
                                               debug=Debug(collect_attention=True),
                                               compilation_cache=False,
                                               speculative=Speculative(num_tokens=2, draft=source)))
    calls = {"n": 0}
    for name, step in list(engine.runner.jitted.items()):
        if name.startswith("decode"):
            def failing(*args, _step=step, **kwargs):
                calls["n"] += 1
                if calls["n"] in (6, 13):
                    raise RuntimeError("injected failure")
                return _step(*args, **kwargs)
            engine.runner.jitted[name] = failing
    ids = [engine.add_request(p, max_new_tokens=GEN, temperature=t)
           for p, t in zip(PROMPTS, TEMPERATURES, strict=True)]
    failures = 0
    while engine.has_work:
        try:
            engine.step()
        except RuntimeError as e:
            assert "injected failure" in str(e)
            failures += 1
    try:
        assert failures == 2
        assert engine.metrics.preemptions > 0 and engine.metrics.replayed_tokens > 0
        _check_same(reference, engine, [engine.finished[i] for i in ids])
    finally:
        engine.close()


def test_mtp_drafts_and_the_per_row_ablation_are_exact(reference):
    for union in (True, False):
        engine, out = _serve(speculative=Speculative(num_tokens=2), sizes=dict(num_gpu_blocks=60),
                             residency=HiSparse(per_row=not union))
        try:
            _check_same(reference, engine, out)
            assert engine.config.draft == MTPDraft()
            assert engine.metrics.draft_tokens > 0 and engine.metrics.hot_misses > 0
            assert engine.residency.per_row is not union
        finally:
            engine.close()


def test_acceptance_rate_draft_accepts_at_its_rate():
    rate, k = 0.6, 2
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=4, max_model_len=256,
                                                           block_size=4), residency=AllResident(),
                                               compilation_cache=False,
                                               speculative=Speculative(
                                                   num_tokens=k, draft=AcceptanceRateDraft(rate))))
    for p in PROMPTS:
        engine.add_request(p[:20], max_new_tokens=200)
    engine.run()
    m = engine.metrics
    # Each step verifies k drafts (fewer near the end); draft i is accepted with probability
    # rate ** i: the accepted fraction is (rate + rate^2) / 2 = 0.48 over ~500 steps.
    assert m.draft_tokens > 500
    assert abs(m.accepted_tokens / m.draft_tokens - (rate + rate ** 2) / 2) < 0.05
    assert m.generated_tokens == 6 * 200


class _BadDrafts(ScriptedDraft):
    """Right drafts, except that from generated token 2 on requests 0-3 get bad ones: a token
    id past int32, one draft too many, a negative id, None; request 4's propose raises."""

    def propose(self, request, num_tokens):
        good = super().propose(request, num_tokens)
        if request.live < 2 or request.index > 4:
            return good
        if request.index == 4:
            raise ZeroDivisionError("no draft today")
        return {0: [2 ** 40] + good[1:], 1: good + [1], 2: [-1], 3: None}[request.index]


def test_bad_host_drafts_fail_their_request_only(reference):
    """A host draft source that breaks its rule fails that request (finish reason "error",
    naming the source and the rule); the others end as they do without speculation."""
    source = _BadDrafts({r.index: r.generated for r in reference}, lambda i, j: True)
    engine, out = _serve(speculative=Speculative(num_tokens=2, draft=source))
    try:
        rule = "the rule: a list of at most 2 int token ids in [0, 512)"
        whats = ["token id 1099511627776", "3 drafts", "token id -1", "None",
                 "ZeroDivisionError"]
        for req, what in zip(out[:5], whats, strict=True):
            assert req.finish_reason == "error", req.index
            assert "EngineConfig.speculative.draft _BadDrafts.propose" in req.error
            assert what in req.error and (rule in req.error or req.index == 4), req.error
            assert req.generated == reference[req.index].generated[:len(req.generated)]
            assert len(req.generated) >= 2
        _check_same(reference[5:], engine, out[5:])
        assert not engine.has_work and not engine.running
    finally:
        engine.close()


def test_speculation_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"EngineConfig.speculative.num_tokens must be an int in "
                                         r"\[1, EngineConfig.sizes.block_size=4\)"):
        EngineConfig(sizes=Sizes(block_size=4), speculative=Speculative(num_tokens=4))
    with pytest.raises(ValueError, match="EngineConfig.speculative.num_tokens must be a positive"):
        Speculative(num_tokens=0, draft=MTPDraft())
    with pytest.raises(ValueError, match="EngineConfig.speculative.draft must be a "
                                         "hisparse_jax.draft_sources"):
        EngineConfig(speculative=Speculative(num_tokens=1, draft="mtp"))
    with pytest.raises(ValueError, match="per_row=True"):
        EngineConfig(residency=HiSparse(per_row=True))
    with pytest.raises(ValueError, match="acceptance_rate must be a number in"):
        AcceptanceRateDraft(1.5)
    plain = models.init_model("tiny", seed=0)  # no MTP module
    with pytest.raises(ValueError, match="needs a model with an MTP module"):
        Engine(plain, EngineConfig(speculative=Speculative(num_tokens=1)))
    with pytest.raises(ValueError, match=r"EngineConfig.sizes.hot_size must be >= \(1 \+ "
                                         r"EngineConfig.speculative.num_tokens\)"):
        Engine(tiny_model(), EngineConfig(speculative=Speculative(num_tokens=1),
                                          sizes=Sizes(hot_size=16)))
    # The mesh engine verifies drafts too (its tokens: `tests/test_mesh_compose.py`).
    MeshEngine(tiny_model(), EngineConfig(speculative=Speculative(num_tokens=1)),
               mesh_shape=(1, 1)).close()


def test_mtp_module_leaves_the_main_model_unchanged():
    plain, with_mtp = models.init_model("tiny", seed=0), tiny_model()
    assert plain.mtp is None and with_mtp.mtp is not None
    np.testing.assert_array_equal(plain.lm_head.kernel[...], with_mtp.lm_head.kernel[...])
    np.testing.assert_array_equal(plain.blocks[1].mlp.up.kernel[...],
                                  with_mtp.blocks[1].mlp.up.kernel[...])


@pytest.mark.gpu
def test_gpu_scale_speculation_under_pressure_matches_plain_decoding():
    """dsv32-2l (top_k 2048) on the GPU kernels: 8 requests of ~3000-3500 tokens on a device
    pool of 400 blocks of 64 rows; k = 1 and 2 drafts per step (random right / wrong
    pattern), each step's 2-3 query rows per request resolved as one union by the Triton
    kernel. Greedy tokens are identical to all-resident decoding without speculation whose
    decode batch has as many rows (8 (1 + k) seats): on the GPU a bf16 matmul of another row
    count may round differently, and a near-tie of the random model can then flip a token,
    so the baseline keeps the row count (the model's arithmetic per row is then the same)."""
    import jax

    model = models.init_model("dsv32-2l", seed=0)
    prompts = [np.random.default_rng(i).integers(0, 129280, 3000 + 71 * i).tolist()
               for i in range(8)]

    def serve(residency=None, speculative=None, **sizes):
        engine = Engine(model, EngineConfig(
            sizes=Sizes(max_model_len=4096, block_size=64, **sizes),
            prefill=PrefillPolicy(bucket=4096), compilation_cache=True,
            residency=residency or HiSparse(), speculative=speculative))
        ids = [engine.add_request(p, max_new_tokens=24) for p in prompts]
        out = engine.run()
        engine.close()
        return engine.summary(), [out[i] for i in ids]

    same_rows_as_plain8 = None
    for k in (1, 2):
        _, plain = serve(max_seats=8 * (1 + k), residency=AllResident())
        s, out = serve(max_seats=8, num_gpu_blocks=400, hot_size=2048 * (1 + k),
                       speculative=Speculative(num_tokens=k, draft=ScriptedDraft(
                           {r.index: r.generated for r in plain}, _random_pattern(3))))
        print(k, s)
        assert s["hot_grants"] > 0 and s["rows_moved_h2d"] > 0 and s["lost_pages"] > 0, s
        assert s["accepted_tokens"] > 0 and s["tokens_per_request_step"] > 1.0, s
        for a, b in zip(plain, out, strict=True):
            assert a.generated == b.generated, (k, a.request_id, a.generated, b.generated)
        if same_rows_as_plain8 is None:
            _, plain8 = serve(max_seats=8, residency=AllResident())
            same_rows_as_plain8 = [a.generated == b.generated
                                   for a, b in zip(plain8, plain, strict=True)]
            print("plain decoding, 8 vs 16 batch rows, same tokens per request:",
                  same_rows_as_plain8)
    assert jax.default_backend() == "gpu"
