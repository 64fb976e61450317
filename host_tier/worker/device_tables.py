"""`DeviceBlockTables`: the worker's copy of the per-request block tables, as device arrays.

Three int32 device arrays, `src [S, max_pages]`, `res [S, max_pages]` and `hot [S, hot_blocks]`
(S = max_num_reqs); their meaning, the null block 0 and the row layout are those of the
scheduler's `BlockTables` (`host_tier/scheduler/block_tables.py`). `apply` takes the
`TableUpdate` of each `StepPlan` (`host_tier/plan.py`), which carries only the rows that changed.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from host_tier.plan import GROUPS, TableRows, TableUpdate
from host_tier.sizes import check_int, config_size, pow2_bucket

__all__ = ["DeviceBlockTables"]

MIN_ROWS_BUCKET = 8
"""Row counts of an update are padded to a power of two, at least this, to bound compiles."""


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("size",))
def _set_rows(tables: tuple[jax.Array, ...], packed: jax.Array, *, size: int
              ) -> tuple[jax.Array, ...]:
    """Every table's changed rows in one call: `packed` int32 holds, for each table in
    order, `size` row indices (padded with an out-of-range index: dropped) then their
    `size` x width values, flattened."""
    out, at = [], 0
    for table in tables:
        width = table.shape[1]
        rows = packed[at:at + size]
        values = packed[at + size:at + size * (1 + width)].reshape(size, width)
        out.append(table.at[rows].set(values, mode="drop"))
        at += size * (1 + width)
    return tuple(out)


class DeviceBlockTables:
    """Worker-side tables as int32 device arrays `src [S, P]`, `res [S, P]`, `hot [S, Hb]`.

    `apply` re-sends only the changed rows (padded to a power-of-two count, at least 8, shared
    by the three tables) and updates the arrays in place (the previous arrays are donated:
    read the properties after each `apply`).

    Args:
      max_num_reqs: S, state rows.
      max_pages: P, width of `src` and `res`.
      hot_blocks: Hb, width of `hot`.
      device: where the arrays live (default: the first device).
    """

    def __init__(self, max_num_reqs: int, max_pages: int, hot_blocks: int,
                 *, device: jax.Device | None = None) -> None:
        max_num_reqs = check_int("DeviceBlockTables", "max_num_reqs", max_num_reqs)
        widths = {"src": check_int("DeviceBlockTables", "max_pages", max_pages),
                  "res": int(max_pages),
                  "hot": check_int("DeviceBlockTables", "hot_blocks", hot_blocks)}
        self._device = device or jax.devices()[0]
        self._arrays = {g: jax.device_put(np.zeros((max_num_reqs, w), np.int32), self._device)
                        for g, w in widths.items()}
        self.rows_sent = 0  # rows transferred so far, for tests and metrics

    @classmethod
    def from_config(cls, config: Any, *, device: jax.Device | None = None) -> DeviceBlockTables:
        """Tables sized by a sizes object (e.g. `hisparse_jax.HiSparseConfig`).

        Reads `config.max_num_reqs`, `config.max_pages` and `config.hot_blocks`.

        Raises:
          ValueError: one of them is None or missing, or not a positive int.
        """
        owner = "DeviceBlockTables.from_config"
        return cls(config_size(config, "max_num_reqs", owner=owner),
                   config_size(config, "max_pages", owner=owner),
                   config_size(config, "hot_blocks", owner=owner), device=device)

    @property
    def src(self) -> jax.Array:
        return self._arrays["src"]

    @property
    def res(self) -> jax.Array:
        return self._arrays["res"]

    @property
    def hot(self) -> jax.Array:
        return self._arrays["hot"]

    def apply(self, update: TableUpdate) -> None:
        """Scatters the changed rows of `update` into the device arrays (donating the old ones).

        One host-to-device copy and one jitted call for all three tables (each a fixed cost of
        tens of microseconds on a GPU host, paid per step): every table's row list is padded to
        the same power-of-two count (at least 8), so one compile per count.

        Raises:
          ValueError: an update's values do not have the table's width (nothing is applied).
        """
        parts: list[TableRows] = [getattr(update, group) for group in GROUPS]
        counts = [len(part) for part in parts]
        if not any(counts):
            return
        tables = [self._arrays[group] for group in GROUPS]
        for group, part, n, table in zip(GROUPS, parts, counts, tables, strict=True):
            if part.values.shape != (n, table.shape[1]):
                raise ValueError(
                    f"{group} update values must have shape ({n}, {table.shape[1]}), "
                    f"got {part.values.shape}")
        size = pow2_bucket(max(counts), MIN_ROWS_BUCKET)
        packed = np.zeros(sum(size * (1 + t.shape[1]) for t in tables), np.int32)
        at = 0
        for part, n, table in zip(parts, counts, tables, strict=True):
            num_rows, width = table.shape
            packed[at:at + size] = num_rows  # padding rows: out of range, dropped
            packed[at:at + n] = part.rows
            values = packed[at + size:at + size * (1 + width)].reshape(size, width)
            values[:n] = part.values
            at += size * (1 + width)
        new = _set_rows(tuple(tables), jax.device_put(packed, self._device), size=size)
        self._arrays = dict(zip(GROUPS, new, strict=True))
        self.rows_sent += sum(counts)

    def as_numpy(self) -> dict[str, np.ndarray]:
        """Copies of the three tables (never views: views would block the next donation)."""
        return {g: np.array(a, copy=True) for g, a in self._arrays.items()}
