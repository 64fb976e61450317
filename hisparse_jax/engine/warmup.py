"""Warm-up: compiles every shape bucket a run can reach, so that no served step compiles
(`warm`); `CompileWatch` (`metrics.py`) tells the engine which later calls compiled anyway.

Reached by a run, and compiled by `warm`, with inputs that change no state a request can
see (call it while no request is admitted):

  * each decode variant (`Runner.jitted`; "decode_fast" only when the mode can take the fast
    path, `reachable_variants`): every batch row padding (state row -1 writes and selects
    nothing);
  * the prefill at every padded length `prefill_length(n)`, n = 1 .. max_model_len - 1 (a
    prompt is shorter than max_model_len; a preempted request prefills its prompt again):
    writes to no row (-1) and per-seat row S (dropped); with `prefill.chunk_size` C, the
    chunk prefill at every `prefill_length(n)`, n = 1 .. min(C, max_model_len - 1), with a
    block-table row of null blocks (writes nothing);
  * the top-k source's `admit` (seat 0, a free seat: the next admission rewrites it);
  * the block-table updates (`host_tier.DeviceBlockTables.apply`) of every row count bucket
    up to S rows per table: the current rows sent again;
  * the hot-state updates (`hisparse_jax.state.warm_hot_updates`) for invalidations of up to
    max_pages blocks;
  * the transfer worker's spill copies (`mirror_group_fn`, else `mirror_fn`) of every
    row-list bucket up to `max_spill_pages` pages per plan (the coordinator's spill budget),
    every row -1 (skipped), into every layer's pool. Restores are planned only with prefix
    caching (`EngineConfig.prefill.prefix_caching`); with it, the restore copies
    (`restore_fn`) of every row-list bucket up to every device block's rows, every row -1,
    the chunk prefill at every length a hit's rest can take (up to max_model_len - 1 without
    prefill.chunk_size) and the page copies of the per-seat arrays (read and written back
    unchanged at seat 0) are compiled too; with prefill.prefix_hit_pages "stage", the staged chunk
    prefill ("prefill_chunk_staged") at the chunk prefill's lengths, with null host pages
    (it stages nothing).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from hisparse_jax.cache import AllResident, Residency
from hisparse_jax.state import invalidation_width, warm_hot_updates
from host_tier.plan import TableRows, TableUpdate
from host_tier.sizes import pow2_bucket
from host_tier.worker.device_tables import MIN_ROWS_BUCKET as _TABLE_BUCKET
from host_tier.worker.transfer import MIN_ROWS_BUCKET as _SPILL_BUCKET

PREFILL_KINDS = ("prefill", "prefill_chunk", "prefill_chunk_staged")


def _pow2_sizes(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, ..., hi (powers of two, lo <= hi)."""
    sizes = [lo]
    while sizes[-1] < hi:
        sizes.append(2 * sizes[-1])
    return sizes


def reachable_variants(residency: Residency) -> list[tuple[str, Residency]]:
    """The decode variants a mode of `residency` runs: (name, residency) pairs."""
    out = []
    if not residency.reads_host or residency.resident_fast_path:
        out.append(("decode_fast", AllResident()))
    if residency.reads_host:
        out.append(("decode_hot", residency))
    return out


def spill_budget(manager: Any) -> int:
    """Pages a plan can spill at most: the host tier's spill budget
    (`SpillPlanner.max_spill_pages`), or 1 for a manager without a host tier (no spills)."""
    planner = getattr(manager, "spill_planner", None)
    return 1 if planner is None else planner.max_spill_pages


def warm(runner: Any, *, max_spill_pages: int, decode: bool = True) -> list[Hashable]:
    """Compiles every bucket of `runner` (a `Runner`) a run can reach (module docstring).
    Returns the step variants it compiled (for the step clock) and sets `runner.warmed`,
    every bucket by kind ("decode", "prefill", "prefill_chunk", "prefill_chunk_staged",
    "table_rows", "invalidation_widths", "spill_rows", "restore_rows"). decode=False
    leaves out the runner's decode variants (the mesh engine runs its own)."""
    warmed: dict[str, list[Any]] = collections.defaultdict(list)
    for name, residency in reachable_variants(runner.residency) if decode else ():
        jax.block_until_ready(runner.run_decode(residency, *runner.idle_inputs()))
        warmed["decode"].append(name)
    kinds = [kind for kind in PREFILL_KINDS if kind in runner.jitted]
    for kind in kinds:
        warmed[kind] = _warm_prefills(runner, kind)
    if runner.config.prefill.prefix_caching:  # a page's per-seat values, out and in
        keys = runner.read_page_keys(0, [0])
        runner.write_page_keys(0, [(0, keys[0])])  # seat 0 is free: its rows unchanged
    if runner.topk_source is not None:
        runner.topk_state = runner.topk_source.admit(runner.topk_state, 0, 0, 1)
    warmed["table_rows"] = _warm_tables(runner.tables, runner.cfg.max_num_reqs)
    if runner.residency.reads_host:
        cfg, state = runner.cfg, runner.state
        warm_hot_updates(state.cache.kv.hot, block_size=cfg.block_size,
                         max_blocks=cfg.max_pages)
        # A deferred hot update that a reader applies itself (the `cache` property).
        state.hot_deferred = state.hot_rows()
        jax.block_until_ready(state.cache.kv.hot)
        warmed["invalidation_widths"] = _pow2_sizes(invalidation_width(1),
                                                    invalidation_width(cfg.max_pages))
        warmed["spill_rows"] = _warm_spills(runner, max_spill_pages)
        if runner.config.prefill.prefix_caching:
            warmed["restore_rows"] = _warm_restores(runner)
    jax.block_until_ready(runner.state.arrays())
    runner.warmed = dict(warmed)
    return warmed["decode"] + [(kind, T) for kind in kinds for T in warmed[kind]]


