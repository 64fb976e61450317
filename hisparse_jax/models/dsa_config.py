"""`DSAConfig`: the static sizes of a DeepSeek-Sparse-Attention decoder (DeepSeek-V3.2,
`model_type` "deepseek_v32", and GLM-5, "glm_moe_dsa"), read from a Hugging Face config.json.

`DSAConfig.from_hf(config)` reads the dict as transformers (5.25, `DeepseekV32Config` /
`GlmMoeDsaConfig`) does: a key that is absent takes that class's default; `mlp_layer_types`
defaults to `first_k_dense_replace` dense layers and then MoE layers; GLM's per-layer
`indexer_types` ("full": the layer runs its indexer, "shared": it reuses the previous full
layer's top-k) default to `index_topk_pattern` ("FSS..."), else to the schedule of
`index_topk_freq` / `index_skip_topk_offset` (DeepSeek-V3.2: every layer "full"); the rotary
parameters come from `rope_parameters` or the legacy `rope_scaling`, with `rope_theta` beside
them. What this port does not implement (another activation, tied embeddings, biases, a rope
type other than "default" / "yarn", ...) is a ValueError naming the field and the rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# transformers 5.25's class defaults (DeepseekV32Config, GlmMoeDsaConfig) of the keys read here.
_COMMON_DEFAULTS: dict[str, Any] = dict(
    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
    qk_rope_head_dim=64, num_experts_per_tok=8, norm_topk_prob=True, hidden_act="silu",
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, index_topk=2048,
    index_head_dim=128, first_k_dense_replace=3, moe_intermediate_size=2048)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": dict(
        _COMMON_DEFAULTS, vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, v_head_dim=128,
        qk_nope_head_dim=128, n_group=8, topk_group=4, max_position_embeddings=163840,
        rms_norm_eps=1e-6, index_n_heads=64),
    "glm_moe_dsa": dict(
        _COMMON_DEFAULTS, vocab_size=154880, hidden_size=6144, intermediate_size=12288,
        num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048, v_head_dim=256,
        qk_nope_head_dim=192, n_group=1, topk_group=1, max_position_embeddings=202752,
        rms_norm_eps=1e-5, index_n_heads=32),
}
_DEFAULT_ROPE_THETA = 10000.0
_ROPE_TYPES = ("default", "yarn")
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "num_experts_per_tok", "n_group", "topk_group", "index_topk", "index_n_heads",
    "index_head_dim", "max_position_embeddings")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """The rotary embedding of the attention and the indexer (both use one table).

    rope_type "default": inv_freq = 1 / theta^(2i / d) over d = qk_rope_head_dim;
    "yarn": the YaRN blend of interpolated (inv_freq / factor) and extrapolated frequencies
    over a linear ramp between the correction dims of beta_fast / beta_slow rotations at
    original_max_position_embeddings; cos and sin are multiplied by `attention_factor`
    (1 for "default"). `mscale_all_dim` (yarn) also scales the attention's softmax scale by
    yarn_get_mscale(factor, mscale_all_dim)^2 (`DSAConfig.sm_scale`).
    """

    rope_type: str = "default"
    theta: float = _DEFAULT_ROPE_THETA
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DSAConfig:
    """Static sizes of a DeepSeek-V3.2 / GLM-5 decoder (hashable: a static jit argument).

    Fields carry config.json's names. Per layer: `mlp_layer_types[i]` "dense" (SwiGLU of
    intermediate_size) or "sparse" (MoE), `indexer_types[i]` "full" or "shared" (layer 0 is
    "full"). The MTP layer (num_nextn_predict_layers = 1) is layer num_hidden_layers; its
    MLP type follows first_k_dense_replace. dtype: compute and parameter dtype (the router,
    its bias and the indexer's head weights stay float32, as transformers keeps them);
    kv_dtype: the dtype of KV rows, attention queries and index keys / queries.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    first_k_dense_replace: int
    num_nextn_predict_layers: int
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rope: RopeParameters
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("dtype", "kv_dtype"):
            value = getattr(self, field)
            try:
                dt = jnp.dtype(value)
            except TypeError as e:
                raise ValueError(f"DSAConfig.{field} is not a dtype: {value!r}") from e
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"DSAConfig.{field} must be a float dtype, got {value!r}")
            object.__setattr__(self, field, dt.name)
        object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        _check(self)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, dtype: Any = None, kv_dtype: Any = None
                ) -> DSAConfig:
        """The config of a Hugging Face config.json dict (module docstring: defaults and
        checks). dtype: compute and parameter dtype, default float32 when the config's
        "dtype" (or "torch_dtype") is float32, else bfloat16; kv_dtype default: dtype."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported; "
                             f"supported: {', '.join(map(repr, SUPPORTED_MODEL_TYPES))}")
        _check_hf_only(config, model_type)
        get = _getter(config, _DEFAULTS[model_type])
        n_layers = get("num_hidden_layers")
        n_routed = config.get("num_experts") or config.get("num_local_experts")
        if dtype is None:
            stored = config.get("dtype") or config.get("torch_dtype")
            dtype = "float32" if stored == "float32" else "bfloat16"
        fields = {f: get(f) for f in _DEFAULTS[model_type] if f in _FIELD_NAMES}
        fields.update(
            model_type=model_type,
            n_routed_experts=n_routed if n_routed is not None else get("n_routed_experts"),
            n_shared_experts=get("n_shared_experts") or 0,
            num_nextn_predict_layers=config.get("num_nextn_predict_layers") or 0,
            mlp_layer_types=_mlp_layer_types(config, n_layers, get("first_k_dense_replace")),
            indexer_types=_indexer_types(config, model_type, n_layers),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            rms_norm_eps=float(get("rms_norm_eps")), norm_topk_prob=bool(get("norm_topk_prob")),
            rope=_rope_parameters(config, get("max_position_embeddings")),
            dtype=dtype, kv_dtype=dtype if kv_dtype is None else kv_dtype)
        return cls(**fields)

    # ------------------------------------------------------------------ derived sizes

    @property
    def name(self) -> str:
        return f"{self.model_type}-{self.num_hidden_layers}l-h{self.hidden_size}"

    @property
    def param_dtype(self) -> str:
        """Parameter dtype (= dtype; the synthetic layers' helpers read this name)."""
        return self.dtype

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def row_width(self) -> int:
        """W, values of one latent KV row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def top_k(self) -> int:
        """Positions the indexer selects per query row (= index_topk)."""
        return self.index_topk

    @property
    def sm_scale(self) -> float:
        """The attention's softmax scale: qk_head_dim^-0.5, times yarn_get_mscale(factor,
        mscale_all_dim)^2 under YaRN with mscale_all_dim set (transformers'
        `yarn_apply_mscale`, the DeepSeek reference's softmax_scale)."""
        scale = self.qk_head_dim ** (-0.5)
        r = self.rope
        if r.rope_type != "default" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def indexer_rope_interleaved(self) -> bool:
        """The indexer's RoPE layout: interleaved pairs (GLM-5) or rotate-half (DeepSeek)."""
        return self.model_type == "glm_moe_dsa"

    @property
    def group_layers(self) -> tuple[int, ...]:
        """Layers per index group: a "full" layer and the "shared" layers after it."""
        counts: list[int] = []
        for kind in self.indexer_types:
            if kind == "full":
                counts.append(1)
            else:
                counts[-1] += 1
        return tuple(counts)

    @property
    def num_groups(self) -> int:
        return len(self.group_layers)

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """The index group of each layer (the count of "full" layers up to it, minus 1)."""
        return tuple(g for g, n in enumerate(self.group_layers) for _ in range(n))

    def layer_mlp_type(self, layer: int) -> str:
        """"dense" or "sparse" for a decoder layer, or for the MTP layer (num_hidden_layers:
        MoE from first_k_dense_replace on, as DeepSeek's decoder layers choose)."""
        if layer < self.num_hidden_layers:
            return self.mlp_layer_types[layer]
        return "sparse" if layer >= self.first_k_dense_replace else "dense"

    def layer_has_indexer(self, layer: int) -> bool:
        """Whether the layer runs its own indexer ("full"); the MTP layer has none used."""
        return layer < self.num_hidden_layers and self.indexer_types[layer] == "full"


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(DSAConfig))


