"""`Coordinator`: decides where every page of every request lives (scheduler side, stdlib + numpy).

A JAX port of the upstream HiSparse coordinator of vLLM and SGLang. GPU-resident pages are a
write-back cache of the pinned host pool; the residency semantics are written down in
`docs/semantics.md`. The coordinator composes four parts, each in its own module:

  - `PrefixCache` (`prefix_cache.py`): page hashes, the published prefix of a prompt, the
    copy-on-write decision for a partial hit, publication of durable pages, and the index of
    device copies of published pages that later hits adopt;
  - `SpillPlanner` (`spill_planner.py`): eager write-back of sealed pages within the budget,
    spill and restore records, transfer ids, and what each worker report releases;
  - `ResidencyPolicy` (`residency.py`): the watermark and `request_room`, hot-region requests
    and grants, unpinning clean pages outside the active tail, the readers of unpinned blocks,
    and losing a page when its block is reused (plus the offload_all baseline);
  - `check_coordinator` (`invariants.py`): the invariants, checked from the parts.

The coordinator itself owns the requests, the state rows, the block tables and the open pass
(admission, scheduling, plan building, release). The parts share the two `BlockPool`s, one
`PassLog` (what the open pass changed) and one stats counter; besides that they talk through two
callbacks: the planner releases a spilled page's device block through the residency policy, and
the residency policy's reuse watcher tells the prefix cache that a device copy is gone.

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

import array
import collections
import heapq
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from host_tier.plan import HotInvalidation, StepPlan, StepWrite, TransferReport
from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.block_tables import BlockTables
from host_tier.scheduler.invariants import check_coordinator
from host_tier.scheduler.prefix_cache import PrefixCache
from host_tier.scheduler.records import (
    ACTIVE_TAIL_PAGES,
    INT64_END,
    INT64_MIN,
    Admitted,
    CapacityError,
    PassLog,
    RequestRecord,
    RequestView,
    RestoreRecord,
    SpillRecord,
    Wait,
    check_tokens,
)
from host_tier.scheduler.residency import ResidencyPolicy
from host_tier.scheduler.spill_planner import SpillPlanner
from host_tier.sizes import cdiv, check_int, config_size, is_int

__all__ = ["ACTIVE_TAIL_PAGES", "Admitted", "CapacityError", "Coordinator", "RequestView",
           "Wait"]

_SIZES = ("block_size", "num_gpu_blocks", "num_host_blocks", "hot_blocks", "max_num_reqs",
          "max_model_len")
_KEYWORD_SIZES = ("num_gpu_blocks", "num_host_blocks", "max_model_len")
_new_tuple = tuple.__new__


class Coordinator:
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
        max_pages = cdiv(max_model_len, block_size)
        unspillable = max_pages - num_host_blocks  # sealed pages past the host pool, at most
        min_device = hot_blocks + max(ACTIVE_TAIL_PAGES, unspillable) + 1
        if num_gpu_blocks - 1 < min_device:
            pinned = (f"{ACTIVE_TAIL_PAGES} pinned tail pages" if unspillable <= ACTIVE_TAIL_PAGES
                      else f"{unspillable} sealed pages the host pool's {num_host_blocks - 1} "
                           "usable blocks cannot take")
            raise ValueError(
                f"Coordinator.num_gpu_blocks={num_gpu_blocks} leaves {num_gpu_blocks - 1} usable "
                f"blocks; one decoding request needs up to {min_device} (hot region of "
                f"{hot_blocks} + {pinned} + 1 new page) to reach max_model_len={max_model_len}")
        self.block_size = block_size
        self.hot_blocks = hot_blocks
        self.max_model_len = max_model_len
        self.max_pages = max_pages
        self.resident_prefix_hits = bool(resident_prefix_hits)

        self.device_pool = BlockPool(num_gpu_blocks, name="device pool")
        self.host_pool = BlockPool(num_host_blocks, name="host pool")
        self.tables = BlockTables(max_num_reqs, self.max_pages, hot_blocks)
        # Counters, for tests and metrics (shared with the parts).
        self.stats: collections.Counter[str] = collections.Counter()

        self._log = PassLog()
        self._prefix = PrefixCache(self.host_pool, self.device_pool, block_size=block_size,
                                   enabled=enable_prefix_caching, stats=self.stats)
        self._residency = ResidencyPolicy(self.device_pool, hot_blocks=hot_blocks,
                                          block_size=block_size,
                                          offload_all=offload_all, log=self._log,
                                          stats=self.stats,
                                          forget_copy=self._prefix.forget_block)
        self._planner = SpillPlanner(self.host_pool, self.device_pool, block_size=block_size,
                                     max_spill_pages=max(1, max_model_len // block_size),
                                     log=self._log, stats=self.stats,
                                     release_device_page=self._residency.release_device_page)

        self._requests: dict[Hashable, RequestRecord] = {}
        self._free_rows = list(range(max_num_reqs))
        heapq.heapify(self._free_rows)
        self._detached: set[RequestRecord] = set()
        self._failed: dict[Hashable, None] = {}  # running requests a failed restore broke
        self._retry: dict[RequestRecord, None] = {}  # running requests with failed spills
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

    @property
    def watermark(self) -> int:
        """Free device blocks below which requests ask for hot regions:
        `max(hot_blocks, num_gpu_blocks // 10)`."""
        return self._residency.watermark

    @watermark.setter
    def watermark(self, value: int) -> None:
        self._residency.watermark = value

    @property
    def max_spill_pages(self) -> int:
        """Spills planned and not yet enqueued, at most: `max(1, max_model_len // B)`."""
        return self._planner.max_spill_pages

    @property
    def enable_prefix_caching(self) -> bool:
        return self._prefix.enabled

    def cached_tokens(self, prompt_token_ids: Sequence[int]) -> int:
        """The prompt tokens `admit` would reuse from published pages right now (0 without
        prefix caching): admit's `num_new_tokens` is at most the rest. Changes nothing."""
        return self.admission_need(prompt_token_ids)[0]

    def admission_need(self, prompt_token_ids: Sequence[int]) -> tuple[int, int]:
        """(cached, blocks) for a prompt admitted now: the tokens `admit` would reuse from
        published pages (as `cached_tokens`), and the device blocks the request holds once
        its whole prompt is prefilled: a block per prompt page, except that a staged hit's
        whole pages stay host-only and it takes a hot region instead (with
        `resident_prefix_hits` every hit page gets a block). Changes nothing. Without prefix
        caching the tokens are not read (`admit` checks them), so asking costs nothing per
        pass while a long prompt waits."""
        pages = cdiv(len(prompt_token_ids), self.block_size)
        if not self._prefix.enabled:
            return 0, pages
        hit = self._prefix.match(check_tokens(prompt_token_ids, "prompt_token_ids"))
        if hit.full_pages and not self.resident_prefix_hits:
            return hit.num_cached, pages - hit.full_pages + self.hot_blocks
        return hit.num_cached, pages

    def publishes(self, request_id: Hashable) -> bool:
        """Whether pages of the request may still be published: it is running, or it finished
        and its last copies are in flight (they publish its durable prefix when they
        complete)."""
        return request_id in self._requests or any(r.request_id == request_id
                                                   for r in self._detached)

    def listen(self, *, on_publish: Callable[[Hashable, int, bytes], None] | None = None,
               on_unpublish: Callable[[bytes], None] | None = None) -> None:
        """Registers the listeners of published pages (None: none): `on_publish(request_id,
        page, page_hash)` when a page of a request is published (called from `on_transfers`,
        `finish` or `cancel`; a finished request's last pages may publish after its state row
        is reused), `on_unpublish(page_hash)` when its host block is handed out again (the
        page is evicted: later prompts no longer hit it). Listeners must not call the
        coordinator."""
        self._prefix.on_publish = on_publish
        self.host_pool.on_unpublish = on_unpublish

    def drop_prefix_cache(self) -> None:
        """Forgets every published page and every indexed device copy of one: later prompts
        hit nothing published so far (e.g. after the device caches or host pool layers were
        rebuilt: their rows are gone). Running requests keep their blocks."""
        for block in list(self._prefix.copy_of_block):
            self._prefix.forget_block(block)
        self.host_pool.unpublish_all()

    @property
    def offload_all(self) -> bool:
        return self._residency.offload_all

    @property
    def num_in_flight_transfers(self) -> int:
        """Spills and restores the worker has not finished reporting."""
        return self._planner.num_in_flight

    def has_pending_transfers(self) -> bool:
        return self._planner.has_pending()

    @property
    def num_dirty_sealed_pages(self) -> int:
        """Sealed pages of running requests whose host copy has not completed (waiting for a
        spill, or in flight): the write-back backlog. Right after many long prompts are
        admitted it is large (every prompt page), and steps spill it within the budget; a
        steady decode seals about one page per request every `block_size` steps."""
        B = self.block_size
        return sum(r.num_computed // B - len(r.valid) for r in self._requests.values())

    @property
    def num_spill_retries(self) -> int:
        """Pages whose spill failed, to be spilled again by the next `build_plan` (whether or
        not their request is scheduled). Until then they stay dirty and pinned: a caller with
        nothing to schedule should still build and execute a plan while this is > 0 and no copy
        is in flight."""
        return sum(sum(1 for p in r.unbound if r.host_blocks[p] != NULL_BLOCK)
                   for r in self._retry)

    def request_room(self, num_blocks: int) -> None:
        """Asks the running requests to make room for `num_blocks` more device blocks (e.g. a
        waiting admission: a long prompt needs its pages free at once). Until it is cancelled
        (`request_room(0)`), the residency policy treats the pool as under pressure while
        fewer than `watermark + num_blocks` blocks are free, so requests move to hot regions
        and unpin their clean pages, whose blocks count as free."""
        self._residency.request_room(num_blocks)

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

    def capacity_error(self, num_prompt_tokens: int, max_total_tokens: int, *,
                       num_lookahead_tokens: int = 0) -> str | None:
        """Whether these pools serve a request to completion when it runs alone. Changes nothing.

        The request is admitted with its whole prompt (`num_prompt_tokens`), then writes one
        token per step until it holds `max_total_tokens` (prompt + new tokens; every one counts
        as written: an engine that never writes its last sampled token needs one token less);
        no prefix hit (a hit only lowers the need), no `request_room`. The answer is exact for
        this coordinator's policy (`docs/semantics.md`, host tier: the lone-request rule): None
        means such a request finishes without a stall whatever the order and delay of the
        worker's reports (a step that must wait for blocks succeeds once every copy in flight
        is reported); a reason means it never finishes (a stall, or `admit` raises
        `CapacityError`).

        With `num_lookahead_tokens` (`schedule`: rows written past the counted tokens, at
        positions below max_total_tokens) the request's pages open up to that many tokens
        earlier; the answer then stays sufficient (None is still a guarantee) but may refuse
        a request that an earlier hot-region ask would have saved.

        Returns:
          None, or the reason: the limit ("max_model_len", "host pool", "device pool") and the
          sizes needed and available.

        Raises:
          ValueError: the counts are not ints with 1 <= num_prompt_tokens <= max_total_tokens.
        """
        P = check_int("Coordinator.capacity_error", "num_prompt_tokens", num_prompt_tokens)
        T = check_int("Coordinator.capacity_error", "max_total_tokens", max_total_tokens)
        if T < P:
            raise ValueError(
                f"Coordinator.capacity_error: max_total_tokens={T} is less than "
                f"num_prompt_tokens={P} (it counts the prompt too)")
        la = check_int("Coordinator.capacity_error", "num_lookahead_tokens",
                       num_lookahead_tokens, minimum=0)
        if la >= self.block_size:
            raise ValueError(f"Coordinator.capacity_error: num_lookahead_tokens must be < "
                             f"block_size={self.block_size}, got {la}")
        B, H = self.block_size, self.hot_blocks
        usable, host_usable = self.device_pool.num_usable, self.host_pool.num_usable
        if T > self.max_model_len:
            return (f"max_model_len: the request holds up to {T} tokens ({P} in the prompt), "
                    f"more than max_model_len={self.max_model_len}")
        prompt_pages = cdiv(P, B)
        if prompt_pages > host_usable:
            return (f"host pool: the prompt needs {prompt_pages} host blocks, the host pool has "
                    f"only {host_usable}")
        if prompt_pages > usable:
            return (f"device pool: the prompt needs {prompt_pages} device blocks at admission, "
                    f"the device pool has only {usable}")
        # Alone, the request asks for its hot region after the step that leaves it holding
        # `ask` tokens (free blocks = usable - its pages; see ResidencyPolicy.update).
        residency = self._residency
        ask = max(P, residency.ask_at_tokens)
        under_watermark = usable - residency.watermark + 1  # pages that leave free < watermark
        ask = min(ask, max(P, (under_watermark - 1) * B + 1))
        if residency.offload_all:
            ask = P
        if ask >= T:
            return None  # it ends before it asks: never more than its own pages (rule above)
        # The grant comes with the step that writes token `ask`: every page is still pinned
        # (and the step's lookahead rows may open one more).
        pages = cdiv(ask, B)
        opens = cdiv(min(ask + 1 + la, T), B) - pages
        need = pages + opens + H
        if need > usable:
            return (f"device pool: alone, the request asks for its hot region once it holds "
                    f"{ask} tokens ({pages} pages, all pinned); the grant needs {need} device "
                    f"blocks ({pages} pages + {opens} new + a hot region of {H}), the device "
                    f"pool has only {usable}; shorten the prompt or raise num_gpu_blocks")
        # From then on, each new page q needs the hot region, the pages it cannot unpin (its
        # last ACTIVE_TAIL_PAGES, and sealed pages past the host pool, which stay dirty) and
        # itself; the need grows with q, so the last page decides.
        last = cdiv(T, B) - 1
        if last >= pages + opens:
            pinned = max(min(last, ACTIVE_TAIL_PAGES), last - host_usable)
            need = H + pinned + 1
            if need > usable:
                return (f"device pool: alone, the request needs {need} device blocks when it "
                        f"opens page {last} (a hot region of {H} + {pinned} pages it cannot "
                        f"unpin: its last {ACTIVE_TAIL_PAGES}, or sealed pages past the host "
                        f"pool's {host_usable} blocks + 1 new page), the device pool has only "
                        f"{usable}; raise num_gpu_blocks or num_host_blocks")
        return None

    # ------------------------------------------------------------------ admission

    def admit(self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
              num_new_tokens: int | None = None) -> Admitted | Wait:
        """Admits a request and schedules its first chunk for the next plan.

        Looks up the longest published prefix of the prompt (at most `len - 1` tokens, so the
        last token is recomputed), allocates a state row, host blocks for every prompt page that
        is not a hit, resident pages for the first chunk (`num_new_tokens`, default: the whole
        uncached prompt) and, on a prefix hit, a hot region.

        Returns:
          `Admitted`, or `Wait` (nothing allocated) when state rows, host or device blocks are
          short right now.

        Raises:
          ValueError: `request_id` is already admitted, or a token/num_new_tokens is invalid.
          CapacityError: the prompt or the first chunk can never fit in the pools.
        """
        if request_id in self._requests:
            raise ValueError(f"admit: request_id {request_id!r} is already admitted")
        tokens = check_tokens(prompt_token_ids, "prompt_token_ids")
        num_tokens = len(tokens)
        if num_tokens == 0:
            raise ValueError("admit: prompt_token_ids must not be empty")
        if num_tokens > self.max_model_len:
            raise CapacityError(
                f"admit: prompt_token_ids has {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}")
        B = self.block_size
        prompt_pages = cdiv(num_tokens, B)
        if prompt_pages > self.host_pool.num_usable:
            raise CapacityError(
                f"admit: the prompt needs {prompt_pages} host blocks, the host pool has only "
                f"{self.host_pool.num_usable}; raise host_pool_gib")

        hit = self._prefix.match(tokens)
        num_cached, full_hit = hit.num_cached, hit.full_pages
        remaining = num_tokens - num_cached
        chunk = remaining if num_new_tokens is None else num_new_tokens
        if not is_int(chunk) or not 1 <= chunk <= remaining:
            raise ValueError(
                f"admit: num_new_tokens must be in [1, {remaining}] (uncached prompt tokens), "
                f"got {num_new_tokens!r}")
        chunk = int(chunk)
        new_res_pages = cdiv(num_cached + chunk, B) - full_hit
        resident_hits = self.resident_prefix_hits
        need_hot = full_hit > 0 and not resident_hits  # a prefix hit reads host pages
        # Resident hits: a block per hit page at most (adopted device copies need none).
        device_need = (new_res_pages + (self.hot_blocks if need_hot else 0)
                       + (full_hit if resident_hits else 0))
        if device_need > self.device_pool.num_usable:
            raise CapacityError(
                f"admit: the first chunk needs {device_need} device blocks, the device pool has "
                f"only {self.device_pool.num_usable}; admit it with a smaller num_new_tokens")
        host_need = prompt_pages - full_hit

        if not self._free_rows:
            return Wait("state_rows", 1, 0,
                        f"all {self.tables.max_num_reqs} state rows (max_num_reqs) are in use; "
                        "a request must finish or be preempted first")
        held = hit.held_blocks
        host_available = self.host_pool.num_free - sum(
            1 for b in set(held) if self.host_pool.is_free(b))
        if host_need > host_available:
            return Wait("host_blocks", host_need, host_available,
                        self._host_wait_reason(host_need, host_available, "the prompt"))
        if device_need > self.device_pool.num_free:
            return Wait("device_blocks", device_need, self.device_pool.num_free,
                        self._device_wait_reason(device_need, "the first chunk"))

        state_row = heapq.heappop(self._free_rows)
        self.host_pool.touch(held)
        new_host = self.host_pool.allocate(host_need)
        hot = self.device_pool.allocate(self.hot_blocks) if need_hot else []
        res = self.device_pool.allocate(new_res_pages)
        r = RequestRecord(request_id=request_id, state_row=state_row,
                          token_ids=array.array("q", tokens), num_computed=num_cached,
                          host_blocks=hit.blocks[:full_hit] + new_host,
                          res_blocks=[NULL_BLOCK] * full_hit + res, hot=hot,
                          valid=set(range(full_hit)), ready_prefix=full_hit,
                          num_published=full_hit, spill_cursor=full_hit,
                          page_hashes=hit.hashes[:full_hit], scheduled=chunk)
        self._requests[request_id] = r
        self._pass.append(r)
        self._log.touched.add(r)
        self._log.hot_resets.add(state_row)
        self._log.invalidate(r, new_host)
        if hit.cow_source:
            # Copy-on-write of the shared page: restore its rows into the private resident page
            # (the restore holds the reference taken above).
            self._planner.plan_restore(r, hit.cow_source, r.res_blocks[full_hit], num_cached % B)
        # Adopt readable device copies of the hit pages (after this admission's allocations).
        self._prefix.adopt(r, hit.hashes[:full_hit])
        if resident_hits:
            # Hit pages without a device copy: restored from their published host pages.
            missing = [p for p in range(full_hit) if r.res_blocks[p] == NULL_BLOCK]
            for p, block in zip(missing, self.device_pool.allocate(len(missing)), strict=True):
                self.host_pool.touch([r.host_blocks[p]])  # the restore's reference
                self._planner.plan_restore(r, r.host_blocks[p], block, B,
                                           stat="prefix_restores")
                r.res_blocks[p] = block
                r.pinned_clean.add(p)
        r.num_nonresident = r.res_blocks.count(NULL_BLOCK)
        self.stats["cached_tokens"] += num_cached
        return Admitted(request_id, state_row, num_cached, chunk)

    # ------------------------------------------------------------------ scheduling

    def schedule(self, request_id: Hashable, num_tokens: int | None = None, *,
                 new_token_ids: Sequence[int] = (),
                 num_lookahead_tokens: int = 0) -> Wait | None:
        """Schedules the next `num_tokens` tokens of a running request in this pass.

        `new_token_ids` are appended first (e.g. the token sampled by the previous step); by
        default every known token not computed yet is scheduled. Grants a pending hot region,
        then allocates the device pages the tokens need. (Pages past the prompt get their host
        block when they seal; while the host pool is full a sealed page stays pinned.)

        `num_lookahead_tokens` (an int in [0, block_size)): the step also writes rows at the
        next that many positions past the scheduled tokens (speculative draft tokens, capped
        at max_model_len), which do not count as computed: their pages are allocated and kept
        resident, but they seal nothing and are never spilled. The caller schedules a
        position again (as a token) once its row is final; until then the row may be
        rewritten by a later step (`docs/semantics.md`, speculative rows).

        Returns:
          None when scheduled; `Wait` (nothing changed) when the device pool is short.

        Raises:
          ValueError: unknown request, already scheduled in this pass, invalid tokens, more
            than max_model_len tokens, or num_lookahead_tokens out of range.
        """
        r = self._requests.get(request_id)
        if num_tokens is None and self._on_fast_path([r], [new_token_ids],
                                                     [num_lookahead_tokens])[0]:
            r.token_ids.append(new_token_ids[0])
            r.scheduled = 1
            self._pass.append(r)
            return None
        return self._schedule_checked(*self._check_schedule(
            "schedule", request_id, num_tokens, new_token_ids, num_lookahead_tokens))

    def schedule_batch(self, request_ids: Sequence[Hashable],
                       new_token_ids: Sequence[Sequence[int]],
                       num_lookahead_tokens: Sequence[int] | None = None) -> list[Wait | None]:
        """Schedules running requests in this pass, in order, with every known token: the same
        as `schedule(request_ids[i], new_token_ids=new_token_ids[i],
        num_lookahead_tokens=num_lookahead_tokens[i])` for each i, in one call.

        An engine's decode step schedules every running request; at hundreds of requests the
        per-call overhead of `schedule` was a large part of the host time between model steps.
        Requests on the decode fast path (one new token, room in their pages, no hot region to
        grant) are scheduled inline; the others take `schedule`'s general path.

        Every argument is checked before anything changes: a ValueError leaves the pass as it
        was. A `Wait` for one request does not stop the others (as with separate calls).

        Args:
          request_ids: running requests, each at most once.
          new_token_ids: per request, the tokens to append first (`schedule`'s new_token_ids).
          num_lookahead_tokens: per request, `schedule`'s num_lookahead_tokens; None: all 0.

        Returns:
          Per request, what `schedule` returns: None when scheduled, else `Wait`.

        Raises:
          ValueError: the sequences differ in length, a request id appears twice, or an entry
            `schedule` would reject (the message names its index).
        """
        n = len(request_ids)
        if len(new_token_ids) != n:
            raise ValueError(f"schedule_batch: new_token_ids has {len(new_token_ids)} entries, "
                             f"request_ids {n}; they must have one entry per request")
        if num_lookahead_tokens is None:
            num_lookahead_tokens = (0,) * n
        elif len(num_lookahead_tokens) != n:
            raise ValueError(
                f"schedule_batch: num_lookahead_tokens has {len(num_lookahead_tokens)} entries, "
                f"request_ids {n}; they must have one entry per request (or be None)")
        if len(set(request_ids)) != n:
            seen: set[Hashable] = set()
            twice = next(rid for rid in request_ids if rid in seen or seen.add(rid))
            raise ValueError(f"schedule_batch: request_ids names request {twice!r} twice; a "
                             "request is scheduled at most once per pass")
        requests = self._requests
        records = [requests.get(rid) for rid in request_ids]
        fast = self._on_fast_path(records, new_token_ids, num_lookahead_tokens)
        if all(fast):  # the common decode step: every request inline, in one loop
            for r, tokens in zip(records, new_token_ids, strict=True):
                r.token_ids.append(tokens[0])
                r.scheduled = 1
            self._pass += records
            return [None] * n
        checked = [None if f else self._check_schedule(f"schedule_batch[{i}]", rid, None,
                                                       tokens, la)
                   for i, (f, rid, tokens, la) in enumerate(zip(
                       fast, request_ids, new_token_ids, num_lookahead_tokens, strict=True))]
        results: list[Wait | None] = []
        pass_ = self._pass
        for r, args, tokens in zip(records, checked, new_token_ids, strict=True):
            if args is None:
                r.token_ids.append(tokens[0])
                r.scheduled = 1
                pass_.append(r)
                results.append(None)
            else:
                results.append(self._schedule_checked(*args))
        return results

    def set_token_ids(self, updates: Sequence[tuple[Hashable, int, int]]) -> None:
        """Sets token ids already counted: (request_id, index, token) replaces token `index`
        (prompt tokens first) of a running request's token history. An engine with
        asynchronous scheduling counts a token still on the device with a placeholder id
        and sets the real one when it arrives. Only page hashes (prefix caching) read the
        ids: with prefix caching on, a page must not seal while it holds a placeholder.

        Raises:
          ValueError: a request is not admitted, an index is out of its history, or a token
            is not an int64 (before anything changes).
        """
        # One pass of cheap checks for the common batch (plain ints, every request running;
        # hundreds per step); the checks that name the culprit run only when one fails.
        requests = self._requests
        records = [requests.get(rid) for rid, _, _ in updates]
        # (A list, not a generator: all() over a generator cost a resume per update.)
        if all([r is not None and type(index) is int and 0 <= index < len(r.token_ids)
                and type(token) is int and INT64_MIN <= token < INT64_END
                for r, (_, index, token) in zip(records, updates, strict=True)]):
            for r, (_, index, token) in zip(records, updates, strict=True):
                r.token_ids[index] = token
            return
        for i, (rid, index, token) in enumerate(updates):
            r = self._running(rid, f"set_token_ids[{i}]")
            if not is_int(index) or not 0 <= index < len(r.token_ids):
                raise ValueError(f"set_token_ids[{i}]: index must be an int in [0, "
                                 f"{len(r.token_ids)}) (request {rid!r}'s known tokens), "
                                 f"got {index!r}")
            check_tokens([token], f"set_token_ids[{i}]: token")
        for r, (_, index, token) in zip(records, updates, strict=True):
            r.token_ids[index] = int(token)

    def _on_fast_path(self, records: list[RequestRecord | None],
                      new_token_ids: Sequence[Sequence[int]],
                      num_lookahead_tokens: Sequence[Any]) -> list[bool]:
        """Per request (None: not admitted), whether scheduling it with its new tokens and
        lookahead is the decode step of a request with room in its pages: one valid new token,
        nothing to allocate, no table row changes (the general path does the same, slower).
        One loop for the batch: a call per request cost more than the check."""
        B, max_len = self.block_size, self.max_model_len
        return [r is not None and not r.scheduled and len(tokens) == 1
                and (nc := r.num_computed) == len(r.token_ids) and nc < max_len
                and type(la) is int and 0 <= la < B
                and (nc + la if nc + la < max_len else max_len - 1) < len(r.res_blocks) * B
                and nc < len(r.host_blocks) * B
                and (r.hot or not r.hot_required)
                and type(t := tokens[0]) is int and INT64_MIN <= t < INT64_END
                for r, tokens, la in zip(records, new_token_ids, num_lookahead_tokens,
                                         strict=True)]

    def _check_schedule(self, what: str, request_id: Hashable, num_tokens: int | None,
                        new_token_ids: Sequence[int], num_lookahead_tokens: Any
                        ) -> tuple[RequestRecord, list[int], int, int]:
        """`schedule`'s argument checks, which change nothing: the record, the new tokens, the
        tokens to schedule and the lookahead. None of them depends on other requests, so a
        batch checks every entry before scheduling any."""
        la = num_lookahead_tokens
        if la and (not is_int(la) or not 0 <= la < self.block_size):
            raise ValueError(
                f"{what}: num_lookahead_tokens must be an int in [0, block_size="
                f"{self.block_size}) (lookahead rows may open at most one page), got {la!r}")
        r = self._running(request_id, what)
        if r.scheduled:
            raise ValueError(f"{what}: request {request_id!r} is already scheduled in this pass")
        extra = check_tokens(new_token_ids, f"{what}: new_token_ids")
        known = len(r.token_ids) + len(extra)
        if known > self.max_model_len:
            raise ValueError(
                f"{what}: request {request_id!r} would hold {known} tokens, more than "
                f"max_model_len={self.max_model_len}")
        remaining = known - r.num_computed
        n = remaining if num_tokens is None else num_tokens
        if not is_int(n) or not 1 <= n <= remaining:
            raise ValueError(
                f"{what}: num_tokens must be in [1, {remaining}] (known tokens not computed "
                f"yet), got {num_tokens!r}")
        n = int(n)
        la = int(la)
        page_end = min(r.num_computed + n + la, self.max_model_len)
        new_pages = max(cdiv(page_end, self.block_size) - len(r.res_blocks), 0)
        need = new_pages + (self.hot_blocks if r.hot_required and not r.hot else 0)
        if need > self.device_pool.num_usable:
            raise ValueError(
                f"{what}: {n} tokens need {need} device blocks, the device pool has only "
                f"{self.device_pool.num_usable}; schedule a smaller chunk")
        return r, extra, n, la

    def _schedule_checked(self, r: RequestRecord, extra: list[int], n: int,
                          la: int) -> Wait | None:
        """`schedule`'s general path after `_check_schedule`: grants a pending hot region and
        allocates the pages, or returns `Wait` (nothing changed) when the pool is short."""
        page_end = min(r.num_computed + n + la, self.max_model_len)  # lookahead rows need pages
        new_pages = max(cdiv(page_end, self.block_size) - len(r.res_blocks), 0)
        grant_hot = r.hot_required and not r.hot
        need = new_pages + (self.hot_blocks if grant_hot else 0)
        if need > self.device_pool.num_free:
            self.stats["schedule_waits"] += 1
            return Wait("device_blocks", need, self.device_pool.num_free,
                        self._device_wait_reason(need, f"request {r.request_id!r}"))

        r.token_ids.extend(extra)
        if grant_hot:
            self._residency.grant_hot_region(r)
        if new_pages:
            r.res_blocks.extend(self.device_pool.allocate(new_pages))
        new_host_pages = cdiv(page_end, self.block_size) - len(r.host_blocks)
        if new_host_pages > 0:
            # Host blocks of pages past the prompt are bound when the page seals (its spill is
            # planned): sealed pages get free host blocks first, the tail does not need one.
            r.host_blocks.extend([NULL_BLOCK] * new_host_pages)
        r.scheduled = n
        self._pass.append(r)
        if grant_hot or new_pages or new_host_pages > 0:
            self._log.touched.add(r)  # its table rows changed
        return None

    def build_plan(self) -> StepPlan:
        """Closes the pass: the requests scheduled in it advance, and the plan is returned.

        For each scheduled request (in scheduling order): its tokens count as computed (the
        plan's forward writes them), sealed pages without a host copy are spilled within the
        budget, and the residency policy runs (ask for a hot region below the watermark, unpin
        clean pages once it has one). Then pages whose spill failed are spilled again, those of
        requests not scheduled in this pass included: a plan with nothing scheduled (no
        forward) still carries them (`num_spill_retries`).
        """
        pass_ = self._pass
        # `tuple.__new__` builds the same named tuples without a Python-level `__new__` call.
        writes = [_new_tuple(StepWrite, (r.request_id, r.state_row, r.num_computed, r.scheduled))
                  for r in pass_]
        budget = self._planner.budget
        plan_spills, update_residency = self._planner.plan_spills, self._residency.update
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
        if self._retry:
            for r in list(self._retry):
                budget -= plan_spills(r, budget)
                if not any(r.host_blocks[p] != NULL_BLOCK for p in r.unbound):
                    del self._retry[r]
        log, tables = self._log, self.tables
        for r in log.touched:
            tables.set_row("src", r.state_row, r.host_blocks)
            tables.set_row("res", r.state_row, r.res_blocks)
            tables.set_row("hot", r.state_row, r.hot)
        for group, changed in log.entries.items():  # only these entries changed
            for r, pages in changed.items():
                if r not in log.touched:
                    tables.set_entries(group, r.state_row, pages,
                                       r.host_blocks if group == "src" else r.res_blocks)
        restores, spills = self._planner.take_pass()
        plan = StepPlan(
            step=self._step,
            writes=tuple(writes),
            tables=tables.take_update(),
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
        planner = self._planner
        planner.check_report(enqueued_ids, completed_ids, failed_ids)
        failed_spills = []
        for tid in failed_ids:
            if planner.is_restore(tid):
                planner.fail(tid, restore_failed=self._restore_failed,
                             spill_failed=self._page_failed)
            else:
                failed_spills.append(tid)
        for tid in enqueued_ids:
            planner.enqueued(tid)
        for tid in completed_ids:
            planner.complete(tid, self._page_clean)
        for tid in failed_spills:
            planner.fail(tid, restore_failed=self._restore_failed,
                         spill_failed=self._page_failed)

    def _page_clean(self, spill: SpillRecord) -> None:
        """A spill completed: its page is clean (and may be unpinned), and the durable prefix of
        its request is published; a finished request's last completion publishes its prefix and
        releases its host blocks."""
        r, page = spill.request, spill.page
        del r.pending[page]
        r.valid.add(page)
        if self._requests.get(r.request_id) is r:
            assert r.res_blocks[page] == spill.device_block, "a dirty page lost its block"
            self._residency.page_clean(r, page)
            self._prefix.advance_and_publish(r, record_copies=True)
        else:
            self._settle_detached(r)

    def _page_failed(self, spill: SpillRecord) -> None:
        """A spill failed: its page is dirty again. A running request spills it again on a later
        pass (same host block); a request that left drops it (a finished one publishes the
        prefix before it once its other copies are done)."""
        r, page = spill.request, spill.page
        del r.pending[page]
        self.stats["failed_spills"] += 1
        if self._requests.get(r.request_id) is r:
            assert r.res_blocks[page] == spill.device_block, "a dirty page lost its block"
            r.unbound.add(page)  # it keeps its host block
            self._retry[r] = None
        else:
            self._settle_detached(r)

    def _restore_failed(self, restore: RestoreRecord) -> None:
        """A copy-on-write restore failed: the request's page lacks the shared rows."""
        r = restore.request
        r.failed = True
        self.stats["failed_restores"] += 1
        if self._requests.get(r.request_id) is r:
            self._failed[r.request_id] = None

    def _settle_detached(self, r: RequestRecord) -> None:
        """A finished request's copy ended: after its last one, its durable prefix is published
        and its host blocks are released."""
        if r.detached_pages >= 0 and not r.pending:
            self._prefix.advance_and_publish(r, record_copies=False)
            self.host_pool.free(reversed(r.host_blocks[:r.detached_pages]))
            r.detached_pages = -1
            self._detached.discard(r)

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
        check_coordinator(requests=self._requests, detached=self._detached,
                          free_rows=self._free_rows, hot_blocks=self.hot_blocks,
                          device_pool=self.device_pool, host_pool=self.host_pool,
                          planner=self._planner, residency=self._residency,
                          prefix_cache=self._prefix, failed=self._failed,
                          retry=self._retry)

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
            self._planner.drop_pass_restores(r)
        del self._requests[r.request_id]
        self._failed.pop(r.request_id, None)
        self._retry.pop(r, None)
        keep_prefix = keep_prefix and not r.failed
        self._log.forget(r)
        if keep_prefix and not r.pending:
            self._prefix.advance_and_publish(r, record_copies=True)
        self._residency.release_pages(r)
        num_full = r.num_computed // self.block_size
        if keep_prefix and self.enable_prefix_caching and r.pending:
            # Publish the durable prefix once the copies in flight complete.
            r.detached_pages = num_full
            self._detached.add(r)
            self.host_pool.free(reversed(r.host_blocks[num_full:]))
        else:
            self.host_pool.free(reversed(r.host_blocks))
        heapq.heappush(self._free_rows, r.state_row)
        self.tables.clear_row(r.state_row)

    def _host_wait_reason(self, needed: int, available: int, what: str) -> str:
        in_flight = self._planner.num_in_flight
        text = (f"host pool full: {what} needs {needed} free host blocks, {available} are "
                "available")
        if in_flight or self._detached:
            return text + (f"; {in_flight} transfers in flight and {len(self._detached)} "
                           "finished requests awaiting their last copies hold host blocks that "
                           "are released as the worker reports completions")
        return text + "; finish or preempt running requests to release host blocks"

    def _device_wait_reason(self, needed: int, what: str) -> str:
        text = (f"device pool full: {what} needs {needed} free device blocks, "
                f"{self.device_pool.num_free} are free")
        unenqueued = self._planner.num_unenqueued
        if unenqueued:
            return text + (f"; {unenqueued} pages are pinned until the worker enqueues their "
                           "spills")
        return text + "; pages unpin once their host copies complete, or preempt a request"
