"""The DSA layers (`hisparse_jax.models.dsa_config`, `dsa_layers`, `dsa_moe`, `dsa_weights`)
against references written here: the config parser (fixture config.json files, defaults,
bad configs), the rotary tables against their formulas, both RoPE layouts, the router's
choice rules, the ragged_dot experts against a dense per-expert loop, the absorbed MLA
against the expanded per-head attention, and the checkpoint name map."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hisparse_jax.models.dsa_config import DSAConfig, yarn_get_mscale
from hisparse_jax.models.dsa_layers import (
    DSAMTP,
    DSAAttention,
    DSABlock,
    DSAIndexer,
    rope_half,
    rope_interleaved,
    rope_inv_freq,
    rotary_cos_sin,
)
from hisparse_jax.models.dsa_moe import MoE, choose_experts, routed_experts
from hisparse_jax.models.dsa_weights import (
    check_names,
    expected_tensors,
    load_into,
    optional_tensors,
)
from hisparse_jax.models.synthetic_layers import RMSNorm, as_dtype, linear

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
HI = jax.lax.Precision.HIGHEST

TINY = dict(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=12,
            num_experts_per_tok=3, n_group=3, topk_group=2, index_topk=4, index_n_heads=3,
            index_head_dim=12, first_k_dense_replace=1, dtype="float32")


LEGACY_ROPE = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 4096}


def tiny(model_type: str = "deepseek_v32", **overrides) -> DSAConfig:
    return DSAConfig.from_hf({"model_type": model_type, **TINY, **overrides})


def _normal(key: int, shape, scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


# --------------------------------------------------------------------------- config


def _safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of a checkpoint folder's tensors, from the safetensors headers."""
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    shapes = {}
    for name in files:
        with open(folder / name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in FIXTURES.glob("*/config.json"))
                         or [pytest.param(None, marks=pytest.mark.skip("no HF fixtures"))])
def test_config_and_names_of_the_fixture_checkpoints(folder):
    path = FIXTURES / folder
    config = json.loads((path / "config.json").read_text())
    cfg = DSAConfig.from_hf(config)
    assert cfg.dtype == cfg.kv_dtype == "float32"  # the fixtures are float32 checkpoints
    assert sum(cfg.group_layers) == cfg.num_hidden_layers
    assert cfg.num_groups == cfg.indexer_types.count("full")
    shapes = {k: v for k, v in _safetensors_shapes(path).items()
              if not k.endswith("_scale_inv")}
    check_names(cfg, shapes)
    expected = expected_tensors(cfg)
    assert {k: shapes[k] for k in expected} == expected
    if cfg.rope.rope_type == "yarn":
        m = yarn_get_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        assert cfg.sm_scale == pytest.approx(cfg.qk_head_dim ** -0.5 * m * m, rel=1e-15)


