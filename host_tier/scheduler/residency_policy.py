"""`ResidencyPolicy`: which resident pages a request keeps pinned (standard library only).

The residency semantics are written down in `docs/semantics.md`. In short:

  - a request "can read from host" once it owns a hot region (`hot_blocks` device blocks).
    While the device pool has at least `watermark + room` free blocks
    (`watermark = max(hot_blocks, num_gpu_blocks // 10)`, `room` set by `request_room`),
    requests keep their pages pinned; below it they ask for a hot region (`hot_required`),
    granted when the request is next scheduled (`grant_hot_region`, counted in the blocks the
    schedule needs: `schedule_need`). A request also asks once it holds
    `ask_at_tokens = (usable blocks - hot_blocks) * B - 1` tokens (`capacity.ask_at_tokens`):
    the last moment at which, alone in the pool, its pages, the pages of its next two
    one-token steps and a hot region still fit (the lone-request rule of `docs/semantics.md`);
  - a request that can read from host unpins every clean page except its last
    `ACTIVE_TAIL_PAGES`: the block counts as free in the device pool yet is still read
    (`readers`) until the pool hands it to someone else; then the owner's `res` entry becomes
    null and the page is read from host (`lose_page`);
  - `offload_all` (the naive-offload baseline): every request asks for a hot region from its
    first step, and an unpinned page is lost at once;
  - a request whose prompt is admitted in chunks keeps every page pinned and asks for no hot
    region until its last chunk is computed (`RequestRecord.prefilling`): a chunk reads the
    earlier chunks' rows through its resident pages.

Every resident block is released through `release_device_page`, whose reuse watcher also drops
the block from the prefix cache's index of device copies (`forget_copy`).

Invariants (checked in `host_tier/scheduler/invariants.py`): every `readers` entry `(r, p)` is a
running request whose page p is unpinned and still points at the block; an unpinned block is
never a dirty page or a hot region.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.capacity import ask_at_tokens
from host_tier.scheduler.records import ACTIVE_TAIL_PAGES, PassLog, RequestRecord
from host_tier.sizes import cdiv, is_int


class ResidencyPolicy:
    """The watermark policy over one device pool.

    Args:
      device_pool: resident pages and hot regions.
      hot_blocks: device blocks of one hot region.
      block_size: B, tokens per page.
      offload_all: the naive-offload baseline (see module docstring).
      log: the open pass's changes (requests whose rows change, hot resets).
      stats: counters shared with the coordinator ("hot_grants", "unpinned_pages",
        "lost_pages").
      forget_copy: called with a device block when the pool hands it out again.
    """

    def __init__(self, device_pool: BlockPool, *, hot_blocks: int, block_size: int,
                 offload_all: bool, log: PassLog, stats: collections.Counter[str],
                 forget_copy: Callable[[int], None]) -> None:
        self.device_pool = device_pool
        self.hot_blocks = hot_blocks
        self.block_size = block_size
        self.offload_all = bool(offload_all)
        self.watermark = max(hot_blocks, device_pool.num_blocks // 10)
        # A request holding this many computed tokens asks for a hot region whatever the free
        # count: cdiv(tokens + 2, B) + hot_blocks would exceed the usable blocks.
        self.ask_at_tokens = ask_at_tokens(num_usable=device_pool.num_usable,
                                           hot_blocks=hot_blocks, block_size=block_size)
        self.room = 0  # device blocks a waiting admission asked for (`request_room`)
        self.log = log
        self.stats = stats
        self.forget_copy = forget_copy
        # Unpinned device block -> (request, page) pairs still reading it.
        self.readers: dict[int, set[tuple[RequestRecord, int]]] = {}

    def request_room(self, num_blocks: int) -> None:
        """Treat the pool as under pressure while fewer than `watermark + num_blocks` blocks
        are free (0 cancels).

        Raises:
          ValueError: `num_blocks` is not an int >= 0.
        """
        if not is_int(num_blocks) or num_blocks < 0:
            raise ValueError(f"request_room: num_blocks must be an int >= 0, got {num_blocks!r}")
        self.room = int(num_blocks)

    def update(self, r: RequestRecord) -> None:
        """After `r`'s step: ask for a hot region under pressure or once it holds
        `ask_at_tokens` tokens, or unpin its clean pages outside the tail once it has one (tail
        first: heads survive longer). A request whose prompt is still being computed in chunks
        (`RequestRecord.prefilling`) does neither: its next chunk reads every earlier row
        through its resident pages, so it asks (and unpins) after its last chunk."""
        if r.prefilling:
            return
        if not r.hot:
            if (self.device_pool.num_free >= self.watermark + self.room
                    and r.num_computed < self.ask_at_tokens and not self.offload_all):
                return
            r.hot_required = True  # granted when the request is next scheduled
            return
        if not r.pinned_clean:
            return
        tail_start = len(r.res_blocks) - ACTIVE_TAIL_PAGES
        for p in sorted(r.pinned_clean, reverse=True):
            if p < tail_start:
                self.unpin_page(r, p)

    def schedule_need(self, r: RequestRecord, page_end: int) -> tuple[int, int]:
        """(new pages, device blocks) for `r` to hold rows `[0, page_end)`: the resident pages
        it opens, and the blocks they take with the hot region granted at the same time (one is
        asked for and not granted yet)."""
        new_pages = max(cdiv(page_end, self.block_size) - len(r.res_blocks), 0)
        return new_pages, new_pages + (self.hot_blocks if r.hot_required and not r.hot else 0)

    def grant_hot_region(self, r: RequestRecord) -> None:
        """Gives `r` its hot region now (the caller checked that the blocks are free)."""
        r.hot = self.device_pool.allocate(self.hot_blocks)
        self.log.hot_resets.add(r.state_row)
        self.stats["hot_grants"] += 1

    def page_clean(self, r: RequestRecord, page: int) -> None:
        """Page `page` of running request `r` got its completed host copy."""
        r.pinned_clean.add(page)
        if r.hot and not r.prefilling and page < len(r.res_blocks) - ACTIVE_TAIL_PAGES:
            self.unpin_page(r, page)

    def unpin_page(self, r: RequestRecord, page: int) -> None:
        block = r.res_blocks[page]
        self.readers.setdefault(block, set()).add((r, page))
        r.pinned_clean.discard(page)
        r.unpinned.add(page)
        self.release_device_page(block)
        self.stats["unpinned_pages"] += 1
        if self.offload_all:  # lost at once: read from host from the next step on
            readers = self.readers[block]
            readers.discard((r, page))
            if not readers:
                del self.readers[block]
            self.lose_page(r, page)

    def release_device_page(self, block: int) -> None:
        """Drops one reference on a resident page's block, watching for its reuse.

        Resident pages are always released with the watcher, so that a device copy indexed by
        the prefix cache or read by an unpinned page is forgotten the moment the block is
        reused."""
        self.device_pool.unpin([block], self._on_device_block_reused)

    def _on_device_block_reused(self, block: int) -> None:
        self.forget_copy(block)
        for r, page in self.readers.pop(block, ()):
            self.lose_page(r, page)

    def lose_page(self, r: RequestRecord, page: int) -> None:
        """An unpinned page loses its device block: its owner reads it from host from now on."""
        r.res_blocks[page] = NULL_BLOCK
        r.num_nonresident += 1
        r.unpinned.discard(page)
        self.log.entry_changed("res", r, page)
        self.stats["lost_pages"] += 1

    def release_pages(self, r: RequestRecord) -> None:
        """`r` leaves: its resident pages are released (tail first: heads survive longer; an
        unpinned page only stops being read) and its hot region is freed."""
        for p in reversed(range(len(r.res_blocks))):
            block = r.res_blocks[p]
            if block == NULL_BLOCK:
                continue
            if p in r.unpinned:
                readers = self.readers[block]
                readers.discard((r, p))
                if not readers:
                    del self.readers[block]
            else:
                self.release_device_page(block)
        r.res_blocks = []
        r.unpinned.clear()
        r.pinned_clean.clear()
        if r.hot:
            self.device_pool.free(r.hot)
            r.hot = []
