"""`Coordinator`: decides where every page of every request lives (scheduler side, stdlib + numpy).

A JAX port of the upstream HiSparse coordinator of vLLM and SGLang. GPU-resident pages are a
write-back cache of the pinned host pool; the residency semantics are written down in
`docs/semantics.md`. The coordinator composes its parts, each in its own module; callers reach
them by name (`coord.prefix_cache`, `coord.spill_planner`, `coord.residency_policy`):

  - `PrefixCache` (`prefix_cache.py`): page hashes, the published prefix of a prompt, the
    copy-on-write decision for a partial hit, publication of durable pages, and the index of
    device copies of published pages that later hits adopt;
  - `SpillPlanner` (`spill_planner.py`): eager write-back of sealed pages within the budget,
    spill and restore records, transfer ids, and what each worker report releases;
  - `ResidencyPolicy` (`residency_policy.py`): the watermark and `request_room`, hot-region
    requests and grants, unpinning clean pages outside the active tail, the readers of unpinned
    blocks, and losing a page when its block is reused (plus the offload_all baseline);
  - the capacity rules (`capacity.py`): functions of sizes and counts, without state;
  - `check_coordinator` (`invariants.py`): the invariants, checked from the parts.

The coordinator itself owns the requests, the state rows, the block tables and the open pass.
Its calls are grouped by what they do: admission (`Admission`, `admission.py`: `admit` and the
questions about an admission), scheduling (`Scheduling`, `scheduling.py`: `schedule`,
`schedule_batch`, `set_token_ids` and their argument checks), and here plan building, worker
reports and release. The parts share the two `BlockPool`s, one `PassLog` (what the open pass
changed) and one stats counter; besides that they talk through two callbacks: the planner
releases a spilled page's device block through the residency policy, and the residency
policy's reuse watcher tells the prefix cache that a device copy is gone.

Spills are transactions: the resident block stays pinned until the worker reports the copy
enqueued, the host block until it reports it completed.

Usage, once per model step::

    coord.admit(rid, prompt)              # new requests: Admitted, or Wait(reason)
    coord.schedule(rid, new_token_ids=t)  # running requests: None, or Wait(reason)
    coord.schedule_batch(rids, tokens)    # (or all of them in one call, the decode step)
    plan = coord.build_plan()             # StepPlan for the TransferEngine / model step
    ...                                   # worker executes the plan
    coord.on_transfers(report)            # whenever the worker reports (late, any order)
    coord.failed_requests()               # requests a failed restore broke: finish with error
    coord.finish(rid) / coord.preempt(rid) / coord.cancel(rid) / coord.abort(rid)

Capacity limits are states: admission and scheduling return `Wait` with a reason and allocate
nothing; only a request that can never fit raises `CapacityError`. Every pool size the
constructor accepts serves a lone request (whole prompt at admission, then one token per step)
of `max_model_len` tokens to completion; `capacity_error` says whether one of a given prompt and
length is served alone, and if not, why (the rule and its proof: `docs/semantics.md`).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from host_tier.plan import HotInvalidation, StepPlan, StepWrite, TransferReport
from host_tier.scheduler import capacity
from host_tier.scheduler.admission import Admission
from host_tier.scheduler.block_pool import BlockPool
from host_tier.scheduler.block_tables import BlockTables
from host_tier.scheduler.invariants import check_coordinator
from host_tier.scheduler.prefix_cache import PrefixCache
from host_tier.scheduler.records import (
    ACTIVE_TAIL_PAGES,
    Admitted,
    CapacityError,
    PassLog,
    RequestRecord,
    RequestView,
    RestoreRecord,
    SpillRecord,
    Wait,
)
from host_tier.scheduler.residency_policy import ResidencyPolicy
from host_tier.scheduler.scheduling import Scheduling
from host_tier.scheduler.spill_planner import SpillPlanner
from host_tier.sizes import cdiv, check_int, config_size

__all__ = ["ACTIVE_TAIL_PAGES", "Admitted", "CapacityError", "Coordinator", "RequestView",
           "Wait"]

_SIZES = ("block_size", "num_gpu_blocks", "num_host_blocks", "hot_blocks", "max_num_reqs",
          "max_model_len")
_KEYWORD_SIZES = ("num_gpu_blocks", "num_host_blocks", "max_model_len")
_new_tuple = tuple.__new__


class Coordinator(Admission, Scheduling):
    """Host-tier residency decisions for one index group (see module docstring).

    Not thread-safe: call it from the scheduler thread only (worker reports included).

    Args:
      block_size: B, rows per page (host, resident and hot pages alike).
      num_gpu_blocks: device block ids, null block included; resident pages and hot regions
        share them.
      num_host_blocks: host block ids, null block included (`HostPool.num_blocks`).
      hot_blocks: device blocks of one hot region (`HiSparseConfig.hot_blocks`).
      max_num_reqs: state rows: requests admitted at once.
      max_model_len: longest request, in tokens.
      enable_prefix_caching: publish durable host pages and serve prefix hits from them.
      offload_all: the naive-offload policy (a benchmark baseline): every request asks for a
        hot region from its first step and each page loses its device block as soon as its
        host copy completes, so everything but the pinned tail is read from host.
      resident_prefix_hits: a prefix hit's pages are all resident from admission on: every
        hit page without a device copy to adopt gets a resident block and a restore of its
        published host page (`StepPlan.restores`, counted in `stats["prefix_restores"]`),
        and the request needs no hot region at admission. For a caller that reads the
        prefix through the resident table (an engine's chunked prefill after a hit).

    Attributes:
      max_pages: ceil(max_model_len / B), the width of the `src` and `res` tables.
      device_pool, host_pool: the `BlockPool`s of device and host block ids.
      prefix_cache: the `PrefixCache` (`enabled`: prefix caching is on).
      spill_planner: the `SpillPlanner` (`max_spill_pages`: spills planned and not yet
        enqueued, at most `max(1, max_model_len // B)`; `num_in_flight`: transfers the worker
        has not finished reporting; `num_retries`: pages whose spill failed, spilled again by
        the next `build_plan`).
      residency_policy: the `ResidencyPolicy` (`watermark`: free device blocks below which
        requests ask for hot regions, `max(hot_blocks, num_gpu_blocks // 10)`; `offload_all`).
      tables: the scheduler's `BlockTables` (`[max_num_reqs, max_pages]` src/res,
        `[max_num_reqs, hot_blocks]` hot).
      stats: counters for tests and metrics ("spills", "published_pages", "adopted_pages",
        "copy_on_write", "prefix_restores", "cached_tokens", "hot_grants", "unpinned_pages",
        "lost_pages", "schedule_waits", "preemptions", "aborts", "failed_spills",
        "failed_restores").

    Raises:
      ValueError: a size is not a positive int, or the device pool is smaller than a lone
        request of `max_model_len` tokens needs:
        `hot_blocks + 1 + max(ACTIVE_TAIL_PAGES, max_pages - num_host_blocks)` usable blocks
        (a hot region, the pages it cannot unpin: its pinned tail, or sealed pages the host
        pool has no block for, and one new page).
    """

    def __init__(self, *, block_size: int, num_gpu_blocks: int, num_host_blocks: int,
                 hot_blocks: int, max_num_reqs: int, max_model_len: int,
                 enable_prefix_caching: bool = True, offload_all: bool = False,
                 resident_prefix_hits: bool = False) -> None:
        sizes = {name: check_int("Coordinator", name, value) for name, value in (
            ("block_size", block_size), ("num_gpu_blocks", num_gpu_blocks),
            ("num_host_blocks", num_host_blocks), ("hot_blocks", hot_blocks),
            ("max_num_reqs", max_num_reqs), ("max_model_len", max_model_len))}
        block_size, num_gpu_blocks = sizes["block_size"], sizes["num_gpu_blocks"]
        num_host_blocks, hot_blocks = sizes["num_host_blocks"], sizes["hot_blocks"]
        max_num_reqs, max_model_len = sizes["max_num_reqs"], sizes["max_model_len"]
        if num_host_blocks < 2:
            raise ValueError(f"Coordinator.num_host_blocks must be >= 2, got {num_host_blocks}")
        error = capacity.device_pool_error(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_host_blocks=num_host_blocks,
            hot_blocks=hot_blocks, max_model_len=max_model_len)
        if error:
            raise ValueError(error)
        self.block_size = block_size
        self.hot_blocks = hot_blocks
        self.max_model_len = max_model_len
        self.max_pages = cdiv(max_model_len, block_size)
        self.resident_prefix_hits = bool(resident_prefix_hits)

        self.device_pool = BlockPool(num_gpu_blocks, name="device pool")
        self.host_pool = BlockPool(num_host_blocks, name="host pool")
        self.tables = BlockTables(max_num_reqs, self.max_pages, hot_blocks)
        # Counters, for tests and metrics (shared with the parts).
        self.stats: collections.Counter[str] = collections.Counter()

        self._log = PassLog()
        self.prefix_cache = PrefixCache(self.host_pool, self.device_pool, block_size=block_size,
                                        enabled=enable_prefix_caching, stats=self.stats)
        self.residency_policy = ResidencyPolicy(
            self.device_pool, hot_blocks=hot_blocks, block_size=block_size,
            offload_all=offload_all, log=self._log, stats=self.stats,
            forget_copy=self.prefix_cache.forget_block)
        self.spill_planner = SpillPlanner(
            self.host_pool, self.device_pool, block_size=block_size,
            max_spill_pages=max(1, max_model_len // block_size), log=self._log,
            stats=self.stats, release_device_page=self.residency_policy.release_device_page)

        self._requests: dict[Hashable, RequestRecord] = {}
        self._free_rows = list(range(max_num_reqs))
        heapq.heapify(self._free_rows)
        self._failed: dict[Hashable, None] = {}  # running requests a failed restore broke
        self._step = 0
        self._pass: list[RequestRecord] = []  # requests scheduled in the open pass, in order

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> Coordinator:
        """A coordinator sized by a sizes object (e.g. `hisparse_jax.HiSparseConfig`).

        Reads `config.block_size`, `config.hot_blocks` and `config.max_num_reqs`, and
        `config.num_gpu_blocks`, `config.num_host_blocks` and `config.max_model_len` unless they
        are passed as keyword arguments (which win). Other keyword arguments
        (`enable_prefix_caching`, `offload_all`) go to the constructor.

        Raises:
          ValueError: a size it reads is None or missing, or invalid (as in the constructor).
        """
        owner = "Coordinator.from_config"
        for name in _SIZES:
            if name in _KEYWORD_SIZES:
                if kwargs.get(name) is None:
                    kwargs[name] = config_size(config, name, owner=owner, keyword=True)
            elif name in kwargs:
                raise TypeError(f"{owner}: {name} comes from the config, not a keyword argument")
            else:
                kwargs[name] = config_size(config, name, owner=owner)
        return cls(**kwargs)

    # ------------------------------------------------------------------ queries

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        return tuple(self._requests)

    def publishes(self, request_id: Hashable) -> bool:
        """Whether pages of the request may still be published: it is running, or it finished
        and its last copies are in flight (they publish its durable prefix when they
        complete)."""
        return request_id in self._requests or any(r.request_id == request_id
                                                   for r in self.prefix_cache.detached)

    def listen(self, *, on_publish: Callable[[Hashable, int, bytes], None] | None = None,
               on_unpublish: Callable[[bytes], None] | None = None) -> None:
        """Registers the listeners of published pages (None: none): `on_publish(request_id,
        page, page_hash)` when a page of a request is published (called from `on_transfers`,
        `finish`, `cancel` or `set_token_ids`; a finished request's last pages may publish
        after its state row is reused), `on_unpublish(page_hash)` when its host block is
        handed out again (the page is evicted: later prompts no longer hit it). Listeners must
        not call the coordinator."""
        self.prefix_cache.on_publish = on_publish
        self.host_pool.on_unpublish = on_unpublish

    def drop_prefix_cache(self) -> None:
        """Forgets every published page and every indexed device copy of one: later prompts
        hit nothing published so far (e.g. after the device caches or host pool layers were
        rebuilt: their rows are gone). Running requests keep their blocks."""
        for block in list(self.prefix_cache.copy_of_block):
            self.prefix_cache.forget_block(block)
        self.host_pool.unpublish_all()

    def has_pending_transfers(self) -> bool:
        """Whether the worker still owes a report (the engine's residency-manager protocol)."""
        return self.spill_planner.has_pending()

    @property
    def num_dirty_sealed_pages(self) -> int:
        """Sealed pages of running requests whose host copy has not completed (waiting for a
        spill, or in flight): the write-back backlog. Right after many long prompts are
        admitted it is large (every prompt page), and steps spill it within the budget; a
        steady decode seals about one page per request every `block_size` steps."""
        B = self.block_size
        return sum(r.num_computed // B - len(r.valid) for r in self._requests.values())

    def request_room(self, num_blocks: int) -> None:
        """Asks the running requests to make room for `num_blocks` more device blocks (e.g. a
        waiting admission: a long prompt needs its pages free at once). Until it is cancelled
        (`request_room(0)`), the residency policy treats the pool as under pressure while
        fewer than `watermark + num_blocks` blocks are free, so requests move to hot regions
        and unpin their clean pages, whose blocks count as free. (The engine's
        residency-manager protocol.)"""
        self.residency_policy.request_room(num_blocks)

    def all_pages_resident(self, request_id: Hashable) -> bool:
        """Whether every computed page of a running request has its resident block (no read
        from host needed: the decode fast path). Cheaper than `view`."""
        return self._running(request_id, "all_pages_resident").num_nonresident == 0

    def view(self, request_id: Hashable) -> RequestView:
        return self._running(request_id, "view").view()

    def failed_requests(self) -> tuple[Hashable, ...]:
        """Running requests whose copy-on-write restore failed (`on_transfers(failed=...)`), in
        report order; taken once: the call returns them and forgets them. Their rows are wrong,
        so nothing of theirs is published; the caller ends each (`abort`) with an error."""
        failed, self._failed = tuple(self._failed), {}
        return failed

    # ------------------------------------------------------------------ the plan

    def build_plan(self) -> StepPlan:
        """Closes the pass: the requests scheduled in it advance, and the plan is returned.

        For each scheduled request (in scheduling order): its tokens count as computed (the
        plan's forward writes them), sealed pages without a host copy are spilled within the
        budget, and the residency policy runs (ask for a hot region below the watermark, unpin
        clean pages once it has one). Then pages whose spill failed are spilled again, those of
        requests not scheduled in this pass included: a plan with nothing scheduled (no
        forward) still carries them (`spill_planner.num_retries`).
        """
        pass_ = self._pass
        # `tuple.__new__` builds the same named tuples without a Python-level `__new__` call.
        writes = [_new_tuple(StepWrite, (r.request_id, r.state_row, r.num_computed, r.scheduled))
                  for r in pass_]
        budget = self.spill_planner.budget
        plan_spills = self.spill_planner.plan_spills
        update_residency = self.residency_policy.update
        B = self.block_size
        for r in pass_:
            r.num_computed = computed = r.num_computed + r.scheduled
            r.scheduled = 0
            # The calls are skipped where they would change nothing (most requests of a decode
            # step): no page sealed since the last pass and none to retry; a hot region with no
            # clean page pinned outside the active tail (the pages `update` unpins), or a hot
            # region already asked for.
            if r.unbound or r.spill_cursor < computed // B:
                budget -= plan_spills(r, budget)
            if r.hot:
                if r.pinned_clean and min(r.pinned_clean) < len(r.res_blocks) - ACTIVE_TAIL_PAGES:
                    update_residency(r)
            elif not r.hot_required:
                update_residency(r)
        if self.spill_planner.retry:
            self.spill_planner.plan_retries(budget)
        log = self._log
        log.write_tables(self.tables)
        restores, spills = self.spill_planner.take_pass()
        plan = StepPlan(
            step=self._step,
            writes=tuple(writes),
            tables=self.tables.take_update(),
            hot_resets=tuple(sorted(log.hot_resets)),
            hot_invalidations=tuple(HotInvalidation(row, tuple(sorted(set(blocks))))
                                    for row, blocks in sorted(log.invalidations.items())),
            restores=restores,
            spills=spills,
        )
        self._step += 1
        self._pass = []
        log.clear()
        return plan

    # ------------------------------------------------------------------ worker reports

    def on_transfers(self, report: TransferReport | None = None, *,
                     enqueued: Iterable[int] = (), completed: Iterable[int] = (),
                     failed: Iterable[int] = ()) -> None:
        """Applies worker reports: transfers enqueued, completed and failed, in any order and
        any delay (`report` and the keyword lists are merged).

        An enqueued spill releases its resident block; a completed spill makes its page clean
        (unpinned at once if the request can read from host), releases its host block and may
        publish the request's durable prefix. A completion reported before its enqueue notice
        counts as both. A failed spill releases its blocks like a completed one, but its page
        stays dirty (never clean, never published) and is spilled again by the next
        `build_plan` (dropped if the request left). A failed restore releases its shared host
        block
        and marks its request failed: nothing of it is published from then on, and a running
        one is listed by `failed_requests`. Failed restores are applied first, so a spill
        completed in the same report publishes nothing of their requests. A plan whose copies
        cannot run at all (its forward raised) is reported by failing its transfer ids
        (`TransferEngine.fail_spills`). Ids are checked before anything changes.

        Raises:
          ValueError: an unknown id, an id reported twice, a restore reported completed, or a
            failed id that is not a pending transfer.
        """
        enqueued_ids = list(report.enqueued if report else ()) + list(enqueued)
        completed_ids = list(report.completed if report else ()) + list(completed)
        failed_ids = list(report.failed if report else ()) + list(failed)
        self.spill_planner.apply_report(
            enqueued_ids, completed_ids, failed_ids, page_clean=self._page_clean,
            spill_failed=self._page_failed, restore_failed=self._restore_failed)

    def _page_clean(self, spill: SpillRecord) -> None:
        """A spill completed: its page is clean (and may be unpinned), and the durable prefix of
        its request is published; a finished request's last completion publishes its prefix and
        releases its host blocks."""
        r, page = spill.request, spill.page
        del r.pending[page]
        r.valid.add(page)
        if self._requests.get(r.request_id) is r:
            assert r.res_blocks[page] == spill.device_block, "a dirty page lost its block"
            self.residency_policy.page_clean(r, page)
            self.prefix_cache.advance_and_publish(r, record_copies=True)
        else:
            self.prefix_cache.settle(r)

    def _page_failed(self, spill: SpillRecord) -> None:
        """A spill failed: its page is dirty again. A running request spills it again on a later
        pass (same host block); a request that left drops it (a finished one publishes the
        prefix before it once its other copies are done)."""
        r, page = spill.request, spill.page
        del r.pending[page]
        self.stats["failed_spills"] += 1
        if self._requests.get(r.request_id) is r:
            assert r.res_blocks[page] == spill.device_block, "a dirty page lost its block"
            self.spill_planner.spill_again(r, page)
        else:
            self.prefix_cache.settle(r)

    def _restore_failed(self, restore: RestoreRecord) -> None:
        """A copy-on-write restore failed: the request's page lacks the shared rows."""
        r = restore.request
        r.failed = True
        self.stats["failed_restores"] += 1
        if self._requests.get(r.request_id) is r:
            self._failed[r.request_id] = None

    # ------------------------------------------------------------------ leaving

    def finish(self, request_id: Hashable) -> None:
        """The request ended normally. Its durable prefix stays published; pages whose copies
        are still in flight are published when they complete. Its clean resident pages stay
        readable device copies until reused."""
        self._release(self._running(request_id, "finish"), keep_prefix=True)

    def cancel(self, request_id: Hashable) -> None:
        """The request was aborted. Like `finish`: every page a completed step wrote and whose
        copy completes is sound, so it may outlive the request."""
        self._release(self._running(request_id, "cancel"), keep_prefix=True)

    def preempt(self, request_id: Hashable) -> None:
        """The request is evicted to be recomputed later. Pages already published stay; pending
        publications are dropped (copies in flight complete, then their blocks are freed)."""
        self._release(self._running(request_id, "preempt"), keep_prefix=False)
        self.stats["preemptions"] += 1

    def abort(self, request_id: Hashable) -> None:
        """The request failed (its admission, prefill or a restore): released like `preempt`
        (pending publications dropped; copies in flight still run, report and release their
        blocks) and counted in `stats["aborts"]`. Works in the pass of its admission (its step
        and restore never run) and after the plan went to the worker."""
        self._release(self._running(request_id, "abort"), keep_prefix=False)
        self.stats["aborts"] += 1

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raises AssertionError when a residency invariant is broken (used by the tests; the
        list is in `host_tier/scheduler/invariants.py`)."""
        check_coordinator(requests=self._requests, detached=self.prefix_cache.detached,
                          free_rows=self._free_rows, hot_blocks=self.hot_blocks,
                          device_pool=self.device_pool, host_pool=self.host_pool,
                          planner=self.spill_planner, residency=self.residency_policy,
                          prefix_cache=self.prefix_cache, failed=self._failed,
                          retry=self.spill_planner.retry)

    # ------------------------------------------------------------------ internals

    def _running(self, request_id: Hashable, what: str) -> RequestRecord:
        r = self._requests.get(request_id)
        if r is None:
            raise ValueError(f"{what}: request_id {request_id!r} is not admitted")
        return r

    def _release(self, r: RequestRecord, *, keep_prefix: bool) -> None:
        if r.scheduled:  # scheduled in this pass, but its step will not run
            self._pass.remove(r)
            r.scheduled = 0
            self.spill_planner.drop_pass_restores(r)
        del self._requests[r.request_id]
        self._failed.pop(r.request_id, None)
        self.spill_planner.retry.pop(r, None)
        keep_prefix = keep_prefix and not r.failed
        self._log.forget(r)
        if keep_prefix and not r.pending:
            self.prefix_cache.advance_and_publish(r, record_copies=True)
        self.residency_policy.release_pages(r)
        num_full = r.num_computed // self.block_size
        if keep_prefix and self.prefix_cache.enabled and r.pending:
            self.prefix_cache.detach(r, num_full)  # published once its copies complete
        else:
            self.host_pool.free(reversed(r.host_blocks))
        heapq.heappush(self._free_rows, r.state_row)
        self.tables.clear_row(r.state_row)
