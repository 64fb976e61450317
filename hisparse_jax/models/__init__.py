"""Models the engine serves, and the protocol they implement.

  * `protocol.py`: `ServedModel` (what a model implements: `prefill`, `prefill_chunk`,
    `decode`, optional `draft`, `init_index_keys`), `ModelSpec` (the static facts the engine
    reads), `DecodeCache` / `DecodeBatch` (the caches and per-step inputs it passes).
  * `synthetic.py` / `synthetic_layers.py`: the synthetic DeepSeek-V3.2-style decoder the
    tests and benchmarks serve (`init_model("tiny")`, configs `CONFIGS` / `get_config`).
"""

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

__all__ = ["CONFIGS", "MLP", "Block", "DecodeBatch", "DecodeCache", "LightningIndexer",
           "MTPHead", "ModelConfig", "ModelSpec", "RMSNorm", "ServedModel", "SparseMLA",
           "Transformer", "check_served_model", "get_config", "init_model", "model_spec"]
