"""Hot-region state: a pytree of device arrays, updated functionally by the ops.

Besides the ops (`hisparse_jax.ops`), two host-tier events change it between steps, both
carried by a `host_tier.plan.StepPlan` and applied by `apply_hot_updates`: hot resets (a
request starts, or gets a new hot region) and hot invalidations (host blocks newly allocated
to a request: its hot slots that still hold rows of those blocks are stale).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.config import HiSparseConfig
from host_tier.plan import StepPlan
from host_tier.sizes import pow2_bucket

# Host-built block lists are padded to a power of two (at least this): few compiled sizes.
_MIN_BUCKET = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HotState:
    """LRU state of every request's hot region; one row per request state row.

    Attributes:
      slot_rows: int32[S, H], host row held by each hot slot, -1 when empty.
      lru: int16[S, H], a permutation of the slot ids, position 0 the oldest.
    Shared by all layers of an index group: the leader layer resolves, followers replay.
    """

    slot_rows: jax.Array
    lru: jax.Array

    @property
    def max_num_reqs(self) -> int:
        return self.slot_rows.shape[0]

    @property
    def hot_size(self) -> int:
        return self.slot_rows.shape[1]


def _empty(num_rows: int, hot_size: int) -> HotState:
    """`num_rows` rows with every slot empty and LRU = arange(H)."""
    shape = (num_rows, hot_size)
    return HotState(
        slot_rows=jnp.full(shape, -1, jnp.int32),
        lru=jnp.broadcast_to(jnp.arange(hot_size, dtype=jnp.int16), shape),
    )


def init_hot_state(cfg: HiSparseConfig) -> HotState:
    """Every slot empty, LRU = arange(H) for every state row."""
    return _empty(cfg.max_num_reqs, cfg.hot_size)


def empty_like(state: HotState) -> HotState:
    """A state of the same shape with every row empty (usable inside jit)."""
    return _empty(state.max_num_reqs, state.hot_size)


@jax.jit
def reset_rows(state: HotState, rows: jax.Array) -> HotState:
    """Empties the hot regions of state rows `rows` (int32[R]) for requests that start or end.

    Entries outside [0, S) (e.g. -1 padding) are ignored.
    """
    rows = jnp.asarray(rows, jnp.int32).reshape(-1)
    num_rows, hot_size = state.slot_rows.shape
    rows = jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)  # out of range: dropped
    fresh = _empty(rows.shape[0], hot_size)
    return HotState(
        slot_rows=state.slot_rows.at[rows].set(fresh.slot_rows, mode="drop"),
        lru=state.lru.at[rows].set(fresh.lru, mode="drop"),
    )


@functools.partial(jax.jit, static_argnames=("block_size",), donate_argnums=(0,))
def invalidate_host_blocks(slot_rows: jax.Array, state_rows: jax.Array, host_blocks: jax.Array,
                           *, block_size: int) -> jax.Array:
    """Empties the hot slots of `state_rows` that hold a row of their `host_blocks`.

    Args:
      slot_rows: int32[S, H], host row held by each hot slot (-1 empty); donated.
      state_rows: int32[R], distinct state rows; entries outside [0, S) are ignored.
      host_blocks: int32[R, M], host blocks per state row, padded with -1.
      block_size: B (static); host row g belongs to host block g // B.
    Returns:
      The new `slot_rows` int32[S, H].
    """
    num_rows = slot_rows.shape[0]
    in_range = (state_rows >= 0) & (state_rows < num_rows)
    rows = slot_rows[jnp.where(in_range, state_rows, 0)]
    blocks = jnp.where(rows >= 0, rows // block_size, -2)  # -2 never matches padding
    stale = (blocks[:, :, None] == host_blocks[:, None, :]).any(-1)
    return slot_rows.at[jnp.where(in_range, state_rows, num_rows)].set(
        jnp.where(stale, -1, rows), mode="drop")


def _padded_rows(state_rows: Any, num_rows: int) -> jax.Array:
    """int32[S] of `state_rows` padded with -1 (ignored): one compiled size per state."""
    rows = np.full(num_rows, -1, np.int32)
    rows[:len(state_rows)] = state_rows
    return jnp.asarray(rows)


def invalidation_width(num_blocks: int) -> int:
    """The padded width of a plan's hot invalidations whose widest row lists `num_blocks`
    host blocks: a power of two, at least 64 (the only size that varies between plans)."""
    return pow2_bucket(num_blocks, _MIN_BUCKET)


def apply_hot_updates(plan: StepPlan, hot_state: Any, *, block_size: int,
                      reset_rows_fn: Callable[[Any, jax.Array], Any] | None = None) -> Any:
    """A plan's hot resets, then its hot invalidations, applied to one hot state.

    The row lists are padded to the state's S rows (a plan names each state row at most once
    per list), the invalidations' block lists to `invalidation_width` of the widest: the
    jitted updates compile once for the resets and once per width bucket for the
    invalidations (`warm_hot_updates` compiles them ahead).

    Args:
      plan: the step's plan (`plan.hot_resets`: state rows to empty;
        `plan.hot_invalidations`: per state row, host blocks whose rows leave its hot slots).
      hot_state: a `HotState` (or any dataclass with `slot_rows` int32[S, H] and `lru`); its
        `slot_rows` is donated when there are invalidations.
      block_size: B.
      reset_rows_fn: empties state rows (default `reset_rows`).
    Returns:
      The new hot state (the same object when the plan changes nothing).
    """
    num_rows = hot_state.slot_rows.shape[0]
    if plan.hot_resets:
        reset_rows_fn = reset_rows_fn or reset_rows
        hot_state = reset_rows_fn(hot_state, _padded_rows(plan.hot_resets, num_rows))
    if plan.hot_invalidations:
        width = max(len(inv.host_blocks) for inv in plan.hot_invalidations)
        blocks = np.full((num_rows, invalidation_width(width)), -1, np.int32)
        for i, inv in enumerate(plan.hot_invalidations):
            blocks[i, :len(inv.host_blocks)] = inv.host_blocks
        rows = _padded_rows([inv.state_row for inv in plan.hot_invalidations], num_rows)
        slot_rows = invalidate_host_blocks(hot_state.slot_rows, rows, jnp.asarray(blocks),
                                           block_size=block_size)
        hot_state = dataclasses.replace(hot_state, slot_rows=slot_rows)
    return hot_state


def warm_hot_updates(hot_state: Any, *, block_size: int, max_blocks: int) -> Any:
    """Compiles every shape `apply_hot_updates` can reach for plans whose invalidations list
    at most `max_blocks` host blocks per state row (e.g. max_pages), with inputs that change
    nothing (every row padding). Returns the hot state to keep (`slot_rows` is donated)."""
    num_rows = hot_state.slot_rows.shape[0]
    none = _padded_rows((), num_rows)
    hot_state = reset_rows(hot_state, none)
    width = _MIN_BUCKET
    while True:
        blocks = jnp.asarray(np.full((num_rows, width), -1, np.int32))
        slot_rows = invalidate_host_blocks(hot_state.slot_rows, none, blocks,
                                           block_size=block_size)
        hot_state = dataclasses.replace(hot_state, slot_rows=slot_rows)
        if width >= invalidation_width(max_blocks):
            return hot_state
        width *= 2
