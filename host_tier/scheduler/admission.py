"""`Admission`: the coordinator's admission calls (standard library only).

A mixin of `Coordinator` (`coordinator.py`, which owns the state it reads): `admit` takes a state
row and the blocks of a request's first chunk, or returns `Wait`; `admission_need`,
`cached_tokens` and `capacity_error` answer questions about an admission without changing
anything. The arithmetic lives beside the parts it reads: what an admission allocates is
`PrefixHit.admission_need` (`prefix_cache.py`), the rules a request can never pass are functions
of `capacity.py`, and the residency policy's watermark and hot-region ask decide the lone-request
rule.
"""

from __future__ import annotations

import array
import collections
import heapq
from collections.abc import Hashable, Sequence

from host_tier.scheduler import capacity
from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.block_tables import BlockTables
from host_tier.scheduler.prefix_cache import AdmissionNeed, PrefixCache, PrefixHit
from host_tier.scheduler.records import (
    Admitted,
    CapacityError,
    PassLog,
    RequestRecord,
    Wait,
    check_tokens,
)
from host_tier.scheduler.residency_policy import ResidencyPolicy
from host_tier.scheduler.spill_planner import SpillPlanner
from host_tier.sizes import cdiv, is_int


class Admission:
    """`Coordinator`'s admission calls (see module docstring); the attributes below are the
    coordinator's."""

    block_size: int
    hot_blocks: int
    max_model_len: int
    resident_prefix_hits: bool
    device_pool: BlockPool
    host_pool: BlockPool
    tables: BlockTables
    stats: collections.Counter[str]
    prefix_cache: PrefixCache
    residency_policy: ResidencyPolicy
    spill_planner: SpillPlanner
    _log: PassLog
    _requests: dict[Hashable, RequestRecord]
    _free_rows: list[int]
    _pass: list[RequestRecord]

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
        n = len(prompt_token_ids)
        if not self.prefix_cache.enabled:
            return 0, cdiv(n, self.block_size)
        hit = self.prefix_cache.match(check_tokens(prompt_token_ids, "prompt_token_ids"))
        return hit.num_cached, hit.admission_need(
            n, n, block_size=self.block_size, hot_blocks=self.hot_blocks,
            resident_hits=self.resident_prefix_hits).device_blocks

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
          ValueError: the counts are not ints with 1 <= num_prompt_tokens <= max_total_tokens,
            or num_lookahead_tokens is not an int in [0, block_size).
        """
        policy = self.residency_policy
        return capacity.lone_request_error(
            num_prompt_tokens, max_total_tokens, num_lookahead_tokens=num_lookahead_tokens,
            block_size=self.block_size, hot_blocks=self.hot_blocks,
            num_usable=self.device_pool.num_usable, num_host_usable=self.host_pool.num_usable,
            max_model_len=self.max_model_len, watermark=policy.watermark,
            ask_at=policy.ask_at_tokens, offload_all=policy.offload_all)

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
        if not tokens:
            raise ValueError("admit: prompt_token_ids must not be empty")
        error = capacity.prompt_error(len(tokens), block_size=self.block_size,
                                      max_model_len=self.max_model_len,
                                      num_host_usable=self.host_pool.num_usable)
        if error:
            raise CapacityError(error)
        hit = self.prefix_cache.match(tokens)
        remaining = len(tokens) - hit.num_cached
        chunk = remaining if num_new_tokens is None else num_new_tokens
        if not is_int(chunk) or not 1 <= chunk <= remaining:
            raise ValueError(
                f"admit: num_new_tokens must be in [1, {remaining}] (uncached prompt tokens), "
                f"got {num_new_tokens!r}")
        chunk = int(chunk)
        need = hit.admission_need(len(tokens), hit.num_cached + chunk, block_size=self.block_size,
                                  hot_blocks=self.hot_blocks,
                                  resident_hits=self.resident_prefix_hits)
        error = capacity.first_chunk_error(need.device_blocks, self.device_pool.num_usable)
        if error:
            raise CapacityError(error)
        wait = self._admission_wait(hit, need)
        if wait is not None:
            return wait
        r = self._open_request(request_id, tokens, hit, need, chunk)
        self.stats["cached_tokens"] += hit.num_cached
        return Admitted(request_id, r.state_row, hit.num_cached, chunk)

    def _admission_wait(self, hit: PrefixHit, need: AdmissionNeed) -> Wait | None:
        """`Wait` when a state row, the host blocks or the device blocks of an admission are
        short right now (the hit's held host blocks that are free count as taken), else None."""
        if not self._free_rows:
            return Wait("state_rows", 1, 0,
                        f"all {self.tables.max_num_reqs} state rows (max_num_reqs) are in use; "
                        "a request must finish or be preempted first")
        host_available = self.host_pool.num_free - sum(
            1 for b in set(hit.held_blocks) if self.host_pool.is_free(b))
        if need.host_blocks > host_available:
            reason = capacity.host_wait_reason(
                need.host_blocks, host_available, "the prompt",
                num_in_flight=self.spill_planner.num_in_flight,
                num_detached=len(self.prefix_cache.detached))
            return Wait("host_blocks", need.host_blocks, host_available, reason)
        if need.device_blocks > self.device_pool.num_free:
            free = self.device_pool.num_free
            return Wait("device_blocks", need.device_blocks, free, capacity.device_wait_reason(
                need.device_blocks, free, "the first chunk",
                num_unenqueued=self.spill_planner.num_unenqueued))
        return None

    def _open_request(self, request_id: Hashable, tokens: list[int], hit: PrefixHit,
                      need: AdmissionNeed, chunk: int) -> RequestRecord:
        """Allocates an admitted request's state row and blocks (`_admission_wait` found them
        free), plans its restores and schedules its first `chunk` tokens in the open pass."""
        B, full_hit = self.block_size, hit.full_pages
        state_row = heapq.heappop(self._free_rows)
        self.host_pool.touch(hit.held_blocks)
        new_host = self.host_pool.allocate(need.host_blocks)
        hot = self.device_pool.allocate(self.hot_blocks) if need.hot_region else []
        res = self.device_pool.allocate(need.resident_pages)
        r = RequestRecord(request_id=request_id, state_row=state_row,
                          token_ids=array.array("q", tokens), num_computed=hit.num_cached,
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
            self.spill_planner.plan_restore(r, hit.cow_source, r.res_blocks[full_hit],
                                            hit.num_cached % B)
        # Adopt readable device copies of the hit pages (after this admission's allocations).
        self.prefix_cache.adopt(r, hit.hashes[:full_hit])
        if self.resident_prefix_hits:
            # Hit pages without a device copy: restored from their published host pages.
            missing = [p for p in range(full_hit) if r.res_blocks[p] == NULL_BLOCK]
            for p, block in zip(missing, self.device_pool.allocate(len(missing)), strict=True):
                self.host_pool.touch([r.host_blocks[p]])  # the restore's reference
                self.spill_planner.plan_restore(r, r.host_blocks[p], block, B,
                                                stat="prefix_restores")
                r.res_blocks[p] = block
                r.pinned_clean.add(p)
        r.num_nonresident = r.res_blocks.count(NULL_BLOCK)
        return r
