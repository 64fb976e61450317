"""`DeviceBlockTables`: the worker's copy of the per-request block tables, as device arrays.

Three int32 device arrays, `src [S, max_pages]`, `res [S, max_pages]` and `hot [S, hot_blocks]`
(S = max_num_reqs); their meaning, the null block 0 and the row layout are those of the
scheduler's `BlockTables` (`host_tier/scheduler/block_tables.py`). `apply` takes the
`TableUpdate` of each `StepPlan` (`host_tier/plan.py`), which carries only the rows that changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from host_tier.plan import GROUPS, TableRows, TableUpdate
from host_tier.sizes import check_int, config_size, pow2_bucket

__all__ = ["DeviceBlockTables"]

MIN_ROWS_BUCKET = 8
"""Row counts of an update are padded to a power of two, at least this, to bound compiles."""


def table_update_size(tables: Sequence[Any], size: int) -> int:
    """Length of a packed update of `size` rows per table (`set_rows`) for arrays of the
    tables' shapes."""
    return sum(size * (1 + t.shape[1]) for t in tables)


def set_rows(tables: tuple[jax.Array, ...], packed: jax.Array, *, size: int
             ) -> tuple[jax.Array, ...]:
    """Every table's changed rows (traceable: also runs inside a caller's jit, e.g. a decode
    step that folds a deferred update, `DeviceBlockTables.take_deferred`): `packed` int32
    holds, for each table in order, `size` row indices (padded with an out-of-range index:
    dropped) then their `size` x width values, flattened (`DeviceBlockTables.pack`)."""
    out, at = [], 0
    for table in tables:
        width = table.shape[1]
        rows = packed[at:at + size]
        values = packed[at + size:at + size * (1 + width)].reshape(size, width)
        out.append(table.at[rows].set(values, mode="drop"))
        at += size * (1 + width)
    return tuple(out)


_set_rows = jax.jit(set_rows, donate_argnums=(0,), static_argnames=("size",))


class DeviceBlockTables:
    """Worker-side tables as int32 device arrays `src [S, P]`, `res [S, P]`, `hot [S, Hb]`.

    `apply` re-sends only the changed rows (padded to a power-of-two count, at least 8, shared
    by the three tables) and updates the arrays in place (the previous arrays are donated:
    read the properties after each `apply`).

    `defer` keeps a small update for the next caller that applies it inside its own jitted
    call (`take_deferred` / `adopt`: a decode step folds it into its executable, saving one
    launch and one host-to-device copy per step); reading a table property first applies an
    update still deferred, so every reader sees the latest rows.

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
        self.rows_folded = 0  # of which inside a caller's call (`take_deferred`)
        self._deferred: TableUpdate | None = None

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
        self.flush()
        return self._arrays["src"]

    @property
    def res(self) -> jax.Array:
        self.flush()
        return self._arrays["res"]

    @property
    def hot(self) -> jax.Array:
        self.flush()
        return self._arrays["hot"]

    def apply(self, update: TableUpdate) -> None:
        """Scatters the changed rows of `update` into the device arrays (donating the old ones).

        One host-to-device copy and one jitted call for all three tables (each a fixed cost of
        tens of microseconds on a GPU host, paid per step): every table's row list is padded to
        the same power-of-two count (at least 8), so one compile per count.

        Raises:
          ValueError: an update's values do not have the table's width (nothing is applied).
        """
        self.flush()
        counts = self._check(update)
        if not any(counts):
            return
        size = pow2_bucket(max(counts), MIN_ROWS_BUCKET)
        self._send(self.pack(update, size), size)
        self.rows_sent += sum(counts)

    def _check(self, update: TableUpdate) -> list[int]:
        """Each table's row count in `update`, after checking the values' widths."""
        counts = []
        for group in GROUPS:
            part: TableRows = getattr(update, group)
            n, width = len(part), self._arrays[group].shape[1]
            if part.values.shape != (n, width):
                raise ValueError(f"{group} update values must have shape ({n}, {width}), "
                                 f"got {part.values.shape}")
            counts.append(n)
        return counts

    def _send(self, packed: np.ndarray, size: int) -> None:
        tables = tuple(self._arrays[group] for group in GROUPS)
        new = _set_rows(tables, jax.device_put(packed, self._device), size=size)
        self._arrays = dict(zip(GROUPS, new, strict=True))

    def packed_size(self, size: int) -> int:
        """Length of a packed update of `size` rows per table (`pack`)."""
        return table_update_size(list(self._arrays.values()), size)

    def pack(self, update: TableUpdate | None, size: int) -> np.ndarray:
        """`update` as the int32 array `set_rows` takes: per table `size` row indices, then
        their values; padding rows (and an empty or None update) carry an out-of-range row
        index, dropped by the scatter. Each table changes at most `size` rows."""
        packed = np.zeros(self.packed_size(size), np.int32)
        at = 0
        for group in GROUPS:
            num_rows, width = self._arrays[group].shape
            packed[at:at + size] = num_rows  # padding rows: out of range, dropped
            if update is not None:
                part: TableRows = getattr(update, group)
                n = len(part)
                packed[at:at + n] = part.rows
                packed[at + size:at + size * (1 + width)].reshape(size, width)[:n] = part.values
            at += size * (1 + width)
        return packed

    def defer(self, update: TableUpdate, *, max_rows: int) -> None:
        """Keeps `update` for the next `take_deferred` caller when no table changes more than
        `max_rows` rows (else applies it now, as `apply`). An update deferred earlier and not
        taken is applied first: updates reach the tables in order.

        Raises:
          ValueError: as `apply` (nothing is kept or applied).
        """
        self.flush()
        counts = self._check(update)
        if not any(counts):
            return
        if max(counts) > max_rows:
            self.apply(update)
            return
        self._deferred = update

    def flush(self) -> None:
        """Applies an update still deferred (no-op without one)."""
        if self._deferred is None:
            return
        update, self._deferred = self._deferred, None
        self.apply(update)

    def take_deferred(self, size: int) -> tuple[tuple[jax.Array, ...], np.ndarray]:
        """The three arrays (src, res, hot) as they are, and the deferred update packed for
        `size` rows per table (`pack`; all padding when nothing is deferred, or when the
        deferred update has more rows than `size`: then it is applied first). The caller runs
        `set_rows(arrays, packed, size=size)` inside its jitted call (donating the arrays)
        and hands the result to `adopt`; until then the deferred update stays kept, so a call
        that fails leaves it to the next reader."""
        if self._deferred is not None and max(
                len(getattr(self._deferred, g)) for g in GROUPS) > size:
            self.flush()
        return tuple(self._arrays[g] for g in GROUPS), self.pack(self._deferred, size)

    def adopt(self, arrays: tuple[jax.Array, ...]) -> None:
        """Takes the arrays a `take_deferred` caller returned: the deferred update is in
        them now."""
        self._arrays = dict(zip(GROUPS, arrays, strict=True))
        if self._deferred is not None:
            self.rows_sent += len(self._deferred)
            self.rows_folded += len(self._deferred)
            self._deferred = None

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        """(src, res, hot) as they are, without applying a deferred update (e.g. to check
        whether they were lost)."""
        return tuple(self._arrays[g] for g in GROUPS)

    def as_numpy(self) -> dict[str, np.ndarray]:
        """Copies of the three tables (never views: views would block the next donation)."""
        self.flush()
        return {g: np.array(a, copy=True) for g, a in self._arrays.items()}
