"""Host-tier parts built from the engine's one `HiSparseConfig`.

merge: host_tier from_config. The host tier gains `Coordinator.from_config(cfg, ...)`,
`HostPool.from_config(cfg, num_layers=..., device=...)` and
`DeviceBlockTables.from_config(cfg, device=...)`; until then these functions build the parts
from the same fields. At the merge, call those classmethods and delete this module.
"""

from __future__ import annotations

from typing import Any

import jax

from hisparse_jax.config import HiSparseConfig
from host_tier import Coordinator, DeviceBlockTables, HostPool


def coordinator_from_config(cfg: HiSparseConfig, **kwargs: Any) -> Coordinator:
    """`Coordinator.from_config(cfg, **kwargs)` (sizes: block_size, hot_blocks,
    max_num_reqs, max_model_len, num_gpu_blocks, num_host_blocks)."""
    return Coordinator.from_config(cfg, num_gpu_blocks=cfg.require("num_gpu_blocks"),
                                   num_host_blocks=cfg.require("num_host_blocks"),
                                   max_model_len=cfg.require("max_model_len"), **kwargs)


def host_pool_from_config(cfg: HiSparseConfig, *, num_layers: int,
                          device: jax.Device | None = None) -> HostPool:
    """`HostPool.from_config(cfg, num_layers=..., device=...)`: num_host_blocks blocks of
    [block_size, row_width] kv_dtype rows per layer, pinned."""
    return HostPool(num_layers=num_layers, block_size=cfg.block_size, row_width=cfg.row_width,
                    dtype=cfg.kv_dtype, num_blocks=cfg.require("num_host_blocks"),
                    device=device)


def device_tables_from_config(cfg: HiSparseConfig, *,
                              device: jax.Device | None = None) -> DeviceBlockTables:
    """`DeviceBlockTables.from_config(cfg, device=...)`: src / res [max_num_reqs, max_pages],
    hot [max_num_reqs, hot_blocks]."""
    return DeviceBlockTables(cfg.max_num_reqs, cfg.max_pages, cfg.hot_blocks, device=device)