def test_config_defaults_and_derived_layer_types():
    ds = DSAConfig.from_hf({"model_type": "deepseek_v32"})
    assert (ds.num_hidden_layers, ds.hidden_size, ds.n_group, ds.dtype) == (
        61, 7168, 8, "bfloat16")
    assert ds.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert ds.group_layers == (1,) * 61 and ds.row_width == 576 and ds.top_k == 2048
    assert not ds.indexer_rope_interleaved
    glm = DSAConfig.from_hf({"model_type": "glm_moe_dsa", "num_hidden_layers": 7,
                             "index_topk_freq": 3, "index_skip_topk_offset": 2,
                             "torch_dtype": "float32"})
    assert glm.indexer_types == ("full", "full", "shared", "shared", "full", "shared",
                                 "shared")
    assert glm.group_layers == (1, 3, 3) and glm.group_of_layer == (0, 1, 1, 1, 2, 2, 2)
    assert glm.dtype == "float32" and glm.rms_norm_eps == 1e-5 and glm.indexer_rope_interleaved
    pattern = DSAConfig.from_hf({"model_type": "glm_moe_dsa", "num_hidden_layers": 3,
                                 "index_topk_pattern": "FSF"}, kv_dtype="float16")
    assert pattern.indexer_types == ("full", "shared", "full") and pattern.kv_dtype == "float16"
    legacy = DSAConfig.from_hf({"model_type": "deepseek_v32", "rope_theta": 5000.0,
                                "rope_scaling": LEGACY_ROPE})
    r = legacy.rope
    assert (r.rope_type, r.theta, r.factor, r.beta_fast, r.beta_slow) == (
        "yarn", 5000.0, 40.0, 32.0, 1.0)
    assert r.attention_factor == 1.0  # mscale / mscale_all_dim = 1
    assert legacy.sm_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192))
    # rope_parameters' own theta wins over rope_theta beside it; the config is hashable.
    again = DSAConfig.from_hf({"model_type": "deepseek_v32", "rope_theta": 1.0,
                               "rope_parameters": {**LEGACY_ROPE, "rope_theta": 5000.0}})
    assert again == legacy and hash(again) == hash(legacy)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3' is not supported.*glm_moe_dsa"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' must be 'silu'"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True must be false"),
    ({"attention_bias": True}, "attention_bias=True must be false"),
    ({"q_lora_rank": None}, "q_lora_rank=None must be an int"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal num_attention_heads=4"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' must be 'sigmoid'"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     "rope type 'linear' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5 must be 1"),
    ({"n_group": 5}, "n_routed_experts=12 must be a multiple of n_group=5"),
    ({"n_group": 12}, "at least 2 experts per group"),
    ({"topk_group": 4}, "topk_group=4 must be <= n_group=3"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be <= topk_group"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must hold 4"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers must be 0 or 1"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
    ({"index_topk": 0}, "index_topk must be a positive int"),
])
def test_config_rejects_what_the_port_does_not_implement(change, match):
    with pytest.raises(ValueError, match=match):
        tiny(**change)


@pytest.mark.parametrize("change, match", [
    ({"indexer_types": ["shared", "full", "full", "full"]}, r"indexer_types\[0\] must be"),
    ({"indexer_types": ["full", "sparse", "full", "full"]}, "indexer_types must hold 4"),
    ({"index_topk_pattern": "FXFF"}, "index_topk_pattern='FXFF'.*'F'"),
])
def test_config_rejects_bad_glm_indexer_types(change, match):
    with pytest.raises(ValueError, match=match):
        tiny("glm_moe_dsa", **change)


# --------------------------------------------------------------------------- rotary


