"""The coordinator's invariants, checked from its parts (standard library only; used by tests).

`check_coordinator` raises AssertionError when one is broken:

  - every device and host block is free xor referenced, and each reference is accounted for by
    a holder (a request's pages and hot region, a finished request awaiting its last copies, a
    spill or restore in flight): no leak, no double free;
  - published host pages are never spill targets;
  - a request's last `ACTIVE_TAIL_PAGES` pages stay pinned; unpinned pages are clean and
    registered as readers of their block; a null resident page is clean on host and its request
    owns a hot region;
  - a page being written (dirty) and a hot region are never shared with another reader, an
    unpinned block or an indexed device copy;
  - a page waiting to be spilled again (`unbound`: no host block was free, or its spill failed)
    is sealed, dirty, not pending and still resident;
  - requests listed as failed are running and marked failed; requests waiting to spill a failed
    page again are running;
  - no hashed or published page of a request holds a placeholder token id;
  - the prefix cache's device-copy index is consistent; state rows are used at most once.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping

from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.prefix_cache import PrefixCache
from host_tier.scheduler.records import ACTIVE_TAIL_PAGES, RequestRecord
from host_tier.scheduler.residency_policy import ResidencyPolicy
from host_tier.scheduler.spill_planner import SpillPlanner


def check_coordinator(*, requests: Mapping[object, RequestRecord],
                      detached: Iterable[RequestRecord], free_rows: Iterable[int],
                      hot_blocks: int, device_pool: BlockPool, host_pool: BlockPool,
                      planner: SpillPlanner, residency: ResidencyPolicy,
                      prefix_cache: PrefixCache, failed: Iterable[object] = (),
                      retry: Iterable[RequestRecord] = ()) -> None:
    """Raises AssertionError when a residency invariant is broken (see module docstring).

    Args:
      requests: request id -> record of every running request.
      detached: finished requests whose publications wait for copies in flight.
      free_rows: state rows not in use.
      hot_blocks: device blocks of one hot region.
      failed: ids of running requests a failed restore broke, not yet taken.
      retry: requests with pages whose spill failed, to be spilled again.
    """
    for r in retry:
        assert requests.get(r.request_id) is r, (
            f"request {r.request_id!r} waits to spill a failed page again but is not running")
    for request_id in failed:
        r = requests.get(request_id)
        assert r is not None and r.failed, (
            f"request {request_id!r} is listed as failed but is not a running failed request")
    device_refs: collections.Counter[int] = collections.Counter()
    host_refs: collections.Counter[int] = collections.Counter()
    exclusive: dict[int, str] = {}  # device blocks that must have exactly one user

    def claim(block: int, who: str) -> None:
        assert block not in exclusive, f"device block {block} used by {exclusive[block]} " \
                                       f"and {who}"
        exclusive[block] = who

    for r in requests.values():
        _check_request(r, hot_blocks=hot_blocks, planner=planner, residency=residency,
                       device_refs=device_refs, host_refs=host_refs, claim=claim)
    for r in detached:
        assert r.detached_pages >= 0 and r.pending, "detached record without pending spills"
        for block in r.host_blocks[:r.detached_pages]:
            if block != NULL_BLOCK:
                host_refs[block] += 1
    for spill in planner.spills.values():
        host_refs[spill.host_block] += 1
        if not spill.enqueued:
            device_refs[spill.device_block] += 1
    for restore in planner.restores.values():
        host_refs[restore.host_block] += 1
    device_pool.check_invariants(dict(device_refs))
    host_pool.check_invariants(dict(host_refs))

    spill_targets = {s.host_block for s in planner.spills.values()}
    for block in host_pool.published_blocks():
        assert block not in spill_targets, f"published host block {block} is being written"
    assert planner.num_unenqueued == sum(
        not s.enqueued for s in planner.spills.values()), "unenqueued spill count drifted"
    for block, readers in residency.readers.items():
        assert readers, f"empty reader set for device block {block}"
        for r, p in readers:
            assert requests.get(r.request_id) is r, "a departed request still reads"
            assert r.res_blocks[p] == block and p in r.unpinned, "stale reader entry"
            assert block not in exclusive, (
                f"unpinned device block {block} is also {exclusive[block]}")
    for h, block in prefix_cache.copies.items():
        assert prefix_cache.copy_of_block.get(block) == h, "device copy index disagrees"
        assert block not in exclusive, f"device copy {block} is also {exclusive[block]}"
    assert len(prefix_cache.copies) == len(prefix_cache.copy_of_block), (
        "device copy index sizes differ")
    rows = [r.state_row for r in requests.values()]
    assert len(set(rows)) == len(rows), "two requests share a state row"
    assert not set(rows) & set(free_rows), "a used state row is also free"


def _check_request(r: RequestRecord, *, hot_blocks: int, planner: SpillPlanner,
                   residency: ResidencyPolicy, device_refs: collections.Counter[int],
                   host_refs: collections.Counter[int], claim) -> None:
    """One running request's own invariants; counts the references it holds."""
    assert r.num_nonresident == r.res_blocks.count(NULL_BLOCK), (
        f"request {r.request_id!r}: non-resident page count out of date")
    name = f"request {r.request_id!r}"
    n = len(r.res_blocks)
    assert len(r.host_blocks) >= n, f"{name}: fewer host entries than resident pages"
    assert len(r.hot) in (0, hot_blocks), f"{name}: partial hot region"
    assert not any(p >= n - ACTIVE_TAIL_PAGES for p in r.unpinned), (
        f"{name}: one of its last {ACTIVE_TAIL_PAGES} pages is unpinned")
    assert r.unpinned <= r.valid, f"{name}: an unpinned page is not clean"
    assert not (set(r.pending) & r.valid), f"{name}: a page is both pending and clean"
    ready = 0
    while ready in r.valid:
        ready += 1
    assert r.ready_prefix == ready, f"{name}: ready prefix {r.ready_prefix} != {ready}"
    assert r.num_published <= max(r.ready_prefix, 0), f"{name}: published past ready"
    if r.placeholders:
        first = min(r.placeholders)
        assert max(r.placeholders) < len(r.token_ids), f"{name}: placeholder past its tokens"
        assert max(r.num_published, len(r.page_hashes)) * planner.block_size <= first, (
            f"{name}: a hashed or published page holds the placeholder token {first}")
    pinned_clean = set()
    for p, block in enumerate(r.res_blocks):
        if block == NULL_BLOCK:
            assert p in r.valid and r.host_blocks[p] != NULL_BLOCK, (
                f"{name}: page {p} has no resident block and no complete host copy")
            assert r.hot, f"{name}: page {p} is read from host without a hot region"
            continue
        if p in r.unpinned:
            assert (r, p) in residency.readers.get(block, ()), (
                f"{name}: unpinned page {p} is not registered as a reader")
            continue
        device_refs[block] += 1
        if p in r.valid:
            pinned_clean.add(p)
        else:
            claim(block, f"{name} page {p} (dirty)")
    assert r.pinned_clean == pinned_clean, f"{name}: pinned_clean out of date"
    for block in r.hot:
        device_refs[block] += 1
        claim(block, f"{name} hot region")
    for p in r.valid:
        assert r.host_blocks[p] != NULL_BLOCK, f"{name}: clean page {p} has no host block"
    for p, tid in r.pending.items():
        spill = planner.spills.get(tid)
        assert spill is not None and spill.request is r and spill.page == p, (
            f"{name}: pending page {p} has no matching spill")
    sealed = r.num_computed // planner.block_size
    for p in r.unbound:
        assert p < sealed and p not in r.valid and p not in r.pending, (
            f"{name}: page {p} waits to be spilled but is not a sealed dirty page")
        assert r.res_blocks[p] != NULL_BLOCK, f"{name}: dirty page {p} has no resident block"
    for block in r.host_blocks:
        if block != NULL_BLOCK:
            host_refs[block] += 1
