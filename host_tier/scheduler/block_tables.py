"""`BlockTables`: the scheduler's copy of the per-request block tables (numpy only).

One table per group, one row per request state row (`0 <= s < max_num_reqs`), int32:

  - `src[s, p]` (`[S, max_pages]`): host block of page `p` (host row of position t:
    `src[s, t // B] * B + t % B`);
  - `res[s, p]` (`[S, max_pages]`): device block of resident page `p`, 0 when the page is read
    from host;
  - `hot[s, j]` (`[S, hot_blocks]`): device block of page `j` of the request's hot region (slot
    `i` lives at device row `hot[s, i // B] * B + i % B`), all 0 while the request has no hot
    region.

Block 0 is the null block; unused entries and rows are 0. The jitted step reads these by state
row (gather `table[state_rows]` for its batch).

`BlockTables` records which rows changed; `take_update` hands only those to the worker, whose
`DeviceBlockTables` (`host_tier/worker/device_tables.py`) scatters them into its device arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from host_tier.plan import GROUPS, TableRows, TableUpdate
from host_tier.sizes import check_int

__all__ = ["GROUPS", "BlockTables"]

_CHUNK = 64  # entries `set_row` compares at a time to find the span that changed


def _bisect(lo: int, hi: int, right: Callable[[int, int], bool]) -> tuple[int, int]:
    """Halves `[lo, hi)` down to `_CHUNK` entries, keeping the upper half where
    `right(lo, mid)` and the lower half otherwise; returns the last `(lo, hi)`."""
    while hi - lo > _CHUNK:
        mid = (lo + hi) // 2
        if right(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


class BlockTables:
    """Scheduler-side copy of the three tables, tracking rows that changed since the last update.

    Args:
      max_num_reqs: state rows S.
      max_pages: width of `src` and `res`, ceil(max_model_len / B).
      hot_blocks: width of `hot`, pages of one hot region.
    """

    def __init__(self, max_num_reqs: int, max_pages: int, hot_blocks: int) -> None:
        max_num_reqs = check_int("BlockTables", "max_num_reqs", max_num_reqs)
        self.widths = {"src": check_int("BlockTables", "max_pages", max_pages),
                       "res": int(max_pages),
                       "hot": check_int("BlockTables", "hot_blocks", hot_blocks)}
        self._tables = {g: np.zeros((max_num_reqs, w), np.int32) for g, w in self.widths.items()}
        self._dirty: dict[str, set[int]] = {g: set() for g in GROUPS}
        # Each row's blocks as last set (a list; the table holds them padded with 0): `set_row`
        # compares lists, far cheaper than converting them to numpy.
        self._rows: dict[str, list[list[int]]] = {g: [[] for _ in range(max_num_reqs)]
                                                  for g in GROUPS}

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
        old = self._rows[group][state_row]
        new = blocks if type(blocks) is list else list(blocks)
        if new == old:  # the common case (list comparisons run in C)
            return
        m = len(old)
        if len(new) > m and new[:m] == old:  # grown (a page opened), the rest unchanged
            tail = new[m:]
            old += tail  # the row as last set is this object's own copy
            if any(tail):
                table[state_row, m:len(new)] = tail
                self._dirty[group].add(state_row)
            return
        new = new.copy()
        # Converting a Python list to numpy costs ~35 ns an entry, and rows are max_pages wide
        # while a step changes a few entries (a page opened or bound near the tail, a page
        # lost): bisect (list comparisons run in C) for the span that changed, write only it.
        n, m = len(new), len(old)
        common, end = min(n, m), max(n, m)
        if n != m and new[:common] == old[:common]:  # grown or shrunk, the rest unchanged
            if not (any(new[common:]) or any(old[common:])):
                self._rows[group][state_row] = new
                return  # the same row once padded with 0
            lo = common
        else:
            # The first chunk that differs (new[:lo] == old[:lo]) and, for rows of one length,
            # the last (new[end:] == old[end:]).
            lo = _bisect(0, common, lambda a, mid: new[a:mid] == old[a:mid])[0]
            if n == m:
                end = _bisect(lo, n, lambda a, mid: new[mid:n] != old[mid:n])[1]
        table[state_row, lo:end] = new[lo:end] + [0] * (end - n)
        self._dirty[group].add(state_row)
        self._rows[group][state_row] = new

    def set_entries(self, group: str, state_row: int, entries: Sequence[int],
                    blocks: Sequence[int]) -> None:
        """`set_row(group, state_row, blocks)` for a caller that knows the row differs from
        the row last set at most at indices `entries`: compares and writes only those (a
        decode step changes an entry or two of a row thousands of entries wide). A row of
        another length is set by `set_row`.

        Raises:
          ValueError: as `set_row`.
        """
        table = self._table(group)
        if not 0 <= state_row < table.shape[0]:
            raise ValueError(f"state_row must be in [0, {table.shape[0]}), got {state_row}")
        old = self._rows[group][state_row]  # this object's own copy (`set_row` copies)
        if len(old) != len(blocks):
            self.set_row(group, state_row, blocks)
            return
        changed = [i for i in entries if old[i] != blocks[i]]
        if not changed:
            return
        values = [blocks[i] for i in changed]
        for i, value in zip(changed, values, strict=True):
            old[i] = value
        table[state_row, changed] = values
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
