"""`PrefixCache`: prefix reuse of durable host pages (standard library only).

A full page is named by a chained content hash (`page_hash`: it depends on every token of the
prefix up to the page's end). The cache

  - finds a prompt's published prefix in the host `BlockPool` (`match`), and decides the
    copy-on-write: when the reusable prefix ends inside a page (the last prompt token is always
    recomputed), that page's shared host block is never written; its rows are restored into the
    request's private resident page instead (`PrefixHit.cow_source`);
  - says what an admission with a hit allocates (`PrefixHit.admission_need`: the hit's whole
    pages need no new host block, and no resident page unless hits are made resident);
  - publishes a request's pages once their host copies completed and every earlier page is
    durable too (`advance_and_publish`): the host pool's hash index names them from then on;
    a finished request with copies in flight publishes once they complete (`detach`, `settle`);
    a page holding a token id the caller does not know yet (a placeholder) is neither hashed
    nor published until the id is set;
  - indexes device blocks holding a copy of a published page (`copies`), for as long as the
    block is not reused (`forget_block`), and lets later prefix hits adopt them (`adopt`).

Invariants (checked in `host_tier/scheduler/invariants.py`): `copies` and `copy_of_block` are
inverse maps; an indexed device copy is never a dirty page or a hot region.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.records import RequestRecord
from host_tier.sizes import cdiv


def page_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained content hash of one full page (16 bytes): depends on every token of the prefix.

    Args:
      parent: the hash of the previous page, None for page 0.
      tokens: the page's B token ids (int64).
    """
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


