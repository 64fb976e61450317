"""Flax NNX modules for DeepSeek-V3.2-style sparse MLA served through HiSparse.

* `LightningIndexer`: index queries from the query low-rank path, index keys from the hidden
  state (their own cache, kept on the device), per-head ReLU scores weighted per head, exact
  top-k per query row (-1 where the context is shorter than `top_k`).
* `SparseMLA`: absorbed MLA (one latent KV row of `kv_lora_rank + rope_dim` per token, e.g.
  512 + 64 = 576, shared by `num_heads` query heads), attention through `sparse_mla_decode`
  over one flat device row per selected token.
* `Transformer`: embedding, `num_layers` blocks of (indexer +) sparse MLA + SwiGLU MLP,
  RMSNorm, RoPE. Layers are grouped into index groups of `index_group_size` layers: the
  group's first layer owns the indexer and looks the group's rows up in the KV-cache handle
  (one hot state per group); the others reuse its rows (DeepSeek-V3.2: groups of one layer).

Caches are data: `DecodeCache` (the KV-cache handle `hisparse_jax.cache.HiSparseKVCache`
and the per-group index-key caches `[S, max_model_len, index_dim]`) is passed into
`Transformer.decode` / `Transformer.prefill` and returned, never kept in module variables,
so a step jits with the caches donated (`nnx.split` / `nnx.merge` at the jit boundary, see
`hisparse_jax.engine.runner`).

One decode path for every residency: each layer writes its new row through the handle
(`HiSparseKVCache.write`), the leader layer of each index group picks the top-k (its
indexer, or `DecodeBatch.topk` from an external source) and asks the handle for the rows to
attend (`HiSparseKVCache.lookup`: through the resident table, or through the hot region with
misses copied from the pinned host pool, as the handle's residency type says), and every
layer of the group attends over those rows (`sparse_mla_decode`). The write-back of rows to
the host pool is done page by page by the host tier's spills (`host_tier.TransferEngine`),
once a page is sealed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax.cache import (
    AllResident,
    CacheBatch,
    HiSparseKVCache,
    PendingLookup,
    layers_per_pool_array,
)
from hisparse_jax.ops import sparse_mla_decode, stage_prefill_rows

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


# --------------------------------------------------------------------------- cache pytrees


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCache:
    """Device-side cache state of the model (a pytree; donate it at the jit boundary).

    Attributes:
      kv: the KV-cache handle: per-layer latent KV caches [num_blocks, B, Ws] (rows stored in
        its `kv_format`) and per-group hot states, with the residency that serves lookups.
      index_keys: per index group, the indexer key cache [S, max_model_len, index_dim]
        (kv_dtype), indexed by state row and position ([1, 1, index_dim] placeholders when the
        top-k comes from an external source).
    """

    kv: HiSparseKVCache
    index_keys: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step's inputs for N batch rows (seats).

    Attributes:
      tokens: int32[N], the input token of each batch row (anything on padding rows).
      kv: the handle's per-step inputs (state rows, -1 padding; positions written this step;
        the rows' block tables; the pinned host pools).
      topk: optional int32[G, N, top_k] positions per index group from an external source
        (`hisparse_jax.topk_sources`); when given, the indexer (and its key cache) is skipped.
    """

    tokens: jax.Array
    kv: CacheBatch
    topk: jax.Array | None = None


# --------------------------------------------------------------------------- building blocks


