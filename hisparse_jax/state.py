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

# Host-built row lists are padded to a power of two (at least this): few compiled sizes.
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


def apply_hot_updates(plan: StepPlan, hot_state: Any, *, block_size: int,
                      reset_rows_fn: Callable[[Any, jax.Array], Any] | None = None) -> Any:
    """A plan's hot resets, then its hot invalidations, applied to one hot state.

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
    if plan.hot_resets:
        reset_rows_fn = reset_rows_fn or reset_rows
        rows = np.full(pow2_bucket(len(plan.hot_resets), _MIN_BUCKET), -1, np.int32)  # -1: none
        rows[:len(plan.hot_resets)] = plan.hot_resets
        hot_state = reset_rows_fn(hot_state, jnp.asarray(rows))
    if plan.hot_invalidations:
        n = len(plan.hot_invalidations)
        width = max(len(inv.host_blocks) for inv in plan.hot_invalidations)
        rows = np.full(pow2_bucket(n, _MIN_BUCKET), -1, np.int32)
        blocks = np.full((rows.shape[0], pow2_bucket(width, _MIN_BUCKET)), -1, np.int32)
        for i, inv in enumerate(plan.hot_invalidations):
            rows[i] = inv.state_row
            blocks[i, :len(inv.host_blocks)] = inv.host_blocks
        slot_rows = invalidate_host_blocks(hot_state.slot_rows, jnp.asarray(rows),
                                           jnp.asarray(blocks), block_size=block_size)
        hot_state = dataclasses.replace(hot_state, slot_rows=slot_rows)
    return hot_state
