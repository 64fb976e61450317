"""Hot-region state: a pytree of device arrays, updated functionally by the ops."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hisparse_jax.config import HiSparseConfig


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
