"""The models the benchmarks serve, by name: the synthetic configs (`hisparse_jax.models.
CONFIGS`) and slices of the real architectures at their real dimensions with random weights.

A slice is a real checkpoint's `config.json` (DeepSeek-V3.2: `DEEPSEEK_V32`) cut to its first
layers (`--num-layers`, default 4: the three dense layers and the first mixture-of-experts
layer), built as `hisparse_jax.models.DSAModel` with random bfloat16 weights on the device
(no checkpoint is read: 671B parameters do not fit one GPU, four layers do). Its attention,
indexer and MoE are the real ones; only the weights and the layer count differ.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from hisparse_jax import models

# DeepSeek-V3.2's config.json (the released model's sizes; 61 layers, the first 3 dense).
DEEPSEEK_V32: dict[str, Any] = {
    "model_type": "deepseek_v32", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "index_topk": 2048,
    "index_head_dim": 128, "index_n_heads": 64, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}

# DeepSeek-V3.2's architecture at sizes a CPU runs in seconds (smoke tests of the benchmarks).
DEEPSEEK_V32_MINI: dict[str, Any] = dict(
    DEEPSEEK_V32, vocab_size=512, hidden_size=64, intermediate_size=128,
    moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, index_topk=16,
    index_head_dim=32, index_n_heads=4, first_k_dense_replace=1, dtype="float32")

# name -> (config.json, default layer count)
SLICES: dict[str, tuple[dict[str, Any], int]] = {"dsv32-real": (DEEPSEEK_V32, 4),
                                                 "dsv32-mini": (DEEPSEEK_V32_MINI, 2)}

NAMES = sorted(models.CONFIGS) + sorted(SLICES)


def build(name: str, *, num_layers: int | None = None, index_group_size: int | None = None,
          seed: int = 0) -> Any:
    """The served model `name` (a `ServedModel`: read its `spec`). `num_layers` deepens or
    cuts it; `index_group_size` regroups a synthetic config's layers (slices keep their
    checkpoint's grouping: ValueError). ValueError for an unknown name or a bad size."""
    if name in models.CONFIGS:
        overrides = {k: v for k, v in (("num_layers", num_layers),
                                       ("index_group_size", index_group_size)) if v is not None}
        return models.init_model(models.get_config(name, **overrides), seed=seed)
    if name not in SLICES:
        raise ValueError(f"unknown model {name!r}; known: {NAMES}")
    if index_group_size is not None:
        raise ValueError(f"--index-group-size applies to the synthetic configs, not {name!r} "
                         "(its index groups are its checkpoint's)")
    hf, layers = SLICES[name]
    hf = dict(hf, num_hidden_layers=num_layers or layers)
    cfg = models.DSAConfig.from_hf(hf)
    return _initializer(cfg)(jax.random.key(seed, impl="rbg"))


def _initializer(cfg: Any):
    """Random weights made on the device in one compiled call (none pass through the host)."""
    return nnx.jit(lambda key: models.DSAModel(cfg, rngs=nnx.Rngs(key)))
