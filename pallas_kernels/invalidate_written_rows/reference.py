"""invalidate_written_rows, jnp reference.

A host row that is rewritten must not be served from a stale hot copy (`docs/semantics.md`):
for each written token with host row w >= 0 of state row s, every slot of slot_rows[s] equal
to w becomes -1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def invalidate_written_rows(slot_rows: jax.Array, state_rows_per_token: jax.Array,
                            written_rows: jax.Array) -> jax.Array:
    """slot_rows: int32[S, H]; state_rows_per_token, written_rows: int32[T] -> int32[S, H].

    Tokens whose state row is outside [0, S) or whose written row is negative are ignored.
    Cost O(T * H): one compare of each token's row against its request's slots.
    """
    num_state_rows = slot_rows.shape[0]
    live = (state_rows_per_token >= 0) & (state_rows_per_token < num_state_rows) & (
        written_rows >= 0)
    srow = jnp.where(live, state_rows_per_token, num_state_rows)
    held = slot_rows[jnp.clip(srow, 0, num_state_rows - 1)]            # [T, H]
    stale = (held == written_rows[:, None]) & live[:, None]
    stale_any = jnp.zeros(slot_rows.shape, jnp.bool_).at[srow].max(stale, mode="drop")
    return jnp.where(stale_any, -1, slot_rows)
