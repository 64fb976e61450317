"""Real checkpoints: `from_pretrained` + `score` + the engine against transformers.

The tiny DeepSeek-V3.2 / GLM-5 checkpoints of `tests/fixtures/hf/` (README there) were written
by transformers 5.25 with its outputs beside them (`expected.npz`): the logits of one
teacher-forced forward over prompt + greedy tokens, and the greedy tokens of `generate`.
Loaded in float32, every position's logits (`score`, the prefill path) equal transformers' to
float32 rounding, and the engine decodes transformers' greedy tokens exactly, all-resident and
HiSparse under pool pressure (decode rows read back from the host pool through the hot
regions; chunked prefills, and prefix hits whose host-only rows are staged into them). The
fp8 checkpoint (DeepSeek's release layout) loads to the outputs of its dequantized weights.
A checkpoint that does not match its config fails with an error naming the tensor or field.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from hisparse_jax.draft_sources import MTPDraft
from hisparse_jax.engine import (
    AllResident,
    Engine,
    EngineConfig,
    HiSparse,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from hisparse_jax.engine.mesh import param_specs
from hisparse_jax.models import DSAConfig, DSAModel, check_served_model, from_pretrained, score
from hisparse_jax.models.checkpoint import SafetensorsFile, save_safetensors


@pytest.fixture(autouse=True, scope="module")
def _float32_matmuls():
    """Float32 matmuls in float32 (on an NVIDIA GPU jax's default for float32 is TF32, whose
    rounding flips the fixtures' close indexer choices; transformers' reference ran in true
    float32). Off a GPU this changes nothing."""
    with jax.default_matmul_precision("highest"):
        yield


FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
NAMES = ("dsv32-yarn", "dsv32-fp8", "glm5-shared", "glm5-576")
SUFFIXES = ("", "2")  # the fixtures' two prompts: prompt / greedy / logits, prompt2 / ...
SCORE_RTOL = 2e-3  # max |score - logits| / max |logits|, float32
MAX_LEN, BLOCK = 64, 4  # 16 pages per request; the prompts are 40 and 25 tokens, + 16
PRESSURE_BLOCKS = 20  # device blocks per layer for two requests: pages spill and come back


@functools.cache
def _model(name: str, kv_dtype: str = "float32") -> DSAModel:
    return from_pretrained(FIXTURES / name, kv_dtype=kv_dtype)


@functools.cache
def _expected(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "expected.npz") as data:
        return dict(data)


def _relative_error(name: str, suffix: str) -> float:
    want = _expected(name)
    ids = np.concatenate([want["prompt" + suffix], want["greedy" + suffix]])
    got = score(_model(name), ids)
    ref = want["logits" + suffix]
    assert got.shape == ref.shape and got.dtype == np.float32
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", NAMES)
def test_score_equals_transformers_logits(name, record_property):
    """Every position's logits through the prefill path, both prompts (prompt + greedy):
    within SCORE_RTOL of transformers' forward (the fp8 checkpoint: of its dequantized
    weights' forward)."""
    errors = {suffix or "1": _relative_error(name, suffix) for suffix in SUFFIXES}
    record_property("score_relative_error", errors)
    print(f"{name}: score relative error {errors}")
    assert max(errors.values()) < SCORE_RTOL, errors


def test_the_model_is_a_served_model_with_the_checkpoints_groups():
    glm = _model("glm5-shared")
    spec = check_served_model("test", glm)
    assert spec.group_layers == (1, 2, 2) and spec.top_k == 8 and not spec.has_draft
    assert [b.indexer is None for b in glm.blocks] == [False, False, True, False, True]
    dsv = _model("dsv32-yarn")
    assert dsv.spec.has_draft and dsv.spec.group_layers == (1, 1, 1)
    assert dsv.spec.sm_scale == dsv.cfg.sm_scale != dsv.cfg.qk_head_dim ** -0.5  # YaRN mscale
    keys = dsv.init_index_keys(2, MAX_LEN, external_topk=False)
    assert len(keys) == 3 and keys[0].shape == (2, MAX_LEN, dsv.cfg.index_head_dim)
    drafts = dsv.draft(np.zeros((2, dsv.cfg.hidden_size), np.float32),
                       np.array([5, 7], np.int32), 3)
    assert drafts.shape == (2, 3) and drafts.dtype == np.int32
    # Tensor parallelism: q_b_proj by heads (its output dim), o_proj on its input dim,
    # experts on the expert dim; q_a_proj (shared by every head) and the router replicated;
    # a model axis of 2 divides every split dim of the fixtures (docs/mesh.md, DSA models).
    rule = DSAModel.tensor_parallel_dim
    assert rule("blocks.1.attn.wq_a.kernel", (64, 32)) is None
    assert rule("blocks.1.attn.wq_b.kernel", (32, 128)) == 1
    assert rule("blocks.1.attn.wo.kernel", (64, 64)) == 0
    assert rule("blocks.1.mlp.w_gate_up", (8, 64, 64)) == 0
    assert rule("blocks.1.mlp.w_down", (8, 32, 64)) == 0
    assert rule("blocks.1.mlp.router.kernel", (64, 8)) is None
    assert rule("blocks.1.attn.w_uk", (4, 16, 32)) == 0
    assert rule("final_norm.scale", (64,)) is None
    specs = param_specs(dsv, 2)
    sizes = [x.size for x in jax.tree.leaves(nnx.state(dsv))]
    split = sum(n for n, spec in zip(sizes, specs, strict=True) if any(spec))
    assert split > sum(sizes) // 2  # most of the weights by size (norms etc. replicated)


