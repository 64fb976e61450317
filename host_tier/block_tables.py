"""Per-request block tables: host source (`src`), resident (`res`) and hot (`hot`) pages.

Both sides keep one table per group with one row per request state row (`0 <= s < max_num_reqs`):

  - `src[s, p]`: host block of page `p` (host row of position t: `src[s, t // B] * B + t % B`);
  - `res[s, p]`: device block of resident page `p`, 0 when the page is read from host;
  - `hot[s, j]`: device block of page `j` of the request's hot region (slot `i` lives at device
    row `hot[s, i // B] * B + i % B`), all 0 while the request has no hot region.

Block 0 is the null block; unused entries and rows are 0. The jitted step reads these by state row
(gather `table[state_rows]` for its batch).

`BlockTables` (scheduler side, numpy) records which rows changed; `take_update` hands only those
to the worker, and `DeviceBlockTables.apply` scatters them into padded int32 device arrays.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from host_tier.plan import TableRows, TableUpdate

GROUPS = ("src", "res", "hot")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class BlockTables:
    """Scheduler-side copy of the three tables, tracking rows that changed since the last update.

    Args:
      max_num_reqs: state rows S.
      max_pages: width of `src` and `res`, ceil(max_model_len / B).
      hot_blocks: width of `hot`, pages of one hot region.
    """

    def __init__(self, max_num_reqs: int, max_pages: int, hot_blocks: int) -> None:
        _check_positive("max_num_reqs", max_num_reqs)
        _check_positive("max_pages", max_pages)
        _check_positive("hot_blocks", hot_blocks)
        self.widths = {"src": max_pages, "res": max_pages, "hot": hot_blocks}
        self._tables = {g: np.zeros((max_num_reqs, w), np.int32) for g, w in self.widths.items()}
        self._dirty: dict[str, set[int]] = {g: set() for g in GROUPS}

    @property
    def max_num_reqs(self) -> int:
        return self._tables["src"].shape[0]

    def set_row(self, group: str, state_row: int, blocks: Sequence[int]) -> None:
        """Sets row `state_row` of `group` to `blocks` padded with 0; marks it only if it changed.

        Raises:
          ValueError: unknown group, state row out of range, or more blocks than the table width.
        """
        table = self._table(group)
        if not 0 <= state_row < table.shape[0]:
            raise ValueError(f"state_row must be in [0, {table.shape[0]}), got {state_row}")
        if len(blocks) > table.shape[1]:
            raise ValueError(
                f"{group} table rows hold {table.shape[1]} blocks, got {len(blocks)} "
                f"(for src/res: more pages than max_model_len allows)")
        new = np.zeros(table.shape[1], np.int32)
        new[: len(blocks)] = blocks
        if not np.array_equal(new, table[state_row]):
            table[state_row] = new
            self._dirty[group].add(state_row)

    def clear_row(self, state_row: int) -> None:
        for group in GROUPS:
            self.set_row(group, state_row, ())

    def row(self, group: str, state_row: int) -> np.ndarray:
        """A copy of one row."""
        return self._table(group)[state_row].copy()

    def take_update(self) -> TableUpdate:
        """The rows changed since the previous call (copies), and forgets them."""
        parts = {}
        for group in GROUPS:
            if not self._dirty[group]:  # the common decode step: nothing changed
                parts[group] = TableRows(rows=np.zeros(0, np.int32),
                                         values=np.zeros((0, self._tables[group].shape[1]),
                                                         np.int32))
                continue
            rows = np.array(sorted(self._dirty[group]), np.int32)
            parts[group] = TableRows(rows=rows, values=self._tables[group][rows].copy())
            self._dirty[group].clear()
        return TableUpdate(**parts)

    def full_update(self) -> TableUpdate:
        """Every row of every table, e.g. for a worker that starts from scratch."""
        rows = np.arange(self.max_num_reqs, dtype=np.int32)
        return TableUpdate(**{g: TableRows(rows=rows, values=self._tables[g].copy())
                              for g in GROUPS})

    def _table(self, group: str) -> np.ndarray:
        if group not in self._tables:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
        return self._tables[group]


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_rows(table: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    # rows padded with an out-of-range index: those updates are dropped.
    return table.at[rows].set(values, mode="drop")


def _bucket(n: int) -> int:
    """Row counts are padded to a power of two (at least 8) to bound recompilations."""
    return max(8, 1 << (n - 1).bit_length())


class DeviceBlockTables:
    """Worker-side tables as int32 device arrays `src [S, P]`, `res [S, P]`, `hot [S, Hb]`.

    `apply` re-sends only the changed rows (padded to a power-of-two count) and updates the
    arrays in place (the previous arrays are donated: read the properties after each `apply`).
    """

    def __init__(self, max_num_reqs: int, max_pages: int, hot_blocks: int,
                 *, device: jax.Device | None = None) -> None:
        _check_positive("max_num_reqs", max_num_reqs)
        _check_positive("max_pages", max_pages)
        _check_positive("hot_blocks", hot_blocks)
        self._device = device or jax.devices()[0]
        widths = {"src": max_pages, "res": max_pages, "hot": hot_blocks}
        self._arrays = {g: jax.device_put(np.zeros((max_num_reqs, w), np.int32), self._device)
                        for g, w in widths.items()}
        self.rows_sent = 0  # rows transferred so far, for tests and metrics

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
        for group in GROUPS:
            part: TableRows = getattr(update, group)
            n = len(part)
            if n == 0:
                continue
            table = self._arrays[group]
            num_rows, width = table.shape
            if part.values.shape != (n, width):
                raise ValueError(
                    f"{group} update values must have shape ({n}, {width}), "
                    f"got {part.values.shape}")
            size = _bucket(n)
            rows = np.full(size, num_rows, np.int32)
            rows[:n] = part.rows
            values = np.zeros((size, width), np.int32)
            values[:n] = part.values
            self._arrays[group] = _set_rows(table, jax.device_put(rows, self._device),
                                            jax.device_put(values, self._device))
            self.rows_sent += n

    def as_numpy(self) -> dict[str, np.ndarray]:
        """Copies of the three tables (never views: views would block the next donation)."""
        return {g: np.array(a, copy=True) for g, a in self._arrays.items()}

