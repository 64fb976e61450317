"""Scheduler side of the host tier: decides where pages live (standard library and numpy only).

  - `block_pool`: `BlockPool`, block ids with reference counts and an eviction-ordered queue;
  - `block_tables`: `BlockTables`, the numpy copy of the per-request `src`/`res`/`hot` tables;
  - `records`: the request / spill / restore records and the result types;
  - `prefix_cache`, `spill_planner`, `residency_policy`, `capacity`, `invariants`: the
    coordinator's parts;
  - `coordinator`: `Coordinator`, which composes them and builds one `StepPlan` per step (its
    calls are grouped in `admission` and `scheduling`).

Importing this package loads no jax.
"""

from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool, PoolExhaustedError
from host_tier.scheduler.block_tables import BlockTables
from host_tier.scheduler.coordinator import Coordinator
from host_tier.scheduler.records import (
    ACTIVE_TAIL_PAGES,
    Admitted,
    CapacityError,
    RequestView,
    Wait,
)

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "NULL_BLOCK",
    "Admitted",
    "BlockPool",
    "BlockTables",
    "CapacityError",
    "Coordinator",
    "PoolExhaustedError",
    "RequestView",
    "Wait",
]