def _dt(x: Any) -> jnp.dtype:
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
        self.scale = nnx.Param(jnp.ones((dim,), _dt(param_dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=_dt(cfg.dtype),
                      param_dtype=_dt(cfg.param_dtype), rngs=rngs)


class LightningIndexer(nnx.Module):
    """DeepSeek-V3.2 lightning indexer: picks the top_k context positions of each query row.

    score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) for s <= pos[t]; the top_k positions by
    score (ties: lower position first), -1 where fewer than top_k positions exist.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wq = _linear(cfg, cfg.q_lora_rank, cfg.index_heads * cfg.index_dim, rngs)
        self.wk = _linear(cfg, cfg.hidden, cfg.index_dim, rngs)
        self.k_norm = nnx.LayerNorm(cfg.index_dim, dtype=_dt(cfg.dtype),
                                    param_dtype=_dt(cfg.param_dtype), rngs=rngs)
        self.w_heads = _linear(cfg, cfg.hidden, cfg.index_heads, rngs)

    def keys(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Index keys [T, index_dim] (kv_dtype) of hidden states x [T, hidden]."""
        c = self.cfg
        k = self.k_norm(self.wk(x))
        k = jnp.concatenate([rope(k[..., : c.rope_dim], positions, c.rope_theta),
                             k[..., c.rope_dim:]], -1)
        return k.astype(_dt(c.kv_dtype))

    def queries(self, q_lora: jax.Array, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """Index queries [T, index_heads, index_dim] and head weights float32[T, index_heads]."""
        c = self.cfg
        q = self.wq(q_lora).reshape(*q_lora.shape[:-1], c.index_heads, c.index_dim)
        q = jnp.concatenate([rope(q[..., : c.rope_dim], positions, c.rope_theta),
                             q[..., c.rope_dim:]], -1).astype(_dt(c.kv_dtype))
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
        self.wq_a = _linear(cfg, cfg.hidden, cfg.q_lora_rank, rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.wq_b = _linear(cfg, cfg.q_lora_rank, h * (cfg.qk_nope_dim + cfg.rope_dim), rngs)
        self.wkv_a = _linear(cfg, cfg.hidden, cfg.kv_lora_rank + cfg.rope_dim, rngs)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        init = nnx.initializers.normal(stddev=1.0)
        pd = _dt(cfg.param_dtype)
        # Absorbed up-projections: W_uk folds into the query, W_uv into the output.
        self.w_uk = nnx.Param(init(rngs.params(), (h, cfg.qk_nope_dim, cfg.kv_lora_rank), pd)
                              * (cfg.kv_lora_rank ** -0.5))
        self.w_uv = nnx.Param(init(rngs.params(), (h, cfg.kv_lora_rank, cfg.v_head_dim), pd)
                              * (cfg.kv_lora_rank ** -0.5))
        self.wo = _linear(cfg, h * cfg.v_head_dim, cfg.hidden, rngs)

    def project(self, x: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, hidden] -> (q_lora [T, q_lora_rank], absorbed q [T, h, W], row [T, W]);
        q and row in kv_dtype (the attention kernel reads both in that dtype)."""
        c = self.cfg
        kv_dt = _dt(c.kv_dtype)
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
                       self.w_uv[...].astype(jnp.float32)).astype(_dt(c.dtype))
        return self.wo(o.reshape(o.shape[0], -1))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = _linear(cfg, cfg.hidden, cfg.mlp_hidden, rngs)
        self.up = _linear(cfg, cfg.hidden, cfg.mlp_hidden, rngs)
        self.down = _linear(cfg, cfg.mlp_hidden, cfg.hidden, rngs)

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
        self.proj = _linear(cfg, 2 * cfg.hidden, cfg.hidden, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=pd)
        self.mlp = MLP(cfg, rngs=rngs)
        self.norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=pd)

    def __call__(self, hidden: jax.Array, token_embedding: jax.Array) -> jax.Array:
        """The module's hidden state [N, hidden] (feed it back for the next draft)."""
        x = self.proj(jnp.concatenate([self.hnorm(hidden), self.enorm(token_embedding)], -1))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """Decoder with sparse MLA layers; `decode`, `prefill` and `prefill_chunk` take and
    return the caches."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, dtype=_dt(cfg.dtype),
                               param_dtype=_dt(cfg.param_dtype), rngs=rngs)
        self.blocks = nnx.List([
            Block(cfg, has_indexer=(i % cfg.index_group_size == 0), rngs=rngs)
            for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden, eps=cfg.norm_eps, param_dtype=cfg.param_dtype)
        self.lm_head = _linear(cfg, cfg.hidden, cfg.vocab_size, rngs)
        # Built last: the main model's parameters do not depend on whether it has one.
        self.mtp = MTPHead(cfg, rngs=rngs) if cfg.mtp_layers else None

    def _finish(self, x: jax.Array, block: Block, attn_out: jax.Array) -> jax.Array:
        x = x + attn_out
        return x + block.mlp(block.mlp_norm(x))

    def logits(self, x: jax.Array) -> jax.Array:
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)

    def draft(self, hidden: jax.Array, tokens: jax.Array, num_tokens: int) -> jax.Array:
        """Greedy drafts int32[N, num_tokens] of the MTP module (`MTPHead`): hidden [N, hidden]
        is the last hidden state of position t (`decode`'s aux "hidden"), tokens int32[N] the
        token at t + 1; draft i is the module's guess for position t + 2 + i."""
        if self.mtp is None:
            raise ValueError(f"model {self.cfg.name!r} has no MTP module (build it with "
                             "mtp_layers=1 to draft with it)")
        drafts = []
        for _ in range(num_tokens):
            hidden = self.mtp(hidden, self.embed(tokens))
            logits = self.lm_head(self.mtp.norm(hidden)).astype(jnp.float32)
            tokens = jnp.argmax(logits, -1).astype(jnp.int32)
            drafts.append(tokens)
        return jnp.stack(drafts, 1)

    def decode(self, cache: DecodeCache, batch: DecodeBatch, *,
               attention_backend: str | None = None, collect_attention: bool = False
               ) -> tuple[jax.Array, DecodeCache, dict]:
        """One decode token per batch row. Returns (logits float32[N, V], new cache, aux).

        Each layer writes its row through `cache.kv.write`; the leader of each index group
        selects the top-k (causal: entries past a row's position are dropped; padding rows
        select nothing) and calls `cache.kv.lookup`, whose rows every layer of the group
        attends over. The residency (`cache.kv.residency`) decides how rows are found.

        Several query rows per request (speculative verification: `CacheBatch.
        rows_per_request` = r adjacent rows of one state row at consecutive positions): each
        row writes its own position and attends causally, so row i sees the rows written by
        rows < i in the same step; a row of position -1 writes and selects nothing.

        aux: "hits" / "misses" int32[num_groups] (hot-region lookups summed over rows; zeros
        when the residency reads no host rows), "hidden" [N, hidden] (the last hidden state,
        before the final norm: what an MTP module drafts from) and, with
        `collect_attention`, "attention" [L, N, h, kv_lora] (each layer's latent attention
        output).
        """
        c = self.cfg
        kvb = batch.kv
        live, pos = kvb.live, kvb.positions
        writes = live & (pos >= 0)
        srow = jnp.where(live, kvb.state_rows, 0)
        kv, index_keys = cache.kv, list(cache.index_keys)
        hits, misses, attn = [], [], []
        x = self.embed(batch.tokens)
        lookup = None
        # With an external selection and copy_with_attention, group g + 1 is looked up ahead,
        # before group g attends: its copies from host run in the launch of group g's first
        # attention.
        ahead = batch.topk is not None and kv.copy_with_attention
        pending = None
        if ahead:  # no attention runs before group 0's: its copies run at its lookup
            kv, found = kv.lookup(0, self._external_topk(batch, 0), kvb)
            pending = PendingLookup(0, found)
        for layer, block in enumerate(self.blocks):
            g, leader = layer // c.index_group_size, layer % c.index_group_size == 0
            h = block.attn_norm(x)
            q_lora, q, row = block.attn.project(h, pos)
            if leader and ahead:
                kv, lookup = kv.land(pending, kvb)
                pending = None
                if g + 1 < c.num_groups:
                    kv, pending = kv.lookup_ahead(g + 1, self._external_topk(batch, g + 1), kvb)
            kv = kv.write(layer, row, kvb)
            if leader and not ahead:
                if batch.topk is not None:
                    topk = self._external_topk(batch, g)
                else:
                    idx = block.indexer
                    keys = index_keys[g]
                    keys = keys.at[jnp.where(writes, kvb.state_rows, keys.shape[0]),
                                   jnp.maximum(pos, 0)].set(idx.keys(h, pos), mode="drop")
                    index_keys[g] = keys
                    iq, iw = idx.queries(q_lora, h, pos)
                    topk = idx.select(iq, iw, keys[srow], pos)
                    topk = jnp.where(live[:, None], topk, -1)
                kv, lookup = kv.lookup(g, topk, kvb)
            if leader:
                hits.append(jnp.sum(lookup.hits))
                misses.append(jnp.sum(lookup.misses))
            # The first attention after a lookup ahead also runs its copies, when they wait
            # for one (`copy_with_attention`); any other attends alone.
            kv, latent, _, pending = kv.attend(
                layer, q, lookup.attention_rows, kvb, sm_scale=c.sm_scale,
                v_width=c.kv_lora_rank, backend=attention_backend, pending=pending)
            out = block.attn.output(latent)
            if collect_attention:
                attn.append(latent)
            x = self._finish(x, block, out)
        aux = {"hits": jnp.stack(hits), "misses": jnp.stack(misses), "hidden": x}
        if collect_attention:
            aux["attention"] = jnp.stack(attn)
        return self.logits(x), DecodeCache(kv, tuple(index_keys)), aux

    @staticmethod
    def _external_topk(batch: DecodeBatch, group: int) -> jax.Array:
        """Group `group`'s top-k from the batch's external source: causal entries only, none
        for padding rows."""
        kvb = batch.kv
        topk = batch.topk[group]
        keep = (topk <= kvb.positions[:, None]) & kvb.live[:, None]
        return jnp.where(keep, topk, -1)

    def prefill(self, cache: DecodeCache, tokens: jax.Array, length: jax.Array,
                state_row: jax.Array, write_rows: jax.Array, *,
                attention_backend: str | None = None, collect_attention: bool = False
                ) -> tuple[jax.Array, DecodeCache, dict]:
        """Prefill one request: tokens int32[T] (padded; the first `length` are real), written
        to flat device rows write_rows int32[T] (-1: not written) and to the index-key cache
        row `state_row` (through `cache.kv.write_rows`: prefill rows always go to resident
        pages). Every query row attends to its own top-k (sparse, the decode rule), over the
        rows just computed as the cache stores them (`HiSparseKVCache.encode`: with
        "fp8_ds_mla" the quantized rows, as upstream, which quantizes at write and attends
        over the stored rows; prefill and every decode residency thus read the same values).
        Returns (logits float32[V] of the last real token, new
        cache, aux with "attention" [L, h, kv_lora] of the last token when collected).
        """
        pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return self._prefill(cache, tokens, pos, length, state_row, write_rows=write_rows,
                             attention_backend=attention_backend,
                             collect_attention=collect_attention)

    def prefill_chunk(self, cache: DecodeCache, tokens: jax.Array, start: jax.Array,
                      length: jax.Array, state_row: jax.Array, pages: jax.Array, *,
                      host_pages: jax.Array | None = None,
                      host_pools: tuple[jax.Array, ...] = (),
                      attention_backend: str | None = None, collect_attention: bool = False
                      ) -> tuple[jax.Array, DecodeCache, dict]:
        """Prefill one chunk of a request's prompt: tokens int32[T] at positions
        [start, start + T) (padded; the first `length` are real), of the request in state row
        `state_row` whose resident pages are `pages` int32[P] (its block-table row; every page
        up to position start + length - 1 resident: `docs/semantics.md`, chunked prefill).

        The chunk's rows go to its pages (`HiSparseKVCache.write`) and its index keys to
        `cache.index_keys[g][state_row]`, after the earlier chunks' keys; each query row runs
        the indexer over the keys of positions [0, its position] and attends to its own top-k
        through the resident table (`AllResident`: one lookup per index group, read after the
        group's write), i.e. the query rows of a chunk are decode rows of one request at
        consecutive positions. The rows read are the stored ones, earlier chunks' and this
        chunk's alike (this chunk's rows equal `HiSparseKVCache.encode` of its values, what
        `prefill` reads), so a prompt prefilled chunk by chunk reads the values the one-shot
        `prefill` reads. Padding rows write and select nothing. Returns (logits float32[V] of
        the last real token, new cache, aux with "attention" [L, h, kv_lora] of the last token
        when collected).

        Staging (`host_pages` int32[P], the request's host block of each page, and
        `host_pools`, the pinned host pool's arrays (`HostPool.arrays`);
        `docs/semantics.md`, prefill staging):
        pages before the chunk may then be host-only (null in `pages`). After each group
        leader's selection, the distinct positions the chunk's rows select (at most M =
        min(T * top_k, max_model_len)) are gathered into one compact array [M, Ws] per layer
        of the group: those before the chunk once, by `stage_prefill_rows` (a resident copy
        device to device, else the host pool's), the chunk's own after each layer's write;
        each layer attends over its compact array, the same values in the same order per
        query row as the resident read (and the KV array stays far below the attention
        kernel's 2^31-element limit, whatever the chunk). aux gains "staged_rows_host" /
        "staged_rows_device" (int32: rows per layer, summed over the groups).
        """
        T = tokens.shape[0]
        pos = start + jnp.arange(T, dtype=jnp.int32)
        res = jnp.broadcast_to(pages, (T, pages.shape[0]))
        if host_pages is None:
            src = jnp.zeros_like(res)
        else:
            if host_pages.shape != pages.shape:
                raise ValueError(
                    f"prefill_chunk: staging needs host_pages of the shape of pages "
                    f"{tuple(pages.shape)}, got {tuple(host_pages.shape)}")
            try:
                layers_per_pool_array(len(host_pools), self.cfg.num_layers,
                                      self.cfg.index_group_size)
            except ValueError as e:
                raise ValueError(f"prefill_chunk: staging: {e}") from None
            src = jnp.broadcast_to(host_pages, res.shape)
        pages_batch = CacheBatch(
            state_rows=jnp.where(jnp.arange(T) < length, state_row, -1), positions=pos,
            src=src, res=res, hot=jnp.zeros((T, 0), jnp.int32),
            host_pools=tuple(host_pools) if host_pages is not None else ())
        return self._prefill(cache, tokens, pos, length, state_row, pages_batch=pages_batch,
                             attention_backend=attention_backend,
                             collect_attention=collect_attention)

    def _prefill(self, cache: DecodeCache, tokens: jax.Array, pos: jax.Array,
                 length: jax.Array, state_row: jax.Array, *, write_rows: jax.Array | None = None,
                 pages_batch: CacheBatch | None = None, attention_backend: str | None,
                 collect_attention: bool) -> tuple[jax.Array, DecodeCache, dict]:
        """The layers of `prefill` (`write_rows`: rows written by flat row, the indexer over
        the step's own keys, attention over the step's encoded rows) and of `prefill_chunk`
        (`pages_batch`: rows written and read through the request's pages, the indexer over
        the request's index-key row), query rows at positions `pos`."""
        c = self.cfg
        real = jnp.arange(tokens.shape[0]) < length
        kv, index_keys = cache.kv, list(cache.index_keys)
        staging = pages_batch is not None and bool(pages_batch.host_pools)
        x = self.embed(tokens)
        attn = []
        rows = staged = None
        counts = [jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)]
        for layer, block in enumerate(self.blocks):
            g, leader = layer // c.index_group_size, layer % c.index_group_size == 0
            h = block.attn_norm(x)
            q_lora, q, row = block.attn.project(h, pos)
            if pages_batch is None:
                kv = kv.write_rows(layer, write_rows, row)
            else:
                kv = kv.write(layer, row, pages_batch)
            if leader:
                idx = block.indexer
                keys = idx.keys(h, pos)
                index_keys[g] = index_keys[g].at[state_row, pos].set(
                    jnp.where(real[:, None], keys, 0), mode="drop")
                iq, iw = idx.queries(q_lora, h, pos)
                if pages_batch is None:
                    rows = idx.select(iq, iw, keys, pos)
                else:
                    topk = idx.select(iq, iw, index_keys[g][state_row], pos)
                    kv, found = AllResident().lookup(kv, g, topk, pages_batch)
                    rows = found.attention_rows
                    if staging:
                        staged, from_device, from_host = _stage_group(
                            kv, g, topk, rows, pos[0], pages_batch, index_keys[g].shape[1])
                        counts = [counts[0] + from_host, counts[1] + from_device]
            if staged is not None:
                stored, attend_rows = _staged_read(kv.caches[layer], staged,
                                                   layer % c.index_group_size)
            else:
                stored = kv.encode(row) if pages_batch is None else kv.caches[layer]
                attend_rows = rows
            out, latent = block.attn.attend(q, stored, attend_rows, backend=attention_backend,
                                            kv_format=kv.kv_format)
            if collect_attention:
                attn.append(latent[length - 1])
            x = self._finish(x, block, out)
        last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=False)
        aux = {"attention": jnp.stack(attn)} if collect_attention else {}
        if staging:
            aux["staged_rows_host"], aux["staged_rows_device"] = counts
        return self.logits(last[None])[0], DecodeCache(kv, tuple(index_keys)), aux


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Staged:
    """One index group's selection in a chunk prefill (`_stage_group`): the distinct selected
    positions of the chunk's rows, M of them at most (`positions` int32[M], ascending, -1
    padding), `buffers` [M, Ws] per layer of the group holding the rows of those before the
    chunk (staged), `rows` int32[M] the resident flat row of each (-1: none), and `ids`
    int32[T, K] the union index each query row attends to (-1: no row)."""

    buffers: tuple[jax.Array, ...]
    positions: jax.Array
    rows: jax.Array
    ids: jax.Array
    start: jax.Array


def _stage_group(kv: HiSparseKVCache, group: int, topk: jax.Array, rows: jax.Array,
                 start: jax.Array, batch: CacheBatch, max_len: int
                 ) -> tuple[_Staged, jax.Array, jax.Array]:
    """Gathers the rows a chunk's selection topk int32[T, K] reads (`rows`: their resident
    rows, -1 where not resident) into one compact array per layer of group `group`: the
    distinct selected positions (a mask over the max_len positions, then at most M = min(T
    * K, max_len) of them in ascending order); those before `start` (written by earlier
    chunks or a reused prefix, for every layer of the group) are copied now by
    `stage_prefill_rows` (the resident copy where there is one, else the host's), those of
    the chunk itself are read per layer after its write (`_staged_read`). A position whose
    row exists nowhere (neither resident nor, before the chunk, on the host) is a hole, as
    in the resident read. Returns (the `_Staged`, rows copied device to device, rows
    copied from host)."""
    B = kv.block_size
    T, K = topk.shape
    P = batch.res.shape[1]
    page_of = lambda p: jnp.minimum(jnp.maximum(p, 0) // B, P - 1)
    host_of = lambda p: jnp.take(batch.src[0], page_of(p))
    exists = (rows >= 0) | ((topk < start) & (topk // B < P) & (host_of(topk) > 0))
    want = (topk >= 0) & exists & batch.live[:, None]
    mask = jnp.zeros(max_len, bool).at[jnp.where(want, topk, max_len)].set(True, mode="drop")
    M = min(T * K, max_len)
    (positions,) = jnp.nonzero(mask, size=M, fill_value=-1)
    positions = positions.astype(jnp.int32)
    index_of = jnp.full(max_len, -1, jnp.int32).at[
        jnp.where(positions >= 0, positions, max_len)].set(jnp.arange(M, dtype=jnp.int32),
                                                            mode="drop")
    ids = jnp.where(want, index_of[jnp.where(want, topk, 0)], -1)
    res_block = jnp.take(batch.res[0], page_of(positions))
    union_rows = jnp.where((positions >= 0) & (res_block > 0),
                           res_block * B + jnp.maximum(positions, 0) % B, -1)
    layers = slice(group * kv.index_group_size, (group + 1) * kv.index_group_size)
    caches = kv.caches[layers]
    out = stage_prefill_rows(
        batch.group_pools(group, kv.index_group_size, kv.num_layers), caches,
        tuple(jnp.zeros((M, cache.shape[-1]), cache.dtype) for cache in caches),
        jnp.where(positions < start, positions, -1), batch.src[0], batch.res[0],
        block_size=B, backend=kv.ops_backend)
    return (_Staged(out.staging, positions, union_rows, ids, start), out.rows_from_device,
            out.rows_from_host)


def _staged_read(cache: jax.Array, staged: _Staged, member: int
                 ) -> tuple[jax.Array, jax.Array]:
    """The rows a staged chunk's query rows attend over: the compact array [M, Ws] of the
    group's distinct selected rows (staged rows before the chunk; the chunk's own rows from
    `cache` [num_blocks, B, Ws], after the layer's write; member: the layer's index in its
    group) and the attention rows int32[T, K] into it (-1: a hole). The values and their
    order per query row are those of the resident read."""
    flat = cache.reshape(-1, cache.shape[-1])
    own = (staged.positions >= staged.start)[:, None]
    compact = jnp.where(own, flat[jnp.maximum(staged.rows, 0)], staged.buffers[member])
    return compact, staged.ids


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