def _serve(name: str, kv_dtype: str, residency: str):
    """Both prompts of a fixture, 16 greedy tokens each, on one engine, twice: (the generated
    token lists of each round, the engine's metrics).

    "all-resident": one-shot prefills, no reuse. "hisparse": a device pool of
    PRESSURE_BLOCKS blocks per layer, prompts prefilled in chunks of 16 with prefix caching;
    the second round's prompts hit the first round's published pages, whose rows are by
    then host-only and are staged into its prefill chunks (`prefix_hit_pages="stage"`)."""
    hisparse = residency == "hisparse"
    prefill = (PrefillPolicy(bucket=16, chunk_size=16, prefix_caching=True,
                             prefix_hit_pages="stage") if hisparse
               else PrefillPolicy(bucket=MAX_LEN))
    sizes = Sizes(max_seats=2, max_model_len=MAX_LEN, block_size=BLOCK,
                  num_gpu_blocks=PRESSURE_BLOCKS if hisparse else None)
    engine = Engine(_model(name, kv_dtype), EngineConfig(
        sizes=sizes, residency=HiSparse() if hisparse else AllResident(), prefill=prefill))
    try:
        want = _expected(name)
        rounds = []
        for _ in range(2 if hisparse else 1):
            ids = [engine.add_request(want["prompt" + s].tolist(), max_new_tokens=16)
                   for s in SUFFIXES]
            out = engine.run()
            rounds.append([list(out[i].generated) for i in ids])
        return rounds, engine.metrics
    finally:
        engine.close()


# (fixture, KV row dtype): float32 rows everywhere; bfloat16 rows where the fixture's margins
# allow it (dsv32-yarn, glm5-576). In glm5-shared and dsv32-fp8 a bf16 index key or query
# flips a top-k decision whose gap is ~1e-4 of the score scale (the README's
# index_min_rel_gap) and the tokens part from transformers' (its bf16 emulation rounds at
# other points than the absorbed attention and the index-key cache do).
ENGINE_CASES = [("dsv32-yarn", "float32"), ("dsv32-yarn", "bfloat16"),
                ("glm5-shared", "float32"), ("glm5-576", "float32"), ("glm5-576", "bfloat16")]


@pytest.mark.parametrize("residency", ["all-resident", "hisparse"])
@pytest.mark.parametrize("name, kv_dtype", ENGINE_CASES, ids=[f"{n}-{d}" for n, d in ENGINE_CASES])
def test_the_engine_decodes_transformers_greedy_tokens(name, kv_dtype, residency):
    rounds, metrics = _serve(name, kv_dtype, residency)
    want = [_expected(name)["greedy" + s].tolist() for s in SUFFIXES]
    for tokens in rounds:
        assert tokens == want
    if residency == "hisparse":
        assert metrics.hot_misses > 0  # decode rows read back from the host pool
        assert metrics.staged_rows_host > 0  # prefill rows staged from the host pool


