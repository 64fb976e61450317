"""The position map rule of the resolve kernel (`triton.resolve_residency_mapped`): steps 3-5
of `docs/semantics.md` for a live batch row with pending columns, exactly as
`reference.resolve_residency_mapped` does them, LRU order included.

With the hot state's position map (`pos_slot[s, t]`: the slot position t was last copied
to), a row needs no table of its pending host rows and no probe per slot: each pending
column reads its candidate slot from the map and checks that the slot still holds its host
row (one dependent load each); candidates mark their slot in a slot-indexed scratch row;
the LRU walk reads the mark of each slot it passes (a walked candidate is a hit and confirms
its column); the rest (new LRU, evictables, columns: `frame.reorder`, `frame.columns`) is
the search rule's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.resolve_residency.frame import (
    Outs,
    barrier,
    columns,
    device_row,
    frame,
    reorder,
)


def mapped_kernel(topk_ref, state_ref, host_rows_ref, hot_ref, src_ref, res_ref, lru_old_ref,
                  *refs, k, kp, hot, hp, chunk, block_size, num_state_rows, num_aliased,
                  interpret, volatile):
    """The kernel of one batch row (refs as `frame.launch` passes them)."""
    refs = refs[num_aliased:]          # skip the aliased inputs: use the outputs
    outs = Outs(*refs[:8])
    map_ref, mark_ref, conf_ref, evict_ref = refs[8:]
    rule = functools.partial(
        mapped_rule, outs=outs, hot_ref=hot_ref, lru_old_ref=lru_old_ref, map_ref=map_ref,
        mark_ref=mark_ref, conf_ref=conf_ref, evict_ref=evict_ref, k=k, kp=kp, hot=hot, hp=hp,
        chunk=chunk, block_size=block_size, interpret=interpret, volatile=volatile)
    frame(rule, topk_ref, state_ref, host_rows_ref, src_ref, res_ref, outs, k=k, kp=kp,
          block_size=block_size, num_state_rows=num_state_rows)


def mapped_rule(row, *, outs, hot_ref, lru_old_ref, map_ref, mark_ref, conf_ref, evict_ref,
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
    barrier(interpret)
    plgpu.store(mark_ref.at[n, jnp.where(candidate, j, hp)], kk, mask=candidate)
    barrier(interpret)

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

    def reorder_walked(carry, walked, num_hits):
        p, pin, slot, _, col = walked
        return reorder(row, outs, evict_ref, carry, p, pin, slot, col, num_hits, hot=hot,
                       kp=kp)

    if num_chunks == 1:
        walked = walk(0)
        num_hits = confirm(walked)
        reorder_walked((i32(0), i32(0)), walked, num_hits)
    else:
        # The marks do not change during the walk: the reorder pass reads them again.
        num_hits = jax.lax.fori_loop(0, num_chunks, lambda c, h: h + confirm(walk(c)), i32(0))
        jax.lax.fori_loop(0, num_chunks,
                          lambda c, carry: reorder_walked(carry, walk(c), num_hits),
                          (i32(0), i32(0)))
    barrier(interpret)
    num_miss = row.num_pending - num_hits

    # Columns: confirmed hits read their slot; each miss's position now names its slot.
    hit_slot = plgpu.load(conf_ref.at[n, jnp.where(pending, kk, kp)], mask=pending, other=-1,
                          volatile=volatile)
    is_hit = pending & (hit_slot >= 0)
    hit_dev = device_row(hot_ref, n, hit_slot, is_hit, block_size)
    miss_ok, miss_slot = columns(row, outs, hot_ref, evict_ref, kk, kin, is_hit, hit_dev,
                                  num_hits, num_miss, k=k, kp=kp, hot=hot,
                                  block_size=block_size, volatile=volatile)
    put = miss_ok & (t < map_width)
    plgpu.store(map_ref.at[s, jnp.where(put, t, map_width)], miss_slot.astype(map_ref.dtype),
                mask=put)
