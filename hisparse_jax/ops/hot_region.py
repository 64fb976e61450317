"""The hot-region ops: `resolve_residency` (+ its `Resolution`: which device row each selected
position reads, and the LRU update of the hot region) and `invalidate_written_rows` (drops hot
copies of rows a step rewrites).

Both are pure (hot state in, hot state out) and jit once per shape; `backend=` picks the
implementation through `hisparse_jax.ops._registry` (None: the Triton kernel on a GPU, the
jnp reference elsewhere). Semantics: `docs/semantics.md`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hisparse_jax.ops import _checks, _registry, _values
from hisparse_jax.state import HotState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Resolution:
    """Output of `resolve_residency` for a batch of N query rows with K selected positions,
    r = query_rows_per_request adjacent rows per request, G = N / r requests (r = 1: G = N).

    Attributes:
      attention_rows: int32[N, K], flat device row to attend per column, -1 = masked.
      valid_counts: int32[N], columns with a resident or host row, per query row.
      swap_src: int32[G, r*K], host row of miss m of the request (compacted), -1 past
        swap_counts. The plan is per request: each missing host row appears once.
      swap_dst: int32[G, r*K], device row that miss m is copied to, -1 past swap_counts
        (and -1 for a miss that met an out-of-range LRU slot id).
      swap_counts: int32[G], misses per request.
      num_hits: int32[G], hot-region hits per request (of the distinct host rows its rows
        select: hits / (hits + misses) is the request's hit rate).
    """

    attention_rows: jax.Array
    valid_counts: jax.Array
    swap_src: jax.Array
    swap_dst: jax.Array
    swap_counts: jax.Array
    num_hits: jax.Array


def _rule(state: HotState) -> tuple[str, tuple[jax.Array, ...]]:
    """The registry op of the state's resolve rule (the search rule, or the position map
    rule when the state keeps a map) and the state arrays it takes and returns, in order."""
    if state.pos_slot is None:
        return "resolve_residency", (state.slot_rows, state.lru)
    return "resolve_residency_mapped", (state.slot_rows, state.lru, state.pos_slot)


@functools.partial(jax.jit,
                   static_argnames=("block_size", "backend", "query_rows_per_request"))
def _resolve(state, topk, state_rows, hot_block_table, source_block_table,
             resident_block_table, *, block_size, host_rows, backend, query_rows_per_request):
    op, arrays = _rule(state)
    outs = _registry.implementation(op, backend)(
        *arrays, topk, state_rows, hot_block_table, source_block_table, resident_block_table,
        block_size=block_size, host_rows=host_rows,
        query_rows_per_request=query_rows_per_request)
    return Resolution(*outs[:6]), HotState(*outs[6:])


def resolve_residency(
    state: HotState,
    topk: jax.Array,
    *,
    state_rows: jax.Array,
    hot_block_table: jax.Array,
    source_block_table: jax.Array,
    resident_block_table: jax.Array | None = None,
    block_size: int,
    host_rows: int,
    backend: str | None = None,
    validate: bool | None = None,
    query_rows_per_request: int = 1,
) -> tuple[Resolution, HotState]:
    """Maps each selected position to a device row, updating the hot-region LRU.

    Args:
      state: the hot state (slot_rows int32[S, H], lru int16[S, H], and the position map
        pos_slot int16[S, P] or None). With the map, a pending position is looked up in it
        (`resolve_residency_mapped` of the kernels: one lookup per selected row, no search
        of the slots) and the map is updated; the results equal the search rule's on every
        state these ops reach (`docs/semantics.md`). P >= source_block_table's width * B.
      topk: int32[N, K] selected logical positions per batch row (-1 = none), 1 <= K and
        query_rows_per_request * K <= H; valid host rows must be unique within a row.
      state_rows: int32[N], hot-state row of each batch row; -1 marks a padding row; the live
        ones < S and distinct across requests.
      hot_block_table: int32[N, >= ceil(H/B)], device blocks of each row's hot region.
      source_block_table: int32[N, Ms], host blocks of each row's request (0 = null).
      resident_block_table: int32[N, Mr] or None, still-resident device blocks (0 = none).
      block_size: B, static. host_rows: rows of the host pool (a Python int, passed as a
        traced scalar so a pool resize does not recompile); g >= host_rows is -1.
      backend: "reference", "triton" or None (see `hisparse_jax.ops._registry`).
      validate: how the value rules of the live rows (state_rows >= 0) are checked: valid
        host rows unique within each row of topk, each state.lru row a permutation of
        0..H-1, the first ceil(H/B) hot_block_table ids > 0 (and with
        query_rows_per_request > 1: a request's rows carry equal table rows, its distinct
        positions distinct host rows). Broken, they give garbage (a negative hot block id
        gives negative attention rows, a repeated LRU slot one device row to several
        misses, a repeated host row one host row in several slots). None (default):
        concrete arrays (outside jax.jit) are checked on the host before any work (a
        ValueError naming the argument, the row and the rule; the call waits for the
        arrays to reach the host); under jit the rules are `checkify.debug_check`s, raised
        where the caller runs under `jax.experimental.checkify.checkify` and free
        otherwise (no device work; the jitted function dispatches through jax's Python
        path). True: the host check, a ValueError for traced arrays. False: no check (the
        engine: its indices are valid by construction). `docs/semantics.md`, value checks.
      query_rows_per_request: r (static int >= 1), query rows per request (1 + speculative
        tokens: `HiSparseConfig.query_rows_per_request`). N must be a multiple of r; the r
        rows of a request are adjacent and carry the same state row and table rows (the op
        reads the first row's). The request is resolved as ONE pass over the union of its
        rows' positions (first-appearance order), so its LRU moves once per step and its
        swap plan lists each missing host row once; every row gets its own attention rows.
        r = 1 is the single-row op (and, over the same rows with one call per row index,
        the per-row ablation).
    Returns:
      (Resolution, new HotState); exact semantics in `docs/semantics.md`.
    """
    _checks.validate_resolve(state, topk, state_rows, hot_block_table, source_block_table,
                             resident_block_table, block_size, host_rows,
                             query_rows_per_request)
    op, arrays = _rule(state)
    backend = _registry.select(
        op, backend, *arrays, topk, state_rows, hot_block_table, source_block_table,
        resident_block_table, block_size=block_size, host_rows=host_rows,
        query_rows_per_request=query_rows_per_request)
    named = (("state.slot_rows", state.slot_rows), ("state.lru", state.lru), ("topk", topk),
             ("state_rows", state_rows), ("hot_block_table", hot_block_table),
             ("source_block_table", source_block_table),
             ("resident_block_table", resident_block_table))
    check = _values.mode(validate, "resolve_residency", named)
    if check is not None:
        (_values.resolve_host if check == "host" else _values.resolve_traced)(
            state, topk, state_rows, hot_block_table, source_block_table, block_size,
            host_rows, resident_block_table, query_rows_per_request)
    return _resolve(state, topk, state_rows, hot_block_table, source_block_table,
                    resident_block_table, block_size=int(block_size),
                    host_rows=jnp.int32(host_rows), backend=backend,
                    query_rows_per_request=int(query_rows_per_request))


@functools.partial(jax.jit, static_argnames=("backend",))
def _invalidate(state, state_rows_per_token, written_rows, *, backend):
    slot_rows = _registry.implementation("invalidate_written_rows", backend)(
        state.slot_rows, state_rows_per_token, written_rows)
    # The position map's entries of emptied slots go stale (never a hit): kept as is.
    return dataclasses.replace(state, slot_rows=slot_rows)


def invalidate_written_rows(
    state: HotState,
    state_rows_per_token: jax.Array,
    written_rows: jax.Array,
    *,
    backend: str | None = None,
) -> HotState:
    """Drops hot copies of host rows that were just rewritten.

    state_rows_per_token, written_rows: int32[T]. For each token with written host row
    w >= 0 of state row s (0 <= s < S), every slot of slot_rows[s] equal to w becomes -1;
    the LRU order is unchanged.
    """
    _checks.validate_invalidate(state, state_rows_per_token, written_rows)
    backend = _registry.select("invalidate_written_rows", backend, state.slot_rows,
                               state_rows_per_token, written_rows)
    return _invalidate(state, state_rows_per_token, written_rows, backend=backend)
