"""The layers of the DSA decoder (DeepSeek-V3.2, GLM-5) in the synthetic model's layer
interface (`hisparse_jax.models.synthetic_layers`: `SparseMLA`, `LightningIndexer`,
`Block`), so one decode / prefill skeleton drives both models.

* Rotary tables (`rope_inv_freq`, `rotary_cos_sin`): "default" and YaRN frequencies
  computed in float32 as transformers' `modeling_rope_utils` does; cos and sin scaled by the
  YaRN attention factor and rounded to the compute dtype, as transformers hands them to its
  layers. Two ways to apply them: `rope_interleaved` (rotary pairs (x0, x1), (x2, x3), ...;
  the output DE-INTERLEAVED: the rotated even elements, then the rotated odd ones, as
  transformers' `apply_rotary_pos_emb_interleave` returns them) and `rope_half` (pairs
  (x_i, x_{i + d/2}), rotate-half). A query and the key it meets always use one layout, so
  their dot product is that of the interleaved rotation.
* `DSAAttention`: MLA in the absorbed form over latent KV rows [kv_a_norm(latent) (kv_lora),
  roped k (qk_rope_head_dim, de-interleaved)]; its `attend` / `output` are `SparseMLA`'s.
* `DSAIndexer`: the lightning indexer (DeepSeek-V3.2: rotate-half RoPE on its first
  qk_rope_head_dim dims; GLM-5: interleaved); its `select` is `LightningIndexer`'s.
* `DSABlock`: pre-norm attention (+ indexer on a "full" layer) and MLP (`SwiGLU` or `MoE`,
  `hisparse_jax.models.dsa_moe`). `DSAMTP`: DeepSeek's multi-token-prediction layer.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.models.dsa_config import DSAConfig, RopeParameters
from hisparse_jax.models.dsa_moe import MoE, SwiGLU
from hisparse_jax.models.synthetic_layers import (
    LightningIndexer,
    RMSNorm,
    SparseMLA,
    as_dtype,
    linear,
)

# transformers builds q_a_layernorm, kv_a_layernorm and the indexer's k_norm with this eps,
# not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6

# --------------------------------------------------------------------------- rotary


@functools.cache
def rope_inv_freq(rope: RopeParameters, dim: int) -> np.ndarray:
    """float32[dim // 2] inverse frequencies of the rotary embedding over `dim` dims.

    "default": 1 / theta^(2i / dim). "yarn": 1 / (factor * theta^(2i / dim)) (interpolated)
    blended into 1 / theta^(2i / dim) (extrapolated) by 1 - ramp(i), ramp linear from 0 at
    the correction dim of beta_fast rotations to 1 at that of beta_slow (floored / ceiled
    when `truncate`), over original_max_position_embeddings. float32 arithmetic, in
    transformers' order of operations.
    """
    f32 = np.float32
    exponents = np.arange(0, dim, 2).astype(f32) / f32(dim)
    pos_freqs = (f32(rope.theta) ** exponents).astype(f32)
    if rope.rope_type == "default":
        return (f32(1.0) / pos_freqs).astype(f32)
    extrapolation = f32(1.0) / pos_freqs
    interpolation = f32(1.0) / (f32(rope.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    extrapolation_factor = (f32(1) - ramp).astype(f32)
    return (interpolation * (f32(1) - extrapolation_factor)
            + extrapolation * extrapolation_factor).astype(f32)


def rotary_cos_sin(cfg: DSAConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) float32[T, qk_rope_head_dim // 2] at positions int32[T]: the angles
    position * inv_freq, scaled by the rope's attention factor, rounded to cfg.dtype."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    scale = cfg.rope.attention_factor if cfg.rope.rope_type != "default" else 1.0
    dt = as_dtype(cfg.dtype)
    return ((jnp.cos(angles) * scale).astype(dt).astype(jnp.float32),
            (jnp.sin(angles) * scale).astype(dt).astype(jnp.float32))


def _rotate(x1: jax.Array, x2: jax.Array, cos: jax.Array, sin: jax.Array, dtype
            ) -> jax.Array:
    """concat(x1 cos - x2 sin, x2 cos + x1 sin) in float32, cos / sin [T, d/2] broadcast
    over the head dims between T and the last."""
    while cos.ndim < x1.ndim:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(dtype)


def rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved RoPE of x [T, ..., d] (pairs (x0, x1), (x2, x3), ... rotated by one
    angle each), returned de-interleaved: [rotated evens, rotated odds] (module docstring)."""
    return _rotate(x[..., 0::2], x[..., 1::2], cos, sin, x.dtype)


def rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [T, ..., d]: pairs (x_i, x_{i + d/2}), layout kept."""
    d = x.shape[-1]
    return _rotate(x[..., : d // 2], x[..., d // 2:], cos, sin, x.dtype)


# --------------------------------------------------------------------------- attention


class DSAAttention(SparseMLA):
    """MLA of DeepSeek-V3 in the absorbed decode form, over one latent KV row per token.

    Parameters (torch [out, in] weights stored transposed as [in, out] kernels): wq_a
    (q_a_proj), q_norm (q_a_layernorm), wq_b (q_b_proj, per head [nope | rope]), wkv_a
    (kv_a_proj_with_mqa, [latent | k_rope]), kv_norm (kv_a_layernorm), w_uk float[h, nope,
    kv_lora] and w_uv [h, kv_lora, v] (kv_b_proj [h * (nope + v), kv_lora] split per head:
    k_nope = W_uk latent, v = W_uv^T latent), wo (o_proj).

    Score of query t and key s: q_nope . k_nope + q_rope . k_rope = (q_nope W_uk) . latent_s
    + q_rope . k_rope_s, so the absorbed query [q_nope W_uk | q_rope] meets the stored row
    [latent | k_rope]; the attention's latent output o (the probability-weighted latents)
    gives each head's value output o W_uv. Scale: cfg.sm_scale (with YaRN's mscale^2).
    `attend` and `output` are `SparseMLA`'s (they read cfg.sm_scale, cfg.kv_lora_rank,
    w_uv, wo and cfg.dtype).
    """

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, pd = cfg.num_attention_heads, cfg.param_dtype
        self.wq_a = linear(cfg, cfg.hidden_size, cfg.q_lora_rank, rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=_LATENT_NORM_EPS, param_dtype=pd)
        self.wq_b = linear(cfg, cfg.q_lora_rank, h * cfg.qk_head_dim, rngs)
        self.wkv_a = linear(cfg, cfg.hidden_size, cfg.row_width, rngs)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=_LATENT_NORM_EPS, param_dtype=pd)
        init = nnx.initializers.normal(stddev=cfg.kv_lora_rank ** -0.5)
        self.w_uk = nnx.Param(init(rngs.params(), (h, cfg.qk_nope_head_dim, cfg.kv_lora_rank),
                                   as_dtype(pd)))
        self.w_uv = nnx.Param(init(rngs.params(), (h, cfg.kv_lora_rank, cfg.v_head_dim),
                                   as_dtype(pd)))
        self.wo = linear(cfg, h * cfg.v_head_dim, cfg.hidden_size, rngs)

    @property
    def sm_scale(self) -> float:
        return self.cfg.sm_scale

    @property
    def v_width(self) -> int:
        """Values of a row the attention reads as the value: the latent (kv_lora_rank)."""
        return self.cfg.kv_lora_rank

    def project(self, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, H] (the normed hidden state), positions int32[T] -> (q_resid [T, q_lora]
        (the indexer's query input), absorbed q [T, h, W], row [T, W]); q and row in
        kv_dtype, W = kv_lora_rank + qk_rope_head_dim, rope dims de-interleaved."""
        c = self.cfg
        kv_dt = as_dtype(c.kv_dtype)
        cos, sin = rotary_cos_sin(c, positions)
        q_resid = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_resid).reshape(x.shape[0], c.num_attention_heads, c.qk_head_dim)
        q_rope = rope_interleaved(q[..., c.qk_nope_head_dim:], cos, sin)
        q_latent = jnp.einsum("thd,hdc->thc", q[..., : c.qk_nope_head_dim].astype(jnp.float32),
                              self.w_uk[...].astype(jnp.float32))
        q_full = jnp.concatenate([q_latent, q_rope.astype(jnp.float32)], -1).astype(kv_dt)
        return q_resid, q_full, self.kv_row(x, cos, sin)

    def kv_row(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """The latent KV rows [T, W] (kv_dtype) of x [T, H]: [kv_norm(latent) | roped k]."""
        c = self.cfg
        kv = self.wkv_a(x)
        latent = self.kv_norm(kv[..., : c.kv_lora_rank])
        k_rope = rope_interleaved(kv[..., c.kv_lora_rank:], cos, sin)
        return jnp.concatenate([latent, k_rope], -1).astype(as_dtype(c.kv_dtype))

    def self_attention(self, x: jax.Array) -> jax.Array:
        """Each row attending to its own KV row alone, x [T, H] -> [T, H]: the softmax over
        one key is 1, so every head's latent output is the row's latent (no query, no
        position)."""
        c = self.cfg
        latent = self.kv_norm(self.wkv_a(x)[..., : c.kv_lora_rank]).astype(as_dtype(c.kv_dtype))
        latent = jnp.broadcast_to(latent[:, None], (x.shape[0], c.num_attention_heads,
                                                    c.kv_lora_rank))
        return self.output(latent)


# --------------------------------------------------------------------------- indexer


class DSAIndexer(LightningIndexer):
    """The lightning indexer of DeepSeek-V3.2 / GLM-5: scores s <= t by
    sum_h w[t, h] relu(q[t, h] . k[s]) and keeps the top index_topk.

    Parameters: wq (wq_b: q_resid -> index_n_heads * index_head_dim), wk (hidden ->
    index_head_dim), k_norm (LayerNorm with bias, eps 1e-6), w_heads (weights_proj, float32
    parameters applied to the float32 hidden state, as transformers keeps it). RoPE on the
    first qk_rope_head_dim dims of q and k: rotate-half (DeepSeek-V3.2) or interleaved
    (GLM-5), with the attention's rotary table. `select` is `LightningIndexer.select`
    (cfg.top_k = index_topk).
    """

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, n = cfg.index_head_dim, cfg.index_n_heads
        self.wq = linear(cfg, cfg.q_lora_rank, n * d, rngs)
        self.wk = linear(cfg, cfg.hidden_size, d, rngs)
        self.k_norm = nnx.LayerNorm(d, epsilon=_LATENT_NORM_EPS, dtype=as_dtype(cfg.dtype),
                                    param_dtype=as_dtype(cfg.param_dtype), rngs=rngs)
        self.w_heads = nnx.Linear(cfg.hidden_size, n, use_bias=False, dtype=jnp.float32,
                                  param_dtype=jnp.float32,
                                  precision=jax.lax.Precision.HIGHEST, rngs=rngs)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the first qk_rope_head_dim dims of x [T, ..., index_head_dim]."""
        r = self.cfg.qk_rope_head_dim
        cos, sin = rotary_cos_sin(self.cfg, positions)
        apply = rope_interleaved if self.cfg.indexer_rope_interleaved else rope_half
        return jnp.concatenate([apply(x[..., :r], cos, sin), x[..., r:]], -1)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Index keys [T, index_head_dim] (kv_dtype) of normed hidden states x [T, H]."""
        k = self._rope(self.k_norm(self.wk(x)), positions)
        return k.astype(as_dtype(self.cfg.kv_dtype))

    def queries(self, q_resid: jax.Array, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """Index queries [T, index_n_heads, index_head_dim] (kv_dtype) from q_resid
        [T, q_lora], and head weights float32[T, index_n_heads] from x [T, H], including
        index_n_heads^-0.5 and the score scale index_head_dim^-0.5."""
        c = self.cfg
        q = self.wq(q_resid).reshape(q_resid.shape[0], c.index_n_heads, c.index_head_dim)
        q = self._rope(q, positions).astype(as_dtype(c.kv_dtype))
        w = self.w_heads(x.astype(jnp.float32)) * (c.index_n_heads ** -0.5
                                                   * c.index_head_dim ** -0.5)
        return q, w


# --------------------------------------------------------------------------- blocks


def _norm(cfg: DSAConfig) -> RMSNorm:
    return RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.param_dtype)


class DSABlock(nnx.Module):
    """Decoder layer `layer`: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)).

    Attributes: attn_norm, attn (`DSAAttention`), indexer (`DSAIndexer` on a "full" layer,
    None on a "shared" one and on the MTP layer), mlp_norm, mlp (`MoE` on a "sparse" layer,
    `SwiGLU` of intermediate_size on a "dense" one; `DSAConfig.layer_mlp_type`).
    """

    def __init__(self, cfg: DSAConfig, layer: int, *, rngs: nnx.Rngs):
        if not 0 <= layer <= cfg.num_hidden_layers:
            raise ValueError(f"DSABlock layer={layer} must be in [0, num_hidden_layers="
                             f"{cfg.num_hidden_layers}] (the last: the MTP layer)")
        self.layer = layer
        self.attn_norm = _norm(cfg)
        self.attn = DSAAttention(cfg, rngs=rngs)
        self.indexer = DSAIndexer(cfg, rngs=rngs) if cfg.layer_has_indexer(layer) else None
        self.mlp_norm = _norm(cfg)
        self.mlp = (MoE(cfg, rngs=rngs) if cfg.layer_mlp_type(layer) == "sparse"
                    else SwiGLU(cfg, cfg.intermediate_size, rngs=rngs))


class DSAMTP(nnx.Module):
    """DeepSeek's multi-token-prediction layer (checkpoint layer num_hidden_layers): from the
    last hidden state h of position t (before the final norm) and the token at t + 1,

        h' = block(eh_proj([enorm(embed(token)); hnorm(h)])),  logits = head(norm(h'))

    predicts the token at t + 2 (embedding first in the concatenation, as DeepSeek's
    released eh_proj weights expect). It has its own embed, head and norm (the checkpoint's
    `embed_tokens`, `shared_head.head`, `shared_head.norm`). Fed h' and its own token again,
    it drafts further.

    Draft-only approximation: the engine keeps no KV cache for this layer, so its attention
    attends to the current row alone (`DSAAttention.self_attention`), where the released
    layer attends over its own cache of earlier positions. Drafts never change what the
    engine outputs (a draft is kept only where the model's own token agrees), only how many
    are accepted.
    """

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        H, pd = cfg.hidden_size, cfg.param_dtype
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, H, dtype=as_dtype(cfg.dtype),
                               param_dtype=as_dtype(pd), rngs=rngs)
        self.enorm = _norm(cfg)
        self.hnorm = _norm(cfg)
        self.eh_proj = linear(cfg, 2 * H, H, rngs)
        self.block = DSABlock(cfg, cfg.num_hidden_layers, rngs=rngs)
        self.norm = _norm(cfg)
        self.head = linear(cfg, H, cfg.vocab_size, rngs)

    def __call__(self, hidden: jax.Array, tokens: jax.Array) -> jax.Array:
        """hidden [N, H] (position t's last hidden state), tokens int32[N] (the tokens at
        t + 1) -> the layer's hidden state [N, H] (before its norm)."""
        x = jnp.concatenate([self.enorm(self.embed(tokens)),
                             self.hnorm(hidden.astype(as_dtype(self.cfg.dtype)))], -1)
        x = self.eh_proj(x)
        b = self.block
        x = x + b.attn.self_attention(b.attn_norm(x))
        return x + b.mlp(b.mlp_norm(x))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32[N, V] next-token logits of the layer's hidden state [N, H]."""
        return self.head(self.norm(hidden)).astype(jnp.float32)