def _getter(config: Mapping[str, Any], defaults: Mapping[str, Any]):
    """config[key], or the class default where the key is absent or null."""
    def get(key: str) -> Any:
        value = config.get(key)
        return defaults[key] if value is None else value
    return get


def _check_hf_only(config: Mapping[str, Any], model_type: str) -> None:
    """Checks of config.json keys that are not fields (unsupported features)."""
    get = _getter(config, _DEFAULTS[model_type])
    rules = (
        ("hidden_act", get("hidden_act") == "silu", "must be 'silu' (SwiGLU MLPs)"),
        ("tie_word_embeddings", not get("tie_word_embeddings"),
         "must be false (a separate lm_head.weight; tied embeddings are not supported)"),
        ("attention_bias", not get("attention_bias"), "must be false (no biases)"),
        ("mlp_bias", not get("mlp_bias"), "must be false (no biases)"),
        ("q_lora_rank", config.get("q_lora_rank", 1) is not None,
         "must be an int (the query low-rank path is required)"),
        ("scoring_func", config.get("scoring_func", "sigmoid") == "sigmoid",
         "must be 'sigmoid' (the MoE router's scores)"),
        ("topk_method", config.get("topk_method", "noaux_tc") == "noaux_tc",
         "must be 'noaux_tc' (group-limited choice with the score correction bias)"),
    )
    for key, ok, rule in rules:
        if not ok:
            raise ValueError(f"config.json {key}={config.get(key)!r} {rule}")
    heads = get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(f"config.json num_key_value_heads={kv_heads!r} must equal "
                         f"num_attention_heads={heads!r} (MLA expands every head's key)")


