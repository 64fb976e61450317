"""hisparse-jax: a host-tiered sparse-attention KV cache (HiSparse) for JAX and Pallas."""

from hisparse_jax import models
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    HiSparse,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Speculative,
    Tuning,
)
from hisparse_jax.ops import (
    Resolution,
    gather_compact,
    invalidate_written_rows,
    mirror_rows,
    mirror_rows_group,
    resolve_residency,
    sparse_mla_decode,
)
from hisparse_jax.state import HotState, init_hot_state, reset_rows

__all__ = [
    "AllResident",
    "Debug",
    "Engine",
    "EngineConfig",
    "HiSparse",
    "HiSparseConfig",
    "HotState",
    "NaiveOffload",
    "PrefillPolicy",
    "Resolution",
    "Sizes",
    "Speculative",
    "Tuning",
    "gather_compact",
    "init_hot_state",
    "invalidate_written_rows",
    "mirror_rows",
    "mirror_rows_group",
    "models",
    "reset_rows",
    "resolve_residency",
    "sparse_mla_decode",
]
__version__ = "0.1.0"
