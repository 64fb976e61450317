"""The layers of the synthetic model (`hisparse_jax.models.synthetic.Transformer`): its
config and DeepSeek-V3.2-style building blocks.

* `ModelConfig` / `CONFIGS` / `get_config`: static sizes of the decoder (named configs).
* `LightningIndexer`: index queries from the query low-rank path, index keys from the hidden
  state (their own cache, kept on the device), per-head ReLU scores weighted per head, exact
  top-k per query row (-1 where the context is shorter than `top_k`).
* `SparseMLA`: absorbed MLA (one latent KV row of `kv_lora_rank + rope_dim` per token, e.g.
  512 + 64 = 576, shared by `num_heads` query heads), attention through `sparse_mla_decode`
  over one flat device row per selected token.
* `MLP` (SwiGLU), `RMSNorm`, `rope`, `Block` (indexer + sparse MLA + MLP), `MTPHead` (the
  multi-token-prediction draft module).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.ops import sparse_mla_decode

# --------------------------------------------------------------------------- configs


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static sizes of the decoder (hashable: usable as a static jit argument).

    Row width W of the latent KV cache = kv_lora_rank + rope_dim; the attention score scale
    is 1 / sqrt(qk_nope_dim + rope_dim) as in DeepSeek-V3.2.
    """

    name: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    rope_dim: int
    v_head_dim: int
    mlp_hidden: int
    index_heads: int
    index_dim: int
    top_k: int
    index_group_size: int = 1
    mtp_layers: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    param_dtype: Any = "float32"
    dtype: Any = "float32"
    kv_dtype: Any = "bfloat16"

    def __post_init__(self) -> None:
        if self.num_layers % self.index_group_size:
            raise ValueError(f"num_layers={self.num_layers} must be a multiple of "
                             f"index_group_size={self.index_group_size}")
        if self.rope_dim % 2 or self.index_dim < self.rope_dim:
            raise ValueError("rope_dim must be even and <= index_dim")
        if self.mtp_layers not in (0, 1):
            raise ValueError(f"mtp_layers must be 0 or 1 (one MTP draft module), got "
                             f"{self.mtp_layers!r}")

    @property
    def row_width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_groups(self) -> int:
        return self.num_layers // self.index_group_size

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope_dim + self.rope_dim)


