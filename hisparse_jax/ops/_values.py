"""The value rules of the data-plane ops' index arguments, and how `validate=` checks them.

Shapes and dtypes are checked by `_checks` on every call; the rules here are about values
(which rows an index names), which jax cannot see at trace time. Each op's `validate`:

  None (default): concrete index arrays (a call outside `jax.jit`) are checked on the host
    (numpy over a copy of the arrays: the call waits for them); traced ones (inside a jit)
    by `checkify.debug_check`s of the same rules, which do no device work and raise only
    where the caller's function runs under `jax.experimental.checkify.checkify` (errors
    `checkify.user_checks`); elsewhere they are dropped at compile time. A jitted function
    holding them dispatches through jax's Python path (an effect), not its C++ fast path.
  True: the host check; a ValueError when an index array is traced.
  False: no value check (a caller whose indices are valid by construction: the engine).

`sparse_mla_decode` has no traced check: its kernels mask an entry outside [0, R) as they
mask -1 (`pallas_kernels/sparse_mla_decode/reference.py`), so it is never read.
Errors are ValueErrors naming the argument, the entry and the rule.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from hisparse_jax.ops._checks import is_concrete
from host_tier.sizes import cdiv
from pallas_kernels._rows import flat_rows


def mode(validate: Any, op: str, named: tuple[tuple[str, Any], ...]) -> str | None:
    """"host", "traced" or None (no check) for `validate` and the index arrays `named`
    ((name, array or None) pairs)."""
    if validate is not None and not isinstance(validate, bool):
        raise TypeError(f"validate must be None, True or False, got {validate!r}")
    if validate is False:
        return None
    traced = [name for name, x in named if x is not None and not is_concrete(x)]
    if not traced:
        return "host"
    if validate:
        raise ValueError(f"{op}(validate=True) checks values and needs concrete arrays, but "
                         f"{traced[0]} is traced; call it outside jax.jit, or leave "
                         f"validate=None (checkify-able checks under jit) or pass False")
    return "traced"


def _duplicates(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Along the last axis of int `values` (< 0: none): (sorted values, mask of sorted
    entries equal to the one before, both >= 0)."""
    srt = np.sort(values, axis=-1)
    dup = np.zeros(srt.shape, bool)
    dup[..., 1:] = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    return srt, dup


# --------------------------------------------------------------------------- resolve


