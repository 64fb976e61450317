"""`StaticResidency`: the all-resident residency manager, and `NoTransfers`, its worker.

The engine runs ONE step path for every mode: a residency manager decides (admission, the
step's plan, leaving), a transfer worker moves bytes, the KV-cache handle's residency type
finds the rows. HiSparse and naive offload use the host tier's `Coordinator` and
`TransferEngine`; the all-resident mode uses these two, which offer the part of the same
API the scheduler and the runner call, with a fixed layout and nothing to move:

  * state row s owns the device blocks `1 + s * P .. (s + 1) * P` (P = `max_pages`), one
    full-length request; block 0 is the null block. `num_gpu_blocks` = 1 + S * P;
  * no host blocks and no hot regions: the `src` and `hot` table rows are null, every page is
    resident (`all_pages_resident` is always True, so every decode step is `AllResident`);
  * a request waits only for a free state row.

Seat reuse (`reuse_seats`, the all-resident mode of `EngineConfig.prefill.prefix_caching`): a
state row freed by a request that FINISHED keeps the token ids of its written rows (its
prompt and generated tokens, less the last sampled one, which no step wrote). A later prompt
that starts with them reuses that row: `cached_tokens` / `admit` count the kept rows that
match the prompt in whole pages of `block_size` tokens, at most `len(prompt) - 1` (the host
tier's rule for published pages, so both modes compute the same remaining tokens), and the
request prefills from there; its KV rows and index keys before that position are the ones
already in the row. Admission takes the free row with the longest match, else a row that
keeps nothing (the lowest), else the row kept longest ago; taking a row forgets what it
kept. A preempted, cancelled or aborted request keeps nothing (its rows are not trusted), and
`drop_prefix_cache` forgets every kept row (the engine calls it after rebuilding lost device
arrays). Unlike the host tier's prefix cache, a kept row serves one later request: there is no
sharing between running requests, and the memory that keeps rows is the free rows.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Hashable, Sequence

import jax
import numpy as np

from hisparse_jax.config import HiSparseConfig
from host_tier import Admitted, BlockTables, RequestView, Wait
from host_tier.plan import StepPlan, StepWrite, TransferReport
from host_tier.sizes import is_int


@dataclasses.dataclass
class _Seat:
    state_row: int
    num_computed: int
    num_tokens: int
    scheduled: int


class _StaticPool:
    """`device_pool.num_free` of the static layout: the blocks of the free state rows."""

    def __init__(self, manager: StaticResidency) -> None:
        self._manager = manager

    @property
    def num_free(self) -> int:
        return len(self._manager._free_rows) * self._manager.max_pages


class StaticResidency:
    """Every request fully resident in its own state row's blocks (module docstring).

    Args:
      cfg: sizes (block_size, max_num_reqs, max_model_len, hot_blocks: the hot table width).
      reuse_seats: keep a finished request's rows in its free state row for a later prompt
        that extends them (module docstring; `EngineConfig.prefill.prefix_caching`).
    """

    hot_blocks = 0  # no hot regions: admission keeps no room for one

    def __init__(self, cfg: HiSparseConfig, *, reuse_seats: bool = False) -> None:
        self.block_size = cfg.block_size
        self.max_pages = P = cfg.max_pages
        self.tables = BlockTables(cfg.max_num_reqs, P, cfg.hot_blocks)
        for s in range(cfg.max_num_reqs):
            self.tables.set_row("res", s, range(1 + s * P, 1 + (s + 1) * P))
        self.device_pool = _StaticPool(self)
        self.stats: collections.Counter[str] = collections.Counter()
        self._free_rows = list(range(cfg.max_num_reqs))  # a heap: the lowest row first
        self._seats: dict[Hashable, _Seat] = {}
        self._pass: list[Hashable] = []
        self._step = 0
        self.max_model_len = cfg.max_model_len
        self.enable_prefix_caching = reuse_seats
        # Seat reuse: each admitted request's token ids (prompt, then scheduled new tokens),
        # the indices of those that are placeholders (ids not set yet: `set_token_ids`), and
        # per free state row the written rows' token ids it keeps, oldest first.
        self._tokens: dict[Hashable, list[int]] = {}
        self._placeholders: dict[Hashable, set[int]] = {}
        self._kept: dict[int, np.ndarray] = {}

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._seats

    # ------------------------------------------------------------------ Coordinator API

    def admit(self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
              num_new_tokens: int | None = None) -> Admitted | Wait:
        """Takes a state row; the first `num_new_tokens` prompt tokens (default: all) are
        scheduled, the rest by later `schedule(num_tokens=...)` calls (chunked prefill)."""
        if request_id in self._seats:
            raise ValueError(f"admit: request_id {request_id!r} is already admitted")
        if not self._free_rows:
            return Wait("state_rows", 1, 0, "every state row is in use; a request must finish")
        total = len(prompt_token_ids)
        cached, row = 0, self._free_rows[0]
        if self.enable_prefix_caching:
            cached, row = self._best_row(prompt_token_ids)
            self._kept.pop(row, None)
            self._free_rows.remove(row)
            heapq.heapify(self._free_rows)
            self._tokens[request_id] = list(prompt_token_ids)
        else:
            heapq.heappop(self._free_rows)
        n = total - cached if num_new_tokens is None else num_new_tokens
        if not 0 <= n <= total - cached:
            raise ValueError(f"admit: num_new_tokens must be in [0, {total - cached}] (the "
                             f"prompt's {total} tokens less {cached} reused), got {n}")
        self._seats[request_id] = _Seat(row, cached, total, n)
        self._pass.append(request_id)
        return Admitted(request_id, row, cached, n)

    def cached_tokens(self, prompt_token_ids: Sequence[int]) -> int:
        """The prompt tokens `admit` would reuse from a free row's kept rows right now (0
        without seat reuse). Changes nothing."""
        if not self.enable_prefix_caching or not self._free_rows:
            return 0
        return self._best_row(prompt_token_ids)[0]

    def admission_need(self, prompt_token_ids: Sequence[int]) -> tuple[int, int]:
        """(cached, blocks): `cached_tokens`, and a block per prompt page (every page is
        resident; a reused seat's rows are in its own blocks). Changes nothing."""
        return (self.cached_tokens(prompt_token_ids),
                -(-len(prompt_token_ids) // self.block_size))

    def _best_row(self, prompt: Sequence[int]) -> tuple[int, int]:
        """(reused tokens, free row): the longest match, else the lowest row keeping nothing,
        else the row kept longest ago (`_kept` is oldest first)."""
        B = self.block_size
        best, row = 0, -1
        if self._kept:
            ids = np.asarray(prompt, np.int64)
            for r, kept in self._kept.items():
                n = min(len(kept), len(ids))
                same = kept[:n] == ids[:n]
                common = n if same.all() else int(np.argmin(same))
                reused = min(common // B * B, len(ids) - 1)
                if reused > best:
                    best, row = reused, r
        if row < 0:
            empty = [r for r in self._free_rows if r not in self._kept]
            row = min(empty) if empty else next(iter(self._kept))
        return best, row

    def drop_prefix_cache(self) -> None:
        """Forgets every kept row (their device rows are gone, e.g. rebuilt as zeros)."""
        self._kept.clear()

    def schedule(self, request_id: Hashable, num_tokens: int | None = None, *,
                 new_token_ids: Sequence[int] = (), num_lookahead_tokens: int = 0,
                 num_placeholders: int = 0) -> None:
        """`Coordinator.schedule`; the last `num_placeholders` new token ids are not known
        yet (set by `set_token_ids`): a row keeps no token from the first one that is still
        a placeholder when its request finishes."""
        del num_lookahead_tokens  # every page of the seat is resident already
        seat = self._seats[request_id]
        seat.num_tokens += len(new_token_ids)
        if self.enable_prefix_caching:
            tokens = self._tokens[request_id]
            tokens.extend(int(t) for t in new_token_ids)
            if num_placeholders:
                self._placeholders.setdefault(request_id, set()).update(
                    range(len(tokens) - num_placeholders, len(tokens)))
        seat.scheduled = seat.num_tokens - seat.num_computed if num_tokens is None else num_tokens
        self._pass.append(request_id)

    def schedule_batch(self, request_ids: Sequence[Hashable],
                       new_token_ids: Sequence[Sequence[int]],
                       num_lookahead_tokens: Sequence[int] | None = None, *,
                       num_placeholders: Sequence[int] | None = None) -> list[None]:
        """`schedule` for each request in order (`Coordinator.schedule_batch`); never waits.

        Raises:
          ValueError: the sequences differ in length, or a request is not admitted (before
            anything changes).
        """
        del num_lookahead_tokens  # every page of the seat is resident already
        if len(new_token_ids) != len(request_ids):
            raise ValueError(f"schedule_batch: new_token_ids has {len(new_token_ids)} entries, "
                             f"request_ids {len(request_ids)}; they must have one per request")
        for i, rid in enumerate(request_ids):
            if rid not in self._seats:
                raise ValueError(f"schedule_batch[{i}]: request_id {rid!r} is not admitted")
        placeholders = [0] * len(request_ids) if num_placeholders is None else num_placeholders
        for rid, tokens, k in zip(request_ids, new_token_ids, placeholders, strict=True):
            self.schedule(rid, new_token_ids=tokens, num_placeholders=k)
        return [None] * len(request_ids)

    def set_token_ids(self, updates: Sequence[tuple[Hashable, int, int]]) -> None:
        """`Coordinator.set_token_ids`: with seat reuse, sets the ids in the token history
        (a placeholder's real id; rows are kept by their ids); without it, nothing is kept."""
        if not self.enable_prefix_caching:
            return
        for i, (rid, index, token) in enumerate(updates):
            tokens = self._tokens.get(rid)
            if tokens is None:
                raise ValueError(f"set_token_ids[{i}]: request_id {rid!r} is not admitted")
            if not is_int(index) or not 0 <= index < len(tokens):
                raise ValueError(f"set_token_ids[{i}]: index must be an int in [0, "
                                 f"{len(tokens)}) (request {rid!r}'s known tokens), got "
                                 f"{index!r}")
            tokens[index] = int(token)
            self._placeholders.get(rid, set()).discard(index)

    def build_plan(self) -> StepPlan:
        writes = []
        for rid in self._pass:
            seat = self._seats[rid]
            writes.append(StepWrite(rid, seat.state_row, seat.num_computed, seat.scheduled))
            seat.num_computed += seat.scheduled
            seat.scheduled = 0
        plan = StepPlan(step=self._step, writes=tuple(writes), tables=self.tables.take_update(),
                        hot_resets=(), hot_invalidations=(), restores=(), spills=())
        self._step += 1
        self._pass = []
        return plan

    def request_room(self, num_blocks: int) -> None:
        del num_blocks  # nothing to make room in: every request has its blocks

    def all_pages_resident(self, request_id: Hashable) -> bool:
        del request_id
        return True

    def view(self, request_id: Hashable) -> RequestView:
        seat = self._seats[request_id]
        return RequestView(
            request_id=request_id, state_row=seat.state_row,
            num_computed_tokens=seat.num_computed, host_blocks=(),
            resident_blocks=tuple(int(b) for b in self.tables.row("res", seat.state_row)),
            hot_blocks=(), hot_required=False, valid_pages=frozenset(),
            pending_pages=frozenset(), unpinned_pages=frozenset(), ready_prefix_pages=0,
            published_pages=0)

    def capacity_error(self, num_prompt_tokens: int, max_total_tokens: int, *,
                       num_lookahead_tokens: int = 0) -> str | None:
        """None: a state row's blocks hold any request of at most max_model_len tokens."""
        del num_prompt_tokens, num_lookahead_tokens
        if max_total_tokens > self.max_model_len:
            return (f"a request of {max_total_tokens} tokens does not fit a state row's "
                    f"{self.max_pages} blocks of {self.block_size} (max_model_len="
                    f"{self.max_model_len})")
        return None

    def finish(self, request_id: Hashable) -> None:
        """Frees the request's state row; with seat reuse the row keeps its written rows'
        token ids (the steps of every built plan ran: a request finishes once collected)."""
        self._release(request_id, keep=True)

    def _release(self, request_id: Hashable, *, keep: bool) -> None:
        seat = self._seats.pop(request_id)
        if seat.scheduled:  # scheduled in the open pass, but its step will not run
            self._pass.remove(request_id)
        tokens = self._tokens.pop(request_id, None)
        unknown = self._placeholders.pop(request_id, None)
        # Rows up to the first placeholder: a row kept under a wrong id would be reused for
        # a prompt it does not match (a stop token learned a step late leaves one).
        written = min(seat.num_computed, *unknown) if unknown else seat.num_computed
        if keep and tokens is not None and written:
            self._kept[seat.state_row] = np.asarray(tokens[:written], np.int64)
        heapq.heappush(self._free_rows, seat.state_row)

    def cancel(self, request_id: Hashable) -> None:
        self._release(request_id, keep=False)

    def preempt(self, request_id: Hashable) -> None:
        self._release(request_id, keep=False)
        self.stats["preemptions"] += 1

    def abort(self, request_id: Hashable) -> None:
        self._release(request_id, keep=False)
        self.stats["aborts"] += 1

    def failed_requests(self) -> tuple[Hashable, ...]:
        return ()  # nothing is ever copied

    def has_pending_transfers(self) -> bool:
        return False

    def on_transfers(self, report: TransferReport | None = None, **ids: Sequence[int]) -> None:
        if report or any(ids.values()):
            raise ValueError("StaticResidency.on_transfers: no transfer is ever planned, got "
                             f"{report} {ids}")


class NoTransfers:
    """The transfer worker of `StaticResidency`'s plans: there is never anything to copy."""

    num_in_flight = 0

    def before_forward(self, plan: StepPlan, kv_caches: Sequence[jax.Array]
                       ) -> list[jax.Array]:
        del plan
        return list(kv_caches)

    def after_forward(self, plan: StepPlan, kv_caches: Sequence[jax.Array]) -> None:
        del plan, kv_caches

    def poll(self, *, wait: bool = False) -> TransferReport:
        del wait
        return TransferReport()
