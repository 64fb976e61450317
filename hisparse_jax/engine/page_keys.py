"""`PageKeys`: the engine's side of prefix caching's per-seat arrays (the index keys).

The coordinator publishes pages of KV rows; the model's per-seat arrays (`DecodeCache.
index_keys`) are no part of them, so the engine keeps a host copy of every sealed page's
values in an `IndexKeyStore` (`prefix_keys.py`: lifecycle and bounds), copied out of the
request's seat when the page seals (`stage`, or at publication, `on_publish`) and written
into a new seat before a prefix hit's prefill (`load`). Pages are named by their chained
content hash (`host_tier.scheduler.prefix_cache.page_hash`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hisparse_jax.engine.prefix_keys import IndexKeyStore
from hisparse_jax.engine.request import Request
from host_tier.scheduler.prefix_cache import page_hash


def recorded_rows(req: Request) -> int:
    """Leading rows of `req`'s seat whose tokens the engine has recorded, so final on the
    device: its prefilled prompt tokens, then prompt + generated tokens of this admission
    (`live`: accepted drafts included once recorded, an asynchronous step's pending token
    once collected). Rows past them may still change: a rejected draft's row is rewritten by
    the next step."""
    return req.num_prefilled if req.prefilling else len(req.prompt) + req.live


class PageKeys:
    """Index keys of published pages for one engine (module docstring).

    Args:
      scheduler: the engine's `Scheduler` (its running requests and manager).
      runner: the engine's `Runner` (reads a seat's pages at publication).
      block_size: B, tokens per page.
    """

    def __init__(self, scheduler: Any, runner: Any, block_size: int) -> None:
        self.store = IndexKeyStore()
        self.scheduler, self.runner, self.block_size = scheduler, runner, block_size
        self.owners: set[Hashable] = set()  # requests that staged keys
        scheduler.manager.listen(on_publish=self.on_publish,
                                 on_unpublish=self.store.on_unpublish)

    def page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """The chained hashes of `req`'s first `num_pages` full pages of tokens (prompt, then
        generated), as the coordinator names its pages (`host_tier`'s `page_hash`)."""
        B, hashes = self.block_size, req.page_hashes
        if len(hashes) < num_pages:
            tokens = req.tokens
            while len(hashes) < num_pages:
                p = len(hashes)
                hashes.append(page_hash(hashes[-1] if hashes else None,
                                        tokens[p * B:(p + 1) * B]))
        return hashes[:num_pages]

    def stage(self, req: Request, num_written: int, runner: Any) -> None:
        """Keeps the keys of `req`'s pages sealed since the last call (its seat in `runner`
        holds rows [0, num_written), at most `recorded_rows`: never a draft's row): they may
        be published later (`prefix_keys.py`)."""
        assert num_written <= recorded_rows(req), (
            f"request {req.request_id!r}: rows [0, {num_written}) staged, only "
            f"{recorded_rows(req)} recorded")
        pages = num_written // self.block_size
        if pages <= req.key_pages:
            return
        store, hashes = self.store, self.page_hashes(req, pages)
        new = [p for p in range(req.key_pages, pages) if hashes[p] not in store]
        fresh = (dict(zip(new, runner.read_page_keys_later(req.seat, new), strict=True))
                 if new else {})
        for p in range(req.key_pages, pages):  # kept already: this request may publish it too
            store.stage(req.request_id, hashes[p], fresh.get(p, store.keys.get(hashes[p])))
        self.owners.add(req.request_id)
        req.key_pages = pages

    def on_publish(self, request_id: Hashable, page: int, h: bytes) -> None:
        """The coordinator published `page` of a request (`Coordinator.listen`): its keys are
        kept from then on; copied from its seat now if its step has not staged them yet (the
        page sealed in this step's decode, whose tokens are collected after the reports).

        Only rows of tokens the engine recorded are ever copied (`recorded_rows`): the rows
        of a speculative step's drafts, rejected ones included, are never counted by the
        coordinator, so they seal and publish nothing, and the rows of an asynchronous step's
        pending token publish once their id is set. AssertionError otherwise."""
        store = self.store
        if store.on_publish(h):
            return
        req = self.scheduler.running.get(request_id)
        if req is None or req.seat < 0:
            return  # keys unknown: a prompt hitting this page fails its prefill (never seen)
        assert (page + 1) * self.block_size <= recorded_rows(req), (
            f"request {request_id!r}: page {page} published before its tokens were recorded")
        (keys,) = self.runner.read_page_keys_later(req.seat, [page])
        store.stage(request_id, h, keys)
        self.owners.add(request_id)
        store.on_publish(h)

    def prune(self) -> None:
        """Drops the staged keys of requests that can no longer publish them."""
        running = self.scheduler.running
        gone = [rid for rid in self.owners if rid not in running]
        if gone:
            self.store.prune(gone, self.scheduler.manager.publishes)
            self.owners.difference_update(rid for rid in gone if rid not in self.store.owners)

    def load(self, req: Request, runner: Any) -> None:
        """Writes the index keys of `req`'s prefix hit (pages covering its `num_cached`
        tokens) into its seat, before the prefill of the rest reads them."""
        pages = -(-req.num_cached // self.block_size)
        keys = [self.store.get(h) for h in self.page_hashes(req, pages)]
        missing = [p for p, k in enumerate(keys) if k is None]
        if missing:
            raise RuntimeError(f"prefix hit on pages {missing} whose index keys are not kept")
        runner.write_page_keys(req.seat, list(enumerate(keys)))
