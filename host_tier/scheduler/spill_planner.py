"""`SpillPlanner`: the transfers of the host tier and what their reports release (stdlib only).

Every sealed page is written back to host eagerly (a *spill*), at most `max_spill_pages`
(= `max(1, max_model_len // B)`) spills planned and not yet enqueued by the worker at a time.
A page past the prompt gets its host block when it seals (`plan_spills` binds it); while the
host pool is full it stays pinned and is retried on a later pass (`unbound`), and so is a page
whose spill failed (`fail`, then `spill_again`: it stays dirty, keeps its host block, is never
marked clean, and `plan_retries` spills it again whether or not its request is scheduled). A
partial prefix hit restores the shared page's rows into the request's private resident page
(`plan_restore`).

Transfers are transactions, each with an id from one counter (plan order):

  - a spill holds its device block until the worker reports it enqueued (`enqueued`), its host
    block until it reports it completed (`complete`); a completion that arrives before its
    enqueue notice counts as both, and the late notice is then only acknowledged;
  - a restore holds its shared host block until the worker reports it enqueued;
  - a transfer reported failed (`fail`) releases what it holds like an enqueued and completed
    one, but its page is not clean (a spill) or its request is marked failed (a restore).

Invariants (checked in `host_tier/scheduler/invariants.py`): `num_unenqueued` counts the spills
not enqueued; each pending page of a request names its spill; a spill never targets a published
host block.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence

from host_tier.plan import PageRestore, PageSpill
from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.records import PassLog, RequestRecord, RestoreRecord, SpillRecord


class SpillPlanner:
    """Spill and restore records, transfer ids, and the plan's `spills` / `restores`.

    Args:
      host_pool, device_pool: the pools the transfers hold blocks of.
      block_size: B, tokens per page.
      max_spill_pages: spills planned and not yet enqueued, at most.
      log: the open pass's changes (a bound host block changes the `src` row and is
        invalidated in the request's hot state).
      stats: counters shared with the coordinator ("spills", "copy_on_write").
      release_device_page: releases a resident block (the residency policy's, which watches for
        its reuse); called when a spill is enqueued.
    """

    def __init__(self, host_pool: BlockPool, device_pool: BlockPool, *, block_size: int,
                 max_spill_pages: int, log: PassLog, stats: collections.Counter[str],
                 release_device_page: Callable[[int], None]) -> None:
        self.host_pool = host_pool
        self.device_pool = device_pool
        self.block_size = block_size
        self.max_spill_pages = max_spill_pages
        self.log = log
        self.stats = stats
        self.release_device_page = release_device_page
        self.spills: dict[int, SpillRecord] = {}
        self.restores: dict[int, RestoreRecord] = {}
        self.num_unenqueued = 0
        self.awaiting_enqueue_notice: set[int] = set()  # completed before their enqueue notice
        # Running requests with pages whose spill failed (`spill_again`), in failure order.
        self.retry: dict[RequestRecord, None] = {}
        self._next_transfer_id = itertools.count()
        # The open pass's plan entries.
        self.pass_restores: list[PageRestore] = []
        self.pass_spills: list[PageSpill] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_in_flight(self) -> int:
        """Spills and restores the worker has not finished reporting."""
        return len(self.spills) + len(self.restores)

    def has_pending(self) -> bool:
        return bool(self.spills or self.restores or self.awaiting_enqueue_notice)

    @property
    def num_retries(self) -> int:
        """Pages whose spill failed, to be spilled again by the next `Coordinator.build_plan`
        (whether or not their request is scheduled). Until then they stay dirty and pinned: a
        caller with nothing to schedule should still build and execute a plan while this is > 0
        and no copy is in flight."""
        return sum(sum(1 for p in r.unbound if r.host_blocks[p] != NULL_BLOCK)
                   for r in self.retry)

    @property
    def budget(self) -> int:
        """Spills that may still be planned in this pass."""
        return self.max_spill_pages - self.num_unenqueued

    # ------------------------------------------------------------------ planning

    def plan_spills(self, r: RequestRecord, budget: int) -> int:
        """Eager write-back of `r`'s sealed pages that have no host copy, at most `budget`;
        returns the number of spills planned."""
        sealed = r.num_computed // self.block_size
        if not r.unbound and r.spill_cursor >= sealed:
            return 0  # nothing sealed since the last pass
        planned = 0
        for p in itertools.chain(sorted(r.unbound), range(r.spill_cursor, sealed)):
            if planned >= budget:
                break
            if p >= r.spill_cursor:
                r.spill_cursor = p + 1
            if p in r.valid or p in r.pending:
                continue
            device_block = r.res_blocks[p]
            assert device_block != NULL_BLOCK, f"dirty page {p} has no resident block"
            host_block = r.host_blocks[p]
            if host_block == NULL_BLOCK:
                if self.host_pool.num_free == 0:
                    r.unbound.add(p)  # stays pinned; retried on a later pass
                    continue
                host_block = self.host_pool.allocate(1)[0]
                r.host_blocks[p] = host_block
                self.log.invalidate(r, [host_block])
                self.log.entry_changed("src", r, p)
            r.unbound.discard(p)
            assert self.host_pool.block_hash(host_block) is None, (
                f"spill into published host block {host_block}")
            self.host_pool.touch([host_block])
            self.device_pool.touch([device_block])
            transfer_id = next(self._next_transfer_id)
            self.spills[transfer_id] = SpillRecord(transfer_id, r, p, device_block, host_block)
            self.num_unenqueued += 1
            r.pending[p] = transfer_id
            self.pass_spills.append(PageSpill(transfer_id, device_block, host_block))
            planned += 1
        self.stats["spills"] += planned
        return planned

    def spill_again(self, r: RequestRecord, page: int) -> None:
        """The spill of running request `r`'s page failed: the page keeps its host block and is
        spilled again by `plan_retries`."""
        r.unbound.add(page)
        self.retry[r] = None

    def plan_retries(self, budget: int) -> int:
        """Spills again the pages whose spill failed, of requests scheduled in the pass or not,
        at most `budget`; returns the number of spills planned."""
        planned = 0
        for r in list(self.retry):
            planned += self.plan_spills(r, budget - planned)
            if not any(r.host_blocks[p] != NULL_BLOCK for p in r.unbound):
                del self.retry[r]
        return planned

    def plan_restore(self, r: RequestRecord, host_block: int, device_block: int,
                     num_rows: int, *, stat: str = "copy_on_write") -> None:
        """Copy-on-write: rows `[0, num_rows)` of the shared `host_block` into `r`'s private
        `device_block` (or, with stat="prefix_restores", a whole published page into a resident
        block of `r`). The caller's reference on `host_block` passes to the restore; `stat`
        names the counter it adds to."""
        transfer_id = next(self._next_transfer_id)
        self.restores[transfer_id] = RestoreRecord(transfer_id, r, host_block)
        self.pass_restores.append(PageRestore(transfer_id, host_block, device_block, num_rows))
        self.stats[stat] += 1

    def drop_pass_restores(self, r: RequestRecord) -> None:
        """`r` leaves in the pass that admitted it: its restore never runs."""
        for restore in [x for x in self.pass_restores
                        if self.restores[x.transfer_id].request is r]:
            self.pass_restores.remove(restore)
            self.host_pool.free([self.restores.pop(restore.transfer_id).host_block])

    def take_pass(self) -> tuple[tuple[PageRestore, ...], tuple[PageSpill, ...]]:
        """The open pass's restores and spills, in plan order; starts the next pass."""
        restores, spills = tuple(self.pass_restores), tuple(self.pass_spills)
        self.pass_restores = []
        self.pass_spills = []
        return restores, spills

    # ------------------------------------------------------------------ worker reports

    def check_report(self, enqueued: Sequence[int], completed: Sequence[int],
                     failed: Sequence[int] = ()) -> None:
        """Raises ValueError, before anything changes, for an id reported twice in one list, an
        enqueued id that is unknown or already enqueued, a completed id that is not a pending
        spill, or a failed id that is neither a pending spill nor a restore not yet enqueued
        (nor completed or enqueued as a restore in the same report)."""
        for ids, what in ((enqueued, "enqueued"), (completed, "completed"), (failed, "failed")):
            if len(set(ids)) != len(ids):
                raise ValueError(f"on_transfers: {what} names a transfer id twice: {ids}")
        if failed:
            both = set(failed) & (set(completed) | (set(enqueued) & set(self.restores)))
            if both:
                raise ValueError(
                    f"on_transfers: transfer ids {sorted(both)} are reported failed and also "
                    "completed (a spill) or enqueued (a restore)")
            for tid in failed:
                if tid not in self.spills and tid not in self.restores:
                    raise ValueError(
                        f"on_transfers: failed transfer id {tid} is not a pending spill or "
                        "restore (unknown, or already completed or enqueued)")
        for tid in enqueued:
            spill = self.spills.get(tid)
            if not (tid in self.restores or tid in self.awaiting_enqueue_notice
                    or (spill is not None and not spill.enqueued)):
                raise ValueError(
                    f"on_transfers: enqueued transfer id {tid} is unknown or already enqueued")
        for tid in completed:
            if tid not in self.spills:
                raise ValueError(
                    f"on_transfers: completed transfer id {tid} is not a pending spill "
                    "(unknown, a restore, or already completed)")

    def apply_report(self, enqueued: Sequence[int], completed: Sequence[int],
                     failed: Sequence[int], *, page_clean: Callable[[SpillRecord], None],
                     spill_failed: Callable[[SpillRecord], None],
                     restore_failed: Callable[[RestoreRecord], None]) -> None:
        """Checks one report (`check_report`), then applies it: failed restores first (so that
        a spill completed in the same report publishes nothing of their requests), then the
        enqueued ids, the completed ids (`complete`) and the failed spills (`fail`)."""
        self.check_report(enqueued, completed, failed)
        failed_spills = []
        for tid in failed:
            if tid in self.restores:
                self.fail(tid, restore_failed=restore_failed, spill_failed=spill_failed)
            else:
                failed_spills.append(tid)
        for tid in enqueued:
            self.enqueued(tid)
        for tid in completed:
            self.complete(tid, page_clean)
        for tid in failed_spills:
            self.fail(tid, restore_failed=restore_failed, spill_failed=spill_failed)

    def enqueued(self, tid: int) -> None:
        """The worker enqueued transfer `tid` (checked): a restore releases its shared host
        block, a spill its device block."""
        if tid in self.awaiting_enqueue_notice:
            self.awaiting_enqueue_notice.remove(tid)
        elif tid in self.restores:
            self.host_pool.free([self.restores.pop(tid).host_block])
        else:
            self._spill_enqueued(self.spills[tid])

    def complete(self, tid: int, page_clean: Callable[[SpillRecord], None]) -> None:
        """The worker completed spill `tid` (checked): `page_clean(spill)` records the durable
        page, then the spill's host block is released."""
        spill = self.spills.pop(tid)
        if not spill.enqueued:
            self._spill_enqueued(spill)
            self.awaiting_enqueue_notice.add(tid)
        page_clean(spill)
        self.host_pool.free([spill.host_block])

    def is_restore(self, tid: int) -> bool:
        return tid in self.restores

    def fail(self, tid: int, *, restore_failed: Callable[[RestoreRecord], None],
             spill_failed: Callable[[SpillRecord], None]) -> None:
        """The worker reports transfer `tid` failed (checked): a restore releases its shared
        host block after `restore_failed(restore)`; a spill releases its device block (if not
        enqueued yet) and its host block after `spill_failed(spill)` re-marked the page."""
        restore = self.restores.pop(tid, None)
        if restore is not None:
            restore_failed(restore)
            self.host_pool.free([restore.host_block])
            return
        spill = self.spills.pop(tid)
        if not spill.enqueued:
            self._spill_enqueued(spill)
        spill_failed(spill)
        self.host_pool.free([spill.host_block])

    def _spill_enqueued(self, spill: SpillRecord) -> None:
        spill.enqueued = True
        self.num_unenqueued -= 1
        self.release_device_page(spill.device_block)
