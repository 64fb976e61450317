"""`DSAModel`: a DeepSeek-V3.2 (`model_type` "deepseek_v32") or GLM-5 ("glm_moe_dsa")
decoder served through HiSparse (`hisparse_jax.models.ServedModel`), built from a `DSAConfig`
and filled from a Hugging Face checkpoint by `hisparse_jax.models.loading.from_pretrained`.

Its layers are `dsa_layers.DSABlock`s (absorbed MLA over latent KV rows of kv_lora_rank +
qk_rope_head_dim values, the lightning indexer on "full" layers, a dense SwiGLU or MoE MLP);
its decode / prefill steps are the `SparseDecoder` skeleton (`decoder.py`). Index groups
follow the config's `indexer_types`: a "full" layer and the "shared" layers after it form a
group whose one top-k (the full layer's) every layer of the group attends over, as
transformers' GLM-5 reuses the previous full layer's top-k. The index-key cache of each group
is [S, max_model_len, index_head_dim] (kv_dtype). With an MTP layer in the checkpoint
(`num_nextn_predict_layers` 1), `draft` drafts with it (`dsa_layers.DSAMTP`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from flax import nnx

from hisparse_jax.models.decoder import SparseDecoder
from hisparse_jax.models.dsa_config import DSAConfig
from hisparse_jax.models.dsa_layers import DSAMTP, DSABlock
from hisparse_jax.models.dsa_moe import MoE
from hisparse_jax.models.protocol import ModelSpec
from hisparse_jax.models.synthetic_layers import RMSNorm, as_dtype, linear


class DSAModel(SparseDecoder):
    """Embedding, `num_hidden_layers` `DSABlock`s, the final RMSNorm and the output head
    (lm_head, not tied); `mtp` the MTP layer (`DSAMTP`) or None.

    Parameters mirror the checkpoint's tensors (`hisparse_jax.models.dsa_weights` maps the
    names): embed [V, H] (`model.embed_tokens`), blocks[i] (`model.layers.i`), final_norm
    (`model.norm`), lm_head kernel [H, V] (`lm_head`), mtp (`model.layers.{L}`).
    """

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        self.embed = nnx.Embed(V, H, dtype=as_dtype(cfg.dtype),
                               param_dtype=as_dtype(cfg.param_dtype), rngs=rngs)
        self.blocks = nnx.List([DSABlock(cfg, i, rngs=rngs)
                                for i in range(cfg.num_hidden_layers)])
        self.final_norm = RMSNorm(H, eps=cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.lm_head = linear(cfg, H, V, rngs)
        self.mtp = DSAMTP(cfg, rngs=rngs) if cfg.num_nextn_predict_layers else None

    @property
    def spec(self) -> ModelSpec:
        """The static facts the engine reads (`dsa_spec`)."""
        return dsa_spec(self.cfg)

    @property
    def index_dim(self) -> int:
        """The width of an index key: index_head_dim."""
        return self.cfg.index_head_dim

    def draft_step(self, hidden: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One application of the MTP layer: hidden [N, H] (the last hidden state of position
        t, before the final norm, or the layer's own previous output) and the tokens int32[N]
        at t + 1 -> (the layer's hidden state [N, H], logits float32[N, V] for t + 2)."""
        hidden = self.mtp(hidden, tokens)
        return hidden, self.mtp.logits(hidden)

    @staticmethod
    def tensor_parallel_dim(path: str, shape: tuple[int, ...]) -> int | None:
        """The dim of parameter `path` ("blocks.1.attn.wq_b.kernel") that a mesh's model axis
        splits (kernels are [in, out]):

          * by attention heads: wq_b's output dim (q_b_proj: heads of nope + rope values,
            consecutive), w_uk / w_uv [h, ., .] their first;
          * o_proj (`wo`) and the SwiGLU `down` kernels (the dense MLP's, the shared
            experts') on their input dim; the SwiGLU `gate` / `up` kernels, the output head
            (lm_head, the MTP layer's head) on their output dim; embeddings [V, H] on H;
          * the expert stacks w_gate_up [E, H, 2I] / w_down [E, I, H] on E (expert
            parallelism: `MoE.split_experts`, `for_mesh`).

        Replicated (None): what every device needs whole: wq_a and wkv_a (the KV row and
        the indexer's query input are shared by every head; the KV cache is replicated over
        the model axis), the indexer (its top-k sums over all its heads), the MoE router
        (float32, its top-k reads every expert), the MTP layer's eh_proj, norms and biases.
        """
        names = [p for p in path.split(".") if p != "value"]
        leaf, owner = names[-1], (names[-2] if len(names) > 1 else "")
        if leaf in ("w_uk", "w_uv", "w_gate_up", "w_down") and len(shape) == 3:
            return 0
        if leaf == "embedding" and len(shape) == 2:
            return 1
        if leaf != "kernel" or len(shape) != 2 or "indexer" in names:
            return None
        if owner in ("wq_b", "gate", "up", "lm_head", "head"):
            return 1
        if owner in ("wo", "down"):
            return 0
        return None

    def for_mesh(self, mesh: Any, axis: str) -> DSAModel:
        """This model (the same parameter arrays, no copy) with every MoE's experts split
        over mesh axis `axis` (`MoE.split_experts`): what `MeshEngine` serves. The model
        itself when the axis has one device."""
        if mesh.shape[axis] == 1:
            return self
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state)
        blocks = [*model.blocks, *([model.mtp.block] if model.mtp is not None else [])]
        for block in blocks:
            if isinstance(block.mlp, MoE):
                block.mlp.split_experts(mesh, axis)
        return model


@functools.cache
def dsa_spec(cfg: DSAConfig) -> ModelSpec:
    """The `ModelSpec` of a config: index groups from `indexer_types` (`group_layers`),
    top_k = index_topk, rows of kv_lora_rank + qk_rope_head_dim, the attention's scale (YaRN
    mscale included), a draft when the config has an MTP layer."""
    return ModelSpec(
        name=cfg.name, vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
        group_layers=cfg.group_layers, top_k=cfg.index_topk, kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim, num_heads=cfg.num_attention_heads,
        sm_scale=cfg.sm_scale, kv_dtype=cfg.kv_dtype,
        has_draft=bool(cfg.num_nextn_predict_layers))
