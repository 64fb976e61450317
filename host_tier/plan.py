"""The plan that crosses from the `Coordinator` (decides) to the `TransferEngine` (moves bytes).

Plain frozen dataclasses (and one named tuple) of ints and small numpy arrays (standard library
and numpy only): no jax arrays, nothing to sync. The scheduler side (`host_tier.scheduler`)
builds them, the worker side (`host_tier.worker`) and the data plane consume them. The worker
applies one `StepPlan` per model step, in this order:

  1. `tables`: changed rows of the per-request block tables (`DeviceBlockTables.apply`);
  2. `hot_resets`, then `hot_invalidations`: hot-state rows to empty, and hot entries that point
     at host blocks newly allocated to their request (the data plane's `apply_hot_updates`,
     `hisparse_jax/state.py`);
  3. `restores`: host -> device page copies that must land before the forward reads them;
  4. the forward itself, which writes the KV rows of `writes`;
  5. `spills`: device -> host page copies of pages sealed by this or earlier steps
     (write-backs), enqueued after the forward without waiting for them.

Then the worker reports each transfer id back (`TransferReport`): spills once enqueued and once
completed, restores once enqueued; a copy that raised is reported failed instead. Every plan the
coordinator builds must be executed, in order.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

GROUPS = ("src", "res", "hot")
"""The three per-request block tables, in `TableUpdate` field order (see
`host_tier/scheduler/block_tables.py`)."""


@dataclasses.dataclass(frozen=True)
class PageSpill:
    """Write back one sealed page: device block `device_block` -> host block `host_block`.

    All `block_size` rows of the page, on every layer. The device block stays pinned until the
    worker reports the copy enqueued, the host block until it reports it completed.
    """

    transfer_id: int
    device_block: int
    host_block: int


@dataclasses.dataclass(frozen=True)
class PageRestore:
    """Copy rows `[0, num_rows)` of host block `host_block` into device block `device_block`.

    Used for a partial prefix hit (copy-on-write): the shared host page is never written; the
    request gets a private host block, and the shared rows reach it through its resident page,
    restored here before the forward and spilled once sealed. The host block stays referenced
    until the worker reports the copy enqueued.
    """

    transfer_id: int
    host_block: int
    device_block: int
    num_rows: int


class StepWrite(NamedTuple):
    """The forward of this step writes the KV rows of positions `[start, start + num_tokens)`.

    A named tuple, not a dataclass: a plan holds one per scheduled request, and a frozen
    dataclass took three times as long to build (hundreds per step, on the host's critical
    path between model steps)."""

    request_id: object
    state_row: int
    start: int
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class HotInvalidation:
    """Hot slots of state row `state_row` that hold a row of one of `host_blocks` become empty."""

    state_row: int
    host_blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TableRows:
    """Changed rows of one block table.

    Attributes:
      rows: int32[R], distinct state rows.
      values: int32[R, width], the full new content of each row (0 = null block).
    """

    rows: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return int(self.rows.shape[0])


@dataclasses.dataclass(frozen=True)
class TableUpdate:
    """Changed rows of the host-source (`src`), resident (`res`) and hot (`hot`) tables."""

    src: TableRows
    res: TableRows
    hot: TableRows

    def __len__(self) -> int:
        return len(self.src) + len(self.res) + len(self.hot)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the worker does for one step besides the model itself (see module docstring)."""

    step: int
    writes: tuple[StepWrite, ...]
    tables: TableUpdate
    hot_resets: tuple[int, ...]
    hot_invalidations: tuple[HotInvalidation, ...]
    restores: tuple[PageRestore, ...]
    spills: tuple[PageSpill, ...]

    @property
    def transfer_ids(self) -> tuple[int, ...]:
        return tuple(r.transfer_id for r in self.restores) + tuple(
            s.transfer_id for s in self.spills)


@dataclasses.dataclass(frozen=True)
class TransferReport:
    """What the worker reports back: transfer ids newly enqueued, completed and failed.

    Each spill id appears once in `enqueued` and once in `completed` (possibly in different
    reports, and completions may arrive before the enqueue notice), or once in `failed` (its
    copy raised; possibly after its enqueue notice, never after its completion); each restore
    id appears once, in `enqueued` or in `failed`. A failed restore is reported no later than
    the completion of any spill planned after it (the worker knows it before the forward).
    """

    enqueued: tuple[int, ...] = ()
    completed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.enqueued or self.completed or self.failed)
