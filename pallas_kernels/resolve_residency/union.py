"""Several query rows per request: the union rule of `docs/semantics.md`, as a wrapper that
runs any single-row resolve (the jnp reference or the Triton kernel) once per request.

With `r` query rows per request (speculative decode: the verified token and the drafts), a
batch of N = G * r rows holds G requests, each as r adjacent rows that share one state row
and one set of block tables. The request is resolved as ONE single-row pass over the union
of its rows' selected positions, in first-appearance order (row-major: row 0's columns in
order, then the positions of row 1 not seen yet, ...; negative positions ignored), padded
with -1 to r * K columns. Every query row then reads, per column, the device row its
position got in that pass. Shapes stay static: jits once per (N, K, r, H, table widths).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels._rows import flat_rows

_BIG = jnp.iinfo(jnp.int32).max


def _union_row(t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """t: int32[M] (a request's r * K positions, row-major). Returns (union int32[M]: the
    distinct positions >= 0 in first-appearance order, then -1; column int32[M]: the union
    column of each entry, -1 for a negative position)."""
    m = t.shape[0]
    idx = jnp.arange(m, dtype=jnp.int32)
    key = jnp.where(t >= 0, t, _BIG)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)    # equal keys: first index first
    sorted_key = key[order]
    head = (idx == 0) | (sorted_key != jnp.roll(sorted_key, 1))
    head_at = jax.lax.cummax(jnp.where(head, idx, 0), axis=0)    # start of each run
    first_of = jnp.zeros((m,), jnp.int32).at[order].set(order[head_at])
    valid = t >= 0
    is_first = valid & (first_of == idx)
    rank = jnp.cumsum(is_first.astype(jnp.int32)) - 1
    union = jnp.full((m,), -1, jnp.int32).at[jnp.where(is_first, rank, m)].set(
        t, mode="drop")
    return union, jnp.where(valid, rank[first_of], -1)


def union_positions(topk: jax.Array, rows_per_request: int) -> tuple[jax.Array, jax.Array]:
    """The union rows of a batch and where each column lands in them.

    Args:
      topk: int32[N, K], N = G * r query rows, the r rows of request g at rows g*r .. g*r+r-1.
      rows_per_request: r >= 1 (static).
    Returns:
      union int32[G, r*K]: request g's distinct positions >= 0 in first-appearance order
        (row-major over its rows), -1 after them;
      column int32[N, K]: the union column holding topk[n, i], -1 where topk[n, i] < 0.
    """
    n, k = topk.shape
    r = rows_per_request
    union, column = jax.vmap(_union_row)(topk.reshape(n // r, r * k))
    return union, column.reshape(n, k)


def resolve_union(single: Callable, slot_rows, lru, topk, state_rows, hot_block_table,
                  source_block_table, resident_block_table, *, block_size, host_rows,
                  rows_per_request: int):
    """`resolve_residency` with r = rows_per_request query rows per request, through
    `single` (a single-row resolve with the reference's signature and outputs).

    The tables and state row of request g are those of its first row g*r (the other rows
    of the group must carry the same ones: the caller's contract, checked by the op's
    `validate=True`).
    Returns (attention_rows int32[N, K], valid_counts int32[N] (per query row),
    swap_src int32[G, r*K], swap_dst int32[G, r*K], swap_counts int32[G], num_hits int32[G]
    (per request: the union pass's plan and counts), new_slot_rows int32[S, H],
    new_lru int16[S, H]).
    """
    r = rows_per_request
    n = topk.shape[0]
    num_state_rows = slot_rows.shape[0]
    union, column = union_positions(topk, r)
    first = slice(None, None, r)
    res_first = None if resident_block_table is None else resident_block_table[first]
    (u_rows, _, swap_src, swap_dst, swap_counts, num_hits, new_slot_rows, new_lru) = single(
        slot_rows, lru, union, state_rows[first], hot_block_table[first],
        source_block_table[first], res_first, block_size=block_size, host_rows=host_rows)
    per_row = jnp.repeat(u_rows, r, axis=0, total_repeat_length=n)        # [N, r*K]
    attention_rows = jnp.where(
        column >= 0, jnp.take_along_axis(per_row, jnp.maximum(column, 0), axis=1), -1)

    # valid_counts per query row: columns with a host row or a resident row (the group's
    # tables), 0 for the rows of a padding request.
    def group_table(table):
        return jnp.repeat(table[first], r, axis=0, total_repeat_length=n)

    g = flat_rows(group_table(source_block_table), topk, block_size)
    valid = (g >= 0) & (g < host_rows)
    if resident_block_table is not None:
        valid |= flat_rows(group_table(resident_block_table), topk, block_size) >= 0
    group_rows = jnp.repeat(state_rows[first], r, total_repeat_length=n)
    live = (group_rows >= 0) & (group_rows < num_state_rows)
    valid_counts = jnp.where(live, jnp.sum(valid, axis=1, dtype=jnp.int32), 0)
    return (attention_rows.astype(jnp.int32), valid_counts, swap_src, swap_dst, swap_counts,
            num_hits, new_slot_rows, new_lru)


def resolve_union_mapped(single: Callable, slot_rows, lru, pos_slot, topk, state_rows,
                         hot_block_table, source_block_table, resident_block_table, *,
                         block_size, host_rows, rows_per_request: int):
    """`resolve_union` for the position map rule: `single` has the signature and outputs of
    `reference.resolve_residency_mapped` (the map after the slots and the LRU, and last
    among the outputs); the union row's positions are the ones the map is indexed by.
    Returns `resolve_union`'s outputs, then the new pos_slot."""
    new_map = []

    def one(slots, order, union, rows, hot_table, src, res, **kw):
        *outs, pmap = single(slots, order, pos_slot, union, rows, hot_table, src, res, **kw)
        new_map.append(pmap)
        return tuple(outs)

    outs = resolve_union(one, slot_rows, lru, topk, state_rows, hot_block_table,
                         source_block_table, resident_block_table, block_size=block_size,
                         host_rows=host_rows, rows_per_request=rows_per_request)
    return (*outs, new_map[0])