def _yarn_formula(theta, dim, factor, original, beta_fast, beta_slow, truncate):
    """YaRN's inverse frequencies in float64 from the paper's formula."""
    def correction(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction(beta_fast), correction(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    out = []
    for i in range(dim // 2):
        base = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(base / factor * ramp + base * (1 - ramp))
    return np.array(out)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_and_default_tables_follow_their_formulas(truncate):
    rope = {"rope_type": "yarn", "factor": 16.0, "mscale": 0.7, "mscale_all_dim": 0.9,
            "original_max_position_embeddings": 256, "beta_fast": 24, "beta_slow": 2,
            "rope_theta": 20000.0, "truncate": truncate}
    cfg = tiny(rope_parameters=rope, qk_rope_head_dim=32, index_head_dim=32)
    inv = rope_inv_freq(cfg.rope, 32)
    assert inv.dtype == np.float32
    want = _yarn_formula(20000.0, 32, 16.0, 256, 24, 2, truncate)
    np.testing.assert_allclose(inv, want, rtol=2e-6)
    assert inv[0] == pytest.approx(1.0, rel=1e-6) and inv[-1] == pytest.approx(want[-1], rel=2e-6)
    factor = (0.1 * 0.7 * math.log(16) + 1) / (0.1 * 0.9 * math.log(16) + 1)
    assert cfg.rope.attention_factor == pytest.approx(factor, rel=1e-15)
    assert cfg.sm_scale == pytest.approx((0.1 * 0.9 * math.log(16) + 1) ** 2 / math.sqrt(40),
                                         rel=1e-15)
    pos = jnp.array([0, 5, 300], jnp.int32)
    cos, sin = rotary_cos_sin(cfg, pos)
    angles = np.array([0, 5, 300])[:, None] * want[None]
    np.testing.assert_allclose(cos, factor * np.cos(angles), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(sin, factor * np.sin(angles), rtol=2e-5, atol=2e-5)
    plain = tiny(rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    np.testing.assert_allclose(rope_inv_freq(plain.rope, 8), 500.0 ** (-np.arange(0, 8, 2) / 8),
                               rtol=1e-6)
    assert plain.sm_scale == 16 ** -0.5


def test_rope_layouts_interleaved_is_half_of_the_deinterleaved_input():
    x = _normal(0, (5, 3, 8))
    cfg = tiny()
    cos, sin = rotary_cos_sin(cfg, jnp.arange(5, dtype=jnp.int32) * 7)
    inter = rope_interleaved(x, cos, sin)
    deinterleaved = jnp.concatenate([x[..., 0::2], x[..., 1::2]], -1)
    np.testing.assert_allclose(inter, rope_half(deinterleaved, cos, sin), rtol=1e-6, atol=1e-6)
    # Interleaved pairs are complex numbers x0 + i x1 turned by the angle; the output lists
    # the real parts, then the imaginary parts.
    z = (np.asarray(x[..., 0::2]) + 1j * np.asarray(x[..., 1::2])) * np.exp(
        1j * np.angle(np.asarray(cos) + 1j * np.asarray(sin)))[:, None]
    np.testing.assert_allclose(inter, np.concatenate([z.real, z.imag], -1), rtol=1e-5,
                               atol=1e-5)
    # Scores depend on the distance only: q at t + 3 against k at s + 3.
    q, k = _normal(1, (8,)), _normal(2, (8,))
    for apply in (rope_interleaved, rope_half):
        c, s = rotary_cos_sin(cfg, jnp.array([10, 4, 13, 7], jnp.int32))
        r = apply(jnp.stack([q, k, q, k]), c, s)
        assert float(r[0] @ r[1]) == pytest.approx(float(r[2] @ r[3]), rel=1e-5)


# --------------------------------------------------------------------------- MoE


def test_router_respects_groups_and_bias_moves_choice_not_weights():
    cfg = tiny(n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3,
               routed_scaling_factor=2.5)
    scores = jax.nn.sigmoid(_normal(3, (64, 12), 2.0))
    bias = _normal(4, (12,), 0.3)
    experts = np.asarray(choose_experts(scores, bias, cfg))
    choice = np.asarray(scores + bias)
    for t in range(64):
        groups = choice[t].reshape(4, 3)
        group_score = np.sort(groups, -1)[:, -2:].sum(-1)
        kept = set(np.argsort(-group_score)[:2])
        assert len(set(experts[t])) == 3 and {e // 3 for e in experts[t]} <= kept
        allowed = [e for e in range(12) if e // 3 in kept]
        best = sorted(allowed, key=lambda e: -choice[t, e])[:3]
        assert set(experts[t]) == set(best)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    x = _normal(5, (6, 32))
    w0, e0 = moe.router(x)
    np.testing.assert_allclose(np.sum(w0, -1), 2.5, rtol=1e-6)
    # A large bias on expert 7 puts it in every row's choice; its weight is its own score.
    moe.router.bias[...] = jnp.zeros(12).at[7].set(100.0)
    w1, e1 = moe.router(x)
    assert all(7 in row for row in np.asarray(e1))
    raw = jax.nn.sigmoid(x @ moe.router.kernel[...])
    picked = jnp.take_along_axis(raw, e1, -1)
    np.testing.assert_allclose(w1, 2.5 * picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    unnormed = MoE(tiny(norm_topk_prob=False, routed_scaling_factor=1.5), rngs=nnx.Rngs(0))
    w2, e2 = unnormed.router(x)
    np.testing.assert_allclose(w2, 1.5 * jnp.take_along_axis(
        jax.nn.sigmoid(x @ unnormed.router.kernel[...]), e2, -1), rtol=1e-6)


def test_moe_ragged_dot_equals_a_dense_loop_over_each_tokens_experts():
    cfg = tiny(n_shared_experts=2)
    moe = MoE(cfg, rngs=nnx.Rngs(1))
    moe.router.bias[...] = _normal(6, (12,), 0.5)
    x = _normal(7, (9, 32))
    weights, experts = moe.router(x)
    wgu, wd = np.asarray(moe.w_gate_up[...]), np.asarray(moe.w_down[...])
    want = np.zeros((9, 32))
    for t in range(9):
        for k in range(3):
            e = int(experts[t, k])
            h = np.asarray(x[t], np.float64) @ wgu[e]
            gate, up = h[:16], h[16:]
            want[t] += float(weights[t, k]) * ((gate / (1 + np.exp(-gate)) * up) @ wd[e])
    np.testing.assert_allclose(routed_experts(x, weights, experts, moe.w_gate_up[...],
                                              moe.w_down[...]), want, rtol=1e-5, atol=1e-5)
    s = moe.shared
    shared = (jax.nn.silu(x @ s.gate.kernel[...]) * (x @ s.up.kernel[...])) @ s.down.kernel[...]
    np.testing.assert_allclose(moe(x), want + np.asarray(shared), rtol=1e-5, atol=1e-5)
    assert s.gate.kernel.shape == (32, 32)  # moe_intermediate_size * n_shared_experts


# --------------------------------------------------------------------------- attention


def _expanded_attention(attn: DSAAttention, x, positions, rows_of):
    """Non-absorbed MLA: per-head keys [k_nope | k_rope] and values from the expanded
    kv_b_proj, softmax over each row's selected positions, then o_proj."""
    c = attn.cfg
    cos, sin = rotary_cos_sin(c, positions)
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).reshape(x.shape[0], c.num_attention_heads, -1)
    q = jnp.concatenate([q[..., :c.qk_nope_head_dim],
                         rope_interleaved(q[..., c.qk_nope_head_dim:], cos, sin)], -1)
    kv = attn.wkv_a(x)
    latent = attn.kv_norm(kv[:, :c.kv_lora_rank])
    k_nope = jnp.einsum("sc,hnc->shn", latent, attn.w_uk[...], precision=HI)
    values = jnp.einsum("sc,hcv->shv", latent, attn.w_uv[...], precision=HI)
    k_rope = jnp.broadcast_to(rope_interleaved(kv[:, c.kv_lora_rank:], cos, sin)[:, None],
                              (x.shape[0], c.num_attention_heads, c.qk_rope_head_dim))
    keys = jnp.concatenate([k_nope, k_rope], -1)
    scores = jnp.einsum("thd,shd->ths", q, keys, precision=HI) * c.sm_scale
    mask = np.zeros((x.shape[0], x.shape[0]), bool)
    for t, rows in enumerate(rows_of):
        mask[t, [r for r in rows if r >= 0]] = True
    p = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), -1)
    out = jnp.einsum("ths,shv->thv", p, values, precision=HI)
    return attn.wo(out.reshape(x.shape[0], -1))


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0,
                                         "original_max_position_embeddings": 16}])
def test_absorbed_mla_equals_the_expanded_per_head_attention(rope):
    cfg = tiny(**({"rope_parameters": rope} if rope else {}))
    attn = DSAAttention(cfg, rngs=nnx.Rngs(2))
    T = 7
    x = _normal(8, (T, 32))
    positions = jnp.arange(T, dtype=jnp.int32) + 30
    rows = np.array([[0, -1, -1], [0, 1, -1], [2, 0, 1], [3, 1, -1], [4, 0, 2], [5, 3, 1],
                     [6, 2, 4]], np.int32)
    q_resid, q, row = attn.project(x, positions)
    assert (q_resid.shape, q.shape, row.shape) == ((T, 24), (T, 4, 24), (T, 24))
    assert attn.sm_scale == cfg.sm_scale and attn.v_width == cfg.kv_lora_rank == 16
    out, latent = attn.attend(q, row, jnp.asarray(rows), backend="reference")
    assert latent.shape == (T, 4, 16)
    want = _expanded_attention(attn, x, positions, rows)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # One-row attention (the MTP layer's): each row over itself alone.
    own, _ = attn.attend(q, row, jnp.arange(T, dtype=jnp.int32)[:, None], backend="reference")
    np.testing.assert_allclose(attn.self_attention(x), own, rtol=1e-5, atol=1e-5)


def test_indexers_differ_only_in_rope_layout_and_scale_their_head_weights():
    ds = DSAIndexer(tiny(), rngs=nnx.Rngs(3))
    glm = DSAIndexer(tiny("glm_moe_dsa"), rngs=nnx.Rngs(3))
    x, q_resid = _normal(9, (6, 32)), _normal(10, (6, 24))
    pos = jnp.arange(6, dtype=jnp.int32)
    k_ds, k_glm = ds.keys(x, pos), glm.keys(x, pos)
    np.testing.assert_array_equal(k_ds[:, 8:], k_glm[:, 8:])  # the unroped dims
    raw = ds.k_norm(ds.wk(x))[:, :8]
    cos, sin = rotary_cos_sin(ds.cfg, pos)
    np.testing.assert_allclose(k_ds[:, :8], rope_half(raw, cos, sin), rtol=1e-6)
    np.testing.assert_allclose(k_glm[:, :8], rope_interleaved(raw, cos, sin), rtol=1e-6)
    q, w = ds.queries(q_resid, x, pos)
    assert q.shape == (6, 3, 12) and w.dtype == jnp.float32
    assert ds.w_heads.kernel.dtype == jnp.float32
    np.testing.assert_allclose(w, (x @ ds.w_heads.kernel[...]) * (3 ** -0.5 * 12 ** -0.5),
                               rtol=1e-6)
    top = np.asarray(ds.select(q, w, k_ds, pos))
    assert top.shape == (6, 4) and (top[0, 1:] == -1).all() and (top[4:] >= 0).all()


def test_blocks_follow_the_layer_types_and_the_mtp_layer_drafts():
    cfg = tiny("glm_moe_dsa", indexer_types=["full", "shared", "full", "full"],
               num_nextn_predict_layers=1)
    kinds = [(type(b.mlp).__name__, b.indexer is not None)
             for b in (DSABlock(cfg, i, rngs=nnx.Rngs(0)) for i in range(4))]
    assert kinds == [("SwiGLU", True), ("MoE", False), ("MoE", True), ("MoE", True)]
    with pytest.raises(ValueError, match="DSABlock layer=5 must be in"):
        DSABlock(cfg, 5, rngs=nnx.Rngs(0))
    mtp = DSAMTP(cfg, rngs=nnx.Rngs(4))
    assert mtp.block.indexer is None and isinstance(mtp.block.mlp, MoE)
    hidden, tokens = _normal(11, (3, 32)), jnp.array([1, 5, 9], jnp.int32)
    x = mtp.eh_proj(jnp.concatenate([mtp.enorm(mtp.embed(tokens)), mtp.hnorm(hidden)], -1))
    b = mtp.block
    x = x + b.attn.self_attention(b.attn_norm(x))
    want = x + b.mlp(b.mlp_norm(x))
    out = mtp(hidden, tokens)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    assert mtp.logits(out).shape == (3, 40) and mtp.logits(out).dtype == jnp.float32


# --------------------------------------------------------------------------- weights


class _Model(nnx.Module):
    """The attributes `dsa_weights` fills (`MODEL_PATHS`)."""

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size,
                               param_dtype=as_dtype(cfg.dtype), rngs=rngs)
        self.blocks = nnx.List([DSABlock(cfg, i, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps,
                                  param_dtype=cfg.param_dtype)
        self.lm_head = linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs)
        self.mtp = DSAMTP(cfg, rngs=rngs) if cfg.num_nextn_predict_layers else None


def _checkpoint(cfg: DSAConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in expected_tensors(cfg).items()}


def test_load_into_places_every_tensor_and_names_what_is_wrong():
    cfg = tiny("glm_moe_dsa", indexer_types=["full", "shared", "full", "shared"],
               num_nextn_predict_layers=1, dtype="bfloat16")
    ckpt = _checkpoint(cfg)
    L = cfg.num_hidden_layers
    extra = optional_tensors(cfg)
    assert extra and all(n.startswith(f"model.layers.{L}.self_attn.indexer.") for n in extra)
    assert "model.layers.1.self_attn.indexer.wk.weight" not in ckpt  # a shared layer
    ckpt.update({n: np.zeros(s, np.float32) for n, s in extra.items()})
    asked = {}

    def read(name, dtype):
        asked[name] = np.dtype(dtype)
        return ckpt[name].astype(dtype)

    model = nnx.eval_shape(lambda: _Model(cfg, rngs=nnx.Rngs(0)))
    load_into(model, read, names=ckpt.keys())
    leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
    assert all(isinstance(v.get_value(), jax.Array) for _, v in leaves)
    assert asked.keys() == expected_tensors(cfg).keys()  # optional tensors are not read
    bf16 = np.dtype(jnp.bfloat16)
    assert asked["model.layers.2.mlp.gate.weight"] == np.float32
    assert asked["model.layers.0.self_attn.indexer.weights_proj.weight"] == np.float32
    assert asked["model.layers.2.mlp.experts.3.up_proj.weight"] == bf16

    def same(param, want):
        np.testing.assert_array_equal(np.asarray(param, np.float32),
                                      np.asarray(want.astype(bf16), np.float32))

    b = model.blocks[2]
    same(b.attn.wq_a.kernel[...], ckpt["model.layers.2.self_attn.q_a_proj.weight"].T)
    kv_b = ckpt["model.layers.2.self_attn.kv_b_proj.weight"].reshape(4, 8 + 12, 16)
    same(b.attn.w_uk[...], kv_b[:, :8])
    same(b.attn.w_uv[...], kv_b[:, 8:].transpose(0, 2, 1))
    for e in (0, 5, 11):
        x = f"model.layers.2.mlp.experts.{e}."
        same(b.mlp.w_gate_up[e, :, :16], ckpt[x + "gate_proj.weight"].T)
        same(b.mlp.w_gate_up[e, :, 16:], ckpt[x + "up_proj.weight"].T)
        same(b.mlp.w_down[e], ckpt[x + "down_proj.weight"].T)
    np.testing.assert_array_equal(b.mlp.router.kernel[...],
                                  ckpt["model.layers.2.mlp.gate.weight"].T)
    same(model.mtp.eh_proj.kernel[...], ckpt[f"model.layers.{L}.eh_proj.weight"].T)
    same(model.mtp.block.mlp.w_down[1],
         ckpt[f"model.layers.{L}.mlp.experts.1.down_proj.weight"].T)
    same(model.embed.embedding[...], ckpt["model.embed_tokens.weight"])

    missing = {k: v for k, v in ckpt.items() if k != "model.layers.3.mlp.gate.weight"}
    with pytest.raises(ValueError, match="1 missing tensor.*model.layers.3.mlp.gate.weight"):
        load_into(model, read, names=missing)
    with pytest.raises(ValueError, match="1 unexpected tensor.*model.layers.1.self_attn.index"):
        load_into(model, read, names=[*ckpt, "model.layers.1.self_attn.indexer.wk.weight"])
    ckpt["model.layers.1.self_attn.o_proj.weight"] = np.zeros((32, 47), np.float32)
    with pytest.raises(ValueError, match=r"o_proj.weight: expected shape \(32, 48\), found "
                                         r"\(32, 47\)"):
        load_into(model, read, names=ckpt.keys())
