"""Worker side of the host tier: moves bytes as the scheduler's `StepPlan` says (jax).

  - `host_pool`: `HostPool`, the pinned host KV arrays `[num_blocks, B, W]` per layer, and
    `memory_sharding`;
  - `device_tables`: `DeviceBlockTables`, the int32 device copies of the block tables;
  - `transfer`: `TransferEngine`, the plan's restores and spills through the copy functions it
    is given (a copy that raises is reported failed; `TransferLostError` when it consumed an
    array).

Imports jax, numpy, `host_tier` and `pallas_kernels._compat` only (no kernel, no data plane).
"""

from host_tier.worker.device_tables import DeviceBlockTables
from host_tier.worker.host_pool import HostPool, memory_sharding
from host_tier.worker.transfer import MirrorFn, RestoreFn, TransferEngine, TransferLostError

__all__ = [
    "DeviceBlockTables",
    "HostPool",
    "MirrorFn",
    "RestoreFn",
    "TransferEngine",
    "TransferLostError",
    "memory_sharding",
]
