"""The synthetic model: a DeepSeek-V3.2-style decoder served through HiSparse, the model the
tests and benchmarks run (`hisparse_jax.models.ServedModel`; its layers are in
`synthetic_layers.py`, its decode / prefill steps in `decoder.py`).

`Transformer`: embedding, `num_layers` blocks of (indexer +) sparse MLA + SwiGLU MLP,
RMSNorm, RoPE. Layers are grouped into index groups of `index_group_size` layers: the
group's first layer owns the indexer and looks the group's rows up in the KV-cache handle
(one hot state per group); the others reuse its rows (DeepSeek-V3.2: groups of one layer).

Caches are data: `DecodeCache` (the KV-cache handle `hisparse_jax.cache.HiSparseKVCache`
and the per-group index-key caches `[S, max_model_len, index_dim]`) is passed into
`Transformer.decode` / `Transformer.prefill` and returned, never kept in module variables,
so a step jits with the caches donated (`nnx.split` / `nnx.merge` at the jit boundary, see
`hisparse_jax.engine.step_builder`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.models.decoder import SparseDecoder
from hisparse_jax.models.protocol import ModelSpec
from hisparse_jax.models.synthetic_layers import (
    Block,
    ModelConfig,
    MTPHead,
    RMSNorm,
    as_dtype,
    get_config,
    linear,
)


class Transformer(SparseDecoder):
    """Decoder with sparse MLA layers; `decode`, `prefill` and `prefill_chunk` (the
    `SparseDecoder` skeleton) take and return the caches."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=as_dtype(cfg.dtype),
                               param_dtype=as_dtype(cfg.param_dtype), rngs=rngs)
        self.blocks = nnx.List([
            Block(cfg, has_indexer=(i % cfg.index_group_size == 0), rngs=rngs)
            for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.lm_head = linear(cfg, cfg.hidden, cfg.vocab_size, rngs)
        # Built last: the main model's parameters do not depend on whether it has one.
        self.mtp = MTPHead(cfg, rngs=rngs) if cfg.mtp_layers else None

    @property
    def spec(self) -> ModelSpec:
        """The static facts the engine reads (`hisparse_jax.models.ModelSpec`)."""
        return model_spec(self.cfg)

    @staticmethod
    def tensor_parallel_dim(path: str, shape: tuple[int, ...]) -> int | None:
        """The dim a mesh's model axis splits: dense kernels [in, out] and the embedding
        [vocab, hidden] their last, the absorbed up-projections w_uk / w_uv [heads, ., .]
        their first (heads); norms and everything else are replicated (None)."""
        if len(shape) == 2 and ("kernel" in path or "embedding" in path):
            return 1
        if len(shape) == 3 and ("w_uk" in path or "w_uv" in path):
            return 0
        return None

    @property
    def index_dim(self) -> int:
        return self.cfg.index_dim

    def draft_step(self, hidden: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One application of the MTP module (`MTPHead`): hidden [N, hidden] and the next
        tokens int32[N] -> (its hidden state [N, hidden], logits float32[N, V])."""
        hidden = self.mtp(hidden, self.embed(tokens))
        return hidden, self.lm_head(self.mtp.norm(hidden)).astype(jnp.float32)


@functools.cache
def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The `ModelSpec` of a config: equal index groups of `index_group_size` layers, an MTP
    draft when it has `mtp_layers`."""
    return ModelSpec.equal_groups(
        name=cfg.name, vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
        index_group_size=cfg.index_group_size, top_k=cfg.top_k, kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.rope_dim, num_heads=cfg.num_heads, sm_scale=cfg.sm_scale,
        kv_dtype=cfg.kv_dtype, has_draft=bool(cfg.mtp_layers))


def init_model(cfg: ModelConfig | str, *, seed: int = 0) -> Transformer:
    """A randomly initialised `Transformer` (config object or `CONFIGS` name)."""
    if isinstance(cfg, str):
        cfg = get_config(cfg)
    # "rbg" keys: the initialiser compiles ~2x faster than with threefry on a CPU.
    return _initializer(cfg)(jax.random.key(seed, impl="rbg"))


@functools.cache
def _initializer(cfg: ModelConfig):
    """One compiled initialiser per config (the seed is traced): one compile instead of one
    per parameter shape, and none for a second model of the same config."""
    return nnx.jit(lambda key: Transformer(cfg, rngs=nnx.Rngs(key)))
