"""Models the engine serves, and the protocol they implement.

  * `protocol.py`: `ServedModel` (what a model implements: `prefill`, `prefill_chunk`,
    `decode`, optional `draft`, `init_index_keys`), `ModelSpec` (the static facts the engine
    reads), `DecodeCache` / `DecodeBatch` (the caches and per-step inputs it passes).
  * `decoder.py`: `SparseDecoder`, the decode / prefill skeleton both models run.
  * `synthetic.py` / `synthetic_layers.py`: the synthetic DeepSeek-V3.2-style decoder the
    tests and benchmarks serve (`init_model("tiny")`, configs `CONFIGS` / `get_config`).
  * `dsa.py` (`DSAModel`), `dsa_config.py` (`DSAConfig`), `dsa_layers.py`, `dsa_moe.py`,
    `dsa_weights.py`: DeepSeek-V3.2 / GLM-5 served from Hugging Face checkpoints;
    `loading.py`: `from_pretrained(path)` and `score(model, token_ids)` (every position's
    logits); `checkpoint.py`: the safetensors reader.
"""

from hisparse_jax.models.decoder import SparseDecoder
from hisparse_jax.models.dsa import DSAModel
from hisparse_jax.models.dsa_config import DSAConfig
from hisparse_jax.models.loading import from_pretrained, score
from hisparse_jax.models.protocol import (
    DecodeBatch,
    DecodeCache,
    ModelSpec,
    ServedModel,
    check_served_model,
)
from hisparse_jax.models.synthetic import Transformer, init_model, model_spec
from hisparse_jax.models.synthetic_layers import (
    CONFIGS,
    MLP,
    Block,
    LightningIndexer,
    ModelConfig,
    MTPHead,
    RMSNorm,
    SparseMLA,
    get_config,
)

__all__ = ["CONFIGS", "MLP", "Block", "DSAConfig", "DSAModel", "DecodeBatch", "DecodeCache",
           "LightningIndexer", "MTPHead", "ModelConfig", "ModelSpec", "RMSNorm", "ServedModel",
           "SparseDecoder", "SparseMLA", "Transformer", "check_served_model",
           "from_pretrained", "get_config", "init_model", "model_spec", "score"]