class AdmissionNeed(NamedTuple):
    """What an admission allocates (`PrefixHit.admission_need`).

    Attributes:
      resident_pages: new resident pages of the first chunk (past the hit's whole pages).
      hot_region: whether it takes a hot region (a staged hit reads its pages from host).
      device_blocks: device blocks it allocates: the new pages, the hot region, and with
        resident hits a block per hit page (an adopted device copy needs none: an upper
        bound).
      host_blocks: host blocks it allocates: one per prompt page that is not a hit page.
    """

    resident_pages: int
    hot_region: bool
    device_blocks: int
    host_blocks: int


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The published prefix of one prompt (all empty / 0 when prefix caching is off).

    Attributes:
      blocks: published host blocks of the prompt's leading full pages, in page order.
      hashes: their page hashes.
      num_cached: tokens reused, `min(len(blocks) * B, num_tokens - 1)`.
      full_pages: pages reused as they are, `num_cached // B`.
      cow_source: the shared host block whose rows `[0, num_cached % B)` are restored into the
        request's private page `full_pages` (copy-on-write), or NULL_BLOCK.
    """

    blocks: list[int]
    hashes: list[bytes]
    num_cached: int
    full_pages: int
    cow_source: int

    @property
    def held_blocks(self) -> list[int]:
        """Host blocks the request references from admission on (the copy-on-write source is
        referenced by its restore until the worker enqueues it)."""
        return self.blocks[:self.full_pages] + ([self.cow_source] if self.cow_source else [])

    def admission_need(self, num_tokens: int, end: int, *, block_size: int, hot_blocks: int,
                       resident_hits: bool) -> AdmissionNeed:
        """What admitting a prompt of `num_tokens` tokens with this hit allocates when its
        first chunk ends at token `end` (`num_cached < end <= num_tokens`; `end = num_tokens`:
        the blocks the request holds once its whole prompt is in). The hit's whole pages keep
        their host blocks; they stay host-only behind a hot region, or with `resident_hits` each
        gets a resident block."""
        full = self.full_pages
        new_pages = cdiv(end, block_size) - full
        hot = full > 0 and not resident_hits  # a prefix hit reads host pages
        device = new_pages + (hot_blocks if hot else 0) + (full if resident_hits else 0)
        return AdmissionNeed(new_pages, hot, device, cdiv(num_tokens, block_size) - full)


class PrefixCache:
    """Page hashing, prefix lookup, publication and the index of device copies.

    Args:
      host_pool: its hash index is the published-page index.
      device_pool: device copies are adopted from it (`touch`).
      block_size: B, tokens per page.
      enabled: whether pages are published and prompts looked up (`enable_prefix_caching`).
      stats: counters shared with the coordinator ("published_pages", "adopted_pages").
    """

    def __init__(self, host_pool: BlockPool, device_pool: BlockPool, *, block_size: int,
                 enabled: bool, stats: collections.Counter[str]) -> None:
        self.host_pool = host_pool
        self.device_pool = device_pool
        self.block_size = block_size
        self.enabled = enabled
        self.stats = stats
        # Published host page hash -> a device block holding the same page, until reused.
        self.copies: dict[bytes, int] = {}
        self.copy_of_block: dict[int, bytes] = {}
        # Called as on_publish(request_id, page, page_hash) when a page of a request is
        # published (its hash now names its host block); None: nobody listens.
        self.on_publish: Callable[[Hashable, int, bytes], None] | None = None
        # Finished requests whose durable prefix is published once their copies in flight
        # complete (`detach`, `settle`); they hold the host blocks of its full pages.
        self.detached: set[RequestRecord] = set()

    def match(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest published prefix of `tokens` (a non-empty prompt), chain by chain."""
        B = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        if self.enabled:
            parent = None
            for p in range(len(tokens) // B):
                h = page_hash(parent, tokens[p * B:(p + 1) * B])
                block = self.host_pool.lookup(h)
                if block is None:
                    break
                blocks.append(block)
                hashes.append(h)
                parent = h
        num_cached = min(len(blocks) * B, len(tokens) - 1)
        full_pages = num_cached // B
        cow_source = blocks[full_pages] if num_cached % B else NULL_BLOCK
        return PrefixHit(blocks, hashes, num_cached, full_pages, cow_source)

    def adopt(self, r: RequestRecord, hashes: Sequence[bytes]) -> None:
        """Gives `r` the readable device copies of its hit pages `0 .. len(hashes) - 1`: each
        becomes a pinned clean resident page (one more reference on the device block)."""
        for p, h in enumerate(hashes):
            block = self.copies.get(h)
            if block is not None:
                self.device_pool.touch([block])
                r.res_blocks[p] = block
                r.pinned_clean.add(p)
                self.stats["adopted_pages"] += 1

    def page_hash(self, r: RequestRecord, page: int) -> bytes:
        """The hash of `r`'s full page `page` (cached in `r.page_hashes`). Its tokens are known:
        a placeholder id (`RequestRecord.placeholders`) would name the page by a token it
        does not hold, and a later prompt would hit rows of another token."""
        B = self.block_size
        assert not r.placeholders or (page + 1) * B <= min(r.placeholders), (
            f"request {r.request_id!r}: page {page} holds a placeholder token id (hashed "
            "before set_token_ids)")
        while len(r.page_hashes) <= page:
            p = len(r.page_hashes)
            parent = r.page_hashes[-1] if r.page_hashes else None
            r.page_hashes.append(page_hash(parent, r.token_ids[p * B:(p + 1) * B]))
        return r.page_hashes[page]

    def advance_and_publish(self, r: RequestRecord, *, record_copies: bool) -> None:
        """Extends `r.ready_prefix` over its leading valid pages and publishes the full pages of
        that prefix (the first published copy of a hash wins), up to the first page that holds
        a placeholder token id (published once `set_token_ids` sets it), unless `r` failed (a
        failed restore left rows of it wrong: it publishes nothing). With `record_copies`, each
        published page's resident block is indexed as a device copy."""
        while r.ready_prefix in r.valid:
            r.ready_prefix += 1
        if not self.enabled or r.failed:
            return
        B = self.block_size
        limit = min(r.ready_prefix, r.num_computed // B)
        if r.placeholders:
            limit = min(limit, min(r.placeholders) // B)
        for p in range(r.num_published, limit):
            h = self.page_hash(r, p)
            if self.host_pool.cache(r.host_blocks[p], h) and self.on_publish is not None:
                self.on_publish(r.request_id, p, h)
            block = r.res_blocks[p] if record_copies and p < len(r.res_blocks) else NULL_BLOCK
            if block != NULL_BLOCK:
                old = self.copies.get(h)
                if old is not None and old != block:
                    self.copy_of_block.pop(old, None)
                stale = self.copy_of_block.get(block)
                if stale is not None and stale != h:
                    self.copies.pop(stale, None)
                self.copies[h] = block
                self.copy_of_block[block] = h
            self.stats["published_pages"] += 1
        r.num_published = max(r.num_published, limit)

    def detach(self, r: RequestRecord, num_full: int) -> None:
        """Finished request `r` has copies in flight: its durable prefix among its first
        `num_full` pages is published once they complete (`settle`); until then it keeps those
        pages' host blocks, and releases the rest now."""
        r.detached_pages = num_full
        self.detached.add(r)
        self.host_pool.free(reversed(r.host_blocks[num_full:]))

    def settle(self, r: RequestRecord) -> None:
        """A copy of request `r`, which left, ended: after a detached request's last one, its
        durable prefix is published and its host blocks are released."""
        if r.detached_pages >= 0 and not r.pending:
            self.advance_and_publish(r, record_copies=False)
            self.host_pool.free(reversed(r.host_blocks[:r.detached_pages]))
            r.detached_pages = -1
            self.detached.discard(r)

    def forget_block(self, block: int) -> None:
        """Device block `block` is handed out again: it no longer holds a published page."""
        h = self.copy_of_block.pop(block, None)
        if h is not None and self.copies.get(h) == block:
            del self.copies[h]