def _warm_prefills(runner: Any, kind: str) -> list[int]:
    """The prefill variant `kind` at every padded length it can take; returns them."""
    cfg, S = runner.cfg, runner.cfg.max_num_reqs
    chunk = runner.config.prefill.chunk_size
    longest = (cfg.max_model_len - 1 if kind == "prefill" or chunk is None
               else min(chunk, cfg.max_model_len - 1))
    lengths = sorted({runner.prefill_length(n) for n in range(1, longest + 1)})
    for T in lengths:
        null_pages = np.zeros(cfg.max_pages, np.int32)
        if kind == "prefill":
            token, _ = runner.run_prefill(np.zeros(T, np.int32), 1, S,
                                          np.full(T, -1, np.int32), 0.0, 0, 0, 0)
        else:  # staged: null host pages too (stages nothing)
            token, _ = runner.run_prefill_chunk(
                np.zeros(T, np.int32), 0, 1, S, null_pages, 0.0, 0, 0,
                host_pages=null_pages if kind == "prefill_chunk_staged" else None)
        jax.block_until_ready(token)
    return lengths


def _warm_tables(tables: Any, max_seats: int) -> list[int]:
    """The block-table updates of every row-count bucket (the current rows sent again)."""
    current = tables.as_numpy()
    sizes = _pow2_sizes(_TABLE_BUCKET, pow2_bucket(max_seats, _TABLE_BUCKET))
    for size in sizes:
        rows = np.arange(min(size, max_seats), dtype=np.int32)
        tables.apply(TableUpdate(**{g: TableRows(rows, current[g][rows])
                                    for g in ("src", "res", "hot")}))
    return sizes


def _warm_spills(runner: Any, max_spill_pages: int) -> list[int]:
    """The spill copies of every row-list bucket (`host_tier/worker/transfer.py`: row
    lists padded with -1 to a power of two >= its MIN_ROWS_BUCKET); returns the sizes."""
    pool, transfers, caches = runner.host_pool, runner.transfers, runner.cache.kv.caches
    group = getattr(transfers, "mirror_group_fn", None)
    top = pow2_bucket(max_spill_pages * runner.cfg.block_size, _SPILL_BUCKET)
    for size in _pow2_sizes(_SPILL_BUCKET, top):
        rows = jax.device_put(np.full(size, -1, np.int32), transfers.index_sharding)
        if group is not None:
            for i, new in enumerate(group(caches, pool.arrays, rows, rows)):
                pool.replace_array(i, new)
            continue
        for i, kv in enumerate(caches):
            pool.replace_layer(i, transfers.mirror_fn(kv, pool.layer(i), rows, rows))
    jax.block_until_ready(pool.arrays)
    return _pow2_sizes(_SPILL_BUCKET, top)


def _warm_restores(runner: Any) -> list[int]:
    """The restore copies (`restore_fn`) of every row-list bucket a plan can carry (prefix
    hits: at most every device block's rows), every row -1 (skipped), into every layer's
    cache; returns the sizes."""
    pool, transfers, state, cfg = runner.host_pool, runner.transfers, runner.state, runner.cfg
    most = min(cfg.max_num_reqs * cfg.max_pages, cfg.num_gpu_blocks) * cfg.block_size
    sizes = _pow2_sizes(_SPILL_BUCKET, pow2_bucket(most, _SPILL_BUCKET))
    for size in sizes:
        rows = jax.device_put(np.full(size, -1, np.int32), transfers.index_sharding)
        caches = state.cache.kv.caches
        state.set_caches([transfers.restore_fn(pool.layer(i), c, rows, rows)
                          for i, c in enumerate(caches)], [c.sharding for c in caches])
    jax.block_until_ready(state.cache.kv.caches)
    return sizes
