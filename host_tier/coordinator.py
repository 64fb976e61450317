"""`Coordinator`: decides where every page of every request lives (scheduler side, plain Python).

The JAX port of upstream `HiSparseCoordinator` (vLLM `vllm/v1/hisparse/coordinator.py`, SGLang
`hisparse_coordinator.py`). GPU-resident pages are a write-back cache of the pinned host pool:

  - every sealed page is written back to host eagerly (a *spill*), at most `max_model_len // B`
    spills queued (planned, not yet enqueued by the worker) at a time;
  - a request "can read from host" once it owns a hot region (`hot_blocks` device blocks). While
    the device pool has at least `watermark = max(hot_blocks, num_gpu_blocks // 10)` free blocks
    requests keep their pages pinned; below it they ask for a hot region, granted when the
    request is next scheduled;
  - a request that can read from host unpins every clean sealed page (host copy complete) except
    its last 2 pages: the block counts as free yet is still read until the pool hands it to
    someone else; then the owner's table entry becomes null and the page is read from host;
  - host pages are published for prefix reuse only once their copies completed; a finished
    request's pending publications complete after it left, a preempted request's are dropped;
    GPU copies of published pages are adopted by later prefix hits;
  - a partial prefix hit never writes into the shared host block (copy-on-write: the request gets
    a private host block, its resident page is restored from the shared one before the step);
  - host blocks newly allocated to a request have their rows dropped from its hot state.

Spills are transactions: the resident block stays pinned until the worker reports the copy
enqueued, the host block until it reports it completed.

Usage, once per model step::

    coord.admit(rid, prompt)              # new requests: Admitted, or Wait(reason)
    coord.schedule(rid, new_token_ids=t)  # running requests: None, or Wait(reason)
    plan = coord.build_plan()             # StepPlan for the TransferEngine / model step
    ...                                   # worker executes the plan
    coord.on_transfers(report)            # whenever the worker reports (late, any order)
    coord.finish(rid) / coord.preempt(rid) / coord.cancel(rid)

Capacity limits are states: admission and scheduling return `Wait` with a reason and allocate
nothing; only a request that can never fit raises `CapacityError`.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import heapq
import itertools
import numbers
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from host_tier.block_pool import NULL_BLOCK, BlockPool
from host_tier.block_tables import BlockTables
from host_tier.plan import (
    HotInvalidation,
    PageRestore,
    PageSpill,
    StepPlan,
    StepWrite,
    TransferReport,
)

ACTIVE_TAIL_PAGES = 2
"""A request's last pages that are never unpinned: an in-flight step may still write them."""


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
    """Read-only snapshot of one request's residency, for tests, metrics and debugging."""

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
class _Request:
    """Residency bookkeeping of one admitted request (identity-hashed).

    A resident page is dirty (only the device copy is complete), clean (`valid`: the host copy
    completed) or unpinned (clean, its reference released: read until the block is reused).
    `pinned_clean` = valid pages whose resident block is still referenced by the request.
    """

    request_id: Hashable
    state_row: int
    token_ids: array.array  # int64; a list of 64K ints would cost every full GC a 64K walk
    num_computed: int
    host_blocks: list[int]
    res_blocks: list[int]
    valid: set[int] = dataclasses.field(default_factory=set)
    pending: dict[int, int] = dataclasses.field(default_factory=dict)  # page -> spill id
    unpinned: set[int] = dataclasses.field(default_factory=set)
    pinned_clean: set[int] = dataclasses.field(default_factory=set)
    hot: list[int] = dataclasses.field(default_factory=list)
    hot_required: bool = False
    ready_prefix: int = 0  # leading pages that are all valid
    num_published: int = 0  # leading pages published for prefix reuse
    spill_cursor: int = 0  # pages below it are valid, pending or in `unbound`
    unbound: set[int] = dataclasses.field(default_factory=set)  # sealed, host pool was full
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    scheduled: int = 0  # tokens scheduled in the current pass
    detached_pages: int = -1  # >= 0 once finished with publications still pending
    num_nonresident: int = 0  # NULL entries of res_blocks (pages read from host)


@dataclasses.dataclass(eq=False)
class _Spill:
    transfer_id: int
    request: _Request
    page: int
    device_block: int
    host_block: int
    enqueued: bool = False


