"""resolve_residency, vectorised jnp reference: the oracle every kernel is checked against.

Semantics (`docs/semantics.md`), per batch row n with state row s = state_rows[n]:
  * every selected position t maps to a host row g (source table) and, when its page is
    still resident, a resident device row; resident wins, g < 0 outputs -1, the rest is
    *pending* on g;
  * walking the LRU oldest -> newest, a slot holding a pending g is a hit, every other slot
    (empty, stale, out-of-range id) is evictable;
  * misses (pending and not hit, ascending column order) take the evictables oldest first;
  * new LRU = unused evictables ++ slots just filled (miss order) ++ hits (old LRU order).

No Python loop over rows or columns: one row is sort / searchsorted / cumsum / scatter work,
vmapped over the batch; shapes are static so it jits once per (N, K, H, table widths).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._rows import flat_rows
from pallas_kernels.resolve_residency.union import resolve_union, resolve_union_mapped

_BIG = jnp.iinfo(jnp.int32).max


def _resolve_row(g, res, slot_rows, lru, hot_table, block_size):
    """One live batch row. g, res: int32[K]; slot_rows: int32[H]; lru: int32[H]."""
    k = g.shape[0]
    h = slot_rows.shape[0]
    pending = (res < 0) & (g >= 0)

    # Column lookup by host row: pending g sorted ascending (others pushed to the end).
    key = jnp.where(pending, g, _BIG)
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]

    # Walk the LRU: which slots hold a pending g?
    slot_in_range = (lru >= 0) & (lru < h)
    cached = jnp.where(slot_in_range, slot_rows[jnp.clip(lru, 0, h - 1)], -1)
    pos = jnp.clip(jnp.searchsorted(sorted_key, cached), 0, k - 1)
    hit = (cached >= 0) & (sorted_key[pos] == cached) & pending[order[pos]]  # by LRU position
    hit_col = jnp.where(hit, order[pos], k)                      # column served by the slot
    return _finish_row(g, res, pending, hit, hit_col, slot_rows, lru, hot_table, block_size)


def _resolve_row_mapped(g, res, positions, row_map, slot_rows, lru, hot_table, block_size):
    """One live batch row under the position map rule (`resolve_residency_mapped`).
    positions: int32[K]; row_map: int16[P], the slot each position was last copied to."""
    k = g.shape[0]
    h = slot_rows.shape[0]
    width = row_map.shape[0]
    pending = (res < 0) & (g >= 0)
    in_map = pending & (positions >= 0) & (positions < width)
    j = jnp.where(in_map, row_map[jnp.clip(positions, 0, width - 1)].astype(jnp.int32), -1)
    j_ok = (j >= 0) & (j < h)
    candidate = j_ok & (slot_rows[jnp.clip(j, 0, h - 1)] == g)
    # The column each slot is a candidate of (k: none); a hit is a walked candidate slot.
    mark = jnp.full((h,), k, jnp.int32).at[jnp.where(candidate, j, h)].set(
        jnp.arange(k, dtype=jnp.int32), mode="drop")
    slot_in_range = (lru >= 0) & (lru < h)
    hit_col = jnp.where(slot_in_range, mark[jnp.clip(lru, 0, h - 1)], k)
    hit = hit_col < k
    return _finish_row(g, res, pending, hit, hit_col, slot_rows, lru, hot_table, block_size)


def _finish_row(g, res, pending, hit, hit_col, slot_rows, lru, hot_table, block_size):
    """Steps 4-5 of a row, from its hits by LRU position (hit_col: the column each hit slot
    serves, K elsewhere). Also returns the slot each miss column was copied to (-1 else)."""
    k = g.shape[0]
    h = slot_rows.shape[0]

    def device_row(slot):
        block = hot_table[jnp.clip(slot, 0, h - 1) // block_size]
        return block * block_size + slot % block_size

    # Columns served by a hit.
    col_hit_slot = jnp.full((k,), -1, jnp.int32).at[hit_col].set(lru, mode="drop")
    col_is_hit = col_hit_slot >= 0
    # Evictable slots in walk order; misses take them oldest first.
    evictable = ~hit
    evict_rank = jnp.cumsum(evictable) - 1                      # rank among evictables
    evict_slot = jnp.full((h,), -1, jnp.int32).at[
        jnp.where(evictable, evict_rank, h)].set(lru, mode="drop")
    miss = pending & ~col_is_hit
    miss_rank = jnp.cumsum(miss) - 1
    num_miss = miss_rank[-1] + 1 if k else 0
    miss_slot = evict_slot[jnp.clip(miss_rank, 0, h - 1)]        # slot each miss column takes
    miss_slot_ok = (miss_slot >= 0) & (miss_slot < h)

    out = jnp.where(res >= 0, res, -1)
    out = jnp.where(col_is_hit, device_row(col_hit_slot), out)
    miss_dev = jnp.where(miss_slot_ok, device_row(miss_slot), -1)
    out = jnp.where(miss, miss_dev, out)

    # Swap plan, compacted by miss rank; -1 past swap_counts.
    dst_idx = jnp.where(miss, miss_rank, k)
    swap_src = jnp.full((k,), -1, jnp.int32).at[dst_idx].set(g, mode="drop")
    swap_dst = jnp.full((k,), -1, jnp.int32).at[dst_idx].set(miss_dev, mode="drop")

    # Slots just filled now hold their g (out-of-range slot ids write nothing).
    filled = miss & miss_slot_ok
    fill_at = jnp.where(filled, miss_slot, h)
    new_slot_rows = slot_rows.at[fill_at].set(g, mode="drop")

    # New LRU order: evictables ranked >= num_miss, then ranked < num_miss, then hits.
    num_evict = h - jnp.sum(hit)
    hit_rank = jnp.cumsum(hit) - 1
    new_pos = jnp.where(
        hit, num_evict + hit_rank,
        jnp.where(evict_rank >= num_miss, evict_rank - num_miss,
                  num_evict - num_miss + evict_rank))
    new_lru = jnp.zeros((h,), jnp.int32).at[new_pos].set(lru)

    return (out, swap_src, swap_dst, num_miss.astype(jnp.int32),
            jnp.sum(hit).astype(jnp.int32), new_slot_rows, new_lru,
            jnp.where(filled, miss_slot, -1))


def resolve_residency(slot_rows, lru, topk, state_rows, hot_block_table,
                      source_block_table, resident_block_table, *, block_size, host_rows,
                      query_rows_per_request: int = 1):
    """Reference resolve over a batch.

    Args:
      slot_rows: int32[S, H]; lru: int16[S, H] (the hot state).
      topk: int32[N, K] logical positions (-1 = none); valid host rows unique within a row.
      state_rows: int32[N], state row per batch row; < 0 (or >= S) marks a padding row.
      hot_block_table: int32[N, >= ceil(H / B)]; source_block_table: int32[N, Ms];
      resident_block_table: int32[N, Mr] or None.
      block_size: B (static); host_rows: rows of the host pool (int or traced int32
        scalar): a host row g >= host_rows is treated as null.
      query_rows_per_request: r (static, >= 1). r > 1: N = G * r rows, the r adjacent rows
        of a request share its state row and tables and are resolved as one pass over the
        union of their positions (`union.resolve_union`, `docs/semantics.md`); swap_src,
        swap_dst are then [G, r*K] and swap_counts, num_hits [G] (per request).
    Returns:
      (attention_rows int32[N, K], valid_counts int32[N], swap_src int32[N, K],
       swap_dst int32[N, K], swap_counts int32[N], num_hits int32[N],
       new_slot_rows int32[S, H], new_lru int16[S, H]); padding rows output -1 / 0 and
      leave their state rows unchanged.
    """
    if query_rows_per_request > 1:
        return resolve_union(
            resolve_residency, slot_rows, lru, topk, state_rows, hot_block_table,
            source_block_table, resident_block_table, block_size=block_size,
            host_rows=host_rows, rows_per_request=query_rows_per_request)
    return _resolve_batch(slot_rows, lru, None, topk, state_rows, hot_block_table,
                          source_block_table, resident_block_table, block_size=block_size,
                          host_rows=host_rows)[:8]


def resolve_residency_mapped(slot_rows, lru, pos_slot, topk, state_rows, hot_block_table,
                             source_block_table, resident_block_table, *, block_size,
                             host_rows, query_rows_per_request: int = 1):
    """Reference resolve under the position map rule: `resolve_residency` with the hot
    state's position map `pos_slot` int16[S, P] (P >= the source table's width * B).

    `pos_slot[s, t]` names the slot position t of state row s was last copied to (-1: none).
    The hit rule reads it instead of searching the slots: a pending column at position t is
    a hit when j = pos_slot[s, t] is a slot id in [0, H), slot_rows[s, j] holds the column's
    host row, and j is walked (it sits in the LRU); everything else follows
    `resolve_residency` (evictables, misses, the new LRU). Each miss copied into slot j sets
    pos_slot[s, t] = j. A stale entry (its slot emptied or refilled since) is never a hit.

    Equal to `resolve_residency` on every state in which each slot holding a host row of a
    position t is the one pos_slot[s, t] names; resolves (this rule) keep that, invalidation
    and resets only empty slots, so every state the ops reach from an empty state has it.
    Returns the 8 outputs of `resolve_residency`, then the new pos_slot.
    """
    if query_rows_per_request > 1:
        return resolve_union_mapped(
            resolve_residency_mapped, slot_rows, lru, pos_slot, topk, state_rows,
            hot_block_table, source_block_table, resident_block_table, block_size=block_size,
            host_rows=host_rows, rows_per_request=query_rows_per_request)
    return _resolve_batch(slot_rows, lru, pos_slot, topk, state_rows, hot_block_table,
                          source_block_table, resident_block_table, block_size=block_size,
                          host_rows=host_rows)


def _resolve_batch(slot_rows, lru, pos_slot, topk, state_rows, hot_block_table,
                   source_block_table, resident_block_table, *, block_size, host_rows):
    """Single-row resolve of a batch: the search rule (pos_slot None) or the map rule.
    Returns the 8 outputs of `resolve_residency` and the new pos_slot (None without)."""
    num_state_rows, h = slot_rows.shape
    n, k = topk.shape
    g = flat_rows(source_block_table, topk, block_size)
    g = jnp.where(g < host_rows, g, -1)
    if resident_block_table is None:
        res = jnp.full_like(g, -1)
    else:
        res = flat_rows(resident_block_table, topk, block_size)
    live = (state_rows >= 0) & (state_rows < num_state_rows)
    srow = jnp.clip(state_rows, 0, num_state_rows - 1)
    row_slots = slot_rows[srow]
    row_lru = lru[srow].astype(jnp.int32)

    if pos_slot is None:
        rows_out = jax.vmap(_resolve_row, in_axes=(0, 0, 0, 0, 0, None))(
            g, res, row_slots, row_lru, hot_block_table, block_size)
    else:
        rows_out = jax.vmap(_resolve_row_mapped, in_axes=(0, 0, 0, 0, 0, 0, 0, None))(
            g, res, topk, pos_slot[srow], row_slots, row_lru, hot_block_table, block_size)
    out, swap_src, swap_dst, swap_counts, num_hits, new_rows, new_lru, filled = rows_out

    valid_counts = jnp.sum((res >= 0) | (g >= 0), axis=1, dtype=jnp.int32)
    live_col = live[:, None]
    attention_rows = jnp.where(live_col, out, -1)
    swap_src = jnp.where(live_col, swap_src, -1)
    swap_dst = jnp.where(live_col, swap_dst, -1)
    zero = jnp.zeros((n,), jnp.int32)
    valid_counts = jnp.where(live, valid_counts, zero)
    swap_counts = jnp.where(live, swap_counts, zero)
    num_hits = jnp.where(live, num_hits, zero)

    write_at = jnp.where(live, srow, num_state_rows)            # padding rows write nothing
    new_slot_rows = slot_rows.at[write_at].set(new_rows, mode="drop")
    new_lru_state = lru.at[write_at].set(new_lru.astype(lru.dtype), mode="drop")
    new_pos_slot = None
    if pos_slot is not None:
        # Each miss's position now names its slot (positions past the map: nothing).
        width = pos_slot.shape[1]
        put = live_col & (filled >= 0) & (topk >= 0) & (topk < width)
        flat = jnp.where(put, srow[:, None] * width + topk, pos_slot.size)
        new_pos_slot = pos_slot.reshape(-1).at[flat.reshape(-1)].set(
            filled.reshape(-1).astype(pos_slot.dtype), mode="drop").reshape(pos_slot.shape)
    return (attention_rows, valid_counts, swap_src, swap_dst, swap_counts, num_hits,
            new_slot_rows, new_lru_state, new_pos_slot)
