"""Host tier of HiSparse: the pinned host pool, block pools and the residency coordinator.

  - `host_tier.scheduler` (standard library and numpy only): `BlockPool`, `BlockTables`,
    `Coordinator` and its parts; decides where every page lives.
  - `host_tier.plan` (numpy only): `StepPlan`, `TransferReport` and their parts, the contract
    between the two sides.
  - `host_tier.worker` (jax): `HostPool`, `DeviceBlockTables`, `TransferEngine`; moves bytes.
  - `host_tier.sizes`: small size rules shared by the project.
  - `host_tier.testing` (jax): reference copies and a simulated serving loop, for tests.

The names below are re-exported lazily (PEP 562): `import host_tier` and
`import host_tier.scheduler` load no jax; `from host_tier import HostPool` loads the worker side.
Nothing in this package imports `hisparse_jax` or a kernel: the data-plane copies are passed in
as functions.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ACTIVE_TAIL_PAGES": "host_tier.scheduler.records",
    "Admitted": "host_tier.scheduler.records",
    "CapacityError": "host_tier.scheduler.records",
    "RequestView": "host_tier.scheduler.records",
    "Wait": "host_tier.scheduler.records",
    "NULL_BLOCK": "host_tier.scheduler.block_pool",
    "BlockPool": "host_tier.scheduler.block_pool",
    "PoolExhaustedError": "host_tier.scheduler.block_pool",
    "BlockTables": "host_tier.scheduler.block_tables",
    "Coordinator": "host_tier.scheduler.coordinator",
    "HotInvalidation": "host_tier.plan",
    "PageRestore": "host_tier.plan",
    "PageSpill": "host_tier.plan",
    "StepPlan": "host_tier.plan",
    "StepWrite": "host_tier.plan",
    "TableRows": "host_tier.plan",
    "TableUpdate": "host_tier.plan",
    "TransferReport": "host_tier.plan",
    "DeviceBlockTables": "host_tier.worker.device_tables",
    "HostPool": "host_tier.worker.host_pool",
    "memory_sharding": "host_tier.worker.host_pool",
    "TransferEngine": "host_tier.worker.transfer",
    "TransferLostError": "host_tier.worker.transfer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'host_tier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
