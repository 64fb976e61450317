"""Argument validation shared by the ops: shapes, dtypes, memory kinds and static ints.

Every op validates all its arguments before any work runs and raises a ValueError (or a
TypeError for a wrong type or dtype) whose message names the argument and the rule.
Concrete index arrays are checked for values here where the rule is cheap and about state
rows; traced ones only for shape and dtype. The value rules of the index arrays (which rows
they name) are `_values`', run as each op's `validate=` says.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.state import HotState
from host_tier.sizes import cdiv, is_int
from pallas_kernels import _compat
from pallas_kernels import kv_format as kvf

Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_array(name: str, x: Any, *, ndim: int | tuple[int, ...], dtype: Any = None) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.ndim not in ndims:
        want = " or ".join(str(d) for d in ndims)
        raise ValueError(f"{name} must have rank {want}, got shape {tuple(x.shape)}")
    if dtype is not None and jnp.dtype(x.dtype) != jnp.dtype(dtype):
        raise TypeError(f"{name} must be {jnp.dtype(dtype).name}, got {jnp.dtype(x.dtype).name}")


def check_static_int(name: str, value: Any, *, minimum: int) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be a static Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_hot_state(state: Any) -> None:
    if not isinstance(state, HotState):
        raise TypeError(f"state must be a HotState, got {type(state).__name__}")


def check_host_pool(name: str, pool: Any) -> None:
    if is_concrete(pool):
        kind = pool.sharding.memory_kind
        if kind != "pinned_host":
            raise ValueError(
                f"{name} must live in pinned_host memory (jax.device_put with a sharding whose "
                f"memory_kind='pinned_host'; pageable host memory is ~7x slower to copy), got "
                f"memory_kind={kind!r}")
    elif not _compat.in_host_memory(pool):
        raise ValueError(f"{name} must live in pinned_host memory, got a traced array in "
                         "device memory")


def check_same_length(name_a: str, a: Any, name_b: str, b: Any) -> None:
    check_array(name_a, a, ndim=1, dtype=jnp.int32)
    check_array(name_b, b, ndim=1, dtype=jnp.int32)
    if a.shape != b.shape:
        raise ValueError(f"{name_a} {a.shape} and {name_b} {b.shape} must have the same length")


# --------------------------------------------------------------------------- residency


def validate_resolve(state, topk, state_rows, hot_block_table, source_block_table,
                     resident_block_table, block_size, host_rows,
                     query_rows_per_request: int = 1) -> None:
    """The shape, dtype and static rules of `resolve_residency` (and, for concrete
    state_rows, their values); query_rows_per_request: r adjacent rows per request."""
    check_hot_state(state)
    check_array("state.slot_rows", state.slot_rows, ndim=2, dtype=jnp.int32)
    check_array("state.lru", state.lru, ndim=2, dtype=jnp.int16)
    if state.lru.shape != state.slot_rows.shape:
        raise ValueError(f"state.lru shape {state.lru.shape} must equal state.slot_rows shape "
                         f"{state.slot_rows.shape}")
    num_state_rows, hot = state.slot_rows.shape
    check_array("topk", topk, ndim=2, dtype=jnp.int32)
    n, k = topk.shape
    if k < 1:
        raise ValueError(f"topk must select at least one position per row, got shape "
                         f"{tuple(topk.shape)}; the rule is 1 <= top_k <= hot_size (H={hot})")
    if k > hot:
        raise ValueError(f"topk has {k} columns but the hot region holds only H={hot} slots; "
                         "the rule is top_k <= hot_size")
    r = check_static_int("query_rows_per_request", query_rows_per_request, minimum=1)
    if n % r:
        raise ValueError(f"topk has N={n} rows, not a multiple of query_rows_per_request={r}; "
                         f"the rule is: the r query rows of each request are adjacent, so N is "
                         f"a multiple of r")
    if r * k > hot:
        raise ValueError(f"query_rows_per_request={r} rows of top_k={k} columns make a union "
                         f"of up to r*K={r * k} positions, but the hot region holds only "
                         f"H={hot} slots; the rule is query_rows_per_request * top_k <= "
                         f"hot_size")
    check_array("state_rows", state_rows, ndim=1, dtype=jnp.int32)
    if state_rows.shape[0] != n:
        raise ValueError(f"state_rows has {state_rows.shape[0]} entries but topk has N={n} rows")
    block_size = check_static_int("block_size", block_size, minimum=1)
    check_static_int("host_rows", host_rows, minimum=0)
    need = cdiv(hot, block_size)
    check_array("hot_block_table", hot_block_table, ndim=2, dtype=jnp.int32)
    if hot_block_table.shape[0] != n or hot_block_table.shape[1] < need:
        raise ValueError(f"hot_block_table must be [N={n}, >= ceil(H/B)={need}], got "
                         f"{tuple(hot_block_table.shape)}")
    for name, table in (("source_block_table", source_block_table),
                        ("resident_block_table", resident_block_table)):
        if table is None and name == "resident_block_table":
            continue
        check_array(name, table, ndim=2, dtype=jnp.int32)
        if table.shape[0] != n or table.shape[1] < 1:
            raise ValueError(f"{name} must be [N={n}, >= 1], got {tuple(table.shape)}")
    if state.pos_slot is not None:
        check_array("state.pos_slot", state.pos_slot, ndim=2, dtype=jnp.int16)
        width = source_block_table.shape[1] * block_size
        if state.pos_slot.shape[0] != num_state_rows or state.pos_slot.shape[1] < width:
            raise ValueError(
                f"state.pos_slot must be [S={num_state_rows}, >= P] with P = "
                f"source_block_table's width * block_size = {width} (a position each page "
                f"of the table can hold), got {tuple(state.pos_slot.shape)}")
    if is_concrete(state_rows):
        rows = np.asarray(state_rows)
        if r > 1:
            groups = rows.reshape(n // r, r)
            bad = np.flatnonzero((groups != groups[:, :1]).any(axis=1))
            if bad.size:
                first = int(bad[0]) * r
                raise ValueError(
                    f"state_rows must be equal within each group of query_rows_per_request="
                    f"{r} adjacent rows (the rows of one request); rows {first}..{first + r - 1}"
                    f" hold {groups[bad[0]].tolist()}")
            rows = groups[:, 0]
        live = rows[rows >= 0]
        if live.size and live.max() >= num_state_rows:
            raise ValueError(f"state_rows must be < max_num_reqs={num_state_rows} (or < 0 for "
                             f"padding), got {int(live.max())}")
        if np.unique(live).size != live.size:
            raise ValueError("state_rows must not repeat a state row within one batch"
                             + (f" (except within a request's query_rows_per_request={r} "
                                "adjacent rows)" if r > 1 else ""))


def validate_invalidate(state, state_rows_per_token, written_rows) -> None:
    check_hot_state(state)
    check_same_length("state_rows_per_token", state_rows_per_token, "written_rows",
                      written_rows)


# --------------------------------------------------------------------------- copies


def validate_swap_plan(swap_src, swap_dst, swap_counts) -> None:
    check_array("swap_src", swap_src, ndim=2, dtype=jnp.int32)
    check_array("swap_dst", swap_dst, ndim=2, dtype=jnp.int32)
    check_array("swap_counts", swap_counts, ndim=1, dtype=jnp.int32)
    if swap_dst.shape != swap_src.shape:
        raise ValueError(f"swap_dst shape {swap_dst.shape} must equal swap_src shape "
                         f"{swap_src.shape}")
    if swap_counts.shape[0] != swap_src.shape[0]:
        raise ValueError(f"swap_counts has {swap_counts.shape[0]} entries but swap_src has "
                         f"N={swap_src.shape[0]} rows")


def validate_pool_and_cache(host_pool, kv_cache) -> None:
    check_array("kv_cache", kv_cache, ndim=3)
    check_array("host_pool", host_pool, ndim=(2, 3))
    check_host_pool("host_pool", host_pool)
    if _compat.in_host_memory(kv_cache):
        raise ValueError("kv_cache must live in device memory, got a host-memory array")
    width = kv_cache.shape[-1]
    if width < 1 or host_pool.shape[-1] % width:
        raise ValueError(f"row_width mismatch: host_pool rows are {host_pool.shape[-1]} wide, "
                         f"kv_cache rows {width}; the rule is pool rows of the cache's width "
                         "(or a multiple of it: a packed pool, read as its flat rows)")
    if host_pool.dtype != kv_cache.dtype:
        raise TypeError(f"host_pool dtype {host_pool.dtype} must equal kv_cache dtype "
                        f"{kv_cache.dtype}")


def pool_pack(host_pools, kv_caches, *, pools_name: str = "host_pools",
              caches_name: str = "kv_caches") -> int:
    """G, the layers per pool array: `host_pools` holds one array per layer (G = 1) or A
    arrays for the L = A * G layers, array a holding layers aG..aG+G-1 side by side (rows
    G * W wide, every one of its layers W wide). Checks the count and the widths."""
    arrays, layers = len(host_pools), len(kv_caches)
    if arrays == 0 or layers % arrays:
        raise ValueError(
            f"{pools_name} has {arrays} arrays for the {layers} layers of {caches_name}; the "
            "rule is one array per layer, or one per G layers side by side (A arrays, A "
            "dividing L)")
    pack = layers // arrays
    for a, pool in enumerate(host_pools):
        members = kv_caches[a * pack:(a + 1) * pack]
        if pack == 1 or not all(hasattr(x, "shape") for x in (pool, *members)):
            continue  # one layer per array, or not arrays (the per-array checks name them)
        widths = {c.shape[-1] for c in members}
        if len(widths) != 1 or pool.shape[-1] != pack * min(widths):
            raise ValueError(
                f"{pools_name}[{a}] holds {pack} layers side by side, so its rows must be "
                f"{pack} x the layers' common width; got rows {pool.shape[-1]} wide for "
                f"layers of widths {sorted(widths)}")
    return pack


def validate_group(host_pools, kv_caches) -> int:
    """`validate_pool_and_cache` for every layer against its pool array; returns G
    (`pool_pack`)."""
    if not kv_caches and not host_pools:
        return 1
    pack = pool_pack(host_pools, kv_caches)
    for i, cache in enumerate(kv_caches):
        pool = host_pools[i // pack]
        try:
            validate_pool_and_cache(pool, cache)
            if pack == 1 and pool.shape[-1] != cache.shape[-1]:
                raise ValueError(f"row_width mismatch: host_pool rows are {pool.shape[-1]} "
                                 f"wide, kv_cache rows {cache.shape[-1]}")
        except (ValueError, TypeError) as e:
            raise type(e)(f"layer {i}: {e}") from None
    return pack


def _layers(name: str, value: Any) -> tuple[Any, ...]:
    """`value` as a tuple of per-layer arrays; TypeError for a lone array or a non-sequence."""
    if hasattr(value, "shape") or not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be a sequence (tuple or list) of per-layer arrays, got "
                        f"{type(value).__name__}")
    return tuple(value)


def check_device_array(name: str, x: Any) -> None:
    if _compat.in_host_memory(x):
        raise ValueError(f"{name} must live in device memory, got a host-memory array")


def validate_stage_prefill(host_pools, caches, staging, positions, source_blocks,
                           resident_blocks, block_size) -> int:
    """The shape, dtype, memory-kind and static rules of `stage_prefill_rows`; returns
    block_size as an int.

    L >= 1 layers in each of host_pools, caches and staging. Layer l: host_pools[l]
    [host_blocks, B, W] in pinned_host memory, caches[l] [num_blocks, B, W] and staging[l]
    [M, W] in device memory, all three of one dtype and width W >= 1 (which may differ
    between layers); B == block_size, and host_blocks and num_blocks the same in every layer (one
    pair of block tables addresses them all). positions int32[M]; source_blocks and
    resident_blocks int32[P] of one length.
    """
    host_pools = _layers("host_pools", host_pools)
    caches = _layers("caches", caches)
    staging = _layers("staging", staging)
    if not len(caches) == len(staging):
        raise ValueError(f"caches and staging must hold one array per layer, got "
                         f"{len(caches)} and {len(staging)} layers")
    if not staging:
        raise ValueError("host_pools, caches and staging must hold at least one layer, got 0")
    pack = pool_pack(host_pools, staging, caches_name="staging")
    block_size = check_static_int("block_size", block_size, minimum=1)
    check_array("positions", positions, ndim=1, dtype=jnp.int32)
    check_same_length("source_blocks", source_blocks, "resident_blocks", resident_blocks)
    m = positions.shape[0]
    for i, (cache, buf) in enumerate(zip(caches, staging, strict=True)):
        pool = host_pools[i // pack]
        check_array(f"host_pools[{i // pack}]", pool, ndim=3)
        check_array(f"caches[{i}]", cache, ndim=3)
        check_array(f"staging[{i}]", buf, ndim=2)
        check_host_pool(f"host_pools[{i // pack}]", pool)
        check_device_array(f"caches[{i}]", cache)
        check_device_array(f"staging[{i}]", buf)
        for name, x in ((f"host_pools[{i // pack}]", pool), (f"caches[{i}]", cache)):
            if x.shape[1] != block_size:
                raise ValueError(f"{name} must be [blocks, block_size={block_size}, W], got "
                                 f"shape {tuple(x.shape)}")
        if buf.shape[0] != m:
            raise ValueError(f"staging[{i}] has {buf.shape[0]} rows but positions has M={m} "
                             "entries; the rule is one staging row per position")
        width = buf.shape[1]
        if width < 1:
            raise ValueError(f"staging[{i}] rows must be at least 1 wide, got shape "
                             f"{tuple(buf.shape)}")
        for name, x, want in ((f"host_pools[{i // pack}]", pool, pack * width),
                              (f"caches[{i}]", cache, width)):
            if x.shape[2] != want:
                raise ValueError(f"row_width mismatch: {name} rows are {x.shape[2]} wide, "
                                 f"staging[{i}] rows {width} (a pool array holding {pack} "
                                 f"layers: rows {want} wide)")
            if x.dtype != buf.dtype:
                raise TypeError(f"{name} dtype {x.dtype} must equal staging[{i}] dtype "
                                f"{buf.dtype}")
        for name, x, first in ((f"host_pools[{i // pack}]", pool, host_pools[0]),
                               (f"caches[{i}]", cache, caches[0])):
            if x.shape[0] != first.shape[0]:
                raise ValueError(f"{name} has {x.shape[0]} blocks but layer 0 has "
                                 f"{first.shape[0]}; every layer must have the same number "
                                 "of blocks (one block table addresses them all)")
    return block_size


# --------------------------------------------------------------------------- attention


def validate_attention(q: Any, kv_cache: Any, attention_rows: Any, sm_scale: Any,
                       v_width: Any, kv_format: Any = kvf.BF16) -> None:
    for name, x in (("q", q), ("kv_cache", kv_cache), ("attention_rows", attention_rows)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    kvf.check_kv_format(kv_format)
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in Q_DTYPES]:
        raise TypeError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if q.ndim not in (3, 4):
        raise ValueError(
            f"q must be [N, h_q, D] or, for the multi-query-row form, [N, s_q, h_q, D]; "
            f"got shape {tuple(q.shape)}")
    width = q.shape[-1]
    fp8 = kv_format == kvf.FP8_DS_MLA
    if fp8:
        if width != kvf.ROW_WIDTH:
            raise ValueError(f"q must be {kvf.ROW_WIDTH} wide ({kvf.LATENT_DIM} latent + "
                             f"{kvf.ROPE_DIM} rope) with kv_format={kv_format!r}, got {width}")
        if jnp.dtype(kv_cache.dtype) != jnp.dtype(jnp.uint8):
            raise TypeError(f"kv_cache must be uint8 (bytes of {kv_format} rows) with "
                            f"kv_format={kv_format!r}, got {kv_cache.dtype}")
    elif jnp.dtype(kv_cache.dtype) != jnp.dtype(q.dtype):
        raise TypeError(f"kv_cache dtype must equal q's dtype {q.dtype}, got {kv_cache.dtype}")
    row = kvf.storage_width(kv_format, width)
    unit = "B" if fp8 else "D"
    if kv_cache.ndim not in (2, 3):
        raise ValueError(
            f"kv_cache must be [num_blocks, B, {unit}] (or flat rows [R, {unit}]), got shape "
            f"{tuple(kv_cache.shape)}")
    if kv_cache.shape[-1] != row:
        if fp8:
            raise ValueError(f"kv_cache rows must be {row} bytes with kv_format={kv_format!r}, "
                             f"got {kv_cache.shape[-1]}")
        raise ValueError(f"kv_cache row width {kv_cache.shape[-1]} != q width {width}")
    if jnp.dtype(attention_rows.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"attention_rows must be int32, got {attention_rows.dtype}")
    lead = tuple(q.shape[:-2])  # (N,) or (N, s_q)
    form = "[N, K]" if q.ndim == 3 else "[N, s_q, K]"
    if attention_rows.ndim != len(lead) + 1 or tuple(attention_rows.shape[:-1]) != lead:
        raise ValueError(
            f"attention_rows must be int32 {form} with leading dims {lead} equal to q's, got "
            f"shape {tuple(attention_rows.shape)}")
    if attention_rows.shape[-1] < 1:
        raise ValueError("attention_rows must select at least one entry per row (K >= 1)")
    max_v = kvf.LATENT_DIM if fp8 else width
    if not is_int(v_width) or not 0 < v_width <= max_v:
        what = f"the {kvf.LATENT_DIM} latent values" if fp8 else "the row width"
        raise ValueError(f"v_width must be an int in [1, {max_v}] ({what}), got {v_width!r}")
    if isinstance(sm_scale, jax.Array) or not isinstance(sm_scale, numbers.Real) \
            or isinstance(sm_scale, bool):
        raise TypeError(f"sm_scale must be a Python float (static), got {type(sm_scale).__name__}")
    if not (np.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite positive float, got {sm_scale!r}")
