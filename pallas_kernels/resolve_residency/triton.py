"""resolve_residency as ONE Pallas kernel launch (Triton lowering), one program per batch row.

Contract of `reference.resolve_residency` (the search rule) and of
`reference.resolve_residency_mapped` (the position map rule), exactly, LRU order included
(`docs/semantics.md`). Why Triton: the kernels are built of vector-index gathers and
scatters (block-table lookups, a hash table, compaction by rank), which Mosaic GPU lacks
(`pallas_kernels/_triton.py`).

One program per batch row (`frame.frame`: padding rows, the row's columns) runs phases
separated by barriers. The search rule (`search.py`):
  (a) an open-addressing hash table of the row's pending host rows, built in rounds without
      atomics (claim, barrier, read back);
  (b) the LRU walk oldest -> newest in chunks: each slot probes the table, a hit marks its
      key's entry;
  (c) the new LRU order (unused evictables, filled slots, hits) and the evictables the
      misses take (`frame.reorder`);
  (d) the columns: hits read their slot, misses take evictables in ascending column order
      (`frame.columns`).
The position map rule (`mapped.py`) replaces (a) and (b): each pending column reads its
candidate slot from the map and marks it; the walk reads each slot's mark.
Scratch is per-row global memory (discarded outputs of the call). Every read of that
scratch follows a barrier after the writes it must see; `ResolveTuning.cached_loads` lets
those reads hit L1 instead of going to L2 (volatile loads).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import _triton
from pallas_kernels.resolve_residency.frame import launch, no_rows
from pallas_kernels.resolve_residency.mapped import mapped_kernel
from pallas_kernels.resolve_residency.search import search_kernel
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
      model: one CTA writes and reads a row's scratch, on one SM). On by default: the
      barriers already make the cached reads correct, and an L1 hit saves the round trip
      to L2 that every volatile load pays (the comparison: `bench/NOTES-data_plane.md`).
      False gives volatile loads.
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
        return no_rows((slot_rows, lru), n, k)
    kp = _triton.pow2_ceil(k)
    hp = _triton.pow2_ceil(hot)
    table = _triton.pow2_ceil(max(tuning.table_factor * kp, 2))
    scratch = [jax.ShapeDtypeStruct((n, table), jnp.int32),     # hash keys
               jax.ShapeDtypeStruct((n, table), jnp.int32),     # hash columns
               jax.ShapeDtypeStruct((n, hp), jnp.int32),        # hit mark per LRU position
               jax.ShapeDtypeStruct((n, kp), jnp.int32)]        # evictables taken
    kernel = functools.partial(
        search_kernel, k=k, kp=kp, hot=hot, hp=hp, chunk=min(tuning.chunk, hp),
        log2_table=table.bit_length() - 1, block_size=block_size,
        num_state_rows=num_state_rows, interpret=interpret, volatile=not tuning.cached_loads)
    return launch(kernel, "hisparse_resolve_residency", (slot_rows, lru), scratch, topk,
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
        return no_rows((slot_rows, lru, pos_slot), n, k)
    kp = _triton.pow2_ceil(k)
    hp = _triton.pow2_ceil(hot)
    scratch = [jax.ShapeDtypeStruct((n, hp), jnp.int32),        # candidate column per slot
               jax.ShapeDtypeStruct((n, kp), jnp.int32),        # confirmed slot per column
               jax.ShapeDtypeStruct((n, kp), jnp.int32)]        # evictables taken
    kernel = functools.partial(
        mapped_kernel, k=k, kp=kp, hot=hot, hp=hp, chunk=min(tuning.chunk, hp),
        block_size=block_size, num_state_rows=num_state_rows, interpret=interpret,
        volatile=not tuning.cached_loads)
    return launch(kernel, "hisparse_resolve_residency_mapped", (slot_rows, lru, pos_slot),
                  scratch, topk, state_rows, hot_block_table, source_block_table,
                  resident_block_table, host_rows, lru, tuning=tuning, poison=poison,
                  interpret=interpret)
