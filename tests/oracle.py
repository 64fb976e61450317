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


def oracle_resolve_union(slot_rows, lru, topk, state_rows, hot_table, src_table, res_table,
                         block_size, host_rows, rows_per_request):
    """The union rule of `docs/semantics.md` for r = rows_per_request query rows per request
    (r adjacent rows of topk, sharing the first row's state row and tables): per request, its
    positions >= 0 in first-appearance order (row-major), repeats dropped, padded with -1 to
    r*K, go through `oracle_resolve` as one row; each query row's column then outputs what its
    position got there. Returns (outputs dict: attention_rows [N, K] and valid_counts [N] per
    query row, the plan and counts per request [G, r*K] / [G]; new_slot_rows; new_lru)."""
    r = rows_per_request
    n_rows, k = topk.shape
    groups = n_rows // r
    union = np.full((groups, r * k), -1, np.int32)
    column = {}                                        # (query row, column) -> union column
    for grp in range(groups):
        seen = {}                                      # position -> union column
        for n in range(grp * r, grp * r + r):
            for i in range(k):
                t = int(topk[n, i])
                if t < 0:
                    continue
                if t not in seen:
                    seen[t] = len(seen)
                    union[grp, seen[t]] = t
                column[n, i] = seen[t]
    first = slice(None, None, r)
    outputs, new_rows, new_lru = oracle_resolve(
        slot_rows, lru, union, np.asarray(state_rows)[first], np.asarray(hot_table)[first],
        np.asarray(src_table)[first], None if res_table is None else np.asarray(res_table)[first],
        block_size, host_rows)
    out = np.full((n_rows, k), -1, np.int32)
    valid = np.zeros(n_rows, np.int32)
    for n in range(n_rows):
        grp = n // r
        if int(state_rows[grp * r]) < 0:
            continue
        for i in range(k):
            if (n, i) in column:
                out[n, i] = outputs["attention_rows"][grp, column[n, i]]
            t = int(topk[n, i])
            g = host_row(src_table, grp * r, t, block_size, host_rows)
            res = -1 if res_table is None else host_row(res_table, grp * r, t, block_size)
            valid[n] += int(g >= 0 or res >= 0)
    outputs = dict(outputs, attention_rows=out, valid_counts=valid)
    return outputs, new_rows, new_lru


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



def oracle_stage_prefill(host_pools, caches, staging, positions, source_blocks,
                         resident_blocks, block_size):
    """`docs/prefill_staging.md`, row by row: (staging buffers, rows from the device, rows
    from the host). The resident copy wins; a block id past its array is no copy (a resident
    one does not fall back to the host); everything else keeps what was passed in."""
    out = [np.array(s, copy=True) for s in staging]
    num_blocks, host_blocks = caches[0].shape[0], host_pools[0].shape[0]
    from_device = from_host = 0
    for m, p in enumerate(int(t) for t in positions):
        q = p // block_size
        if p < 0 or q >= len(source_blocks):
            continue
        res, src = int(resident_blocks[q]), int(source_blocks[q])
        if res > 0:
            if res >= num_blocks:
                continue
            tables, block = caches, res
            from_device += 1
        elif 0 < src < host_blocks:
            tables, block = host_pools, src
            from_host += 1
        else:
            continue
        for layer, table in enumerate(tables):
            out[layer][m] = np.asarray(table)[block, p % block_size]
    return out, from_device, from_host

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
        if state_rows[r] >= 0:
            _fill_slots(rng, slot_rows, int(state_rows[r]), ids, r, topk[r], block_size,
                        host_rows)
    if corrupt_lru:
        rows = rng.integers(0, num_state, size=2)
        cols = rng.integers(0, hot, size=2)
        lru[rows, cols] = rng.choice([-1, hot, 32767], size=2)
    return ResolveCase(slot_rows, lru, topk, state_rows, hot_table, ids, res_table,
                       block_size, int(host_rows))


def _fill_slots(rng, slot_rows, s, table, n, positions, block_size, host_rows):
    """Random content for state row s: some host rows of `positions` (through row n of
    `table`), so they hit, then stale rows past the pool; some slots left empty."""
    hot = slot_rows.shape[1]
    gs = [host_row(table, n, int(t), block_size, host_rows) for t in positions]
    gs = list(dict.fromkeys(g for g in gs if g >= 0))        # distinct, in order
    hitting = rng.choice(gs, size=int(rng.integers(0, len(gs) + 1)), replace=False) if gs \
        else np.array([], np.int64)
    stale = rng.choice(np.arange(host_rows, host_rows + 10 * hot), size=hot, replace=False)
    content = np.concatenate([hitting, stale])[:hot]
    fill = rng.permutation(hot)[: int(rng.integers(0, hot + 1))]
    slot_rows[s] = -1
    slot_rows[s, fill] = content[: fill.size]


OVERLAPS = ("identical", "disjoint", "overlapping", "independent")


def random_union_case(rng: np.random.Generator, *, requests: int, rows_per_request: int,
                      k: int, hot: int, block_size: int, src_blocks: int,
                      overlap: str = "independent", resident_share: float = 0.0,
                      corrupt_lru: bool = False, padding: bool = True) -> ResolveCase:
    """A random resolve instance with r = rows_per_request adjacent query rows per request
    (N = requests * r), each request's rows sharing its state row and table rows.

    Row 0 of a request is a `random_case` row; the others select, per `overlap`: the same
    positions (`identical`, in another order), positions no earlier row selects
    (`disjoint`, padded with -1 when the table runs out), half of row 0's plus new ones
    (`overlapping`), or an independent draw (`independent`). Holes (-1) are mixed in
    everywhere; the hot content of a request includes host rows of all its rows (hits from
    any row).
    """
    assert overlap in OVERLAPS, overlap
    r = rows_per_request
    base = random_case(rng, n=requests, k=k, hot=hot, block_size=block_size,
                       src_blocks=src_blocks, resident_share=resident_share,
                       corrupt_lru=corrupt_lru, padding=padding)
    pool = np.arange(-3, src_blocks * block_size + block_size)
    topk = np.full((requests * r, k), -1, np.int32)
    for grp in range(requests):
        row0 = base.topk[grp]
        topk[grp * r] = row0
        for j in range(1, r):
            if overlap == "identical":
                row = rng.permutation(row0)
            elif overlap == "independent":
                row = rng.choice(pool, size=min(k, pool.size), replace=False)
            else:
                seen = topk[grp * r: grp * r + j]                # every earlier row
                fresh = rng.permutation(np.setdiff1d(pool[pool >= 0], seen))
                if overlap == "disjoint":
                    row = fresh[:k]
                else:
                    kept = rng.permutation(row0[row0 >= 0])[: k // 2]
                    row = np.concatenate([kept, fresh[: k - kept.size]])
            row = np.concatenate([row, np.full(k - row.size, -1)]).astype(np.int32)
            row[rng.random(k) < 0.05] = -1
            topk[grp * r + j] = rng.permutation(row)
    case = ResolveCase(base.slot_rows, base.lru, topk, np.repeat(base.state_rows, r),
                       np.repeat(base.hot_table, r, axis=0), np.repeat(base.src_table, r, axis=0),
                       np.repeat(base.res_table, r, axis=0), block_size, base.host_rows)
    for grp in range(requests):
        s = int(base.state_rows[grp])
        if s >= 0:
            _fill_slots(rng, case.slot_rows, s, base.src_table, grp,
                        topk[grp * r: grp * r + r].ravel(), block_size, base.host_rows)
    return case
