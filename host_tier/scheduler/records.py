"""The coordinator's records and result types (standard library only).

Results handed to callers: `Admitted`, `Wait`, `RequestView`, `CapacityError`. Records shared by
the coordinator's parts (`host_tier/scheduler/coordinator.py` composes them): `RequestRecord`
(one admitted request), `SpillRecord` / `RestoreRecord` (one transfer in flight) and `PassLog`
(what the open pass changed besides its tokens). Pages are numbered from 0 per request (page p
holds positions `[p * B, (p + 1) * B)`); blocks are ids of the device or host `BlockPool`, 0 the
null block.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from host_tier.sizes import is_int

if TYPE_CHECKING:
    from host_tier.scheduler.block_tables import BlockTables

ACTIVE_TAIL_PAGES = 2
"""A request's last pages that are never unpinned: an in-flight step may still write them."""

INT64_MIN, INT64_END = -(1 << 63), 1 << 63
"""Token ids are int64: `INT64_MIN <= t < INT64_END`."""


class CapacityError(ValueError):
    """A request that can never fit, whatever else finishes: raised at admission."""


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request was admitted; its first `num_scheduled_tokens` tokens run in the next plan."""

    request_id: Hashable
    state_row: int
    num_cached_tokens: int
    num_scheduled_tokens: int


@dataclasses.dataclass(frozen=True)
class Wait:
    """Not enough of `resource` now ("state_rows", "host_blocks" or "device_blocks").

    Nothing was allocated; retry on a later pass. `reason` says what would release capacity.
    """

    resource: str
    needed: int
    available: int
    reason: str


@dataclasses.dataclass(frozen=True)
class RequestView:
    """Read-only snapshot of one request's residency, for tests, metrics and debugging.

    `host_blocks`, `resident_blocks` (0: read from host) and `hot_blocks` are the request's rows
    of the `src`, `res` and `hot` tables; the page sets are as in `RequestRecord`.
    """

    request_id: Hashable
    state_row: int
    num_computed_tokens: int
    host_blocks: tuple[int, ...]
    resident_blocks: tuple[int, ...]
    hot_blocks: tuple[int, ...]
    hot_required: bool
    valid_pages: frozenset[int]
    pending_pages: frozenset[int]
    unpinned_pages: frozenset[int]
    ready_prefix_pages: int
    published_pages: int


@dataclasses.dataclass(eq=False)
class RequestRecord:
    """Residency bookkeeping of one admitted request (identity-hashed).

    A resident page is dirty (only the device copy is complete), clean (`valid`: the host copy
    completed) or unpinned (clean, its reference released: read until the block is reused).
    `pinned_clean` = valid pages whose resident block is still referenced by the request.

    Invariants (`host_tier/scheduler/invariants.py`): `len(host_blocks) >= len(res_blocks)`;
    `unpinned <= valid`; `pending` and `valid` are disjoint; `ready_prefix` is the number of
    leading valid pages and `num_published <= ready_prefix`; `num_nonresident` counts the null
    entries of `res_blocks`, each of which is a valid page with a host block, read through the
    hot region (`hot` holds 0 or `hot_blocks` blocks); the hashed and the published pages end at
    or before the page of the first placeholder.
    """

    request_id: Hashable
    state_row: int
    token_ids: array.array  # int64; a list of 64K ints would cost every full GC a 64K walk
    num_computed: int
    host_blocks: list[int]  # per page; NULL_BLOCK until a sealed page past the prompt is bound
    res_blocks: list[int]  # per page; NULL_BLOCK once the page is read from host
    valid: set[int] = dataclasses.field(default_factory=set)
    pending: dict[int, int] = dataclasses.field(default_factory=dict)  # page -> spill id
    unpinned: set[int] = dataclasses.field(default_factory=set)
    pinned_clean: set[int] = dataclasses.field(default_factory=set)
    hot: list[int] = dataclasses.field(default_factory=list)
    hot_required: bool = False
    ready_prefix: int = 0  # leading pages that are all valid
    num_published: int = 0  # leading pages published for prefix reuse
    spill_cursor: int = 0  # pages below it are valid, pending or in `unbound`
    # Sealed dirty pages to spill on a later pass: the host pool was full, or the spill failed.
    unbound: set[int] = dataclasses.field(default_factory=set)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    scheduled: int = 0  # tokens scheduled in the current pass
    detached_pages: int = -1  # >= 0 once finished with publications still pending
    num_nonresident: int = 0  # NULL entries of res_blocks (pages read from host)
    failed: bool = False  # a restore into its pages failed: nothing of it is ever published
    # Indices of token ids not known yet (`schedule(num_placeholders=...)` until
    # `set_token_ids`): no page holding one is hashed or published.
    placeholders: set[int] = dataclasses.field(default_factory=set)

    @property
    def prefilling(self) -> bool:
        """Known tokens are not computed yet outside a pass: the prompt is being admitted in
        chunks (`Coordinator.schedule(num_tokens=...)`). Its pages stay pinned until then
        (`ResidencyPolicy`), so a chunk reads every earlier row through `res_blocks`."""
        return self.num_computed + self.scheduled < len(self.token_ids)

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.request_id, state_row=self.state_row,
            num_computed_tokens=self.num_computed, host_blocks=tuple(self.host_blocks),
            resident_blocks=tuple(self.res_blocks), hot_blocks=tuple(self.hot),
            hot_required=self.hot_required, valid_pages=frozenset(self.valid),
            pending_pages=frozenset(self.pending), unpinned_pages=frozenset(self.unpinned),
            ready_prefix_pages=self.ready_prefix, published_pages=self.num_published)


@dataclasses.dataclass(eq=False)
class SpillRecord:
    """A planned write-back of `request`'s page `page`: device block -> host block.

    Holds one reference on `host_block` until completed, and one on `device_block` until
    enqueued (`enqueued` then becomes True).
    """

    transfer_id: int
    request: RequestRecord
    page: int
    device_block: int
    host_block: int
    enqueued: bool = False


@dataclasses.dataclass(eq=False)
class RestoreRecord:
    """A planned copy-on-write restore from the shared `host_block`; holds one reference on it
    until the worker reports the copy enqueued."""

    transfer_id: int
    request: RequestRecord
    host_block: int


@dataclasses.dataclass(eq=False)
class PassLog:
    """What the open pass changed besides its scheduled tokens; `build_plan` reads and clears it.

    Attributes:
      touched: requests whose table rows changed (their `src`/`res`/`hot` rows are re-sent).
      entries: per table ("src", "res"), request -> pages whose entry alone changed (a
        sealed page bound to a host block, a page that lost its resident block: the common
        table changes of a decode step). Of a request not in `touched`, only these entries
        of its rows are compared and written.
      hot_resets: state rows whose hot state is emptied (a new request, a new hot region).
      invalidations: state row -> host blocks newly given to that request, whose rows must not
        be served from its hot state.
    """

    touched: set[RequestRecord] = dataclasses.field(default_factory=set)
    entries: dict[str, dict[RequestRecord, list[int]]] = dataclasses.field(
        default_factory=lambda: {"src": {}, "res": {}})
    hot_resets: set[int] = dataclasses.field(default_factory=set)
    invalidations: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def invalidate(self, r: RequestRecord, new_host_blocks: Sequence[int]) -> None:
        """Host blocks newly given to `r` must not be served from its hot state."""
        if new_host_blocks:
            self.invalidations.setdefault(r.state_row, []).extend(new_host_blocks)

    def entry_changed(self, group: str, r: RequestRecord, page: int) -> None:
        """Entry `page` of `r`'s `group` row ("src" or "res") changed."""
        self.entries[group].setdefault(r, []).append(page)

    def forget(self, r: RequestRecord) -> None:
        """`r` leaves in this pass: its rows are cleared, nothing of it is re-sent."""
        self.touched.discard(r)
        for changed in self.entries.values():
            changed.pop(r, None)
        self.invalidations.pop(r.state_row, None)

    def write_tables(self, tables: BlockTables) -> None:
        """Writes the rows and entries the pass changed into the scheduler's `tables`."""
        for r in self.touched:
            tables.set_row("src", r.state_row, r.host_blocks)
            tables.set_row("res", r.state_row, r.res_blocks)
            tables.set_row("hot", r.state_row, r.hot)
        for group, changed in self.entries.items():  # only these entries changed
            for r, pages in changed.items():
                if r not in self.touched:
                    tables.set_entries(group, r.state_row, pages,
                                       r.host_blocks if group == "src" else r.res_blocks)

    def clear(self) -> None:
        self.touched = set()
        self.entries = {"src": {}, "res": {}}
        self.hot_resets = set()
        self.invalidations = {}


def check_tokens(tokens: Sequence[int], what: str) -> list[int]:
    """`tokens` as a list of ints in the int64 range (ValueError naming `what[i]` otherwise)."""
    out = list(tokens)
    # Fast path (every decode step, every prompt): plain ints in the int64 range.
    if all(type(t) is int for t in out) and (
            not out or (min(out) >= INT64_MIN and max(out) < INT64_END)):
        return out
    out = []
    for i, t in enumerate(tokens):
        if not is_int(t) or not INT64_MIN <= t < INT64_END:
            raise ValueError(f"{what}[{i}] must be an int64 token id, got {t!r}")
        out.append(int(t))
    return out