def _mlp_layer_types(config: Mapping[str, Any], n_layers: int, first_dense: int
                     ) -> tuple[str, ...]:
    kinds = config.get("mlp_layer_types")
    if kinds is None:
        n_dense = min(first_dense, n_layers)
        return ("dense",) * n_dense + ("sparse",) * (n_layers - n_dense)
    return tuple(kinds)


def _indexer_types(config: Mapping[str, Any], model_type: str, n_layers: int
                   ) -> tuple[str, ...]:
    """GLM-5's per-layer indexer modes (module docstring); DeepSeek-V3.2: all "full"."""
    if model_type == "deepseek_v32":
        return ("full",) * n_layers
    kinds = config.get("indexer_types")
    if kinds is not None:
        return tuple(kinds)
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            return tuple(pattern)
        codes = {"F": "full", "S": "shared"}
        bad = sorted(set(pattern) - set(codes))
        if bad:
            raise ValueError(f"config.json index_topk_pattern={pattern!r}: letters must be "
                             f"'F' (full) or 'S' (shared), got {bad}")
        return tuple(codes[c] for c in pattern)
    freq = max(config.get("index_topk_freq", 1), 1)
    offset = config.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(n_layers))


def _rope_parameters(config: Mapping[str, Any], max_positions: int) -> RopeParameters:
    """The rotary parameters: `rope_scaling` (legacy) or `rope_parameters`, `rope_theta`
    beside them filling in a missing theta, "type" read as "rope_type"; YaRN's
    original_max_position_embeddings defaults to max_position_embeddings, its factor to
    their ratio, beta_fast / beta_slow to 32 / 1, attention_factor to yarn_get_mscale(factor)
    (or mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set)."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"config.json rope type {rope_type!r} is not supported; supported: "
                         f"{', '.join(map(repr, _ROPE_TYPES))}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json partial_rotary_factor={partial!r} must be 1 (RoPE "
                         "over all qk_rope_head_dim dims)")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return RopeParameters(rope_type="default", theta=theta)
    original = int(params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor")
    factor = float(max_positions / original if factor is None else factor)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = (yarn_get_mscale(factor, mscale)
                                / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    return RopeParameters(
        rope_type="yarn", theta=theta, factor=factor,
        original_max_position_embeddings=original, attention_factor=float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(mscale or 0.0), mscale_all_dim=float(mscale_all_dim or 0.0),
        truncate=bool(params.get("truncate", True)))


def _check(c: DSAConfig) -> None:
    """The rules every DSAConfig keeps (ValueError naming the field and the rule)."""
    for field in _POSITIVE_INTS:
        value = getattr(c, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"DSAConfig.{field} must be a positive int, got {value!r}")
    for field in ("n_shared_experts", "first_k_dense_replace"):
        value = getattr(c, field)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"DSAConfig.{field} must be an int >= 0, got {value!r}")
    if c.num_nextn_predict_layers not in (0, 1):
        raise ValueError(f"DSAConfig.num_nextn_predict_layers must be 0 or 1 (one MTP "
                         f"layer), got {c.num_nextn_predict_layers!r}")
    if c.qk_rope_head_dim % 2 or c.index_head_dim < c.qk_rope_head_dim:
        raise ValueError(f"DSAConfig.qk_rope_head_dim={c.qk_rope_head_dim} must be even and "
                         f"<= index_head_dim={c.index_head_dim}")
    _check_layer_types(c)
    if "sparse" in c.mlp_layer_types or c.num_nextn_predict_layers:
        _check_router(c)
    if c.rope.rope_type == "yarn" and c.rope.factor <= 0:
        raise ValueError(f"DSAConfig.rope.factor must be > 0, got {c.rope.factor}")


def _check_layer_types(c: DSAConfig) -> None:
    L = c.num_hidden_layers
    for field, allowed in (("mlp_layer_types", ("dense", "sparse")),
                           ("indexer_types", ("full", "shared"))):
        kinds = getattr(c, field)
        if len(kinds) != L or any(k not in allowed for k in kinds):
            raise ValueError(f"DSAConfig.{field} must hold {L} (num_hidden_layers) entries of "
                             f"{allowed}, got {kinds!r}")
    if c.indexer_types[0] != "full":
        raise ValueError("DSAConfig.indexer_types[0] must be 'full': a 'shared' layer reuses "
                         "the top-k of an earlier full layer")


def _check_router(c: DSAConfig) -> None:
    E, G = c.n_routed_experts, c.n_group
    if E % G or E // G < 2:
        raise ValueError(f"DSAConfig.n_routed_experts={E} must be a multiple of n_group={G} "
                         "with at least 2 experts per group (a group scores its top 2)")
    if c.topk_group > G:
        raise ValueError(f"DSAConfig.topk_group={c.topk_group} must be <= n_group={G}")
    if c.num_experts_per_tok > c.topk_group * (E // G):
        raise ValueError(f"DSAConfig.num_experts_per_tok={c.num_experts_per_tok} must be <= "
                         f"topk_group * experts per group = {c.topk_group * (E // G)}")
