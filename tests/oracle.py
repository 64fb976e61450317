"""A slow, obviously-correct loop oracle written straight from `docs/semantics.md`,
and random case generators shared by the resolve tests (reference and kernels).

Plain numpy and Python loops; nothing here is vectorised on purpose.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def host_row(table, n, t, block_size, host_rows=None):
    """g for position t of batch row n, or -1."""
    if t < 0:
        return -1
    blk = t // block_size
    if blk >= table.shape[1]:
        return -1
    block_id = int(table[n, blk])
    if block_id <= 0:
        return -1
    g = block_id * block_size + t % block_size
    if host_rows is not None and g >= host_rows:
        return -1
    return g


def oracle_resolve(slot_rows, lru, topk, state_rows, hot_table, src_table, res_table,
                   block_size, host_rows):
    """Returns (outputs dict, new_slot_rows, new_lru) following `docs/semantics.md` step by step."""
    slot_rows = np.array(slot_rows, dtype=np.int32, copy=True)
    lru = np.array(lru, dtype=np.int16, copy=True)
    n_rows, k = topk.shape
    hot = slot_rows.shape[1]
    out = np.full((n_rows, k), -1, np.int32)
    valid = np.zeros(n_rows, np.int32)
    swap_src = np.full((n_rows, k), -1, np.int32)
    swap_dst = np.full((n_rows, k), -1, np.int32)
    swap_counts = np.zeros(n_rows, np.int32)
    num_hits = np.zeros(n_rows, np.int32)
    for n in range(n_rows):
        s = int(state_rows[n])
        if s < 0:                                     # 1. padding row
            continue

        def dev_row(slot, n=n):
            return int(hot_table[n, slot // block_size]) * block_size + slot % block_size

        pending = {}                                  # g -> column
        for i in range(k):                            # 2. classify columns
            t = int(topk[n, i])
            g = host_row(src_table, n, t, block_size, host_rows)
            res = -1 if res_table is None else host_row(res_table, n, t, block_size)
            if res >= 0 or g >= 0:
                valid[n] += 1
            if res >= 0:
                out[n, i] = res
            elif g < 0:
                out[n, i] = -1
            else:
                pending[g] = i
        if not pending:
            continue
        hits, evictable, hit_cols = [], [], set()
        for slot in lru[s].tolist():                  # 3. walk oldest -> newest
            cached = int(slot_rows[s, slot]) if 0 <= slot < hot else -1
            if cached >= 0 and cached in pending:
                col = pending[cached]
                out[n, col] = dev_row(slot)
                hits.append(slot)
                hit_cols.add(col)
            else:
                evictable.append(slot)
        misses = sorted(i for i in pending.values() if i not in hit_cols)
        col_g = {i: g for g, i in pending.items()}
        for m, i in enumerate(misses):                # 4. misses take the oldest evictables
            slot = evictable[m]
            swap_src[n, m] = col_g[i]
            if 0 <= slot < hot:
                out[n, i] = dev_row(slot)
                slot_rows[s, slot] = col_g[i]
                swap_dst[n, m] = dev_row(slot)
            else:
                out[n, i] = -1
                swap_dst[n, m] = -1
        swap_counts[n] = len(misses)
        num_hits[n] = len(hits)
        used = len(misses)                             # 5. new LRU
        lru[s] = np.array(evictable[used:] + evictable[:used] + hits, dtype=np.int16)
    outputs = dict(attention_rows=out, valid_counts=valid, swap_src=swap_src,
                   swap_dst=swap_dst, swap_counts=swap_counts, num_hits=num_hits)
    return outputs, slot_rows, lru


def oracle_gather(host_pool, kv_cache, swap_src, swap_dst, swap_counts):
    pool = np.asarray(host_pool).reshape(-1, host_pool.shape[-1])
    cache = np.array(kv_cache, copy=True)
    flat = cache.reshape(-1, cache.shape[-1])
    for n in range(swap_src.shape[0]):
        for m in range(int(swap_counts[n])):
            src, dst = int(swap_src[n, m]), int(swap_dst[n, m])
            if src < 0 or dst < 0 or dst >= flat.shape[0]:
                continue
            flat[dst] = pool[src] if src < pool.shape[0] else 0
    return cache


def oracle_invalidate(slot_rows, state_rows_per_token, written_rows):
    slot_rows = np.array(slot_rows, copy=True)
    for s, w in zip(state_rows_per_token.tolist(), written_rows.tolist(), strict=True):
        if 0 <= s < slot_rows.shape[0] and w >= 0:
            slot_rows[s][slot_rows[s] == w] = -1
    return slot_rows


@dataclasses.dataclass
class ResolveCase:
    slot_rows: np.ndarray
    lru: np.ndarray
    topk: np.ndarray
    state_rows: np.ndarray
    hot_table: np.ndarray
    src_table: np.ndarray
    res_table: np.ndarray | None
    block_size: int
    host_rows: int

    def args(self):
        return (self.slot_rows, self.lru, self.topk, self.state_rows, self.hot_table,
                self.src_table, self.res_table)


def random_case(rng: np.random.Generator, *, n: int, k: int, hot: int, block_size: int,
                src_blocks: int, resident_share: float = 0.0, corrupt_lru: bool = False,
                padding: bool = True) -> ResolveCase:
    """A random, precondition-respecting resolve instance (unique valid host rows per row).

    Mixes in everything the semantics names: padding rows, null and negative block ids,
    positions before 0 or past the table, a host_rows cut through the last block, resident
    pages, slots that hit, stale and empty slots, and (optionally) out-of-range LRU ids.
    """
    num_state = n + 2
    max_pos = src_blocks * block_size + block_size            # some positions past the table
    host_blocks = n * src_blocks + 4
    host_rows = host_blocks * block_size - int(rng.integers(0, block_size + 1))
    # Source tables: distinct host blocks across rows (1..host_blocks), some null / negative.
    ids = rng.permutation(np.arange(1, host_blocks + 1))[: n * src_blocks].reshape(n, src_blocks)
    null = rng.random(ids.shape) < 0.1
    ids = np.where(null, rng.choice([0, -1, -7], size=ids.shape), ids).astype(np.int32)
    # Resident pages (always a table, so every case compiles alike; share 0 = none resident).
    res_table = rng.integers(1, 1000, size=(n, src_blocks)).astype(np.int32)
    res_table[rng.random(res_table.shape) >= resident_share] = 0
    hot_blocks = -(-hot // block_size) + int(rng.integers(0, 2))
    hot_table = rng.integers(1, 5000, size=(n, hot_blocks)).astype(np.int32)
    topk = np.empty((n, k), np.int32)
    for r in range(n):
        pool = np.arange(-3, max_pos)
        take = min(k, pool.size)
        row = rng.choice(pool, size=take, replace=False)
        row = np.concatenate([row, np.full(k - take, -1)])
        row[rng.random(k) < 0.05] = -1
        topk[r] = rng.permutation(row)
    state_rows = rng.permutation(num_state)[:n].astype(np.int32)
    if padding:
        state_rows[rng.random(n) < 0.15] = -1
    slot_rows = np.full((num_state, hot), -1, np.int32)
    lru = np.stack([rng.permutation(hot) for _ in range(num_state)]).astype(np.int16)
    for r in range(n):
        s = state_rows[r]
        if s < 0:
            continue
        gs = [host_row(ids, r, int(t), block_size, host_rows) for t in topk[r]]
        gs = [g for g in gs if g >= 0]
        hitting = rng.choice(gs, size=int(rng.integers(0, len(gs) + 1)), replace=False) if gs \
            else np.array([], np.int64)
        stale = rng.choice(np.arange(host_rows, host_rows + 10 * hot), size=hot, replace=False)
        content = np.concatenate([hitting, stale])[:hot]
        fill = rng.permutation(hot)[: int(rng.integers(0, hot + 1))]
        slot_rows[s, fill] = content[: fill.size]
    if corrupt_lru:
        rows = rng.integers(0, num_state, size=2)
        cols = rng.integers(0, hot, size=2)
        lru[rows, cols] = rng.choice([-1, hot, 32767], size=2)
    return ResolveCase(slot_rows, lru, topk, state_rows, hot_table, ids, res_table,
                       block_size, int(host_rows))
