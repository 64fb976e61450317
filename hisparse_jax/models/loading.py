"""Hugging Face checkpoints of DSA models: `from_pretrained` builds a served `DSAModel` from a
checkpoint folder, `score` gives the logits of every position of a token sequence through the
model's prefill path (what a test compares with transformers' teacher-forced forward).

`from_pretrained` never initialises the full-size model: the model is built abstract
(`nnx.eval_shape`: parameter shapes and dtypes, no arrays) and each parameter is then
assigned from the checkpoint tensor by tensor (`dsa_weights.load_into`, reading through
`Checkpoint.read`: memory-mapped, fp8 weights dequantized with their block scales), so the
process holds one copy of the weights plus one tensor in flight.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.cache import AllResident, HiSparseKVCache
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.models import dsa_weights
from hisparse_jax.models.checkpoint import open_checkpoint
from hisparse_jax.models.dsa import DSAModel
from hisparse_jax.models.dsa_config import DSAConfig
from hisparse_jax.models.protocol import DecodeCache

# Rows per page of the cache `score` builds (any size serves: the sequence is all resident).
_SCORE_BLOCK = 16


def from_pretrained(path: str | os.PathLike, *, dtype: Any = None, kv_dtype: Any = None
                    ) -> DSAModel:
    """The `DSAModel` of the checkpoint folder `path` (config.json + safetensors: contract of
    `checkpoint.open_checkpoint`).

    dtype: the compute and parameter dtype (default: float32 when config.json's dtype is
    float32, else bfloat16; `DSAConfig.from_hf`); kv_dtype: the dtype of KV rows, attention
    queries and index keys (default: dtype). Parameters the model keeps in float32 (the MoE
    router and its bias, the indexer's head weights) are read in float32 whatever dtype is.

    Raises:
      ValueError: the folder is not a checkpoint (naming what is missing), its model_type is
        not a supported one (naming the supported ones), or a tensor the config implies is
        missing or of another shape (naming it).
    """
    with open_checkpoint(path) as ckpt:
        cfg = DSAConfig.from_hf(ckpt.config, dtype=dtype, kv_dtype=kv_dtype)
        model = nnx.eval_shape(lambda: DSAModel(cfg, rngs=nnx.Rngs(0)))
        dsa_weights.load_into(model, lambda name: ckpt.read(name, np.float32))
    _check_filled(model)
    return model


def _check_filled(model: nnx.Module) -> None:
    """ValueError naming the parameters the loading left abstract (none after a complete
    `load_into`)."""
    state = nnx.state(model, nnx.Param)
    empty = [".".join(map(str, path)) for path, leaf in nnx.to_flat_state(state)
             if not isinstance(leaf.value if hasattr(leaf, "value") else leaf, jax.Array)]
    if empty:
        raise ValueError(f"from_pretrained: the checkpoint left {len(empty)} parameters "
                         f"unassigned, e.g. {empty[:3]}")


def score(model: DSAModel, token_ids: Any) -> np.ndarray:
    """float32[T, V]: the next-token logits at every position of token_ids int[T] (T >= 1,
    ids in [0, V)), computed by the model's prefill path (`prefill_every_position`) over a
    fresh all-resident KV cache sized for the sequence (the logits of row t depend on
    tokens 0..t only, as in the engine's prefill and a causal forward)."""
    tokens = np.asarray(token_ids)
    spec = model.spec
    if tokens.ndim != 1 or not len(tokens) or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"score: token_ids must be a non-empty 1-D sequence of ints, got "
                         f"shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= spec.vocab_size:
        raise ValueError(f"score: token ids must be in [0, vocab_size={spec.vocab_size}), got "
                         f"[{tokens.min()}, {tokens.max()}]")
    graphdef, state = nnx.split(model)
    logits = _scorer(graphdef, len(tokens))(state, jnp.asarray(tokens, jnp.int32))
    return np.asarray(logits, np.float32)


@functools.lru_cache(maxsize=16)
def _scorer(graphdef: Any, length: int):
    """One compiled scoring pass per (model structure, sequence length)."""
    B = _SCORE_BLOCK
    pages = -(-length // B)

    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        spec = model.spec
        cfg = HiSparseConfig(
            top_k=spec.top_k, hot_size=HiSparseConfig.default_hot_size(spec.top_k, B),
            block_size=B, max_num_reqs=1, row_width=spec.row_width, kv_dtype=spec.kv_dtype,
            max_model_len=pages * B, num_gpu_blocks=pages + 1)
        kv = HiSparseKVCache.create(cfg, num_layers=spec.num_layers, residency=AllResident())
        cache = DecodeCache(kv, model.init_index_keys(1, pages * B, external_topk=False))
        rows = B + jnp.arange(length, dtype=jnp.int32)       # block 0 is the null block
        logits, _ = model.prefill_every_position(cache, tokens, jnp.int32(length),
                                                 jnp.int32(0), rows)
        return logits

    return jax.jit(run)
