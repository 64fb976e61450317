"""Host tier of HiSparse: the pinned host pool, block pools and the residency coordinator.

Scheduler side (plain Python, no jax arrays): `BlockPool`, `BlockTables`, `Coordinator`.
Worker side (jax arrays): `HostPool`, `DeviceBlockTables`, `TransferEngine`.
Between them: the `StepPlan` and `TransferReport` dataclasses of `host_tier.plan`.

This package never imports `pallas_kernels`, and imports `hisparse_jax` only lazily (the data-plane
copies are passed in as functions).
"""

from host_tier.block_pool import NULL_BLOCK, BlockPool, PoolExhaustedError
from host_tier.block_tables import BlockTables, DeviceBlockTables
from host_tier.coordinator import (
    ACTIVE_TAIL_PAGES,
    Admitted,
    CapacityError,
    Coordinator,
    RequestView,
    Wait,
)
from host_tier.host_pool import HostPool, memory_sharding
from host_tier.plan import (
    HotInvalidation,
    PageRestore,
    PageSpill,
    StepPlan,
    StepWrite,
    TableRows,
    TableUpdate,
    TransferReport,
)
from host_tier.transfer import TransferEngine, apply_hot_updates, invalidate_host_blocks

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "NULL_BLOCK",
    "Admitted",
    "BlockPool",
    "BlockTables",
    "CapacityError",
    "Coordinator",
    "DeviceBlockTables",
    "HostPool",
    "HotInvalidation",
    "PageRestore",
    "PageSpill",
    "PoolExhaustedError",
    "RequestView",
    "StepPlan",
    "StepWrite",
    "TableRows",
    "TableUpdate",
    "TransferEngine",
    "TransferReport",
    "Wait",
    "apply_hot_updates",
    "invalidate_host_blocks",
    "memory_sharding",
]