CONFIGS: dict[str, ModelConfig] = {
    # Runs on a CPU in seconds.
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden=128, num_layers=2, num_heads=4, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_dim=32, rope_dim=32, v_head_dim=32, mlp_hidden=256,
        index_heads=4, index_dim=32, top_k=16),
    # `tiny` with the DeepSeek-V3.2 row shape (kv_lora 512 + rope 64 = 576-wide rows): the
    # smallest model whose rows the "fp8_ds_mla" KV row format can store (`docs/kv_format.md`).
    "tiny576": ModelConfig(
        name="tiny576", vocab_size=512, hidden=128, num_layers=2, num_heads=4, q_lora_rank=64,
        kv_lora_rank=512, qk_nope_dim=32, rope_dim=64, v_head_dim=32, mlp_hidden=256,
        index_heads=4, index_dim=64, top_k=16),
    # The real DeepSeek-V3.2 attention dimensions (7168 hidden, 128 heads, q_lora 1536,
    # kv_lora 512 + rope 64 = 576-wide rows, indexer 64 heads x 128, top_k 2048), a dense
    # SwiGLU MLP and 2 layers: a GPU-scale check of the attention path, not the full model.
    "dsv32-2l": ModelConfig(
        name="dsv32-2l", vocab_size=129280, hidden=7168, num_layers=2, num_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, rope_dim=64, v_head_dim=128,
        mlp_hidden=18432, index_heads=64, index_dim=128, top_k=2048,
        param_dtype="bfloat16", dtype="bfloat16"),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """A named config (`CONFIGS`), with fields replaced by `overrides`."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; known: {sorted(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides)


# --------------------------------------------------------------------------- building blocks


def as_dtype(x: Any) -> jnp.dtype:
    """`x` (a dtype or its name) as a numpy dtype."""
    return jnp.dtype(x)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half) over the last dim of x [..., T, (heads,) d]; positions
    int32 broadcastable to x's token dim. Computed in float32, returned in x's dtype."""
    d = x.shape[-1]
    freqs = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    angles = positions.astype(jnp.float32)[..., None] * freqs            # [T, d/2]
    while angles.ndim < x.ndim:
        angles = angles[..., None, :]  # broadcast over head dims
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype: Any):
        self.scale = nnx.Param(jnp.ones((dim,), as_dtype(param_dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free dense layer in the config's compute and parameter dtypes."""
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=as_dtype(cfg.dtype),
                      param_dtype=as_dtype(cfg.param_dtype), rngs=rngs)


class LightningIndexer(nnx.Module):
    """DeepSeek-V3.2 lightning indexer: picks the top_k context positions of each query row.

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) for s <= pos[t]; the top_k positions by
    score (ties: lower position first), -1 where fewer than top_k positions exist.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wq = linear(cfg, cfg.q_lora_rank, cfg.index_heads * cfg.index_dim, rngs)
        self.wk = linear(cfg, cfg.hidden, cfg.index_dim, rngs)
        self.k_norm = nnx.LayerNorm(cfg.index_dim, dtype=as_dtype(cfg.dtype),
                                    param_dtype=as_dtype(cfg.param_dtype), rngs=rngs)
        self.w_heads = linear(cfg, cfg.hidden, cfg.index_heads, rngs)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Index keys [T, index_dim] (kv_dtype) of hidden states x [T, hidden]."""
        c = self.cfg
        k = self.k_norm(self.wk(x))
        k = jnp.concatenate([rope(k[..., : c.rope_dim], positions, c.rope_theta),
                             k[..., c.rope_dim:]], -1)
        return k.astype(as_dtype(c.kv_dtype))

    def queries(self, q_lora: jax.Array, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """Index queries [T, index_heads, index_dim] and head weights float32[T, index_heads]."""
        c = self.cfg
        q = self.wq(q_lora).reshape(*q_lora.shape[:-1], c.index_heads, c.index_dim)
        q = jnp.concatenate([rope(q[..., : c.rope_dim], positions, c.rope_theta),
                             q[..., c.rope_dim:]], -1).astype(as_dtype(c.kv_dtype))
        w = self.w_heads(x).astype(jnp.float32) * (c.index_heads ** -0.5 * c.index_dim ** -0.5)
        return q, w

    def select(self, q: jax.Array, w: jax.Array, keys: jax.Array, positions: jax.Array
               ) -> jax.Array:
        """Top-k positions int32[T, top_k] per query row.

        q [T, Hi, d], w [T, Hi]; keys [T, L, d] (one key row per query row: decode) or [L, d]
        (shared: prefill); positions int32[T]: keys at s > positions[t] are not candidates.
        """
        hi = jax.lax.Precision.HIGHEST
        qf, kf = q.astype(jnp.float32), keys.astype(jnp.float32)
        if keys.ndim == 3:
            logits = jnp.einsum("thd,tsd->ths", qf, kf, precision=hi)
        else:
            logits = jnp.einsum("thd,sd->ths", qf, kf, precision=hi)
        scores = jnp.einsum("ths,th->ts", jax.nn.relu(logits), w, precision=hi)
        length = scores.shape[-1]
        causal = jnp.arange(length)[None, :] <= positions[:, None]
        scores = jnp.where(causal, scores, -jnp.inf)
        k = self.cfg.top_k
        if length < k:
            scores = jnp.pad(scores, ((0, 0), (0, k - length)), constant_values=-jnp.inf)
        top_scores, top_idx = jax.lax.top_k(scores, k)
        return jnp.where(jnp.isfinite(top_scores), top_idx, -1).astype(jnp.int32)


class SparseMLA(nnx.Module):
    """Absorbed multi-head latent attention reading W = kv_lora + rope wide latent rows."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.num_heads
        self.wq_a = linear(cfg, cfg.hidden, cfg.q_lora_rank, rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.wq_b = linear(cfg, cfg.q_lora_rank, h * (cfg.qk_nope_dim + cfg.rope_dim), rngs)
        self.wkv_a = linear(cfg, cfg.hidden, cfg.kv_lora_rank + cfg.rope_dim, rngs)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        init = nnx.initializers.normal(stddev=1.0)
        pd = as_dtype(cfg.param_dtype)
        # Absorbed up-projections: W_uk folds into the query, W_uv into the output.
        self.w_uk = nnx.Param(init(rngs.params(), (h, cfg.qk_nope_dim, cfg.kv_lora_rank), pd)
                              * (cfg.kv_lora_rank ** -0.5))
        self.w_uv = nnx.Param(init(rngs.params(), (h, cfg.kv_lora_rank, cfg.v_head_dim), pd)
                              * (cfg.kv_lora_rank ** -0.5))
        self.wo = linear(cfg, h * cfg.v_head_dim, cfg.hidden, rngs)

    def project(self, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, hidden] -> (q_lora [T, q_lora_rank], absorbed q [T, h, W], row [T, W]);
        q and row in kv_dtype (the attention kernel reads both in that dtype)."""
        c = self.cfg
        kv_dt = as_dtype(c.kv_dtype)
        q_lora = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lora).reshape(x.shape[0], c.num_heads, c.qk_nope_dim + c.rope_dim)
        q_nope, q_rope = q[..., : c.qk_nope_dim], q[..., c.qk_nope_dim:]
        q_rope = rope(q_rope, positions, c.rope_theta)
        q_latent = jnp.einsum("thd,hdc->thc", q_nope.astype(jnp.float32),
                              self.w_uk[...].astype(jnp.float32))
        q_full = jnp.concatenate([q_latent, q_rope.astype(jnp.float32)], -1).astype(kv_dt)
        kv = self.wkv_a(x)
        latent = self.kv_norm(kv[..., : c.kv_lora_rank])
        k_rope = rope(kv[..., c.kv_lora_rank:], positions, c.rope_theta)
        row = jnp.concatenate([latent, k_rope], -1).astype(kv_dt)
        return q_lora, q_full, row

    def attend(self, q: jax.Array, kv_rows: jax.Array, attention_rows: jax.Array, *,
               backend: str | None = None, kv_format: str = "bf16"
               ) -> tuple[jax.Array, jax.Array]:
        """Sparse attention over `attention_rows` (int32[T, K], -1 masked) of stored kv_rows
        ([num_blocks, B, Ws] or [R, Ws] in `kv_format`, `docs/kv_format.md`: W values of
        kv_dtype, or uint8[656] rows dequantized inside attention). Returns (output
        [T, hidden], latent out [T, h, kv_lora])."""
        c = self.cfg
        latent, _ = sparse_mla_decode(q, kv_rows, attention_rows, sm_scale=c.sm_scale,
                                      v_width=c.kv_lora_rank, kv_format=kv_format,
                                      backend=backend)
        return self.output(latent), latent

    def output(self, latent: jax.Array) -> jax.Array:
        """The latent attention output [T, h, kv_lora] -> the layer's output [T, hidden]
        (W_uv, then the output projection)."""
        c = self.cfg
        o = jnp.einsum("thc,hcv->thv", latent.astype(jnp.float32),
                       self.w_uv[...].astype(jnp.float32)).astype(as_dtype(c.dtype))
        return self.wo(o.reshape(o.shape[0], -1))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = linear(cfg, cfg.hidden, cfg.mlp_hidden, rngs)
        self.up = linear(cfg, cfg.hidden, cfg.mlp_hidden, rngs)
        self.down = linear(cfg, cfg.mlp_hidden, cfg.hidden, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, has_indexer: bool, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.attn = SparseMLA(cfg, rngs=rngs)
        self.indexer = LightningIndexer(cfg, rngs=rngs) if has_indexer else None
        self.mlp_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.mlp = MLP(cfg, rngs=rngs)


class MTPHead(nnx.Module):
    """A multi-token-prediction draft module in the DeepSeek-V3 style: from the last hidden
    state h of position t (before the final norm) and the embedding of the token at t + 1, it
    predicts the token at t + 2 through the model's own output head:

        h' = block(proj([hnorm(h); enorm(embed(token))])),  logits = lm_head(norm(h'))

    Applied k times (its h' feeding the next application) it drafts k tokens. DeepSeek-V3's
    module block also has an attention layer over its own KV cache; this one's block is the
    SwiGLU MLP only (residual, pre-norm), so drafting reads no KV rows and needs no cache.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = cfg.param_dtype
        self.hnorm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=pd)
        self.enorm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=pd)
        self.proj = linear(cfg, 2 * cfg.hidden, cfg.hidden, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=pd)
        self.mlp = MLP(cfg, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=pd)

    def __call__(self, hidden: jax.Array, token_embedding: jax.Array) -> jax.Array:
        """The module's hidden state [N, hidden] (feed it back for the next draft)."""
        x = self.proj(jnp.concatenate([self.hnorm(hidden), self.enorm(token_embedding)], -1))
        return x + self.mlp(self.mlp_norm(x))
