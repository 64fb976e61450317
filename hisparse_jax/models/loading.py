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
from jax.sharding import Mesh

from hisparse_jax.cache import AllResident, HiSparseKVCache
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.models import dsa_weights
from hisparse_jax.models.checkpoint import open_checkpoint
from hisparse_jax.models.dsa import DSAModel
from hisparse_jax.models.dsa_config import DSAConfig
from hisparse_jax.models.placement import load_placed
from hisparse_jax.models.protocol import DecodeCache

# Rows per page of the cache `score` builds (any size serves: the sequence is all resident),
# and the multiple its sequences are padded to (one compiled pass serves every length up to
# it: row t's logits never read a later row).
_SCORE_BLOCK = 16
_SCORE_BUCKET = 64


def from_pretrained(path: str | os.PathLike, *, dtype: Any = None, kv_dtype: Any = None,
                    mesh: Mesh | None = None) -> DSAModel:
    """The `DSAModel` of the checkpoint folder `path` (config.json + safetensors: contract of
    `checkpoint.open_checkpoint`).

    dtype: the compute and parameter dtype (default: float32 when config.json's dtype is
    float32, else bfloat16; `DSAConfig.from_hf`); kv_dtype: the dtype of KV rows, attention
    queries and index keys (default: dtype). Each tensor is read in its parameter's dtype
    (float32 for the MoE router and its bias and the indexer's head weights, whatever dtype
    is).

    mesh: a `jax.sharding.Mesh` with a "model" axis (`hisparse_jax.engine.mesh.make_mesh`):
    each parameter is created directly over it, split over "model" on its
    `DSAModel.tensor_parallel_dim` and replicated over the other axes, every device
    getting only its slice (`placement.load_placed`: no device and no host buffer holds the
    whole model); `MeshEngine` serves such a model over the same mesh as placed.

    Raises:
      ValueError: the folder is not a checkpoint (naming what is missing), its model_type is
        not a supported one (naming the supported ones), or its tensors are not the config's
        (a missing, unexpected or mis-shaped tensor, named: `dsa_weights.check_names`).
    """
    with open_checkpoint(path) as ckpt:
        cfg = DSAConfig.from_hf(ckpt.config, dtype=dtype, kv_dtype=kv_dtype)
        model = nnx.eval_shape(lambda: DSAModel(cfg, rngs=nnx.Rngs(0)))
        if mesh is None:
            dsa_weights.load_into(model, ckpt.read, names=ckpt.names())
        else:
            load_placed(model, ckpt, mesh)
    _check_filled(model)
    return model


def _check_filled(model: nnx.Module) -> None:
    """ValueError naming the parameters the loading left abstract (none after a complete
    `load_into`)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    empty = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path
                      if not isinstance(k, jax.tree_util.GetAttrKey))
             for path, leaf in leaves if not isinstance(leaf, jax.Array)]
    if empty:
        raise ValueError(f"from_pretrained: the checkpoint left {len(empty)} parameters "
                         f"unassigned, e.g. {empty[:3]}")


def score(model: DSAModel, token_ids: Any) -> np.ndarray:
    """float32[T, V]: the next-token logits at every position of token_ids int[T] (T >= 1,
    ids in [0, V)), computed by the model's prefill path (`prefill_every_position`) over a
    fresh all-resident KV cache sized for the sequence padded to a multiple of 64 tokens
    (the logits of row t depend on tokens 0..t only, as in the engine's prefill and a causal
    forward, so the padding changes none).

    Raises:
      ValueError: token_ids is not a non-empty 1-D int sequence of ids in [0, V).
    """
    tokens = np.asarray(token_ids)
    spec = model.spec
    if tokens.ndim != 1 or not len(tokens) or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"score: token_ids must be a non-empty 1-D sequence of ints, got "
                         f"shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.min() < 0 or tokens.max() >= spec.vocab_size:
        raise ValueError(f"score: token ids must be in [0, vocab_size={spec.vocab_size}), got "
                         f"[{tokens.min()}, {tokens.max()}]")
    T = len(tokens)
    padded = np.zeros(-(-T // _SCORE_BUCKET) * _SCORE_BUCKET, np.int32)
    padded[:T] = tokens
    graphdef, state = nnx.split(model)
    logits = _scorer(graphdef, len(padded))(state, jnp.asarray(padded), jnp.int32(T))
    return np.asarray(logits[:T], np.float32)


@functools.lru_cache(maxsize=16)
def _scorer(graphdef: Any, padded: int):
    """One compiled scoring pass per (model structure, padded sequence length): tokens
    int32[padded], of which the first `length` are real."""
    B = _SCORE_BLOCK
    pages = -(-padded // B)

    def run(state, tokens, length):
        model = nnx.merge(graphdef, state)
        spec = model.spec
        cfg = HiSparseConfig(
            top_k=spec.top_k, hot_size=HiSparseConfig.default_hot_size(spec.top_k, B),
            block_size=B, max_num_reqs=1, row_width=spec.row_width, kv_dtype=spec.kv_dtype,
            max_model_len=pages * B, num_gpu_blocks=pages + 1)
        kv = HiSparseKVCache.create(cfg, num_layers=spec.num_layers, residency=AllResident(),
                                    group_layers=spec.group_layers)
        cache = DecodeCache(kv, model.init_index_keys(1, pages * B, external_topk=False))
        rows = B + jnp.arange(padded, dtype=jnp.int32)       # block 0 is the null block
        logits, _ = model.prefill_every_position(cache, tokens, length, jnp.int32(0), rows)
        return logits

    return jax.jit(run)
