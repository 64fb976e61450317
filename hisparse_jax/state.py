"""Hot-region state: a pytree of device arrays, updated functionally by the ops.

Besides the ops (`hisparse_jax.ops`), two host-tier events change it between steps, both
carried by a `host_tier.plan.StepPlan` and applied by `apply_hot_updates`: hot resets (a
request starts, or gets a new hot region) and hot invalidations (host blocks newly allocated
to a request: its hot slots that still hold rows of those blocks are stale).
"""

from __future__ import annotations

import dataclasses
import functools

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
      pos_slot: int16[S, P] or None, the position map: the slot each position t < P of the
        row's request was last copied to (-1: none). With it, `resolve_residency` looks a
        selected position up there instead of searching the slots (the same results on
        every state the ops reach, `docs/semantics.md`). Entries go stale when their slot
        is emptied or refilled; a stale entry is never a hit, so resets and invalidations
        leave the map as it is.
    Shared by all layers of an index group: the leader layer resolves, followers replay.
    """

    slot_rows: jax.Array
    lru: jax.Array
    pos_slot: jax.Array | None = None

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
    """Every slot empty, LRU = arange(H) for every state row; with `cfg.position_map` and a
    known max_model_len, an empty position map int16[S, max_pages * B] too."""
    state = _empty(cfg.max_num_reqs, cfg.hot_size)
    if cfg.position_map and cfg.max_model_len is not None:
        width = cfg.max_pages * cfg.block_size
        state = dataclasses.replace(
            state, pos_slot=jnp.full((cfg.max_num_reqs, width), -1, jnp.int16))
    return state


def empty_like(state: HotState) -> HotState:
    """A state of the same shape with every row empty (usable inside jit). The position
    map, if any, is kept as it is: with every slot empty none of its entries is a hit, and
    the state keeps its pytree structure."""
    return dataclasses.replace(_empty(state.max_num_reqs, state.hot_size),
                               pos_slot=state.pos_slot)


@jax.jit
def reset_rows(state: HotState, rows: jax.Array) -> HotState:
    """Empties the hot regions of state rows `rows` (int32[R]) for requests that start or end.

    Entries outside [0, S) (e.g. -1 padding) are ignored.
    """
    rows = jnp.asarray(rows, jnp.int32).reshape(-1)
    num_rows, hot_size = state.slot_rows.shape
    rows = jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)  # out of range: dropped
    fresh = _empty(rows.shape[0], hot_size)
    return dataclasses.replace(      # the position map's entries of these rows go stale
        state,
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


def invalidation_width(num_blocks: int) -> int:
    """The padded width of a plan's hot invalidations whose widest row lists `num_blocks`
    host blocks: a power of two, at least 64 (the only size that varies between plans)."""
    return pow2_bucket(num_blocks, _MIN_BUCKET)


def hot_updates(states: tuple[HotState, ...], packed: jax.Array, *, block_size: int,
                num_rows: int | None = None) -> tuple[HotState, ...]:
    """Resets, then invalidations, for every hot state (traceable: also runs inside a
    caller's jit, e.g. a decode step folding a small update): `packed` int32 holds the reset
    rows [R], the invalidated rows [R] (both padded with -1) and their host blocks [R, W]
    (padded with -1), flattened (`pack_hot_updates`); R = num_rows, default the states' S."""
    if num_rows is None:
        num_rows = states[0].slot_rows.shape[0]
    resets, rows = packed[:num_rows], packed[num_rows:2 * num_rows]
    blocks = packed[2 * num_rows:].reshape(num_rows, -1)
    return tuple(
        dataclasses.replace(state, slot_rows=invalidate_host_blocks(
            state.slot_rows, rows, blocks, block_size=block_size))
        for state in (reset_rows(state, resets) for state in states))


apply_packed_hot_updates = jax.jit(hot_updates, static_argnames=("block_size", "num_rows"))
"""`hot_updates` as one jitted call (a packed update from `pack_hot_updates`)."""


def pack_hot_updates(plan: StepPlan | None, num_rows: int, width: int) -> np.ndarray | None:
    """A plan's hot resets and invalidations as the int32 array `hot_updates` takes, for R =
    `num_rows` rows and `width` blocks per invalidated row (-1 padding; None or a plan
    without either: all padding). None when the plan does not fit (more than R resets or
    invalidated rows, or an invalidation of more than `width` blocks)."""
    packed = np.full(num_rows * (2 + width), -1, np.int32)
    if plan is None or not (plan.hot_resets or plan.hot_invalidations):
        return packed
    if (len(plan.hot_resets) > num_rows or len(plan.hot_invalidations) > num_rows
            or any(len(inv.host_blocks) > width for inv in plan.hot_invalidations)):
        return None
    packed[:len(plan.hot_resets)] = plan.hot_resets
    packed[num_rows:num_rows + len(plan.hot_invalidations)] = [
        inv.state_row for inv in plan.hot_invalidations]
    blocks = packed[2 * num_rows:].reshape(num_rows, width)
    for i, inv in enumerate(plan.hot_invalidations):
        blocks[i, :len(inv.host_blocks)] = inv.host_blocks
    return packed


def apply_hot_updates(plan: StepPlan, hot_states: tuple[HotState, ...], *, block_size: int
                      ) -> tuple[HotState, ...]:
    """A plan's hot resets, then its hot invalidations, applied to hot states (those of
    every index group: they share the plan's state rows).

    One host-to-device copy and one jitted call for all of them (each a fixed cost of tens of
    microseconds on a GPU host, paid on most steps under pressure). The row lists are padded
    to the states' S rows (a plan names each state row at most once per list), the
    invalidations' block lists to `invalidation_width` of the widest: one compile per width
    bucket (`warm_hot_updates` compiles them ahead).

    Args:
      plan: the step's plan (`plan.hot_resets`: state rows to empty;
        `plan.hot_invalidations`: per state row, host blocks whose rows leave its hot slots).
      hot_states: `HotState`s of one shape (not donated).
      block_size: B.
    Returns:
      The new hot states (the same tuple when the plan changes nothing).
    """
    if not (plan.hot_resets or plan.hot_invalidations) or not hot_states:
        return hot_states
    num_rows = hot_states[0].slot_rows.shape[0]
    width = invalidation_width(max((len(inv.host_blocks) for inv in plan.hot_invalidations),
                                   default=1))
    packed = pack_hot_updates(plan, num_rows, width)
    return apply_packed_hot_updates(tuple(hot_states), jnp.asarray(packed),
                                    block_size=block_size, num_rows=num_rows)


def warm_hot_updates(hot_states: tuple[HotState, ...], *, block_size: int, max_blocks: int
                     ) -> None:
    """Compiles every shape `apply_hot_updates` can reach for `hot_states` and plans whose
    invalidations list at most `max_blocks` host blocks per state row (e.g. max_pages)."""
    num_rows = hot_states[0].slot_rows.shape[0]
    width = _MIN_BUCKET
    while True:
        none = jnp.asarray(np.full(num_rows * (2 + width), -1, np.int32))
        jax.block_until_ready(apply_packed_hot_updates(
            tuple(hot_states), none, block_size=block_size, num_rows=num_rows))
        if width >= invalidation_width(max_blocks):
            return
        width *= 2