def resolve_host(state, topk, state_rows, hot_block_table, source_block_table, block_size,
                 host_rows, resident_block_table=None, query_rows_per_request: int = 1
                 ) -> None:
    """The value rules of `resolve_residency` for the live batch rows (state_rows[n] >= 0),
    on concrete arrays, after `_checks.validate_resolve`:

    * topk: the valid host rows of a row are unique (`docs/semantics.md`: a duplicate would
      fill two slots with one row); with r = query_rows_per_request > 1, distinct positions
      of one request (its r rows together) have distinct host rows;
    * r > 1: the r rows of a request carry the same source, resident and hot table rows;
    * state.lru: the row of each live state row is a permutation of 0 .. H-1;
    * hot_block_table: the first ceil(H / B) block ids of a live row are > 0 (the blocks
      its hot slots live in; 0 is the null block, a negative id null too).
    Raises ValueError naming the argument, the first offending batch row and the rule.
    """
    hot = state.lru.shape[1]
    r = query_rows_per_request
    rows = np.asarray(state_rows)
    positions = np.asarray(topk).astype(np.int64)
    hot_table = np.asarray(hot_block_table)[:, :cdiv(hot, block_size)]
    src = np.asarray(source_block_table).astype(np.int64)
    if r > 1:
        tables = (("source_block_table", src), ("hot_block_table", hot_table))
        if resident_block_table is not None:
            tables += (("resident_block_table", np.asarray(resident_block_table)),)
        _check_same_within_requests(rows, r, tables)
        # Each request's rows through its first row's tables, its positions deduplicated.
        positions = positions.reshape(-1, r * positions.shape[1])
        positions = np.where(_first_seen(positions), positions, -1)
        src, hot_table, rows = src[::r], hot_table[::r], rows[::r]
    # Host row of every column (the flat-row rule of docs/semantics.md), -1 where none.
    page = np.where(positions >= 0, positions // block_size, -1)
    in_table = (page >= 0) & (page < src.shape[1])
    block = np.take_along_axis(src, np.clip(page, 0, src.shape[1] - 1), axis=1)
    host = np.where(in_table & (block > 0), block * block_size + positions % block_size, -1)
    host = np.where(host < host_rows, host, -1)
    if host_rows <= np.iinfo(np.int32).max:
        host = host.astype(np.int32)                 # sorts twice as fast as int64
    live = rows >= 0
    dup_rows = _duplicates(host)[1].any(axis=1)
    lru = np.asarray(state.lru)[np.where(live, rows, 0)]
    # int16 (the state's dtype): numpy's stable sort of 16-bit ints is a radix sort.
    bad_lru = (np.sort(lru, axis=1, kind="stable") != np.arange(hot)).any(axis=1)
    null_hot = (hot_table <= 0).any(axis=1)
    bad = np.flatnonzero(live & (dup_rows | bad_lru | null_hot))
    if bad.size:
        n = int(bad[0])
        _raise_resolve_row(n, r, topk.shape[1], host[n], int(rows[n]), lru[n], hot_table[n],
                           dup_rows[n], bad_lru[n])


def _raise_resolve_row(n, r, k, host, s, lru, hot_table, dup, bad_lru) -> None:
    """The ValueError of live (request) row n, first broken rule first."""
    where = f"batch row {n}" if r == 1 else f"batch rows {n * r}..{n * r + r - 1}"
    if dup:
        srt, mask = _duplicates(host)
        value = int(srt[np.argmax(mask)])
        cols = np.flatnonzero(host == value).tolist()
        if r > 1:
            at = [f"topk[{n * r + c // k}, {c % k}]" for c in cols]
            raise ValueError(f"topk rows {n * r}..{n * r + r - 1} (one request): "
                             f"{', '.join(at)} select distinct positions with the same host "
                             f"row {value}; distinct positions of a request must have "
                             f"distinct host rows")
        raise ValueError(f"topk row {n}: columns {cols} all select host row {value}; the valid "
                         f"host rows of a row must be unique")
    hot = lru.shape[0]
    if bad_lru:
        missing = sorted(set(range(hot)) - set(lru.tolist()))
        raise ValueError(f"state.lru[{s}] (the state row of {where}) must be a permutation of "
                         f"0..{hot - 1} (H={hot}); slot ids missing: {missing[:8]}")
    j = int(np.flatnonzero(hot_table <= 0)[0])
    raise ValueError(f"hot_block_table[{n * r}, {j}] = {int(hot_table[j])} for {where}: the "
                     f"first ceil(H/B)={hot_table.shape[0]} blocks of a live row back its hot "
                     f"slots and must be > 0 (block 0 is the null block)")


def _first_seen(values: np.ndarray) -> np.ndarray:
    """bool mask over the last axis: values[..., i] >= 0 and no values[..., j] == values[...,
    i] for j < i."""
    order = np.argsort(values, axis=-1, kind="stable")
    srt = np.take_along_axis(values, order, axis=-1)
    first = np.ones(srt.shape, bool)
    first[..., 1:] = srt[..., 1:] != srt[..., :-1]
    mask = np.zeros(values.shape, bool)
    np.put_along_axis(mask, order, first, axis=-1)
    return mask & (values >= 0)


def _check_same_within_requests(rows: np.ndarray, r: int, tables) -> None:
    """Each live request's r adjacent rows carry equal rows of every named table."""
    for name, table in tables:
        grouped = table.reshape(-1, r, table.shape[1])
        differs = (grouped != grouped[:, :1]).any(axis=(1, 2)) & (rows[::r] >= 0)
        if differs.any():
            first = int(np.flatnonzero(differs)[0]) * r
            raise ValueError(f"{name} rows {first}..{first + r - 1} differ, but they are the "
                             f"query rows of one request (query_rows_per_request={r}) and "
                             f"must carry the same table row")


def resolve_traced(state, topk, state_rows, hot_block_table, source_block_table, block_size,
                   host_rows, resident_block_table=None, query_rows_per_request: int = 1
                   ) -> None:
    """`resolve_host`'s rules as `checkify.debug_check`s of traced arrays (module
    docstring); the message names the first offending batch row."""
    hot = state.lru.shape[1]
    r = query_rows_per_request
    who = "batch row" if r == 1 else "request"
    num_state_rows = state.lru.shape[0]
    hot_table = hot_block_table[::r, :cdiv(hot, block_size)]
    rows = state_rows[::r]
    live = (rows >= 0) & (rows < num_state_rows)
    if r > 1:
        tables = (("source_block_table", source_block_table),
                  ("hot_block_table", hot_block_table),
                  ("resident_block_table", resident_block_table))
        for name, table in tables:
            if table is not None:
                grouped = table.reshape(rows.shape[0], r, table.shape[1])
                differs = jnp.any(grouped != grouped[:, :1], axis=(1, 2))
                _debug_check(differs & live, f"resolve_residency: {name} rows of request {{}} "
                                             f"differ; the query_rows_per_request={r} rows of "
                                             f"a request must carry the same table row")
    # Host rows through each request's first row's source table (the one the op reads).
    host = flat_rows(jnp.repeat(source_block_table[::r], r, axis=0), topk, block_size)
    host = jnp.where(host < host_rows, host, -1)
    if r == 1:
        srt = jnp.sort(host, axis=1)
        dup = jnp.any((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0), axis=1)
        _debug_check(dup & live, "resolve_residency: topk row {} selects one host row in two "
                                 "columns; the valid host rows of a row must be unique")
    else:
        host, pos = host.reshape(rows.shape[0], -1), topk.reshape(rows.shape[0], -1)
        order = jnp.lexsort((pos, host), axis=-1)
        hs = jnp.take_along_axis(host, order, axis=1)
        ps = jnp.take_along_axis(pos, order, axis=1)
        dup = jnp.any((hs[:, 1:] == hs[:, :-1]) & (hs[:, 1:] >= 0) & (ps[:, 1:] != ps[:, :-1]),
                      axis=1)
        _debug_check(dup & live, f"resolve_residency: request {{}} (topk rows of "
                                 f"query_rows_per_request={r}) selects distinct positions "
                                 f"with the same host row; they must have distinct host rows")
    lru = state.lru[jnp.clip(rows, 0, num_state_rows - 1)].astype(jnp.int32)
    bad_lru = jnp.any(jnp.sort(lru, axis=1) != jnp.arange(hot, dtype=jnp.int32), axis=1)
    _debug_check(bad_lru & live, f"resolve_residency: state.lru of the state row of {who} "
                                 f"{{}} must be a permutation of 0..{hot - 1} (H={hot})")
    null_hot = jnp.any(hot_table <= 0, axis=1)
    _debug_check(null_hot & live, f"resolve_residency: hot_block_table of {who} {{}} holds "
                                  f"a block id <= 0 among its first ceil(H/B)="
                                  f"{hot_table.shape[1]}; they back its hot slots and must be "
                                  f"> 0 (block 0 is the null block)")


def _debug_check(bad, message: str) -> None:
    """A debug check that no entry of the bool vector `bad` is set; `message` formats the
    index of the first set entry."""
    checkify.debug_check(~jnp.any(bad), message, jnp.argmax(bad))


# --------------------------------------------------------------------------- copies


def plan_host(swap_src, swap_dst, swap_counts, num_cache_rows: int) -> None:
    """The value rule of a swap plan (`gather_compact`): the live entries (m <
    swap_counts[n], swap_src >= 0, 0 <= swap_dst < num_cache_rows) have distinct
    destinations (two copies into one row would race). ValueError naming two entries."""
    src, dst = np.asarray(swap_src), np.asarray(swap_dst)
    counts = np.asarray(swap_counts)
    live = ((np.arange(src.shape[1])[None, :] < counts[:, None]) & (src >= 0) & (dst >= 0)
            & (dst < num_cache_rows))
    srt, dup = _duplicates(dst[live])                   # only the live entries: few
    if dup.any():
        row = int(srt[np.argmax(dup)])
        n, m = np.divmod(np.flatnonzero((dst == row) & live)[:2], src.shape[1])
        raise ValueError(f"swap_dst[{n[0]}, {m[0]}] and swap_dst[{n[1]}, {m[1]}] both write "
                         f"device row {row}; the live entries of a swap plan (m < "
                         f"swap_counts[n], swap_src >= 0, swap_dst in [0, {num_cache_rows})) "
                         f"must have distinct destinations")


def plan_traced(swap_src, swap_dst, swap_counts, num_cache_rows: int) -> None:
    """`plan_host` as a debug check (module docstring)."""
    live = ((jnp.arange(swap_src.shape[1])[None, :] < swap_counts[:, None]) & (swap_src >= 0)
            & (swap_dst >= 0) & (swap_dst < num_cache_rows))
    srt = jnp.sort(jnp.where(live, swap_dst, -1).reshape(-1))
    dup = (srt[1:] == srt[:-1]) & (srt[1:] >= 0)
    checkify.debug_check(~jnp.any(dup), "swap_dst: device row {} is the destination of two "
                         "live entries of the swap plan; the destinations of its live entries "
                         "must be distinct", srt[1:][jnp.argmax(dup)])


def mirror_host(device_rows, host_rows, num_cache_rows: int, num_pool_rows: int) -> None:
    """The value rule of `mirror_rows`: the kept entries (both ids in range) write distinct
    host rows. ValueError naming two entries."""
    dev, host = np.asarray(device_rows), np.asarray(host_rows)
    keep = (dev >= 0) & (dev < num_cache_rows) & (host >= 0) & (host < num_pool_rows)
    srt, dup = _duplicates(host[keep])
    if dup.any():
        row = int(srt[np.argmax(dup)])
        i, j = np.flatnonzero((host == row) & keep)[:2]
        raise ValueError(f"host_rows[{i}] and host_rows[{j}] both write host row {row}; the "
                         f"kept entries (device_rows in [0, {num_cache_rows}), host_rows in "
                         f"[0, {num_pool_rows})) must have distinct destinations")


def mirror_traced(device_rows, host_rows, num_cache_rows: int, num_pool_rows: int) -> None:
    """`mirror_host` as a debug check (module docstring)."""
    keep = ((device_rows >= 0) & (device_rows < num_cache_rows) & (host_rows >= 0)
            & (host_rows < num_pool_rows))
    srt = jnp.sort(jnp.where(keep, host_rows, -1))
    dup = (srt[1:] == srt[:-1]) & (srt[1:] >= 0)
    checkify.debug_check(~jnp.any(dup), "host_rows: host row {} is the destination of two "
                         "kept entries; the kept entries must have distinct destinations",
                         srt[1:][jnp.argmax(dup)])


# --------------------------------------------------------------------------- attention


def attention_host(attention_rows, num_rows: int) -> None:
    """The value rule of `sparse_mla_decode`: every entry is < R = num_rows (a row of the
    cache) or negative (masked). ValueError naming the first entry past the cache."""
    rows = np.asarray(attention_rows)
    past = rows >= num_rows
    if past.any():
        at = tuple(int(i) for i in np.unravel_index(np.argmax(past), rows.shape))
        raise ValueError(f"attention_rows[{', '.join(map(str, at))}] = {int(rows[at])} is not "
                         f"a row of kv_cache: entries must be < R = num_blocks * B = "
                         f"{num_rows}, or -1 (masked); under jax.jit such an entry is "
                         f"masked as -1 is")
