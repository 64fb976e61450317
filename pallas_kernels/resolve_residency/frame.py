"""The frame both rules of the resolve kernel share (`triton.py`): one program per batch row.

`frame` handles what does not depend on the rule (steps 1-2 of `docs/semantics.md`: a
padding row, the row's columns, a row with nothing pending) and hands a row with pending
columns to the rule (`search.search_rule` or `mapped.mapped_rule`). Both rules end the same
way: `reorder` writes the new LRU order and lists the evictables the misses take (step 5),
`columns` writes the columns and the swap plan (step 4). `launch` is the one `pallas_call`
of either rule's kernel.

Every read of a row's global scratch follows a `barrier` after the writes it must see.
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


def barrier(interpret: bool) -> None:
    """Orders the global-memory scratch traffic between the phases of one program (its
    threads run in lock-step phases); the interpreter runs a program as whole-array ops."""
    if not interpret:
        plgpu.debug_barrier()


def table_rows(positions, table_ref, n, block_size, width, mask):
    """`table[n, t // B] * B + t % B` for positions t [L] (-1 where null or masked)."""
    blk = jnp.where(positions >= 0, positions // block_size, -1)
    in_table = mask & (blk >= 0) & (blk < width)
    block_id = plgpu.load(table_ref.at[n, jnp.where(in_table, blk, width)], mask=in_table,
                          other=0)
    ok = in_table & (block_id > 0)
    return jnp.where(ok, block_id * block_size + jnp.where(ok, positions % block_size, 0), -1)


class Outs(NamedTuple):
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
class Row:
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


def frame(rule, topk_ref, state_ref, host_rows_ref, src_ref, res_ref, outs, *, k, kp,
          block_size, num_state_rows):
    """Steps 1-2 of `docs/semantics.md` for this program's batch row: a padding row, a row's
    columns, a row with nothing pending; `rule(Row)` resolves a row with pending columns."""
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
        g = table_rows(t, src_ref, n, block_size, src_ref.shape[1], kin)
        g = jnp.where(g < host_rows_ref[0], g, -1)
        if res_ref is None:
            res = minus1
        else:
            res = table_rows(t, res_ref, n, block_size, res_ref.shape[1], kin)
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
            rule(Row(n, s, t, g, pending, num_pending, out0))


def device_row(hot_ref, n, slot, mask, block_size):
    """The device row of hot slot `slot` of batch row n (masked lanes: 0 * B + 0)."""
    blk = plgpu.load(hot_ref.at[n, jnp.where(mask, slot // block_size, hot_ref.shape[1])],
                     mask=mask, other=0)
    return blk * block_size + jnp.where(mask, slot % block_size, 0)


def reorder(row, outs, evict_ref, carry, p, pin, slot, col, num_hits, *, hot, kp):
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


def columns(row, outs, hot_ref, evict_ref, kk, kin, is_hit, hit_dev, num_hits, num_miss, *,
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
    miss_dev = jnp.where(miss_ok, device_row(hot_ref, n, miss_slot, miss_ok, block_size), -1)
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


def launch(kernel, name, state, scratch, topk, state_rows, hot_block_table,
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


def no_rows(state, n, k):
    """The outputs of a call with no batch rows or no columns (state unchanged)."""
    zeros = jnp.zeros((n,), jnp.int32)
    minus = jnp.full((n, k), -1, jnp.int32)
    return (minus, zeros, minus, minus, zeros, zeros, *state)
