"""`Scheduling`: the coordinator's scheduling calls and their argument checks (stdlib only).

`Scheduling` is a mixin of `Coordinator` (`coordinator.py`, which owns the state it changes):
`schedule`, `schedule_batch` and `set_token_ids` add running requests' tokens to the open pass,
which `Coordinator.build_plan` closes. The checks are functions that change nothing: every
argument is checked before anything changes, so that a ValueError leaves the open pass as it
was. None of them depends on another request, so a batch checks each entry on its own. The
decode step takes the fast paths (`on_fast_path`, `token_updates_ok`): one loop over the batch
with the cheap tests, and the checks that name the culprit only when one fails.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Any

from host_tier.scheduler import capacity
from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool
from host_tier.scheduler.prefix_cache import PrefixCache
from host_tier.scheduler.records import (
    INT64_END,
    INT64_MIN,
    PassLog,
    RequestRecord,
    Wait,
    check_tokens,
)
from host_tier.scheduler.residency_policy import ResidencyPolicy
from host_tier.scheduler.spill_planner import SpillPlanner
from host_tier.sizes import cdiv, is_int


def not_admitted(what: str, request_id: Hashable) -> ValueError:
    return ValueError(f"{what}: request_id {request_id!r} is not admitted")


def on_fast_path(records: Sequence[RequestRecord | None],
                 new_token_ids: Sequence[Sequence[int]], num_lookahead_tokens: Sequence[Any],
                 *, block_size: int, max_model_len: int) -> list[bool]:
    """Per request (None: not admitted), whether scheduling it with its new tokens and
    lookahead is the decode step of a request with room in its pages: one valid new token,
    nothing to allocate, no table row changes (the general path does the same, slower).
    One loop for the batch: a call per request cost more than the check."""
    B, max_len = block_size, max_model_len
    return [r is not None and not r.scheduled and len(tokens) == 1
            and (nc := r.num_computed) == len(r.token_ids) and nc < max_len
            and type(la) is int and 0 <= la < B
            and (nc + la if nc + la < max_len else max_len - 1) < len(r.res_blocks) * B
            and nc < len(r.host_blocks) * B
            and (r.hot or not r.hot_required)
            and type(t := tokens[0]) is int and INT64_MIN <= t < INT64_END
            for r, tokens, la in zip(records, new_token_ids, num_lookahead_tokens,
                                     strict=True)]


def check_schedule(what: str, request_id: Hashable, r: RequestRecord | None,
                   num_tokens: int | None, new_token_ids: Sequence[int],
                   num_lookahead_tokens: Any, *, block_size: int,
                   max_model_len: int) -> tuple[list[int], int, int]:
    """`schedule`'s argument checks for running request `r` (None: not admitted; `what` names
    the call in errors): the new tokens, the tokens to schedule and the lookahead, as ints.

    Raises:
      ValueError: num_lookahead_tokens is not an int in [0, block_size), the request is not
        admitted or already scheduled in this pass, a token is invalid, the request would hold
        more than max_model_len tokens, or num_tokens is not in [1, known tokens not computed].
    """
    la = num_lookahead_tokens
    if la and (not is_int(la) or not 0 <= la < block_size):
        raise ValueError(
            f"{what}: num_lookahead_tokens must be an int in [0, block_size="
            f"{block_size}) (lookahead rows may open at most one page), got {la!r}")
    if r is None:
        raise not_admitted(what, request_id)
    if r.scheduled:
        raise ValueError(f"{what}: request {request_id!r} is already scheduled in this pass")
    extra = check_tokens(new_token_ids, f"{what}: new_token_ids")
    known = len(r.token_ids) + len(extra)
    if known > max_model_len:
        raise ValueError(
            f"{what}: request {request_id!r} would hold {known} tokens, more than "
            f"max_model_len={max_model_len}")
    remaining = known - r.num_computed
    n = remaining if num_tokens is None else num_tokens
    if not is_int(n) or not 1 <= n <= remaining:
        raise ValueError(
            f"{what}: num_tokens must be in [1, {remaining}] (known tokens not computed "
            f"yet), got {num_tokens!r}")
    return extra, int(n), int(la)


def check_batch(request_ids: Sequence[Hashable], new_token_ids: Sequence[Sequence[int]],
                num_lookahead_tokens: Sequence[int] | None) -> Sequence[int]:
    """`schedule_batch`'s checks of the sequences themselves: one entry per request in each,
    no request twice. Returns the lookahead per request (None: all 0)."""
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
    return num_lookahead_tokens


def check_placeholders(what: str, new_token_ids: Sequence[int], num_placeholders: Any) -> int:
    """`num_placeholders` of `schedule` (`what` names the call) as an int in
    [0, len(new_token_ids)] (ValueError otherwise)."""
    if not is_int(num_placeholders) or not 0 <= num_placeholders <= len(new_token_ids):
        raise ValueError(f"{what}: num_placeholders must be an int in [0, "
                         f"{len(new_token_ids)}] (the new tokens whose ids are not known yet), "
                         f"got {num_placeholders!r}")
    return int(num_placeholders)


def check_batch_placeholders(new_token_ids: Sequence[Sequence[int]],
                             num_placeholders: Sequence[int] | None) -> Sequence[int] | None:
    """`schedule_batch`'s `num_placeholders`: None, or one entry per request, each as
    `check_placeholders` wants."""
    if num_placeholders is None:
        return None
    if len(num_placeholders) != len(new_token_ids):
        raise ValueError(
            f"schedule_batch: num_placeholders has {len(num_placeholders)} entries, "
            f"new_token_ids {len(new_token_ids)}; they must have one entry per request (or be "
            "None)")
    # One pass of cheap checks (an asynchronous engine's decode step: 0 or 1 per request).
    if all([type(k) is int and 0 <= k <= len(tokens)
            for tokens, k in zip(new_token_ids, num_placeholders, strict=True)]):
        return num_placeholders
    return [check_placeholders(f"schedule_batch[{i}]", tokens, k)
            for i, (tokens, k) in enumerate(zip(new_token_ids, num_placeholders, strict=True))]


def token_updates_ok(records: Sequence[RequestRecord | None],
                     updates: Sequence[tuple[Hashable, int, int]]) -> bool:
    """Whether every `set_token_ids` update is a plain int index into a running request's
    history and a plain int64 token: one pass of cheap checks for the common batch."""
    # (A list, not a generator: all() over a generator cost a resume per update.)
    return all([r is not None and type(index) is int and 0 <= index < len(r.token_ids)
                and type(token) is int and INT64_MIN <= token < INT64_END
                for r, (_, index, token) in zip(records, updates, strict=True)])


def check_token_updates(records: Sequence[RequestRecord | None],
                        updates: Sequence[tuple[Hashable, int, int]]) -> None:
    """`set_token_ids`'s checks, naming the first bad update.

    Raises:
      ValueError: a request is not admitted, an index is out of its history, or a token is not
        an int64.
    """
    for i, (r, (rid, index, token)) in enumerate(zip(records, updates, strict=True)):
        if r is None:
            raise not_admitted(f"set_token_ids[{i}]", rid)
        if not is_int(index) or not 0 <= index < len(r.token_ids):
            raise ValueError(f"set_token_ids[{i}]: index must be an int in [0, "
                             f"{len(r.token_ids)}) (request {rid!r}'s known tokens), "
                             f"got {index!r}")
        check_tokens([token], f"set_token_ids[{i}]: token")


class Scheduling:
    """`Coordinator`'s scheduling calls (see module docstring); the attributes below are the
    coordinator's."""

    block_size: int
    max_model_len: int
    device_pool: BlockPool
    stats: collections.Counter[str]
    prefix_cache: PrefixCache
    residency_policy: ResidencyPolicy
    spill_planner: SpillPlanner
    _log: PassLog
    _requests: dict[Hashable, RequestRecord]
    _pass: list[RequestRecord]

    def schedule(self, request_id: Hashable, num_tokens: int | None = None, *,
                 new_token_ids: Sequence[int] = (), num_lookahead_tokens: int = 0,
                 num_placeholders: int = 0) -> Wait | None:
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

        `num_placeholders` (an int in [0, len(new_token_ids)]): the last that many new token
        ids are placeholders, e.g. a token still on the device (an engine's asynchronous
        step): they count like any token, but no page holding one is hashed or published
        until `set_token_ids` sets its id.

        Returns:
          None when scheduled; `Wait` (nothing changed) when the device pool is short.

        Raises:
          ValueError: unknown request, already scheduled in this pass, invalid tokens, more
            than max_model_len tokens, num_lookahead_tokens or num_placeholders out of range.
        """
        r = self._requests.get(request_id)
        k = check_placeholders("schedule", new_token_ids, num_placeholders)
        if num_tokens is None and on_fast_path(
                [r], [new_token_ids], [num_lookahead_tokens], block_size=self.block_size,
                max_model_len=self.max_model_len)[0]:
            r.token_ids.append(new_token_ids[0])
            r.scheduled = 1
            self._pass.append(r)
            result = None
        else:
            result = self._schedule_checked(*self._check_schedule(
                "schedule", request_id, num_tokens, new_token_ids, num_lookahead_tokens))
        if k and result is None:
            n = len(r.token_ids)
            r.placeholders.update(range(n - k, n))
        return result

    def schedule_batch(self, request_ids: Sequence[Hashable],
                       new_token_ids: Sequence[Sequence[int]],
                       num_lookahead_tokens: Sequence[int] | None = None, *,
                       num_placeholders: Sequence[int] | None = None) -> list[Wait | None]:
        """Schedules running requests in this pass, in order, with every known token: the same
        as `schedule(request_ids[i], new_token_ids=new_token_ids[i],
        num_lookahead_tokens=num_lookahead_tokens[i], num_placeholders=num_placeholders[i])`
        for each i, in one call.

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
          num_placeholders: per request, `schedule`'s num_placeholders; None: all 0.

        Returns:
          Per request, what `schedule` returns: None when scheduled, else `Wait`.

        Raises:
          ValueError: the sequences differ in length, a request id appears twice, or an entry
            `schedule` would reject (the message names its index).
        """
        lookahead = check_batch(request_ids, new_token_ids, num_lookahead_tokens)
        placeholders = check_batch_placeholders(new_token_ids, num_placeholders)
        requests = self._requests
        records = [requests.get(rid) for rid in request_ids]
        fast = on_fast_path(records, new_token_ids, lookahead,
                                            block_size=self.block_size,
                                            max_model_len=self.max_model_len)
        if all(fast):  # the common decode step: every request inline, in one loop
            for r, tokens in zip(records, new_token_ids, strict=True):
                r.token_ids.append(tokens[0])
                r.scheduled = 1
            self._pass += records
            results: list[Wait | None] = [None] * len(records)
        else:
            checked = [None if f else self._check_schedule(f"schedule_batch[{i}]", rid, None,
                                                           tokens, la)
                       for i, (f, rid, tokens, la) in enumerate(zip(
                           fast, request_ids, new_token_ids, lookahead, strict=True))]
            results = []
            pass_ = self._pass
            for r, args, tokens in zip(records, checked, new_token_ids, strict=True):
                if args is None:
                    r.token_ids.append(tokens[0])
                    r.scheduled = 1
                    pass_.append(r)
                    results.append(None)
                else:
                    results.append(self._schedule_checked(*args))
        if placeholders is not None:
            for r, k, result in zip(records, placeholders, results, strict=True):
                if k == 1 and result is None:  # (an asynchronous step's pending token)
                    r.placeholders.add(len(r.token_ids) - 1)
                elif k and result is None:
                    n = len(r.token_ids)
                    r.placeholders.update(range(n - k, n))
        return results

    def set_token_ids(self, updates: Sequence[tuple[Hashable, int, int]]) -> None:
        """Sets token ids already counted: (request_id, index, token) replaces token `index`
        (prompt tokens first) of a running request's token history. An engine with
        asynchronous scheduling counts a token still on the device with a placeholder id
        (`schedule(num_placeholders=...)`) and sets the real one when it arrives. Only page
        hashes (prefix caching) read the ids: a page holding a placeholder is published only
        once its ids are set, by this call (its listeners run: `Coordinator.listen`) when its
        host copy completed already, else when it completes.

        Raises:
          ValueError: a request is not admitted, an index is out of its history, or a token
            is not an int64 (before anything changes).
        """
        # One pass of cheap checks for the common batch (plain ints, every request running;
        # hundreds per step); the checks that name the culprit run only when one fails.
        requests = self._requests
        records = [requests.get(rid) for rid, _, _ in updates]
        if not token_updates_ok(records, updates):
            check_token_updates(records, updates)
            updates = [(rid, int(index), int(token)) for rid, index, token in updates]
        B = self.block_size
        ready: dict[int, RequestRecord] = {}  # requests whose set ids end a blocked prefix
        for r, (_, index, token) in zip(records, updates, strict=True):
            r.token_ids[index] = token
            if index in r.placeholders:
                r.placeholders.discard(index)
                # Its page may publish now if its host copy completed (else it publishes
                # when the copy completes, `on_transfers`).
                if index // B in r.valid:
                    ready[id(r)] = r
        if ready and self.prefix_cache.enabled:
            for r in ready.values():
                self.prefix_cache.advance_and_publish(r, record_copies=True)

    def _check_schedule(self, what: str, request_id: Hashable, num_tokens: int | None,
                        new_token_ids: Sequence[int], num_lookahead_tokens: Any
                        ) -> tuple[RequestRecord, list[int], int, int]:
        """`schedule`'s argument checks, which change nothing: the record, the new tokens, the
        tokens to schedule and the lookahead. None of them depends on other requests, so a
        batch checks every entry before scheduling any."""
        r = self._requests.get(request_id)
        extra, n, la = check_schedule(
            what, request_id, r, num_tokens, new_token_ids, num_lookahead_tokens,
            block_size=self.block_size, max_model_len=self.max_model_len)
        page_end = min(r.num_computed + n + la, self.max_model_len)
        error = capacity.chunk_error(what, n, self.residency_policy.schedule_need(r, page_end)[1],
                                     self.device_pool.num_usable)
        if error:
            raise ValueError(error)
        return r, extra, n, la

    def _schedule_checked(self, r: RequestRecord, extra: list[int], n: int,
                          la: int) -> Wait | None:
        """`schedule`'s general path after `_check_schedule`: grants a pending hot region and
        allocates the pages, or returns `Wait` (nothing changed) when the pool is short."""
        page_end = min(r.num_computed + n + la, self.max_model_len)  # lookahead rows need pages
        new_pages, need = self.residency_policy.schedule_need(r, page_end)
        if need > self.device_pool.num_free:
            self.stats["schedule_waits"] += 1
            free = self.device_pool.num_free
            return Wait("device_blocks", need, free, capacity.device_wait_reason(
                need, free, f"request {r.request_id!r}",
                num_unenqueued=self.spill_planner.num_unenqueued))

        r.token_ids.extend(extra)
        grant_hot = r.hot_required and not r.hot
        if grant_hot:
            self.residency_policy.grant_hot_region(r)
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