@dataclasses.dataclass(eq=False)
class _Restore:
    transfer_id: int
    request: _Request
    host_block: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained content hash of one full page: depends on every token of the prefix."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array.array("q", tokens).tobytes())
    return h.digest()


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
    """

    def __init__(self, *, block_size: int, num_gpu_blocks: int, num_host_blocks: int,
                 hot_blocks: int, max_num_reqs: int, max_model_len: int,
                 enable_prefix_caching: bool = True, offload_all: bool = False) -> None:
        for name, value in (("block_size", block_size), ("num_gpu_blocks", num_gpu_blocks),
                            ("num_host_blocks", num_host_blocks), ("hot_blocks", hot_blocks),
                            ("max_num_reqs", max_num_reqs), ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Coordinator.{name} must be a positive int, got {value!r}")
        min_device = hot_blocks + ACTIVE_TAIL_PAGES + 1
        if num_gpu_blocks - 1 < min_device:
            raise ValueError(
                f"Coordinator.num_gpu_blocks={num_gpu_blocks} leaves {num_gpu_blocks - 1} usable "
                f"blocks; one decoding request needs up to {min_device} (hot region of "
                f"{hot_blocks} + {ACTIVE_TAIL_PAGES} pinned tail pages + 1 new page)")
        if num_host_blocks < 2:
            raise ValueError(f"Coordinator.num_host_blocks must be >= 2, got {num_host_blocks}")
        self.block_size = block_size
        self.hot_blocks = hot_blocks
        self.max_model_len = max_model_len
        self.max_pages = _cdiv(max_model_len, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        # Every request reads from host from its first step, and a page's device block is
        # released the moment its host copy completes (the naive-offload baseline).
        self.offload_all = bool(offload_all)
        self.watermark = max(hot_blocks, num_gpu_blocks // 10)
        self._room = 0  # device blocks a waiting admission asked for (`request_room`)
        self.max_spill_pages = max(1, max_model_len // block_size)

        self.device_pool = BlockPool(num_gpu_blocks, name="device pool")
        self.host_pool = BlockPool(num_host_blocks, name="host pool")
        self.tables = BlockTables(max_num_reqs, self.max_pages, hot_blocks)

        self._requests: dict[Hashable, _Request] = {}
        self._free_rows = list(range(max_num_reqs))
        heapq.heapify(self._free_rows)
        self._detached: set[_Request] = set()
        self._spills: dict[int, _Spill] = {}
        self._restores: dict[int, _Restore] = {}
        self._num_unenqueued_spills = 0
        self._awaiting_enqueue_notice: set[int] = set()  # completed before their enqueue notice
        self._next_transfer_id = itertools.count()
        self._step = 0
        # Unpinned device block -> (request, page) pairs still reading it.
        self._owners: dict[int, set[tuple[_Request, int]]] = {}
        # Published host page hash -> a device block holding the same page, until reused.
        self._copies: dict[bytes, int] = {}
        self._copy_of_block: dict[int, bytes] = {}
        # Current pass.
        self._pass: list[_Request] = []
        self._touched: set[_Request] = set()
        self._hot_resets: set[int] = set()
        self._invalidations: dict[int, list[int]] = {}
        self._pass_restores: list[PageRestore] = []
        self._pass_spills: list[PageSpill] = []
        # Counters, for tests and metrics.
        self.stats: collections.Counter[str] = collections.Counter()

    @classmethod
    def from_config(cls, config: Any, *, num_gpu_blocks: int, num_host_blocks: int,
                    max_model_len: int, **kwargs: Any) -> Coordinator:
        """Sizes from a `hisparse_jax.config.HiSparseConfig` (block_size, hot_blocks,
        max_num_reqs)."""
        return cls(block_size=config.block_size, num_gpu_blocks=num_gpu_blocks,
                   num_host_blocks=num_host_blocks, hot_blocks=config.hot_blocks,
                   max_num_reqs=config.max_num_reqs, max_model_len=max_model_len, **kwargs)

    # ------------------------------------------------------------------ queries

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        return tuple(self._requests)

    @property
    def num_in_flight_transfers(self) -> int:
        """Spills and restores the worker has not finished reporting."""
        return len(self._spills) + len(self._restores)

    def has_pending_transfers(self) -> bool:
        return bool(self._spills or self._restores or self._awaiting_enqueue_notice)

    def request_room(self, num_blocks: int) -> None:
        """Asks the running requests to make room for `num_blocks` more device blocks (e.g. a
        waiting admission: a long prompt needs its pages free at once). Until it is cancelled
        (`request_room(0)`), the residency policy treats the pool as under pressure while
        fewer than `watermark + num_blocks` blocks are free, so requests move to hot regions
        and unpin their clean pages, whose blocks count as free."""
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"request_room: num_blocks must be an int >= 0, got {num_blocks!r}")
        self._room = num_blocks

    def all_pages_resident(self, request_id: Hashable) -> bool:
        """Whether every computed page of a running request has its resident block (no read
        from host needed: the decode fast path). Cheaper than `view`."""
        return self._running(request_id, "all_pages_resident").num_nonresident == 0

    def view(self, request_id: Hashable) -> RequestView:
        r = self._running(request_id, "view")
        return RequestView(
            request_id=r.request_id, state_row=r.state_row, num_computed_tokens=r.num_computed,
            host_blocks=tuple(r.host_blocks), resident_blocks=tuple(r.res_blocks),
            hot_blocks=tuple(r.hot), hot_required=r.hot_required,
            valid_pages=frozenset(r.valid), pending_pages=frozenset(r.pending),
            unpinned_pages=frozenset(r.unpinned), ready_prefix_pages=r.ready_prefix,
            published_pages=r.num_published)

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
        tokens = _check_tokens(prompt_token_ids, "prompt_token_ids")
        num_tokens = len(tokens)
        if num_tokens == 0:
            raise ValueError("admit: prompt_token_ids must not be empty")
        if num_tokens > self.max_model_len:
            raise CapacityError(
                f"admit: prompt_token_ids has {num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}")
        B = self.block_size
        prompt_pages = _cdiv(num_tokens, B)
        if prompt_pages > self.host_pool.num_usable:
            raise CapacityError(
                f"admit: the prompt needs {prompt_pages} host blocks, the host pool has only "
                f"{self.host_pool.num_usable}; raise host_pool_gib")

        # Prefix hit: published pages, as long as their chain of hashes matches.
        hit_blocks: list[int] = []
        hashes: list[bytes] = []
        if self.enable_prefix_caching:
            parent = None
            for p in range(num_tokens // B):
                h = page_hash(parent, tokens[p * B:(p + 1) * B])
                block = self.host_pool.lookup(h)
                if block is None:
                    break
                hit_blocks.append(block)
                hashes.append(h)
                parent = h
        num_cached = min(len(hit_blocks) * B, num_tokens - 1)
        full_hit = num_cached // B  # pages reused as they are
        cow_source = hit_blocks[full_hit] if num_cached % B else NULL_BLOCK

        remaining = num_tokens - num_cached
        chunk = remaining if num_new_tokens is None else num_new_tokens
        if (not isinstance(chunk, numbers.Integral) or isinstance(chunk, bool)
                or not 1 <= chunk <= remaining):
            raise ValueError(
                f"admit: num_new_tokens must be in [1, {remaining}] (uncached prompt tokens), "
                f"got {num_new_tokens!r}")
        chunk = int(chunk)
        new_res_pages = _cdiv(num_cached + chunk, B) - full_hit
        need_hot = full_hit > 0
        device_need = new_res_pages + (self.hot_blocks if need_hot else 0)
        if device_need > self.device_pool.num_usable:
            raise CapacityError(
                f"admit: the first chunk needs {device_need} device blocks, the device pool has "
                f"only {self.device_pool.num_usable}; admit it with a smaller num_new_tokens")
        host_need = prompt_pages - full_hit

        if not self._free_rows:
            return Wait("state_rows", 1, 0,
                        f"all {self.tables.max_num_reqs} state rows (max_num_reqs) are in use; "
                        "a request must finish or be preempted first")
        touched = hit_blocks[:full_hit] + ([cow_source] if cow_source else [])
        host_available = self.host_pool.num_free - sum(
            1 for b in set(touched) if self.host_pool.is_free(b))
        if host_need > host_available:
            return Wait("host_blocks", host_need, host_available,
                        self._host_wait_reason(host_need, host_available, "the prompt"))
        if device_need > self.device_pool.num_free:
            return Wait("device_blocks", device_need, self.device_pool.num_free,
                        self._device_wait_reason(device_need, "the first chunk"))

        state_row = heapq.heappop(self._free_rows)
        self.host_pool.touch(touched)
        new_host = self.host_pool.allocate(host_need)
        hot = self.device_pool.allocate(self.hot_blocks) if need_hot else []
        res = self.device_pool.allocate(new_res_pages)
        r = _Request(request_id=request_id, state_row=state_row,
                     token_ids=array.array("q", tokens),
                     num_computed=num_cached, host_blocks=hit_blocks[:full_hit] + new_host,
                     res_blocks=[NULL_BLOCK] * full_hit + res, hot=hot,
                     valid=set(range(full_hit)), ready_prefix=full_hit, num_published=full_hit,
                     spill_cursor=full_hit, page_hashes=hashes[:full_hit], scheduled=chunk)
        self._requests[request_id] = r
        self._pass.append(r)
        self._touched.add(r)
        self._hot_resets.add(state_row)
        self._invalidate(r, new_host)
        if cow_source:
            # Copy-on-write of the shared page: restore its rows into the private resident page.
            transfer_id = next(self._next_transfer_id)
            self._restores[transfer_id] = _Restore(transfer_id, r, cow_source)  # holds the touch
            self._pass_restores.append(PageRestore(transfer_id, cow_source,
                                                   r.res_blocks[full_hit], num_cached % B))
            self.stats["copy_on_write"] += 1
        # Adopt readable device copies of the hit pages (after this admission's allocations).
        for p in range(full_hit):
            block = self._copies.get(hashes[p])
            if block is not None:
                self.device_pool.touch([block])
                r.res_blocks[p] = block
                r.pinned_clean.add(p)
                self.stats["adopted_pages"] += 1
        r.num_nonresident = r.res_blocks.count(NULL_BLOCK)
        self.stats["cached_tokens"] += num_cached
        return Admitted(request_id, state_row, num_cached, chunk)

    # ------------------------------------------------------------------ scheduling

    def schedule(self, request_id: Hashable, num_tokens: int | None = None, *,
                 new_token_ids: Sequence[int] = ()) -> Wait | None:
        """Schedules the next `num_tokens` tokens of a running request in this pass.

        `new_token_ids` are appended first (e.g. the token sampled by the previous step); by
        default every known token not computed yet is scheduled. Grants a pending hot region,
        then allocates the device pages the tokens need. (Pages past the prompt get their host
        block when they seal; while the host pool is full a sealed page stays pinned.)

        Returns:
          None when scheduled; `Wait` (nothing changed) when the device pool is short.

        Raises:
          ValueError: unknown request, already scheduled in this pass, invalid tokens, or more
            than max_model_len tokens.
        """
        r = self._requests.get(request_id)
        if (r is not None and not r.scheduled and num_tokens is None
                and len(new_token_ids) == 1 and r.num_computed == len(r.token_ids)
                and r.num_computed < self.max_model_len
                and r.num_computed < len(r.res_blocks) * self.block_size
                and r.num_computed < len(r.host_blocks) * self.block_size
                and (r.hot or not r.hot_required)):
            # The decode step of a request with room in its pages: one token, nothing to
            # allocate, no table row changes (the general path below does the same, slower).
            token = new_token_ids[0]
            if type(token) is int and -(1 << 63) <= token < (1 << 63):
                r.token_ids.append(token)
                r.scheduled = 1
                self._pass.append(r)
                return None
        r = self._running(request_id, "schedule")
        if r.scheduled:
            raise ValueError(f"schedule: request {request_id!r} is already scheduled in this pass")
        extra = _check_tokens(new_token_ids, "new_token_ids")
        known = len(r.token_ids) + len(extra)
        if known > self.max_model_len:
            raise ValueError(
                f"schedule: request {request_id!r} would hold {known} tokens, more than "
                f"max_model_len={self.max_model_len}")
        remaining = known - r.num_computed
        n = remaining if num_tokens is None else num_tokens
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or not 1 <= n <= remaining:
            raise ValueError(
                f"schedule: num_tokens must be in [1, {remaining}] (known tokens not computed "
                f"yet), got {num_tokens!r}")
        n = int(n)
        end = r.num_computed + n
        new_pages = max(_cdiv(end, self.block_size) - len(r.res_blocks), 0)
        grant_hot = r.hot_required and not r.hot
        need = new_pages + (self.hot_blocks if grant_hot else 0)
        if need > self.device_pool.num_usable:
            raise ValueError(
                f"schedule: {n} tokens need {need} device blocks, the device pool has only "
                f"{self.device_pool.num_usable}; schedule a smaller chunk")
        if need > self.device_pool.num_free:
            self.stats["schedule_waits"] += 1
            return Wait("device_blocks", need, self.device_pool.num_free,
                        self._device_wait_reason(need, f"request {request_id!r}"))

        r.token_ids.extend(extra)
        if grant_hot:
            r.hot = self.device_pool.allocate(self.hot_blocks)
            self._hot_resets.add(r.state_row)
            self.stats["hot_grants"] += 1
        if new_pages:
            r.res_blocks.extend(self.device_pool.allocate(new_pages))
        new_host_pages = _cdiv(end, self.block_size) - len(r.host_blocks)
        if new_host_pages > 0:
            # Host blocks of pages past the prompt are bound when the page seals (its spill is
            # planned): sealed pages get free host blocks first, the tail does not need one.
            r.host_blocks.extend([NULL_BLOCK] * new_host_pages)
        r.scheduled = n
        self._pass.append(r)
        if grant_hot or new_pages or new_host_pages > 0:
            self._touched.add(r)  # its table rows changed
        return None

    def build_plan(self) -> StepPlan:
        """Closes the pass: the requests scheduled in it advance, and the plan is returned.

        For each scheduled request (in scheduling order): its tokens count as computed (the
        plan's forward writes them), sealed pages without a host copy are spilled within the
        budget, and the residency policy runs (ask for a hot region below the watermark, unpin
        clean pages once it has one).
        """
        writes = []
        for r in self._pass:
            writes.append(StepWrite(r.request_id, r.state_row, r.num_computed, r.scheduled))
            r.num_computed += r.scheduled
            r.scheduled = 0
        budget = self.max_spill_pages - self._num_unenqueued_spills
        for r in self._pass:
            budget -= self._plan_spills(r, budget)
            self._update_residency(r)
        for r in self._touched:
            self.tables.set_row("src", r.state_row, r.host_blocks)
            self.tables.set_row("res", r.state_row, r.res_blocks)
            self.tables.set_row("hot", r.state_row, r.hot)
        plan = StepPlan(
            step=self._step,
            writes=tuple(writes),
            tables=self.tables.take_update(),
            hot_resets=tuple(sorted(self._hot_resets)),
            hot_invalidations=tuple(HotInvalidation(row, tuple(sorted(set(blocks))))
                                    for row, blocks in sorted(self._invalidations.items())),
            restores=tuple(self._pass_restores),
            spills=tuple(self._pass_spills),
        )
        self._step += 1
        self._pass = []
        self._touched = set()
        self._hot_resets = set()
        self._invalidations = {}
        self._pass_restores = []
        self._pass_spills = []
        return plan

    # ------------------------------------------------------------------ worker reports

    def on_transfers(self, report: TransferReport | None = None, *,
                     enqueued: Iterable[int] = (), completed: Iterable[int] = ()) -> None:
        """Applies worker reports: transfers enqueued and completed, in any order and any delay.

        An enqueued spill releases its resident block; a completed spill makes its page clean
        (unpinned at once if the request can read from host), releases its host block and may
        publish the request's durable prefix. A completion reported before its enqueue notice
        counts as both. Ids are checked before anything changes.

        Raises:
          ValueError: an unknown id, an id reported twice, or a restore reported completed.
        """
        enqueued_ids = list(report.enqueued if report else ()) + list(enqueued)
        completed_ids = list(report.completed if report else ()) + list(completed)
        for ids, what in ((enqueued_ids, "enqueued"), (completed_ids, "completed")):
            if len(set(ids)) != len(ids):
                raise ValueError(f"on_transfers: {what} names a transfer id twice: {ids}")
        for tid in enqueued_ids:
            spill = self._spills.get(tid)
            if not (tid in self._restores or tid in self._awaiting_enqueue_notice
                    or (spill is not None and not spill.enqueued)):
                raise ValueError(
                    f"on_transfers: enqueued transfer id {tid} is unknown or already enqueued")
        for tid in completed_ids:
            if tid not in self._spills:
                raise ValueError(
                    f"on_transfers: completed transfer id {tid} is not a pending spill "
                    "(unknown, a restore, or already completed)")
        for tid in enqueued_ids:
            if tid in self._awaiting_enqueue_notice:
                self._awaiting_enqueue_notice.remove(tid)
            elif tid in self._restores:
                self.host_pool.free([self._restores.pop(tid).host_block])
            else:
                self._spill_enqueued(self._spills[tid])
        for tid in completed_ids:
            spill = self._spills.pop(tid)
            if not spill.enqueued:
                self._spill_enqueued(spill)
                self._awaiting_enqueue_notice.add(tid)
            self._spill_completed(spill)

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

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raises AssertionError when a residency invariant is broken (used by the tests).

        Every block is free xor referenced and each reference is accounted for (no leak, no
        double free); published host pages have completed copies and are never spill targets;
        the last 2 pages stay pinned; unpinned pages are clean and tracked; a null resident page
        is clean on host and its request owns a hot region; a page being written (dirty) and a
        hot region are never shared with another reader.
        """
        device_refs: collections.Counter[int] = collections.Counter()
        host_refs: collections.Counter[int] = collections.Counter()
        exclusive: dict[int, str] = {}  # device blocks that must have exactly one user

        def claim(block: int, who: str) -> None:
            assert block not in exclusive, f"device block {block} used by {exclusive[block]} " \
                                           f"and {who}"
            exclusive[block] = who

        for r in self._requests.values():
            assert r.num_nonresident == r.res_blocks.count(NULL_BLOCK), (
                f"request {r.request_id!r}: non-resident page count out of date")
            name = f"request {r.request_id!r}"
            n = len(r.res_blocks)
            assert len(r.host_blocks) >= n, f"{name}: fewer host entries than resident pages"
            assert len(r.hot) in (0, self.hot_blocks), f"{name}: partial hot region"
            assert not any(p >= n - ACTIVE_TAIL_PAGES for p in r.unpinned), (
                f"{name}: one of its last {ACTIVE_TAIL_PAGES} pages is unpinned")
            assert r.unpinned <= r.valid, f"{name}: an unpinned page is not clean"
            assert not (set(r.pending) & r.valid), f"{name}: a page is both pending and clean"
            ready = 0
            while ready in r.valid:
                ready += 1
            assert r.ready_prefix == ready, f"{name}: ready prefix {r.ready_prefix} != {ready}"
            assert r.num_published <= max(r.ready_prefix, 0), f"{name}: published past ready"
            pinned_clean = set()
            for p, block in enumerate(r.res_blocks):
                if block == NULL_BLOCK:
                    assert p in r.valid and r.host_blocks[p] != NULL_BLOCK, (
                        f"{name}: page {p} has no resident block and no complete host copy")
                    assert r.hot, f"{name}: page {p} is read from host without a hot region"
                    continue
                if p in r.unpinned:
                    assert (r, p) in self._owners.get(block, ()), (
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
                spill = self._spills.get(tid)
                assert spill is not None and spill.request is r and spill.page == p, (
                    f"{name}: pending page {p} has no matching spill")
            for block in r.host_blocks:
                if block != NULL_BLOCK:
                    host_refs[block] += 1
        for r in self._detached:
            assert r.detached_pages >= 0 and r.pending, "detached record without pending spills"
            for block in r.host_blocks[:r.detached_pages]:
                if block != NULL_BLOCK:
                    host_refs[block] += 1
        for spill in self._spills.values():
            host_refs[spill.host_block] += 1
            if not spill.enqueued:
                device_refs[spill.device_block] += 1
        for restore in self._restores.values():
            host_refs[restore.host_block] += 1
        self.device_pool.check_invariants(dict(device_refs))
        self.host_pool.check_invariants(dict(host_refs))

        spill_targets = {s.host_block for s in self._spills.values()}
        for block in self.host_pool.published_blocks():
            assert block not in spill_targets, f"published host block {block} is being written"
        assert self._num_unenqueued_spills == sum(
            not s.enqueued for s in self._spills.values()), "unenqueued spill count drifted"
        for block, owners in self._owners.items():
            assert owners, f"empty reader set for device block {block}"
            for r, p in owners:
                assert self._requests.get(r.request_id) is r, "a departed request still reads"
                assert r.res_blocks[p] == block and p in r.unpinned, "stale reader entry"
                assert block not in exclusive, (
                    f"unpinned device block {block} is also {exclusive[block]}")
        for h, block in self._copies.items():
            assert self._copy_of_block.get(block) == h, "device copy index disagrees"
            assert block not in exclusive, f"device copy {block} is also {exclusive[block]}"
        assert len(self._copies) == len(self._copy_of_block), "device copy index sizes differ"
        rows = [r.state_row for r in self._requests.values()]
        assert len(set(rows)) == len(rows), "two requests share a state row"
        assert not set(rows) & set(self._free_rows), "a used state row is also free"

    # ------------------------------------------------------------------ internals

    def _running(self, request_id: Hashable, what: str) -> _Request:
        r = self._requests.get(request_id)
        if r is None:
            raise ValueError(f"{what}: request_id {request_id!r} is not admitted")
        return r

    def _invalidate(self, r: _Request, new_host_blocks: Sequence[int]) -> None:
        """Host blocks newly given to `r` must not be served from its hot state."""
        if new_host_blocks:
            self._invalidations.setdefault(r.state_row, []).extend(new_host_blocks)

    def _page_hash(self, r: _Request, page: int) -> bytes:
        B = self.block_size
        while len(r.page_hashes) <= page:
            p = len(r.page_hashes)
            parent = r.page_hashes[-1] if r.page_hashes else None
            r.page_hashes.append(page_hash(parent, r.token_ids[p * B:(p + 1) * B]))
        return r.page_hashes[page]

    def _plan_spills(self, r: _Request, budget: int) -> int:
        """Eager write-back of sealed pages that have no host copy; returns spills planned."""
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
                self._invalidate(r, [host_block])
                self._touched.add(r)
            r.unbound.discard(p)
            assert self.host_pool.block_hash(host_block) is None, (
                f"spill into published host block {host_block}")
            self.host_pool.touch([host_block])
            self.device_pool.touch([device_block])
            transfer_id = next(self._next_transfer_id)
            self._spills[transfer_id] = _Spill(transfer_id, r, p, device_block, host_block)
            self._num_unenqueued_spills += 1
            r.pending[p] = transfer_id
            self._pass_spills.append(PageSpill(transfer_id, device_block, host_block))
            planned += 1
        self.stats["spills"] += planned
        return planned

    def _update_residency(self, r: _Request) -> None:
        if not r.hot:
            free = self.device_pool.num_free
            if free >= self.watermark + self._room and not self.offload_all:
                return
            r.hot_required = True  # granted when the request is next scheduled
            return
        if not r.pinned_clean:
            return
        tail_start = len(r.res_blocks) - ACTIVE_TAIL_PAGES
        for p in sorted(r.pinned_clean, reverse=True):  # tail first: heads survive longer
            if p < tail_start:
                self._unpin_page(r, p)

    def _unpin_page(self, r: _Request, page: int) -> None:
        block = r.res_blocks[page]
        self._owners.setdefault(block, set()).add((r, page))
        r.pinned_clean.discard(page)
        r.unpinned.add(page)
        self._release_device_page(block)
        self.stats["unpinned_pages"] += 1
        if self.offload_all:  # lost at once: read from host from the next step on
            readers = self._owners[block]
            readers.discard((r, page))
            if not readers:
                del self._owners[block]
            self._lose_page(r, page)

    def _release_device_page(self, block: int) -> None:
        # Resident pages are always released with the watcher, so that a device copy indexed
        # in `_copies` or read by an owner is forgotten the moment the block is reused.
        self.device_pool.unpin([block], self._on_device_block_reused)

    def _on_device_block_reused(self, block: int) -> None:
        h = self._copy_of_block.pop(block, None)
        if h is not None and self._copies.get(h) == block:
            del self._copies[h]
        for r, page in self._owners.pop(block, ()):
            self._lose_page(r, page)

    def _lose_page(self, r: _Request, page: int) -> None:
        """An unpinned page loses its device block: its owner reads it from host from now on."""
        r.res_blocks[page] = NULL_BLOCK
        r.num_nonresident += 1
        r.unpinned.discard(page)
        self._touched.add(r)
        self.stats["lost_pages"] += 1

    def _spill_enqueued(self, spill: _Spill) -> None:
        spill.enqueued = True
        self._num_unenqueued_spills -= 1
        self._release_device_page(spill.device_block)

    def _spill_completed(self, spill: _Spill) -> None:
        r, page = spill.request, spill.page
        del r.pending[page]
        r.valid.add(page)
        if self._requests.get(r.request_id) is r:
            assert r.res_blocks[page] == spill.device_block, "a dirty page lost its block"
            r.pinned_clean.add(page)
            if r.hot and page < len(r.res_blocks) - ACTIVE_TAIL_PAGES:
                self._unpin_page(r, page)
            self._advance_and_publish(r, record_copies=True)
        elif r.detached_pages >= 0 and not r.pending:
            self._advance_and_publish(r, record_copies=False)
            self.host_pool.free(reversed(r.host_blocks[:r.detached_pages]))
            r.detached_pages = -1
            self._detached.discard(r)
        self.host_pool.free([spill.host_block])

    def _advance_and_publish(self, r: _Request, *, record_copies: bool) -> None:
        while r.ready_prefix in r.valid:
            r.ready_prefix += 1
        if not self.enable_prefix_caching:
            return
        limit = min(r.ready_prefix, r.num_computed // self.block_size)
        for p in range(r.num_published, limit):
            h = self._page_hash(r, p)
            self.host_pool.cache(r.host_blocks[p], h)
            block = r.res_blocks[p] if record_copies and p < len(r.res_blocks) else NULL_BLOCK
            if block != NULL_BLOCK:
                old = self._copies.get(h)
                if old is not None and old != block:
                    self._copy_of_block.pop(old, None)
                stale = self._copy_of_block.get(block)
                if stale is not None and stale != h:
                    self._copies.pop(stale, None)
                self._copies[h] = block
                self._copy_of_block[block] = h
            self.stats["published_pages"] += 1
        r.num_published = max(r.num_published, limit)

    def _release(self, r: _Request, *, keep_prefix: bool) -> None:
        if r.scheduled:  # scheduled in this pass, but its step will not run
            self._pass.remove(r)
            r.scheduled = 0
            for restore in [x for x in self._pass_restores
                            if self._restores[x.transfer_id].request is r]:
                self._pass_restores.remove(restore)
                self.host_pool.free([self._restores.pop(restore.transfer_id).host_block])
        del self._requests[r.request_id]
        self._touched.discard(r)
        self._invalidations.pop(r.state_row, None)
        if keep_prefix and not r.pending:
            self._advance_and_publish(r, record_copies=True)
        for p in reversed(range(len(r.res_blocks))):  # tail first: heads survive longer
            block = r.res_blocks[p]
            if block == NULL_BLOCK:
                continue
            if p in r.unpinned:
                owners = self._owners[block]
                owners.discard((r, p))
                if not owners:
                    del self._owners[block]
            else:
                self._release_device_page(block)
        r.res_blocks = []
        r.unpinned.clear()
        r.pinned_clean.clear()
        if r.hot:
            self.device_pool.free(r.hot)
            r.hot = []
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
        in_flight = len(self._spills) + len(self._restores)
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
        unenqueued = self._num_unenqueued_spills
        if unenqueued:
            return text + (f"; {unenqueued} pages are pinned until the worker enqueues their "
                           "spills")
        return text + "; pages unpin once their host copies complete, or preempt a request"


def _check_tokens(tokens: Sequence[int], what: str) -> list[int]:
    out = list(tokens)
    # Fast path (every decode step, every prompt): plain ints in the int64 range.
    if all(type(t) is int for t in out) and (
            not out or (min(out) >= -(1 << 63) and max(out) < (1 << 63))):
        return out
    out = []
    for i, t in enumerate(tokens):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not (
                -(1 << 63) <= t < (1 << 63)):
            raise ValueError(f"{what}[{i}] must be an int64 token id, got {t!r}")
        out.append(int(t))
    return out
