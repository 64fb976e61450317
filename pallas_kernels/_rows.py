"""Position -> flat row through a block table, the one jnp definition of the project.

A paged cache of `num_blocks` blocks of `block_size` rows is addressed by flat rows
`block * block_size + offset`; a request's block table lists its blocks, page by page, with
0 (the null block) or a negative id where it has none (`docs/semantics.md`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def flat_rows(table: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """`table[n, t // B] * B + t % B` for every position t of batch row n, else -1.

    Args:
      table: int32[N, P], the block of each page of batch row n (<= 0: null).
      positions: int32[N, ...], logical token positions of batch row n (any trailing shape).
      block_size: B, a static Python int >= 1.
    Returns:
      int32 of `positions`' shape: the flat row, or -1 where the position is negative, its
      page is past the table (>= P) or the page's block id is <= 0.
    """
    width = table.shape[1]
    page = jnp.where(positions >= 0, positions // block_size, -1)
    in_table = (page >= 0) & (page < width)
    per_row = math.prod(positions.shape[1:])
    index = jnp.clip(page, 0, width - 1).reshape(positions.shape[0], per_row)
    block = jnp.take_along_axis(table, index, axis=1).reshape(positions.shape)
    ok = in_table & (block > 0)
    offset = jnp.where(ok, positions % block_size, 0)
    return jnp.where(ok, block * block_size + offset, -1).astype(table.dtype)
