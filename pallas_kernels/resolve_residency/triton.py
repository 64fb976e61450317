"""resolve_residency as ONE Pallas kernel launch (Triton lowering), one program per batch row.

Contract of `reference.resolve_residency` (the search rule) and of
`reference.resolve_residency_mapped` (the position map rule), exactly, LRU order included
(`docs/semantics.md`). Why Triton: the kernels are built of vector-index gathers and
scatters (block-table lookups, a hash table, compaction by rank), which Mosaic GPU lacks
(`pallas_kernels/_triton.py`).

One program per batch row (`_frame`: padding rows, the row's columns) runs phases separated
by barriers. The search rule (`_search_rule`):
  (a) an open-addressing hash table of the row's pending host rows, built in rounds without
      atomics (claim, barrier, read back);
  (b) the LRU walk oldest -> newest in chunks: each slot probes the table, a hit marks its
      key's entry;
  (c) the new LRU order (unused evictables, filled slots, hits) and the evictables the
      misses take (`_reorder`);
  (d) the columns: hits read their slot, misses take evictables in ascending column order
      (`_columns`).
The position map rule (`_mapped_rule`) replaces (a) and (b): each pending column reads its
candidate slot from the map and marks it; the walk reads each slot's mark.
Scratch is per-row global memory (discarded outputs of the call). Every read of that
scratch follows a barrier after the writes it must see; `ResolveTuning.cached_loads` lets
those reads hit L1 instead of going to L2 (volatile loads).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _compat, _triton
from pallas_kernels.resolve_residency.union import resolve_union, resolve_union_mapped


@dataclasses.dataclass(frozen=True)
class ResolveTuning:
    """Knobs of the resolve kernel.

    num_warps: warps per batch row (a power of two <= 32).
    chunk: LRU positions walked per step (a power of two); chunk >= H walks the LRU in one
      pass (walk and reorder fused, no hit-mark round trip).
    table_factor: hash table size as a multiple of the padded K (a power of two >= 2); a
      sparser table shortens the longest linear-probe chain.
    cached_loads: read the row's scratch (hash table, marks) with ordinary loads that may
      hit L1, instead of volatile ones that go to L2 (every such read follows a barrier
      after the writes it must see, which orders them for the CTA under the PTX memory
      model: one CTA writes and reads a row's scratch, on one SM). On by default: faster
      than volatile loads at N=256 in every H200 sweep and at N=64 in all but one;
      False gives volatile loads (`bench/NOTES-data_plane.md`).
    """

    num_warps: int = 16
    chunk: int = 4096
    table_factor: int = 8
    cached_loads: bool = True

    def __post_init__(self) -> None:
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"ResolveTuning.num_warps must be a power of two <= 32, "
                             f"got {self.num_warps}")
        if not _triton.is_pow2(self.chunk):
            raise ValueError(f"ResolveTuning.chunk must be a power of two, got {self.chunk}")
        if not _triton.is_pow2(self.table_factor) or self.table_factor < 2:
            raise ValueError(f"ResolveTuning.table_factor must be a power of two >= 2, "
                             f"got {self.table_factor}")


DEFAULT = ResolveTuning()


def supports(*args: Any, **kwargs: Any) -> str | None:
    """None (takes the arguments of `resolve_residency`): the kernel runs every input the
    validated op accepts (any N, K <= H, any table widths)."""
    del args, kwargs
    return None


_GOLDEN = 0x9E3779B1                   # Knuth's multiplicative hash constant


def _barrier(interpret: bool) -> None:
    """Orders the global-memory scratch traffic between the phases of one program (its
    threads run in lock-step phases); the interpreter runs a program as whole-array ops."""
    if not interpret:
        plgpu.debug_barrier()


def _hash(key: jax.Array, log2_size: int) -> jax.Array:
    """Multiplicative hash of int32 keys >= 0 into [0, 2**log2_size)."""
    mixed = key.astype(jnp.uint32) * jnp.uint32(_GOLDEN)
    return jax.lax.shift_right_logical(mixed, jnp.uint32(32 - log2_size)).astype(jnp.int32)


def _table_rows(positions, table_ref, n, block_size, width, mask):
    """`table[n, t // B] * B + t % B` for positions t [L] (-1 where null or masked)."""
    blk = jnp.where(positions >= 0, positions // block_size, -1)
    in_table = mask & (blk >= 0) & (blk < width)
    block_id = plgpu.load(table_ref.at[n, jnp.where(in_table, blk, width)], mask=in_table,
                          other=0)
    ok = in_table & (block_id > 0)
    return jnp.where(ok, block_id * block_size + jnp.where(ok, positions % block_size, 0), -1)


def _any(mask: jax.Array) -> jax.Array:
    return jnp.max(mask.astype(jnp.int32)) > 0


class _Outs(NamedTuple):
    """The output refs both rules' kernels write (the state ones updated in place)."""

    out: Any
    valid: Any
    ssrc: Any
    sdst: Any
    scount: Any
    hits: Any
    slots: Any
    lru: Any


@dataclasses.dataclass(frozen=True)
class _Row:
    """One live batch row with pending columns, as both rules' kernels see it: its program
    n, state row s, each column's position t, host row g and output so far out0 (its
    resident row or -1), the pending columns. (The rules make their own column lanes:
    values from outside the branch would stay live in registers across it.)"""

    n: Any
    s: Any
    t: Any
    g: Any
    pending: Any
    num_pending: Any
    out0: Any


def _frame(rule, topk_ref, state_ref, host_rows_ref, src_ref, res_ref, outs, *, k, kp,
           block_size, num_state_rows):
    """Steps 1-2 of `docs/semantics.md` for this program's batch row: a padding row, a row's
    columns, a row with nothing pending; `rule(_Row)` resolves a row with pending columns."""
    n = pl.program_id(0)
    s = state_ref[n]
    live = (s >= 0) & (s < num_state_rows)
    kk = jnp.arange(kp, dtype=jnp.int32)
    kin = kk < k
    col_at = jnp.where(kin, kk, k)                     # masked lanes: out of range
    minus1 = jnp.full((kp,), -1, jnp.int32)

    def store_cols(ref, values, mask=kin):
        plgpu.store(ref.at[n, jnp.where(mask, kk, k)], values, mask=mask)

    @pl.when(~live)
    def _padding_row():
        for ref in (outs.out, outs.ssrc, outs.sdst):
            store_cols(ref, minus1)
        for ref in (outs.valid, outs.scount, outs.hits):
            ref[n] = jnp.int32(0)

    @pl.when(live)
    def _live_row():
        t = plgpu.load(topk_ref.at[n, col_at], mask=kin, other=-1)
        g = _table_rows(t, src_ref, n, block_size, src_ref.shape[1], kin)
        g = jnp.where(g < host_rows_ref[0], g, -1)
        if res_ref is None:
            res = minus1
        else:
            res = _table_rows(t, res_ref, n, block_size, res_ref.shape[1], kin)
        outs.valid[n] = jnp.sum((kin & ((res >= 0) | (g >= 0))).astype(jnp.int32))
        pending = kin & (res < 0) & (g >= 0)
        num_pending = jnp.sum(pending.astype(jnp.int32))
        out0 = jnp.where(res >= 0, res, -1)

        @pl.when(num_pending == 0)
        def _nothing_pending():
            store_cols(outs.out, out0)
            store_cols(outs.ssrc, minus1)
            store_cols(outs.sdst, minus1)
            outs.scount[n] = jnp.int32(0)
            outs.hits[n] = jnp.int32(0)

        @pl.when(num_pending > 0)
        def _walk():
            rule(_Row(n, s, t, g, pending, num_pending, out0))


def _device_row(hot_ref, n, slot, mask, block_size):
    """The device row of hot slot `slot` of batch row n (masked lanes: 0 * B + 0)."""
    blk = plgpu.load(hot_ref.at[n, jnp.where(mask, slot // block_size, hot_ref.shape[1])],
                     mask=mask, other=0)
    return blk * block_size + jnp.where(mask, slot % block_size, 0)


def _reorder(row, outs, evict_ref, carry, p, pin, slot, col, num_hits, *, hot, kp):
    """Step 5 for walked LRU positions p (pin: p < H) holding `slot`, col >= 0 at the hits
    among them (-1 elsewhere): new LRU = unused evictables ++ filled (miss order) ++ hits;
    also lists the evictables the misses take, oldest first. carry: (hits, evictables)
    before p."""
    i32 = jnp.int32
    hits_before, evict_before = carry
    num_evict = hot - num_hits
    num_miss = row.num_pending - num_hits
    hit = pin & (col >= 0)
    evict = pin & (col < 0)
    hit_rank = hits_before + jnp.cumsum(hit.astype(i32)) - 1
    evict_rank = evict_before + jnp.cumsum(evict.astype(i32)) - 1
    new_pos = jnp.where(hit, num_evict + hit_rank,
                        jnp.where(evict_rank >= num_miss, evict_rank - num_miss,
                                  num_evict - num_miss + evict_rank))
    plgpu.store(outs.lru.at[row.s, jnp.where(pin, new_pos, hot)], slot.astype(outs.lru.dtype),
                mask=pin)
    taken = evict & (evict_rank < num_miss)
    plgpu.store(evict_ref.at[row.n, jnp.where(taken, evict_rank, kp)], slot, mask=taken)
    return hits_before + jnp.sum(hit.astype(i32)), evict_before + jnp.sum(evict.astype(i32))


def _columns(row, outs, hot_ref, evict_ref, kk, kin, is_hit, hit_dev, num_hits, num_miss, *,
             k, kp, hot, block_size, volatile):
    """Step 4's columns: hits read their slot's device row (`hit_dev`), misses take the
    evictables in ascending column order; writes the outputs, the swap plan and the filled
    slots. Returns (miss_ok, miss_slot): the misses that got a slot in [0, H), and it."""
    i32 = jnp.int32
    n = row.n
    miss = row.pending & ~is_hit
    miss_rank = jnp.cumsum(miss.astype(i32)) - 1
    miss_slot = plgpu.load(evict_ref.at[n, jnp.where(miss, miss_rank, kp)], mask=miss,
                           other=-1, volatile=volatile)
    miss_ok = miss & (miss_slot >= 0) & (miss_slot < hot)
    miss_dev = jnp.where(miss_ok, _device_row(hot_ref, n, miss_slot, miss_ok, block_size), -1)
    out = jnp.where(is_hit, hit_dev, jnp.where(miss, miss_dev, row.out0))
    plgpu.store(outs.out.at[n, jnp.where(kin, kk, k)], out, mask=kin)
    at_rank = jnp.where(miss, miss_rank, k)
    plgpu.store(outs.ssrc.at[n, at_rank], row.g, mask=miss)
    plgpu.store(outs.sdst.at[n, at_rank], miss_dev, mask=miss)
    rest = kin & (kk >= num_miss)
    plgpu.store(outs.ssrc.at[n, jnp.where(rest, kk, k)], jnp.full((kp,), -1, i32), mask=rest)
    plgpu.store(outs.sdst.at[n, jnp.where(rest, kk, k)], jnp.full((kp,), -1, i32), mask=rest)
    plgpu.store(outs.slots.at[row.s, jnp.where(miss_ok, miss_slot, hot)], row.g, mask=miss_ok)
    outs.scount[n] = num_miss
    outs.hits[n] = num_hits
    return miss_ok, miss_slot


def _search_kernel(topk_ref, state_ref, host_rows_ref, hot_ref, src_ref, res_ref, lru_old_ref,
                   *refs, k, kp, hot, hp, chunk, log2_table, block_size, num_state_rows,
                   num_aliased, interpret, volatile):
    refs = refs[num_aliased:]          # skip the aliased inputs: use the outputs
    outs = _Outs(*refs[:8])
    hkey_ref, hval_ref, hitpos_ref, evict_ref = refs[8:]
    rule = functools.partial(
        _search_rule, outs=outs, hot_ref=hot_ref, lru_old_ref=lru_old_ref, hkey_ref=hkey_ref,
        hval_ref=hval_ref, hitpos_ref=hitpos_ref, evict_ref=evict_ref, k=k, kp=kp, hot=hot,
        hp=hp, chunk=chunk, log2_table=log2_table, block_size=block_size,
        interpret=interpret, volatile=volatile)
    _frame(rule, topk_ref, state_ref, host_rows_ref, src_ref, res_ref, outs, k=k, kp=kp,
           block_size=block_size, num_state_rows=num_state_rows)


def _search_rule(row, *, outs, hot_ref, lru_old_ref, hkey_ref, hval_ref, hitpos_ref,
                 evict_ref, k, kp, hot, hp, chunk, log2_table, block_size, interpret,
                 volatile):
    """Steps 3-5 of `docs/semantics.md` for one live row with pending columns (the search
    rule: a table of the pending host rows, probed by every walked slot).

    Every read of this row's scratch follows a barrier after the writes it must see;
    `volatile` (ResolveTuning.cached_loads False) also makes those loads bypass L1."""
    n, s, g, pending = row.n, row.s, row.g, row.pending
    kk = jnp.arange(kp, dtype=jnp.int32)
    kin = kk < k
    i32 = jnp.int32
    table = 1 << log2_table

    # (a) Open-addressing table of the pending g, in this row's scratch, built in rounds
    # without atomics: every unplaced key reads its probe position; keys that saw it empty
    # store themselves there; after a barrier the one that reads itself back owns it. Each
    # column keeps its key's position (`pos_col`); the value table (hval) at that position
    # holds the column (>= 0) until the walk marks a hit there with -2 - slot.
    tt = jnp.arange(table, dtype=jnp.int32)
    plgpu.store(hkey_ref.at[n, tt], jnp.full((table,), -1, i32))
    _barrier(interpret)
    home = _hash(jnp.maximum(g, 0), log2_table)

    def insert_round(carry):
        unplaced, probe = carry
        todo = unplaced > 0
        pos = (home + probe) & (table - 1)
        at = jnp.where(todo, pos, table)
        seen = plgpu.load(hkey_ref.at[n, at], mask=todo, other=-2, volatile=volatile)
        _barrier(interpret)
        claim = todo & (seen == -1)
        plgpu.store(hkey_ref.at[n, jnp.where(claim, pos, table)], g, mask=claim)
        _barrier(interpret)
        back = plgpu.load(hkey_ref.at[n, at], mask=todo, other=-2, volatile=volatile)
        won = todo & (back == g)
        # No barrier after this store: the next round reads only hkey, and the barrier
        # after the loop orders hval before the walk reads it.
        plgpu.store(hval_ref.at[n, jnp.where(won, pos, table)], kk, mask=won)
        still = todo & ~won
        return still.astype(i32), probe + still.astype(i32)

    _, final_probe = jax.lax.while_loop(lambda c: _any(c[0] > 0), insert_round,
                                        (pending.astype(i32), jnp.zeros((kp,), i32)))
    pos_col = (home + final_probe) & (table - 1)      # a placed key's probe stops growing
    _barrier(interpret)

    # (b) Walk the LRU oldest -> newest in chunks: a hit slot marks its key's entry.
    cc = jnp.arange(chunk, dtype=jnp.int32)
    num_chunks = hp // chunk

    def load_walk(c):
        p = c * chunk + cc
        pin = p < hot
        slot = plgpu.load(lru_old_ref.at[s, jnp.where(pin, p, hot)], mask=pin,
                          other=-1).astype(i32)
        return p, pin, slot

    def find_hits(c, num_hits):
        p, pin, slot = load_walk(c)
        in_range = pin & (slot >= 0) & (slot < hot)
        cached = plgpu.load(outs.slots.at[s, jnp.where(in_range, slot, hot)], mask=in_range,
                            other=-1)
        start = _hash(jnp.maximum(cached, 0), log2_table)

        def probe_step(carry):
            searching, probe, where_found = carry
            todo = searching > 0
            q = (start + probe) & (table - 1)
            key = plgpu.load(hkey_ref.at[n, jnp.where(todo, q, table)], mask=todo, other=-1,
                             volatile=volatile)
            found = todo & (key == cached)
            where_found = jnp.where(found, q, where_found)
            still = todo & ~found & (key != -1)
            return still.astype(i32), probe + 1, where_found

        # col: the table position of the key this slot holds (>= 0 iff a hit).
        _, _, col = jax.lax.while_loop(
            lambda c_: _any(c_[0] > 0), probe_step,
            ((cached >= 0).astype(i32), jnp.zeros((chunk,), i32), jnp.full((chunk,), -1, i32)))
        hit = col >= 0
        if num_chunks > 1:             # one chunk: `reorder` gets col in registers
            plgpu.store(hitpos_ref.at[n, jnp.where(pin, p, hp)], col, mask=pin)
        # Only the walk's probes read hkey; hval is read after the barrier of (c).
        plgpu.store(hval_ref.at[n, jnp.where(hit, col, table)], -2 - slot, mask=hit)
        return (p, pin, slot, col), num_hits + jnp.sum(hit.astype(i32))

    # (c) The new LRU and the evictables the misses take (`_reorder`).
    def reorder(carry, walked, num_hits):
        p, pin, slot, col = walked
        return _reorder(row, outs, evict_ref, carry, p, pin, slot, col, num_hits, hot=hot,
                        kp=kp)

    if num_chunks == 1:
        # The whole LRU in one chunk: walk and reorder share registers (no hitpos round
        # trip, no barrier between them; the barrier below orders hval and evict).
        walked, num_hits = find_hits(0, jnp.int32(0))
        reorder((jnp.int32(0), jnp.int32(0)), walked, num_hits)
    else:
        num_hits = jax.lax.fori_loop(0, num_chunks, lambda c, h: find_hits(c, h)[1],
                                     jnp.int32(0))
        _barrier(interpret)

        def reorder_chunk(c, carry):
            p, pin, slot = load_walk(c)
            col = plgpu.load(hitpos_ref.at[n, jnp.where(pin, p, hp)], mask=pin, other=-1,
                             volatile=volatile)
            return reorder(carry, (p, pin, slot, col), num_hits)

        jax.lax.fori_loop(0, num_chunks, reorder_chunk, (jnp.int32(0), jnp.int32(0)))
    _barrier(interpret)
    num_miss = row.num_pending - num_hits

    # (d) Columns: hits read their slot, misses take evictables in ascending column order.
    mark = plgpu.load(hval_ref.at[n, jnp.where(pending, pos_col, table)], mask=pending,
                      other=0, volatile=volatile)
    is_hit = pending & (mark <= -2)
    hit_slot = jnp.where(is_hit, -2 - mark, -1)
    hit_dev = _device_row(hot_ref, n, hit_slot, is_hit, block_size)   # before the evictables
    _columns(row, outs, hot_ref, evict_ref, kk, kin, is_hit, hit_dev, num_hits, num_miss,
             k=k, kp=kp, hot=hot, block_size=block_size, volatile=volatile)


# --- The position map rule: `resolve_residency_mapped` ---------------------------------------
#
# With the hot state's position map (`pos_slot[s, t]`: the slot position t was last copied
# to), a row needs no table of its pending host rows and no probe per slot: each pending
# column reads its candidate slot from the map and checks that the slot still holds its
# host row (one dependent load each); candidates mark their slot in a slot-indexed scratch
# row; the LRU walk reads the mark of each slot it passes (a walked candidate is a hit and
# confirms its column); the rest (new LRU, evictables, columns) is the search rule's.


def _mapped_kernel(topk_ref, state_ref, host_rows_ref, hot_ref, src_ref, res_ref, lru_old_ref,
                   *refs, k, kp, hot, hp, chunk, block_size, num_state_rows, num_aliased,
                   interpret, volatile):
    refs = refs[num_aliased:]          # skip the aliased inputs: use the outputs
    outs = _Outs(*refs[:8])
    map_ref, mark_ref, conf_ref, evict_ref = refs[8:]
    rule = functools.partial(
        _mapped_rule, outs=outs, hot_ref=hot_ref, lru_old_ref=lru_old_ref, map_ref=map_ref,
        mark_ref=mark_ref, conf_ref=conf_ref, evict_ref=evict_ref, k=k, kp=kp, hot=hot, hp=hp,
        chunk=chunk, block_size=block_size, interpret=interpret, volatile=volatile)
    _frame(rule, topk_ref, state_ref, host_rows_ref, src_ref, res_ref, outs, k=k, kp=kp,
           block_size=block_size, num_state_rows=num_state_rows)


def _mapped_rule(row, *, outs, hot_ref, lru_old_ref, map_ref, mark_ref, conf_ref, evict_ref,
                 k, kp, hot, hp, chunk, block_size, interpret, volatile):
    """Steps 3-5 for one live row with pending columns under the position map rule."""
    n, s, t, g, pending = row.n, row.s, row.t, row.g, row.pending
    kk = jnp.arange(kp, dtype=jnp.int32)
    kin = kk < k
    i32 = jnp.int32
    map_width = map_ref.shape[1]
    # Candidates: the slot the map names still holds the column's host row.
    in_map = pending & (t < map_width)
    j = plgpu.load(map_ref.at[s, jnp.where(in_map, t, map_width)], mask=in_map,
                   other=-1).astype(i32)
    j_ok = in_map & (j >= 0) & (j < hot)
    held = plgpu.load(outs.slots.at[s, jnp.where(j_ok, j, hot)], mask=j_ok, other=-1)
    candidate = j_ok & (held == g)
    plgpu.store(mark_ref.at[n, jnp.arange(hp, dtype=i32)], jnp.full((hp,), -1, i32))
    plgpu.store(conf_ref.at[n, kk], jnp.full((kp,), -1, i32))
    _barrier(interpret)
    plgpu.store(mark_ref.at[n, jnp.where(candidate, j, hp)], kk, mask=candidate)
    _barrier(interpret)

    cc = jnp.arange(chunk, dtype=i32)
    num_chunks = hp // chunk

    def walk(c):
        """LRU positions of chunk c: (p, pin, slot, hit, col); a hit confirms column col
        (col is -1 at every other position)."""
        p = c * chunk + cc
        pin = p < hot
        slot = plgpu.load(lru_old_ref.at[s, jnp.where(pin, p, hot)], mask=pin,
                          other=-1).astype(i32)
        in_range = pin & (slot >= 0) & (slot < hot)
        col = plgpu.load(mark_ref.at[n, jnp.where(in_range, slot, hp)], mask=in_range,
                         other=-1, volatile=volatile)
        return p, pin, slot, in_range & (col >= 0), col

    def confirm(walked):
        _, _, slot, hit, col = walked
        plgpu.store(conf_ref.at[n, jnp.where(hit, col, kp)], slot, mask=hit)
        return jnp.sum(hit.astype(i32))

    def reorder(carry, walked, num_hits):
        p, pin, slot, _, col = walked
        return _reorder(row, outs, evict_ref, carry, p, pin, slot, col, num_hits, hot=hot,
                        kp=kp)

    if num_chunks == 1:
        walked = walk(0)
        num_hits = confirm(walked)
        reorder((i32(0), i32(0)), walked, num_hits)
    else:
        # The marks do not change during the walk: the reorder pass reads them again.
        num_hits = jax.lax.fori_loop(0, num_chunks, lambda c, h: h + confirm(walk(c)), i32(0))
        jax.lax.fori_loop(0, num_chunks, lambda c, carry: reorder(carry, walk(c), num_hits),
                          (i32(0), i32(0)))
    _barrier(interpret)
    num_miss = row.num_pending - num_hits

    # Columns: confirmed hits read their slot; each miss's position now names its slot.
    hit_slot = plgpu.load(conf_ref.at[n, jnp.where(pending, kk, kp)], mask=pending, other=-1,
                          volatile=volatile)
    is_hit = pending & (hit_slot >= 0)
    hit_dev = _device_row(hot_ref, n, hit_slot, is_hit, block_size)
    miss_ok, miss_slot = _columns(row, outs, hot_ref, evict_ref, kk, kin, is_hit, hit_dev,
                                  num_hits, num_miss, k=k, kp=kp, hot=hot,
                                  block_size=block_size, volatile=volatile)
    put = miss_ok & (t < map_width)
    plgpu.store(map_ref.at[s, jnp.where(put, t, map_width)], miss_slot.astype(map_ref.dtype),
                mask=put)


def _launch(kernel, name, state, scratch, topk, state_rows, hot_block_table,
            source_block_table, resident_block_table, host_rows, lru, *, tuning, poison,
            interpret):
    """One launch of `kernel`, one program per batch row. Outputs: the six per-row results,
    then `state` (arrays updated in place: aliased), then the `scratch` shapes (discarded).
    `lru` is also passed read only: the kernel reads the old order while it writes the new
    one into `state`'s copy. Returns the results and the new state."""
    n, k = topk.shape
    i32 = jnp.int32
    out_shapes = [
        jax.ShapeDtypeStruct((n, k), i32),                  # attention_rows
        jax.ShapeDtypeStruct((n,), i32),                    # valid_counts
        jax.ShapeDtypeStruct((n, k), i32),                  # swap_src
        jax.ShapeDtypeStruct((n, k), i32),                  # swap_dst
        jax.ShapeDtypeStruct((n,), i32),                    # swap_counts
        jax.ShapeDtypeStruct((n,), i32),                    # num_hits
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state),
        *scratch,
    ]
    has_res = resident_block_table is not None
    host_rows = jnp.asarray(host_rows, jnp.int32).reshape(1)    # may be traced
    inputs = [topk, state_rows, host_rows, hot_block_table, source_block_table]
    if has_res:
        inputs.append(resident_block_table)
    inputs.append(lru)                                      # the old LRU, read only
    aliased = list(state)
    if poison is not None:
        aliased = [jnp.full(o.shape, poison, o.dtype) for o in out_shapes[:6]] + aliased
    first_alias = len(inputs)
    out_index0 = 0 if poison is not None else 6
    aliases = {first_alias + i: out_index0 + i for i in range(len(aliased))}
    num_inputs = len(inputs) + len(aliased)
    body = functools.partial(kernel, num_aliased=len(aliased))

    def kernel_refs(*refs):
        if has_res:
            return body(*refs)
        return body(*refs[:5], None, *refs[5:])

    def call(*args):
        return tuple(pl.pallas_call(
            kernel_refs,
            out_shape=out_shapes,
            grid=(n,),
            in_specs=[_triton.ANY] * num_inputs,
            out_specs=[_triton.ANY] * len(out_shapes),
            input_output_aliases=aliases,
            interpret=interpret,
            compiler_params=_triton.compiler_params(tuning.num_warps),
            name=name,
        )(*args))

    outs = _compat.quiet_triton_call(call, *inputs, *aliased)
    return tuple(outs[:6 + len(state)])


def _no_rows(state, n, k):
    """The outputs of a call with no batch rows or no columns (state unchanged)."""
    zeros = jnp.zeros((n,), jnp.int32)
    minus = jnp.full((n, k), -1, jnp.int32)
    return (minus, zeros, minus, minus, zeros, zeros, *state)


def resolve_residency(slot_rows, lru, topk, state_rows, hot_block_table, source_block_table,
                      resident_block_table, *, block_size, host_rows, interpret: bool = False,
                      tuning: ResolveTuning = DEFAULT, poison: int | None = None,
                      query_rows_per_request: int = 1):
    """resolve_residency in one launch: one program per batch row (same arguments, contract
    and outputs as `reference.resolve_residency`, exactly, including the LRU order).

    query_rows_per_request r > 1: the union rows of the requests are built with jnp
    (`union.resolve_union`) and the kernel runs once per request (one program each) on its
    union row of r * K columns; the per-row outputs are gathered back with jnp.

    host_rows may be a Python int or a traced int32 scalar (it is a kernel operand).
    slot_rows int32[S, H] and a copy of lru int16[S, H] are updated in place (aliased); the
    other outputs are fresh, or, with `poison` set (tests), start filled with that value so
    an entry the kernel fails to write shows. Per-row global scratch (discarded): the hash
    table (keys and values) [N, table_factor * Kp] twice, LRU-position hit marks [N, Hp] and
    the evictables the misses take [N, Kp] (Kp, Hp: K, H rounded up to powers of two).
    """
    if query_rows_per_request > 1:
        single = functools.partial(resolve_residency, interpret=interpret, tuning=tuning,
                                   poison=poison)
        return resolve_union(
            single, slot_rows, lru, topk, state_rows, hot_block_table, source_block_table,
            resident_block_table, block_size=block_size, host_rows=host_rows,
            rows_per_request=query_rows_per_request)
    num_state_rows, hot = slot_rows.shape
    n, k = topk.shape
    if n == 0 or k == 0:
        return _no_rows((slot_rows, lru), n, k)
    kp = _triton.pow2_ceil(k)
    hp = _triton.pow2_ceil(hot)
    table = _triton.pow2_ceil(max(tuning.table_factor * kp, 2))
    scratch = [jax.ShapeDtypeStruct((n, table), jnp.int32),     # hash keys
               jax.ShapeDtypeStruct((n, table), jnp.int32),     # hash columns
               jax.ShapeDtypeStruct((n, hp), jnp.int32),        # hit mark per LRU position
               jax.ShapeDtypeStruct((n, kp), jnp.int32)]        # evictables taken
    kernel = functools.partial(
        _search_kernel, k=k, kp=kp, hot=hot, hp=hp, chunk=min(tuning.chunk, hp),
        log2_table=table.bit_length() - 1, block_size=block_size,
        num_state_rows=num_state_rows, interpret=interpret, volatile=not tuning.cached_loads)
    return _launch(kernel, "hisparse_resolve_residency", (slot_rows, lru), scratch, topk,
                   state_rows, hot_block_table, source_block_table, resident_block_table,
                   host_rows, lru, tuning=tuning, poison=poison, interpret=interpret)


def resolve_residency_mapped(slot_rows, lru, pos_slot, topk, state_rows, hot_block_table,
                             source_block_table, resident_block_table, *, block_size,
                             host_rows, interpret: bool = False, tuning: ResolveTuning = DEFAULT,
                             poison: int | None = None, query_rows_per_request: int = 1):
    """`reference.resolve_residency_mapped` in one launch, one program per batch row (same
    arguments, contract and outputs, exactly). slot_rows, a copy of lru and pos_slot are
    updated in place (aliased). `tuning`: num_warps, chunk and cached_loads apply
    (table_factor does not: there is no table). Per-row global scratch (discarded): the
    candidate column of each slot [N, Hp], the confirmed slot of each column and the
    evictables the misses take [N, Kp] twice."""
    if query_rows_per_request > 1:
        single = functools.partial(resolve_residency_mapped, interpret=interpret,
                                   tuning=tuning, poison=poison)
        return resolve_union_mapped(
            single, slot_rows, lru, pos_slot, topk, state_rows, hot_block_table,
            source_block_table, resident_block_table, block_size=block_size,
            host_rows=host_rows, rows_per_request=query_rows_per_request)
    num_state_rows, hot = slot_rows.shape
    n, k = topk.shape
    if n == 0 or k == 0:
        return _no_rows((slot_rows, lru, pos_slot), n, k)
    kp = _triton.pow2_ceil(k)
    hp = _triton.pow2_ceil(hot)
    scratch = [jax.ShapeDtypeStruct((n, hp), jnp.int32),        # candidate column per slot
               jax.ShapeDtypeStruct((n, kp), jnp.int32),        # confirmed slot per column
               jax.ShapeDtypeStruct((n, kp), jnp.int32)]        # evictables taken
    kernel = functools.partial(
        _mapped_kernel, k=k, kp=kp, hot=hot, hp=hp, chunk=min(tuning.chunk, hp),
        block_size=block_size, num_state_rows=num_state_rows, interpret=interpret,
        volatile=not tuning.cached_loads)
    return _launch(kernel, "hisparse_resolve_residency_mapped", (slot_rows, lru, pos_slot),
                   scratch, topk, state_rows, hot_block_table, source_block_table,
                   resident_block_table, host_rows, lru, tuning=tuning, poison=poison,
                   interpret=interpret)
