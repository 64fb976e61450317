"""TEMPORARY (branch arch-hosttier only): `apply_hot_updates` and `invalidate_host_blocks`, moved
out of `host_tier/transfer.py` unchanged so that `hisparse_jax/engine.py` keeps working.

Their home is `hisparse_jax/state.py` (branch arch-engine moves them there); delete this file
when the branches merge and import them from `hisparse_jax.state`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.state import reset_rows
from host_tier.plan import StepPlan
from host_tier.sizes import pow2_bucket


@functools.partial(jax.jit, static_argnames=("block_size",), donate_argnums=(0,))
def invalidate_host_blocks(slot_rows: jax.Array, state_rows: jax.Array, host_blocks: jax.Array,
                           *, block_size: int) -> jax.Array:
    """Empties the hot slots of `state_rows` that hold a row of their `host_blocks`.

    Args:
      slot_rows: int32[S, H], host row held by each hot slot (-1 empty); donated.
      state_rows: int32[R], distinct state rows; entries outside [0, S) are ignored.
      host_blocks: int32[R, M], host blocks per state row, padded with -1.
    Returns:
      The new `slot_rows`.
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
    """Hot resets, then invalidations, of one plan applied to a state with a `slot_rows` field."""
    if plan.hot_resets:
        reset_rows_fn = reset_rows_fn or reset_rows
        rows = np.full(pow2_bucket(len(plan.hot_resets), 64), -1, np.int32)  # -1: ignored
        rows[:len(plan.hot_resets)] = plan.hot_resets
        hot_state = reset_rows_fn(hot_state, jnp.asarray(rows))
    if plan.hot_invalidations:
        n = len(plan.hot_invalidations)
        width = max(len(inv.host_blocks) for inv in plan.hot_invalidations)
        rows = np.full(pow2_bucket(n, 64), -1, np.int32)
        blocks = np.full((pow2_bucket(n, 64), pow2_bucket(width, 64)), -1, np.int32)
        for i, inv in enumerate(plan.hot_invalidations):
            rows[i] = inv.state_row
            blocks[i, :len(inv.host_blocks)] = inv.host_blocks
        slot_rows = invalidate_host_blocks(hot_state.slot_rows, jnp.asarray(rows),
                                           jnp.asarray(blocks), block_size=block_size)
        hot_state = dataclasses.replace(hot_state, slot_rows=slot_rows)
    return hot_state