def test_fp8_kv_rows_and_naive_offload_decode_all_residents_tokens():
    """glm5-576 (512 + 64-wide rows) with fp8_ds_mla KV rows (`docs/kv_format.md`): HiSparse
    under pool pressure and naive offload decode the tokens all-resident decodes with the
    same rows (quantized rows are not transformers' float32 rows, so the reference here is
    the engine's own all-resident run; with this fixture's margins they also equal
    transformers' greedy tokens, which is asserted too)."""
    want = _expected("glm5-576")
    model = _model("glm5-576")

    def serve(residency, gpu_blocks):
        engine = Engine(model, EngineConfig(
            sizes=Sizes(max_seats=2, max_model_len=MAX_LEN, block_size=BLOCK,
                        num_gpu_blocks=gpu_blocks),
            residency=residency, kv_format="fp8_ds_mla",
            prefill=PrefillPolicy(bucket=MAX_LEN)))
        try:
            ids = [engine.add_request(want["prompt" + s].tolist(), max_new_tokens=16)
                   for s in SUFFIXES]
            out = engine.run()
            return [list(out[i].generated) for i in ids], engine.metrics
        finally:
            engine.close()

    base, _ = serve(AllResident(), None)
    pressed, metrics = serve(HiSparse(), PRESSURE_BLOCKS)
    naive, _ = serve(NaiveOffload(), PRESSURE_BLOCKS)
    assert pressed == base and naive == base
    assert metrics.hot_misses > 0  # rows did come back from the host pool
    assert base == [want["greedy" + s].tolist() for s in SUFFIXES]


def test_mtp_drafts_keep_transformers_greedy_tokens():
    """dsv32-yarn's MTP layer (which transformers ignores) drafts 2 tokens per step; the
    engine keeps only drafts equal to the model's own tokens, so its output is unchanged."""
    want = _expected("dsv32-yarn")
    engine = Engine(_model("dsv32-yarn"), EngineConfig(
        sizes=Sizes(max_seats=2, max_model_len=MAX_LEN, block_size=BLOCK, num_gpu_blocks=27),
        residency=HiSparse(), prefill=PrefillPolicy(bucket=MAX_LEN),
        speculative=Speculative(num_tokens=2)))
    try:
        ids = [engine.add_request(want["prompt" + s].tolist(), max_new_tokens=16)
               for s in SUFFIXES]
        out = engine.run()
        assert [list(out[i].generated) for i in ids] == [
            want["greedy" + s].tolist() for s in SUFFIXES]
        assert engine.config.draft == MTPDraft() and engine.metrics.draft_tokens > 0
    finally:
        engine.close()


def test_the_fp8_checkpoint_loads_its_dequantized_weights():
    """The fp8 release layout (block scales, two shards) loads to the float32 values of its
    dequantized weights: the same config as dsv32-yarn, close to its weights (fp8 rounding),
    and its own expected outputs (test_score_equals_transformers_logits)."""
    fp8, ref = _model("dsv32-fp8"), _model("dsv32-yarn")
    assert fp8.cfg == ref.cfg
    a = np.asarray(fp8.blocks[1].attn.wq_a.kernel[...])
    b = np.asarray(ref.blocks[1].attn.wq_a.kernel[...])
    assert a.dtype == np.float32 and not np.array_equal(a, b)
    assert np.abs(a - b).max() <= 0.07 * np.abs(b).max()  # e4m3: 3 mantissa bits
    # Not quantized in the release layout: the norms load bit for bit.
    assert np.array_equal(np.asarray(fp8.final_norm.scale[...]),
                          np.asarray(ref.final_norm.scale[...]))


def _copy_fixture(tmp_path: pathlib.Path, name: str = "glm5-576") -> pathlib.Path:
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    return folder


def _rewrite_tensors(folder: pathlib.Path, edit) -> None:
    path = folder / "model.safetensors"
    with SafetensorsFile(path) as f:
        tensors = {n: f.array(n) for n in f.names()}
    edit(tensors)
    save_safetensors(path, tensors)


def test_a_checkpoint_missing_a_tensor_names_it(tmp_path):
    folder = _copy_fixture(tmp_path)
    name = "model.layers.1.self_attn.indexer.wk.weight"
    _rewrite_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"missing tensor.*{name.replace('.', '[.]')}"):
        from_pretrained(folder)


def test_a_mis_shaped_tensor_is_named_with_both_shapes(tmp_path):
    folder = _copy_fixture(tmp_path)
    name = "model.embed_tokens.weight"

    def cut(tensors):
        tensors[name] = tensors[name][:-1]

    _rewrite_tensors(folder, cut)
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}.*\(256, 64\).*\(255, 64\)"):
        from_pretrained(folder)


def test_an_unsupported_model_type_names_the_supported_ones(tmp_path):
    folder = _copy_fixture(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported.*deepseek_v32"):
        from_pretrained(folder)
    with pytest.raises(ValueError, match="glm_moe_dsa"):
        DSAConfig.from_hf(config)


def test_score_checks_its_tokens():
    model = _model("glm5-576")
    with pytest.raises(ValueError, match="token ids must be in"):
        score(model, [0, 256])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        score(model, [])
