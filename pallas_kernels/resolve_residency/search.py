"""The search rule of the resolve kernel (`triton.resolve_residency`): steps 3-5 of
`docs/semantics.md` for a live batch row with pending columns, exactly as
`reference.resolve_residency` does them, LRU order included.

  (a) `_build_table`: an open-addressing hash table of the row's pending host rows, built in
      rounds without atomics (claim, barrier, read back);
  (b) `_find_hits`: the LRU walk oldest -> newest in chunks: each slot probes the table
      (`_probe`), a hit marks its key's entry;
  (c) `_walk`: the walk, then the new LRU order (unused evictables, filled slots, hits) and
      the evictables the misses take (`frame.reorder`);
  (d) `search_rule`: the columns: hits read their slot, misses take evictables in ascending
      column order (`frame.columns`).
The table, the hit marks and the evictables live in per-row global scratch; every read of it
follows a barrier after the writes it must see (`frame.barrier`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.resolve_residency.frame import (
    Outs,
    Row,
    barrier,
    columns,
    device_row,
    frame,
    reorder,
)

_GOLDEN = 0x9E3779B1                   # Knuth's multiplicative hash constant


def _hash(key: jax.Array, log2_size: int) -> jax.Array:
    """Multiplicative hash of int32 keys >= 0 into [0, 2**log2_size)."""
    mixed = key.astype(jnp.uint32) * jnp.uint32(_GOLDEN)
    return jax.lax.shift_right_logical(mixed, jnp.uint32(32 - log2_size)).astype(jnp.int32)


def _any(mask: jax.Array) -> jax.Array:
    return jnp.max(mask.astype(jnp.int32)) > 0


@dataclasses.dataclass(frozen=True)
class _Search:
    """One program's refs and the kernel's static sizes, as the search rule's steps see
    them: the outputs, the hot block table, the old LRU (read only), the scratch rows (hash
    keys and values [N, 2**log2_table], hit marks per LRU position [N, hp], evictables
    taken [N, kp]); k, kp: columns and their power-of-two padding; hot, hp: slots and
    theirs; chunk: LRU positions walked per step (a power of two dividing hp).

    volatile (ResolveTuning.cached_loads False): the scratch loads bypass L1."""

    outs: Outs
    hot_ref: Any
    lru_old_ref: Any
    hkey_ref: Any
    hval_ref: Any
    hitpos_ref: Any
    evict_ref: Any
    k: int
    kp: int
    hot: int
    hp: int
    chunk: int
    log2_table: int
    block_size: int
    interpret: bool
    volatile: bool

    @property
    def table(self) -> int:
        return 1 << self.log2_table

    @property
    def num_chunks(self) -> int:
        return self.hp // self.chunk


def search_kernel(topk_ref, state_ref, host_rows_ref, hot_ref, src_ref, res_ref, lru_old_ref,
                  *refs, k, kp, hot, hp, chunk, log2_table, block_size, num_state_rows,
                  num_aliased, interpret, volatile):
    """The kernel of one batch row (refs as `frame.launch` passes them)."""
    refs = refs[num_aliased:]          # skip the aliased inputs: use the outputs
    outs = Outs(*refs[:8])
    hkey_ref, hval_ref, hitpos_ref, evict_ref = refs[8:]
    search = _Search(outs, hot_ref, lru_old_ref, hkey_ref, hval_ref, hitpos_ref, evict_ref,
                     k=k, kp=kp, hot=hot, hp=hp, chunk=chunk, log2_table=log2_table,
                     block_size=block_size, interpret=interpret, volatile=volatile)
    frame(functools.partial(search_rule, search), topk_ref, state_ref, host_rows_ref, src_ref,
          res_ref, outs, k=k, kp=kp, block_size=block_size, num_state_rows=num_state_rows)


def search_rule(sr: _Search, row: Row) -> None:
    """Steps 3-5 for one live row with pending columns: a table of the pending host rows,
    probed by every walked slot."""
    n, pending = row.n, row.pending
    kk = jnp.arange(sr.kp, dtype=jnp.int32)
    kin = kk < sr.k
    pos_col = _build_table(sr, row, kk)
    num_hits = _walk(sr, row)
    barrier(sr.interpret)
    num_miss = row.num_pending - num_hits

    # (d) Columns: hits read their slot, misses take evictables in ascending column order.
    mark = plgpu.load(sr.hval_ref.at[n, jnp.where(pending, pos_col, sr.table)], mask=pending,
                      other=0, volatile=sr.volatile)
    is_hit = pending & (mark <= -2)
    hit_slot = jnp.where(is_hit, -2 - mark, -1)
    hit_dev = device_row(sr.hot_ref, n, hit_slot, is_hit, sr.block_size)  # before the evictables
    columns(row, sr.outs, sr.hot_ref, sr.evict_ref, kk, kin, is_hit, hit_dev, num_hits,
            num_miss, k=sr.k, kp=sr.kp, hot=sr.hot, block_size=sr.block_size,
            volatile=sr.volatile)


def _build_table(sr: _Search, row: Row, kk: jax.Array) -> jax.Array:
    """(a) Open-addressing table of the pending g, in this row's scratch, built in rounds
    without atomics: every unplaced key reads its probe position; keys that saw it empty
    store themselves there; after a barrier the one that reads itself back owns it. Returns
    each column's key position (`pos_col`); the value table (hval) at that position holds
    the column (>= 0) until the walk marks a hit there with -2 - slot."""
    n, g = row.n, row.g
    i32 = jnp.int32
    table = sr.table
    tt = jnp.arange(table, dtype=jnp.int32)
    plgpu.store(sr.hkey_ref.at[n, tt], jnp.full((table,), -1, i32))
    barrier(sr.interpret)
    home = _hash(jnp.maximum(g, 0), sr.log2_table)

    def insert_round(carry):
        unplaced, probe = carry
        todo = unplaced > 0
        pos = (home + probe) & (table - 1)
        at = jnp.where(todo, pos, table)
        seen = plgpu.load(sr.hkey_ref.at[n, at], mask=todo, other=-2, volatile=sr.volatile)
        barrier(sr.interpret)
        claim = todo & (seen == -1)
        plgpu.store(sr.hkey_ref.at[n, jnp.where(claim, pos, table)], g, mask=claim)
        barrier(sr.interpret)
        back = plgpu.load(sr.hkey_ref.at[n, at], mask=todo, other=-2, volatile=sr.volatile)
        won = todo & (back == g)
        # No barrier after this store: the next round reads only hkey, and the barrier
        # after the loop orders hval before the walk reads it.
        plgpu.store(sr.hval_ref.at[n, jnp.where(won, pos, table)], kk, mask=won)
        still = todo & ~won
        return still.astype(i32), probe + still.astype(i32)

    _, final_probe = jax.lax.while_loop(lambda c: _any(c[0] > 0), insert_round,
                                        (row.pending.astype(i32), jnp.zeros((sr.kp,), i32)))
    pos_col = (home + final_probe) & (table - 1)      # a placed key's probe stops growing
    barrier(sr.interpret)
    return pos_col


def _load_walk(sr: _Search, s, cc, c):
    """LRU positions p of chunk c (cc: the chunk's lanes), pin = p < H, and the slot each
    holds."""
    p = c * sr.chunk + cc
    pin = p < sr.hot
    slot = plgpu.load(sr.lru_old_ref.at[s, jnp.where(pin, p, sr.hot)], mask=pin,
                      other=-1).astype(jnp.int32)
    return p, pin, slot


def _probe(sr: _Search, n, cached: jax.Array) -> jax.Array:
    """The table position of the key each walked slot holds (`cached`, -1 for none): >= 0
    iff a hit, else -1 (linear probing until the key or an empty entry)."""
    i32 = jnp.int32
    table = sr.table
    start = _hash(jnp.maximum(cached, 0), sr.log2_table)

    def probe_step(carry):
        searching, probe, where_found = carry
        todo = searching > 0
        q = (start + probe) & (table - 1)
        key = plgpu.load(sr.hkey_ref.at[n, jnp.where(todo, q, table)], mask=todo, other=-1,
                         volatile=sr.volatile)
        found = todo & (key == cached)
        where_found = jnp.where(found, q, where_found)
        still = todo & ~found & (key != -1)
        return still.astype(i32), probe + 1, where_found

    _, _, col = jax.lax.while_loop(
        lambda c_: _any(c_[0] > 0), probe_step,
        ((cached >= 0).astype(i32), jnp.zeros((sr.chunk,), i32),
         jnp.full((sr.chunk,), -1, i32)))
    return col


def _find_hits(sr: _Search, row: Row, cc, c, num_hits):
    """(b) Chunk c of the walk: each slot probes the table, a hit marks its key's entry.
    Returns ((p, pin, slot, col), num_hits including this chunk's); col: the table position
    of a hit slot's key, -1 elsewhere."""
    n, s = row.n, row.s
    p, pin, slot = _load_walk(sr, s, cc, c)
    in_range = pin & (slot >= 0) & (slot < sr.hot)
    cached = plgpu.load(sr.outs.slots.at[s, jnp.where(in_range, slot, sr.hot)],
                        mask=in_range, other=-1)
    col = _probe(sr, n, cached)
    hit = col >= 0
    if sr.num_chunks > 1:              # one chunk: the reorder gets col in registers
        plgpu.store(sr.hitpos_ref.at[n, jnp.where(pin, p, sr.hp)], col, mask=pin)
    # Only the walk's probes read hkey; hval is read after the barrier of (c).
    plgpu.store(sr.hval_ref.at[n, jnp.where(hit, col, sr.table)], -2 - slot, mask=hit)
    return (p, pin, slot, col), num_hits + jnp.sum(hit.astype(jnp.int32))


def _walk(sr: _Search, row: Row) -> jax.Array:
    """(b) then (c): the walk marks the hits, then the new LRU and the evictables the misses
    take are written (`frame.reorder`). Returns the row's number of hits."""
    n = row.n
    cc = jnp.arange(sr.chunk, dtype=jnp.int32)

    def reorder_walked(carry, walked, num_hits):
        p, pin, slot, col = walked
        return reorder(row, sr.outs, sr.evict_ref, carry, p, pin, slot, col, num_hits,
                       hot=sr.hot, kp=sr.kp)

    if sr.num_chunks == 1:
        # The whole LRU in one chunk: walk and reorder share registers (no hitpos round
        # trip, no barrier between them; the barrier after the walk orders hval and evict).
        walked, num_hits = _find_hits(sr, row, cc, 0, jnp.int32(0))
        reorder_walked((jnp.int32(0), jnp.int32(0)), walked, num_hits)
        return num_hits
    num_hits = jax.lax.fori_loop(0, sr.num_chunks,
                                 lambda c, h: _find_hits(sr, row, cc, c, h)[1], jnp.int32(0))
    barrier(sr.interpret)

    def reorder_chunk(c, carry):
        p, pin, slot = _load_walk(sr, row.s, cc, c)
        col = plgpu.load(sr.hitpos_ref.at[n, jnp.where(pin, p, sr.hp)], mask=pin, other=-1,
                         volatile=sr.volatile)
        return reorder_walked(carry, (p, pin, slot, col), num_hits)

    jax.lax.fori_loop(0, sr.num_chunks, reorder_chunk, (jnp.int32(0), jnp.int32(0)))
    return num_hits
