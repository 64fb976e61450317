"""Every Pallas kernel of hisparse-jax that lowers through the (deprecated) Triton backend.

Why Triton and not Mosaic GPU, the backend JAX supports going forward:
  * the row copies (`gather_rows_into_cache`, `scatter_rows_into_pool`) read or write the
    `pinned_host` pool from inside the kernel (zero-copy over PCIe). A Mosaic GPU kernel
    refuses a host operand ("src must be a GMEM reference, got Ref<MemorySpace.Host>"); the
    Triton lowering takes the host buffer's address as it takes any other.
  * `sparse_mla_decode` (the "triton" attention backend) gathers selected rows as
    [block_k, 512] tiles with vector loads and measured 2.9x faster than the Mosaic GPU
    kernel, whose row gathers are 9 TMA copies each (details at the attention section);
  * `resolve_residency` and `invalidate_written_rows` need vector-index gathers and
    scatters (table lookups, compaction by rank). Mosaic GPU has no vector-index gather on
    Hopper (only row-at-a-time copies with a scalar start), and its atomics return nothing.
When Triton leaves Pallas, this module is the one to replace; the jnp references
(`*_ref.py`) stay as the fallback behind the same op interface.

Conventions of every kernel here:
  * operands are whole refs (`memory_space=pl.ANY`), indexed with broadcast integer arrays
    (`ref.at[rows[:, None], cols[None, :]]`), never array-plus-slice: the interpreter
    (CPU tests) cannot discharge a mix of the two;
  * every in-kernel array has a power-of-two size (a Triton rule): a 576-wide MLA row moves
    as 512 + 64 (`row_pieces`), index vectors are padded to a power of two and masked;
  * a masked-off lane gets an out-of-range, non-negative index, so a masked store is dropped
    by the interpreter too (a negative index would wrap to the last row there);
  * each call goes through `_compat.quiet_triton_call`, whose lowering rule is the only place
    the `jax-pallas-triton` deprecation warning is silenced.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _compat
from pallas_kernels.sparse_mla_ref import combine_splits

_ANY = pl.BlockSpec(memory_space=pl.ANY)


@dataclasses.dataclass(frozen=True)
class CopyTuning:
    """Knobs of the row-copy kernels.

    rows_per_program: rows one program moves (a power of two); None picks from the size.
    num_warps: warps per program. max_piece: widest power-of-two column piece per load.
    """

    rows_per_program: int | None = None
    num_warps: int = 4
    max_piece: int = 512


DEFAULT_COPY = CopyTuning()
_TARGET_PROGRAMS = 2 * 132            # two waves of an H200's 132 SMs


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def row_pieces(width: int, max_piece: int) -> tuple[tuple[int, int], ...]:
    """(start, size) column pieces of a row, each size a power of two <= max_piece.

    576 -> ((0, 512), (512, 64)); 2048 with max_piece 512 -> four pieces of 512.
    """
    pieces, start = [], 0
    while start < width:
        size = min(max_piece, 1 << ((width - start).bit_length() - 1))
        pieces.append((start, size))
        start += size
    return tuple(pieces)


def _rows_per_program(total_rows: int, tuning: CopyTuning) -> int:
    if tuning.rows_per_program is not None:
        return tuning.rows_per_program
    rows = 16
    while rows > 2 and -(-total_rows // rows) < _TARGET_PROGRAMS:
        rows //= 2
    return rows


def _row_index(ref_ndim: int, rows: jax.Array, block: int) -> tuple[jax.Array, ...]:
    """Index arrays [R, 1] addressing flat rows of a [rows, W] or [blocks, B, W] ref."""
    rows = rows[:, None]
    if ref_ndim == 2:
        return (rows,)
    return (rows // block, rows % block)


def _copy_rows(src_ref, src_rows, dst_ref, dst_rows, *, load_mask, store_mask, pieces,
               src_block, dst_block):
    """dst rows := src rows, piece by piece; lanes off `load_mask` read 0, off `store_mask`
    write nothing. src_rows/dst_rows: int32[R] (already out-of-range where masked)."""
    src_idx = _row_index(len(src_ref.shape), src_rows, src_block)
    dst_idx = _row_index(len(dst_ref.shape), dst_rows, dst_block)
    nrows = src_rows.shape[0]
    for start, size in pieces:
        cols = (start + jnp.arange(size, dtype=jnp.int32))[None, :]
        shape = (nrows, size)
        vals = plgpu.load(src_ref.at[(*src_idx, cols)],
                          mask=jnp.broadcast_to(load_mask[:, None], shape), other=0)
        plgpu.store(dst_ref.at[(*dst_idx, cols)], vals.astype(dst_ref.dtype),
                    mask=jnp.broadcast_to(store_mask[:, None], shape))


# --------------------------------------------------------------------------- gather_compact


def _gather_kernel(src_ref, dst_ref, count_ref, *refs, layers, k, rows, pieces, host_rows,
                   cache_rows, pool_block, cache_block):
    """One program: `rows` consecutive misses of batch row n, for one layer (grid axis 0
    when there are several layers: each layer replays the same swap plan)."""
    pools, caches = refs[:layers], refs[2 * layers:]
    if layers > 1:
        layer, n, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    else:
        layer, n, j = 0, pl.program_id(0), pl.program_id(1)
    m0 = j * rows
    count = count_ref[n]

    @pl.when(m0 < count)
    def _():
        m = m0 + jnp.arange(rows, dtype=jnp.int32)
        flat = n * k + jnp.minimum(m, k - 1)
        src = src_ref[flat]
        dst = dst_ref[flat]
        for i in range(layers):
            live = (m < count) & (m < k) & (src >= 0) & (dst >= 0) & (dst < cache_rows[i])
            in_pool = live & (src < host_rows[i])
            copy = functools.partial(
                _copy_rows, pools[i], jnp.where(in_pool, src, host_rows[i]),
                caches[i], jnp.where(live, dst, cache_rows[i]), load_mask=in_pool,
                store_mask=live, pieces=pieces[i], src_block=pool_block[i],
                dst_block=cache_block[i])
            if layers == 1:
                copy()
            else:
                pl.when(layer == i)(copy)


def gather_rows_into_caches(host_pools, kv_caches, swap_src, swap_dst, swap_counts, *,
                            interpret: bool = False, tuning: CopyTuning = DEFAULT_COPY):
    """gather_compact for several layers in ONE launch: for every layer l,
    kv_caches[l] row swap_dst[n, m] := host_pools[l] row swap_src[n, m].

    host_pools[l]: [host_rows, W] or [host_blocks, B, W], read in place (pinned_host on the
    GPU). kv_caches[l]: [num_blocks, B, W], written in place (aliased; donate them at the jit
    boundary). swap_src, swap_dst: int32[N, K]; swap_counts: int32[N]. Same contract as
    `gather_compact_ref`: rows past swap_counts, src < 0 or dst outside the cache are
    skipped; src >= host_rows writes zeros. Returns the tuple of updated caches.
    """
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    layers = len(kv_caches)
    n, k = swap_src.shape
    if layers == 0 or n * k == 0 or any(c.size == 0 for c in kv_caches):
        return kv_caches
    rows = _rows_per_program(n * k * layers, tuning)
    widths = [c.shape[-1] for c in kv_caches]
    if interpret:
        host_pools = tuple(_compat.interpret_operand(p) for p in host_pools)
    kernel = functools.partial(
        _gather_kernel, layers=layers, k=k, rows=rows,
        pieces=tuple(row_pieces(w, tuning.max_piece) for w in widths),
        host_rows=tuple(p.size // w for p, w in zip(host_pools, widths, strict=True)),
        cache_rows=tuple(c.shape[0] * c.shape[1] for c in kv_caches),
        pool_block=tuple(p.shape[1] if p.ndim == 3 else 1 for p in host_pools),
        cache_block=tuple(c.shape[1] for c in kv_caches))
    grid = (n, pl.cdiv(k, rows)) if layers == 1 else (layers, n, pl.cdiv(k, rows))
    first_cache = 3 + layers

    def call(src, dst, counts, *pools_and_caches):
        return tuple(pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in kv_caches],
            grid=grid,
            in_specs=[_ANY] * (3 + 2 * layers),
            out_specs=[_ANY] * layers,
            input_output_aliases={first_cache + i: i for i in range(layers)},
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
            name="hisparse_gather_compact",
        )(src, dst, counts, *pools_and_caches))

    return _compat.quiet_triton_call(call, swap_src.reshape(-1), swap_dst.reshape(-1),
                                     swap_counts, *host_pools, *kv_caches)


def gather_rows_into_cache(host_pool, kv_cache, swap_src, swap_dst, swap_counts, *,
                           interpret: bool = False, tuning: CopyTuning = DEFAULT_COPY):
    """gather_compact for one layer: kv_cache row swap_dst[n, m] := host_pool row
    swap_src[n, m] (see `gather_rows_into_caches`; `kv_cache` is updated in place)."""
    (out,) = gather_rows_into_caches((host_pool,), (kv_cache,), swap_src, swap_dst,
                                     swap_counts, interpret=interpret, tuning=tuning)
    return out


# --------------------------------------------------------------------------- mirror_rows


def _mirror_kernel(dev_ref, host_ref, cache_ref, _pool_in, pool_ref, *, total, rows, pieces,
                   cache_rows, pool_rows, cache_block, pool_block):
    e = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
    flat = jnp.minimum(e, total - 1)
    d = dev_ref[flat]
    h = host_ref[flat]
    keep = (e < total) & (d >= 0) & (d < cache_rows) & (h >= 0) & (h < pool_rows)
    _copy_rows(cache_ref, jnp.where(keep, d, cache_rows),
               pool_ref, jnp.where(keep, h, pool_rows),
               load_mask=keep, store_mask=keep, pieces=pieces,
               src_block=cache_block, dst_block=pool_block)


def scatter_rows_into_pool(kv_cache, host_pool, device_rows, host_rows, *,
                           interpret: bool = False, tuning: CopyTuning = DEFAULT_COPY):
    """mirror_rows: host_pool row host_rows[i] := kv_cache row device_rows[i], in place.

    kv_cache: [num_blocks, B, W] on the device. host_pool: [host_rows, W] or
    [host_blocks, B, W], written in place (aliased): the enclosing jit must donate it and,
    for a pinned_host pool on the GPU, name it pinned_host in `out_shardings` (XLA refuses
    a host-memory kernel output otherwise). Entries with an index out of range are skipped.
    """
    total = device_rows.shape[0]
    num_blocks, cache_block, width = kv_cache.shape
    pool_rows = host_pool.size // width if width else 0
    if total == 0 or pool_rows == 0 or kv_cache.size == 0:
        return host_pool
    rows = _rows_per_program(total, tuning)
    pool_block = host_pool.shape[1] if host_pool.ndim == 3 else 1
    # The interpreter cannot alias a kernel output onto a host buffer: run it on a device copy.
    moved_to_device = interpret and _compat.in_host_memory(host_pool)
    if moved_to_device:
        host_pool = _compat.to_device(host_pool)
    kernel = functools.partial(
        _mirror_kernel, total=total, rows=rows, pieces=row_pieces(width, tuning.max_piece),
        cache_rows=num_blocks * cache_block, pool_rows=pool_rows, cache_block=cache_block,
        pool_block=pool_block)

    def call(dev, host, cache, pool):
        return (pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
            grid=(pl.cdiv(total, rows),),
            in_specs=[_ANY] * 4,
            out_specs=_ANY,
            input_output_aliases={3: 0},
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
            name="hisparse_mirror_rows",
        )(dev, host, cache, pool),)

    (out,) = _compat.quiet_triton_call(call, device_rows, host_rows, kv_cache, host_pool)
    if moved_to_device:
        out = _compat.to_host(out)
    return out


# --------------------------------------------------------------------------- invalidate


def _invalidate_kernel(state_ref, written_ref, _slots_in, slots_ref, *, chunk, hot,
                       num_state_rows):
    t = pl.program_id(0)
    c0 = pl.program_id(1) * chunk          # program ids outside pl.when (the interpreter)
    s = state_ref[t]
    w = written_ref[t]

    @pl.when((s >= 0) & (s < num_state_rows) & (w >= 0))
    def _():
        cols = c0 + jnp.arange(chunk, dtype=jnp.int32)
        in_row = cols < hot
        cols = jnp.where(in_row, cols, hot)
        held = plgpu.load(slots_ref.at[s, cols], mask=in_row, other=-1)
        stale = in_row & (held == w)
        # Several tokens may clear slots of one row at once: each stores only its own -1s.
        plgpu.store(slots_ref.at[s, jnp.where(stale, cols, hot)],
                    jnp.full((chunk,), -1, jnp.int32), mask=stale)


@dataclasses.dataclass(frozen=True)
class InvalidateTuning:
    """Knobs of the invalidate kernel: slots per program (a power of two; one program per
    (token, chunk)) and warps per program."""

    chunk: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        if not _is_pow2(self.chunk):
            raise ValueError(f"InvalidateTuning.chunk must be a power of two, got {self.chunk}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"InvalidateTuning.num_warps must be 1..16 (a power of two), "
                             f"got {self.num_warps}")


DEFAULT_INVALIDATE = InvalidateTuning()

# Candidates `bench/bench_data_plane.py` times on the GPU (first = the default). One program
# per (token, chunk) is tiny work: the question is launch/occupancy, so the sweep varies the
# program count (T * H / chunk) and the warps per program.
INVALIDATE_VARIANTS: dict[str, InvalidateTuning] = {
    "c1024_w4": InvalidateTuning(),
    "c4096_w8": InvalidateTuning(chunk=4096, num_warps=8),      # one program per token
    "c2048_w4": InvalidateTuning(chunk=2048, num_warps=4),
    "c512_w4": InvalidateTuning(chunk=512, num_warps=4),
}


def invalidate_rows(slot_rows, state_rows_per_token, written_rows, *, interpret: bool = False,
                    chunk: int | None = None, tuning: InvalidateTuning | None = None):
    """invalidate_written_rows: slot_rows[s, j] := -1 where it equals a token's written row.

    slot_rows: int32[S, H] (aliased onto the output); state_rows_per_token, written_rows:
    int32[T]. One program per (token, chunk of H slots); `chunk` overrides `tuning.chunk`.
    """
    tuning = tuning or DEFAULT_INVALIDATE
    num_state_rows, hot = slot_rows.shape
    tokens = written_rows.shape[0]
    if tokens == 0 or slot_rows.size == 0:
        return slot_rows
    chunk = min(chunk or tuning.chunk, _pow2_ceil(hot))
    kernel = functools.partial(_invalidate_kernel, chunk=chunk, hot=hot,
                               num_state_rows=num_state_rows)

    def call(state_rows, written, slots):
        return (pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(slots.shape, slots.dtype),
            grid=(tokens, pl.cdiv(hot, chunk)),
            in_specs=[_ANY] * 3,
            out_specs=_ANY,
            input_output_aliases={2: 0},
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
            name="hisparse_invalidate_written_rows",
        )(state_rows, written, slots),)

    (out,) = _compat.quiet_triton_call(call, state_rows_per_token, written_rows, slot_rows)
    return out


# --------------------------------------------------------------------------- resolve


@dataclasses.dataclass(frozen=True)
class ResolveTuning:
    """Knobs of the resolve kernel: warps per batch row, LRU positions per chunk (a power of
    two), hash table size as a multiple of the padded K (a power of two >= 2), and
    cached_loads: read the row's scratch (hash table, marks) with ordinary loads that may
    hit L1, instead of volatile ones that go to L2 (every such read follows a barrier after
    the writes it must see, which orders them for the CTA under the PTX memory model)."""

    # Defaults: the best exact candidate of the H200 sweep (run 3, bench_data_plane-gpu.json)
    # without cached_loads, which won by only 6-9% and is kept off as the safer choice.
    num_warps: int = 16
    chunk: int = 4096
    table_factor: int = 8
    cached_loads: bool = False

    def __post_init__(self) -> None:
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"ResolveTuning.num_warps must be a power of two <= 32, "
                             f"got {self.num_warps}")
        if not _is_pow2(self.chunk):
            raise ValueError(f"ResolveTuning.chunk must be a power of two, got {self.chunk}")
        if not _is_pow2(self.table_factor) or self.table_factor < 2:
            raise ValueError(f"ResolveTuning.table_factor must be a power of two >= 2, "
                             f"got {self.table_factor}")


DEFAULT_RESOLVE = ResolveTuning()

# Candidates `bench/bench_data_plane.py` times on the GPU. The kernel is
# latency-bound: its time is a chain of dependent global round trips, dominated by the probe
# rounds (hash build, then one lookup per LRU chunk, each as long as the longest probe in the
# chunk). A sparser table (table_factor 8: load <= 1/8) shortens the longest linear-probe
# chain from ~20 to a few; chunk = H walks the LRU in one pass (walk and reorder fused);
# 16 warps keep the 4096-wide chunk at 8 values per thread (no spills); cached_loads lets
# the random probes of the row's 64 KiB table hit L1 (~40 cycles) instead of L2 (~260).
RESOLVE_VARIANTS: dict[str, ResolveTuning] = {
    "w8_c1024_t2": ResolveTuning(num_warps=8, chunk=1024, table_factor=2),
    "w8_c4096_t8": ResolveTuning(num_warps=8, chunk=4096, table_factor=8),
    "w16_c4096_t8": ResolveTuning(num_warps=16, chunk=4096, table_factor=8),
    "w16_c4096_t8_l1": ResolveTuning(num_warps=16, chunk=4096, table_factor=8,
                                     cached_loads=True),
    "w16_c4096_t4": ResolveTuning(num_warps=16, chunk=4096, table_factor=4),
}
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


def _resolve_kernel(topk_ref, state_ref, host_rows_ref, hot_ref, src_ref, res_ref,
                    lru_old_ref, *refs, k, kp, hot, hp, chunk, log2_table, block_size,
                    num_state_rows, num_aliased, interpret, volatile):
    refs = refs[num_aliased:]          # skip the aliased inputs: use the outputs
    (out_ref, valid_ref, ssrc_ref, sdst_ref, scount_ref, hits_ref, slots_ref, lru_ref,
     hkey_ref, hval_ref, hitpos_ref, evict_ref) = refs
    table = 1 << log2_table
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
        for ref in (out_ref, ssrc_ref, sdst_ref):
            store_cols(ref, minus1)
        for ref in (valid_ref, scount_ref, hits_ref):
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
        valid_ref[n] = jnp.sum((kin & ((res >= 0) | (g >= 0))).astype(jnp.int32))
        pending = kin & (res < 0) & (g >= 0)
        num_pending = jnp.sum(pending.astype(jnp.int32))
        out0 = jnp.where(res >= 0, res, -1)

        @pl.when(num_pending == 0)
        def _nothing_pending():
            store_cols(out_ref, out0)
            store_cols(ssrc_ref, minus1)
            store_cols(sdst_ref, minus1)
            scount_ref[n] = jnp.int32(0)
            hits_ref[n] = jnp.int32(0)

        @pl.when(num_pending > 0)
        def _walk():
            _resolve_pending(
                n, s, g, pending, num_pending, out0, hot_ref, lru_old_ref, out_ref, ssrc_ref,
                sdst_ref, scount_ref, hits_ref, slots_ref, lru_ref, hkey_ref, hval_ref,
                hitpos_ref, evict_ref, k=k, kp=kp, hot=hot, hp=hp, chunk=chunk,
                log2_table=log2_table, table=table, block_size=block_size,
                interpret=interpret, volatile=volatile)


def _resolve_pending(n, s, g, pending, num_pending, out0, hot_ref, lru_old_ref, out_ref,
                     ssrc_ref, sdst_ref, scount_ref, hits_ref, slots_ref, lru_ref, hkey_ref,
                     hval_ref, hitpos_ref, evict_ref, *, k, kp, hot, hp, chunk,
                     log2_table, table, block_size, interpret, volatile):
    """Steps 3-5 of SEMANTICS.md for one live row with pending columns.

    Every read of this row's scratch follows a barrier after the writes it must see;
    `volatile` (ResolveTuning.cached_loads False) also makes those loads bypass L1."""
    kk = jnp.arange(kp, dtype=jnp.int32)
    kin = kk < k
    i32 = jnp.int32
    hot_width = hot_ref.shape[1]

    def device_row(slot, mask):
        blk = plgpu.load(hot_ref.at[n, jnp.where(mask, slot // block_size, hot_width)],
                         mask=mask, other=0)
        return blk * block_size + jnp.where(mask, slot % block_size, 0)

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
        cached = plgpu.load(slots_ref.at[s, jnp.where(in_range, slot, hot)], mask=in_range,
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

    # (c) New LRU = unused evictables ++ filled (miss order) ++ hits; list the evictables
    # the misses take, oldest first.
    def reorder(carry, walked, num_hits):
        hits_before, evict_before = carry
        p, pin, slot, col = walked
        num_evict = hot - num_hits
        num_miss = num_pending - num_hits
        hit = pin & (col >= 0)
        evict = pin & (col < 0)
        hit_rank = hits_before + jnp.cumsum(hit.astype(i32)) - 1
        evict_rank = evict_before + jnp.cumsum(evict.astype(i32)) - 1
        new_pos = jnp.where(hit, num_evict + hit_rank,
                            jnp.where(evict_rank >= num_miss, evict_rank - num_miss,
                                      num_evict - num_miss + evict_rank))
        plgpu.store(lru_ref.at[s, jnp.where(pin, new_pos, hot)], slot.astype(lru_ref.dtype),
                    mask=pin)
        taken = evict & (evict_rank < num_miss)
        plgpu.store(evict_ref.at[n, jnp.where(taken, evict_rank, kp)], slot, mask=taken)
        return (hits_before + jnp.sum(hit.astype(i32)),
                evict_before + jnp.sum(evict.astype(i32)))

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
    num_miss = num_pending - num_hits

    # (d) Columns: hits read their slot, misses take evictables in ascending column order.
    mark = plgpu.load(hval_ref.at[n, jnp.where(pending, pos_col, table)], mask=pending,
                      other=0, volatile=volatile)
    is_hit = pending & (mark <= -2)
    hit_slot = jnp.where(is_hit, -2 - mark, -1)
    hit_dev = device_row(hit_slot, is_hit)            # issued before the evictables' load
    miss = pending & ~is_hit
    miss_rank = jnp.cumsum(miss.astype(i32)) - 1
    miss_slot = plgpu.load(evict_ref.at[n, jnp.where(miss, miss_rank, kp)], mask=miss,
                           other=-1, volatile=volatile)
    miss_ok = miss & (miss_slot >= 0) & (miss_slot < hot)
    miss_dev = jnp.where(miss_ok, device_row(miss_slot, miss_ok), -1)
    out = jnp.where(is_hit, hit_dev, jnp.where(miss, miss_dev, out0))
    plgpu.store(out_ref.at[n, jnp.where(kin, kk, k)], out, mask=kin)
    at_rank = jnp.where(miss, miss_rank, k)
    plgpu.store(ssrc_ref.at[n, at_rank], g, mask=miss)
    plgpu.store(sdst_ref.at[n, at_rank], miss_dev, mask=miss)
    rest = kin & (kk >= num_miss)
    plgpu.store(ssrc_ref.at[n, jnp.where(rest, kk, k)], jnp.full((kp,), -1, i32), mask=rest)
    plgpu.store(sdst_ref.at[n, jnp.where(rest, kk, k)], jnp.full((kp,), -1, i32), mask=rest)
    plgpu.store(slots_ref.at[s, jnp.where(miss_ok, miss_slot, hot)], g, mask=miss_ok)
    scount_ref[n] = num_miss
    hits_ref[n] = num_hits


def resolve_rows(slot_rows, lru, topk, state_rows, hot_block_table, source_block_table,
                 resident_block_table, *, block_size, host_rows, interpret: bool = False,
                 tuning: ResolveTuning = DEFAULT_RESOLVE, poison: int | None = None):
    """resolve_residency in one launch: one program per batch row (same contract and outputs
    as `resolve_residency_ref`, exactly, including the LRU order).

    host_rows may be a Python int or a traced int32 scalar (it is a kernel operand).
    slot_rows int32[S, H] and a copy of lru int16[S, H] are updated in place (aliased); the
    other outputs are fresh, or, with `poison` set (tests), start filled with that value so
    an entry the kernel fails to write shows. Per-row global scratch (discarded): the hash
    table (keys and values) [N, table_factor * Kp] twice, LRU-position hit marks [N, Hp] and
    the evictables the misses take [N, Kp] (Kp, Hp: K, H rounded up to powers of two).
    """
    num_state_rows, hot = slot_rows.shape
    n, k = topk.shape
    if n == 0 or k == 0:
        zeros = jnp.zeros((n,), jnp.int32)
        minus = jnp.full((n, k), -1, jnp.int32)
        return minus, zeros, minus, minus, zeros, zeros, slot_rows, lru
    kp = _pow2_ceil(k)
    hp = _pow2_ceil(hot)
    chunk = min(tuning.chunk, hp)
    table = _pow2_ceil(max(tuning.table_factor * kp, 2))
    log2_table = table.bit_length() - 1
    i32 = jnp.int32
    out_shapes = [
        jax.ShapeDtypeStruct((n, k), i32),                  # attention_rows
        jax.ShapeDtypeStruct((n,), i32),                    # valid_counts
        jax.ShapeDtypeStruct((n, k), i32),                  # swap_src
        jax.ShapeDtypeStruct((n, k), i32),                  # swap_dst
        jax.ShapeDtypeStruct((n,), i32),                    # swap_counts
        jax.ShapeDtypeStruct((n,), i32),                    # num_hits
        jax.ShapeDtypeStruct(slot_rows.shape, i32),         # slot_rows (in place)
        jax.ShapeDtypeStruct(lru.shape, lru.dtype),         # lru (in place, on a copy)
        jax.ShapeDtypeStruct((n, table), i32),              # scratch: hash keys
        jax.ShapeDtypeStruct((n, table), i32),              # scratch: hash columns
        jax.ShapeDtypeStruct((n, hp), i32),                 # scratch: hit mark per position
        jax.ShapeDtypeStruct((n, kp), i32),                 # scratch: evictables taken
    ]
    has_res = resident_block_table is not None
    host_rows = jnp.asarray(host_rows, jnp.int32).reshape(1)    # may be traced
    inputs = [topk, state_rows, host_rows, hot_block_table, source_block_table]
    if has_res:
        inputs.append(resident_block_table)
    inputs.append(lru)                                      # the old LRU, read only
    aliased = [slot_rows, lru]
    if poison is not None:
        aliased = [jnp.full(o.shape, poison, o.dtype) for o in out_shapes[:6]] + aliased
    first_alias = len(inputs)
    out_index0 = 0 if poison is not None else 6
    aliases = {first_alias + i: out_index0 + i for i in range(len(aliased))}
    num_inputs = len(inputs) + len(aliased)

    kernel_body = functools.partial(
        _resolve_kernel, k=k, kp=kp, hot=hot, hp=hp, chunk=chunk, log2_table=log2_table,
        block_size=block_size, num_state_rows=num_state_rows,
        num_aliased=len(aliased), interpret=interpret, volatile=not tuning.cached_loads)

    def kernel(*refs):
        if has_res:
            return kernel_body(*refs)
        return kernel_body(*refs[:5], None, *refs[5:])

    def call(*args):
        return tuple(pl.pallas_call(
            kernel,
            out_shape=out_shapes,
            grid=(n,),
            in_specs=[_ANY] * num_inputs,
            out_specs=[_ANY] * len(out_shapes),
            input_output_aliases=aliases,
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
            name="hisparse_resolve_residency",
        )(*args))

    outs = _compat.quiet_triton_call(call, *inputs, *aliased)
    return tuple(outs[:8])

# --------------------------------------------------------------------------------------------
# Sparse MLA decode attention (`hisparse_jax.sparse_mla_decode(..., backend="triton")`).
#
# Why Triton here: the Mosaic GPU kernel (`sparse_mla_mgpu`) must move every selected row as
# 9 separate 128-byte TMA copies (no vector-index gather on Hopper) and measured 787 us at
# N=64, h_q=128, K=2048 on the H200 against 275 us for this kernel (bench/results/
# sparse_mla-gpu.json), so by the project's rule the faster Triton lowering is the default.
#
# Design: one program per (block of `block_h` heads, K split, query row); the head block is the
# fastest grid axis so that the programs sharing a query row's selected rows run together (the
# second read of a row hits L2). Per step it gathers `block_k` selected rows as a [block_k, 512]
# latent tile and a [block_k, 64] rope tile (Triton needs power-of-two shapes: the 576-wide row
# moves as 512 + 64), computes S = q_nope k_nope^T + q_rope k_rope^T in fp32, an online softmax
# in base 2 (running max starts at the finite -1e30 so fully masked tiles stay NaN-free), and
# acc += P k_nope. A -1 entry loads nothing (masked load) and scores -inf. K splits
# (flash-decoding) are combined in float32 by `sparse_mla_ref.combine_splits`.
# --------------------------------------------------------------------------------------------

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Knobs of the Triton sparse MLA kernel; the only bag of tuning parameters.

    block_h: heads per program (power of two, 16..64); None = min(64, next power of two of
      h_q, at least 16). 64 heads x 512 fp32 accumulator = 128 registers/thread at 8 warps.
    block_k: selected rows gathered per step (power of two, 16..128). Default 32 rows x 3
      stages: the best candidate at both h_q=16 and h_q=128 in the H200 sweep (run 3,
      bench/results/sparse_mla-gpu.json), by a few percent over 64 x 2.
    num_warps: warps per program (4, 8 or 16); None = 8 for block_h 64, else 4.
    num_stages: Triton software-pipelining depth of the K loop.
    num_splits: K splits per (row, head block); None = about two waves of programs.
    prefetch_ids: load each step's row ids one step ahead (loop carry), so the K-tile
      gather does not wait on an id load in the same step (False: run 2's kernel).
    interpret: run with `interpret=True` (CPU testing).
    """

    block_h: int | None = None
    block_k: int = 32
    num_warps: int | None = None
    num_stages: int = 3
    num_splits: int | None = None
    prefetch_ids: bool = True
    interpret: bool = False

    def __post_init__(self) -> None:
        if self.block_h is not None and (not _is_pow2(self.block_h)
                                         or not 16 <= self.block_h <= 64):
            raise ValueError(f"AttentionTuning.block_h must be None or a power of two in "
                             f"[16, 64], got {self.block_h}")
        if not _is_pow2(self.block_k) or not 16 <= self.block_k <= 128:
            raise ValueError(f"AttentionTuning.block_k must be a power of two in [16, 128], "
                             f"got {self.block_k}")
        if self.num_warps is not None and self.num_warps not in (4, 8, 16):
            raise ValueError(f"AttentionTuning.num_warps must be None, 4, 8 or 16, "
                             f"got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"AttentionTuning.num_stages must be >= 1, got {self.num_stages}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"AttentionTuning.num_splits must be None or >= 1, "
                             f"got {self.num_splits}")


# The variants the GPU tests and the benchmark compare. Run 2 (H200): bk64_s2 275 us at
# N=64/h_q=128, 107 us at h_q=16; bk32_s2 349/123 us; h32_bk32_s3 330/130 us. Run 3, with the
# id prefetch: bk32_s3 283/91 us, bk64_s2 287/93 us, bk64_s2_w16 658/122 us; bk32_s3 is the
# default (AttentionTuning()).
#  * prefetch_ids (on in all of these): in run 2 the K-tile gather depended on the row-id
#    load of the same step (one level of indirection); Triton's pipeliner splits its stages
#    across indirection levels, so with 2 stages the gather was likely not issued ahead at
#    all. With the ids carried from the previous step the gather's addresses are loop-carried
#    values: 2 stages can pipeline it. Deeper pipelines (num_stages 3, 4) keep more tiles in
#    flight; bk32 x 3 stages fits in shared memory at 64 heads (Q 72 KiB + 2 buffers of
#    36 KiB).
#  * 16 warps at 64 heads: the 64 x 512 fp32 accumulator drops from 128 to 64 registers per
#    thread (wgmma N split over 4 warpgroups), against spills at 8 warps.
ATTENTION_VARIANTS: dict[str, AttentionTuning] = {
    "bk64_s2": AttentionTuning(block_k=64, num_stages=2),
    "bk32_s3": AttentionTuning(block_k=32, num_stages=3),
    "bk64_s2_w16": AttentionTuning(block_k=64, num_stages=2, num_warps=16),
}
# Benchmark-only candidates that may not build at every shape: bk64 x 3 stages (2 x 72 KiB
# of K tiles + Q 72 KiB at 64 heads) may exceed the 227 KiB of shared memory; at 16 heads
# it fits. The benchmark records a build failure and goes on; the GPU tests skip these.
# bk64_s2_noprefetch is run 2's default kernel, the baseline of the id prefetch.
ATTENTION_SWEEP_EXTRA: dict[str, AttentionTuning] = {
    "bk64_s3": AttentionTuning(block_k=64, num_stages=3),
    "bk64_s2_noprefetch": AttentionTuning(block_k=64, num_stages=2, prefetch_ids=False),
}


def _attention_row_pieces(width: int, v_width: int) -> tuple[tuple[int, int], ...] | None:
    """(start, size) power-of-two column pieces of a row whose first piece is the value
    (0, v_width); None when the row cannot be cut so (576, 512 -> (0, 512), (512, 64))."""
    if not _is_pow2(v_width) or v_width < 16:
        return None
    pieces, start = [(0, v_width)], v_width
    while start < width:
        size = 1 << ((width - start).bit_length() - 1)
        if size < 16:          # a dot needs K >= 16
            return None
        pieces.append((start, size))
        start += size
    return tuple(pieces)


def attention_supports(q_dtype, width: int, v_width: int, kv_elems: int = 0) -> str | None:
    """None when this kernel handles the inputs, else the reason it does not.

    kv_elems: elements of the KV cache; Pallas-Triton addresses with int32 offsets."""
    if kv_elems >= 2**31:
        return (f"the triton kernel addresses the KV cache with int32 offsets: at most 2^31 - 1 "
                f"elements, got {kv_elems}")
    if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the triton kernel needs bfloat16 or float16 inputs, got {q_dtype}"
    if _attention_row_pieces(width, v_width) is None:
        return (f"the triton kernel needs v_width a power of two >= 16 and the rest of the row "
                f"(D - v_width = {width - v_width}) made of power-of-two pieces >= 16; "
                f"got D={width}, v_width={v_width}")
    return None


def _attention_kernel(q_ref, kv_ref, rows_ref, out_ref, lse_ref, *, block_h, block_k, steps, pieces,
            scale2, prefetch_ids):
    """Program (head block hb, split s, query row t): q_ref [T, Hp, D], kv_ref [R, D],
    rows_ref [T, Kp] (Kp = splits * steps * block_k, -1 padded); writes out_ref
    [T, S, Hp, v] (normalised within the split) and lse_ref [T, S, Hp] (base 2)."""
    hb, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = (hb * block_h + jnp.arange(block_h, dtype=jnp.int32))[:, None]
    cols = [(start + jnp.arange(size, dtype=jnp.int32))[None, :] for start, size in pieces]
    q_pieces = [plgpu.load(q_ref.at[t, heads, c]) for c in cols]
    v_width = pieces[0][1]
    dims = (((1,), (1,)), ((), ()))          # contract the column dims: q k^T

    def load_ids(i):
        k0 = (s * steps + i) * block_k
        return plgpu.load(rows_ref.at[t, k0 + jnp.arange(block_k, dtype=jnp.int32)])

    def step(i, carry):
        if prefetch_ids:
            # The ids of step i came with step i - 1 (loop carry): the K-tile gather's
            # addresses are ready at the top of the step, and the load of the next step's ids
            # is issued before it (the last step reloads its own ids, harmlessly).
            acc, m_i, l_i, ids = carry
            ids_next = load_ids(jnp.minimum(i + 1, steps - 1))
        else:
            acc, m_i, l_i = carry
            ids = load_ids(i)
        valid = ids >= 0
        safe = jnp.where(valid, ids, 0)[:, None]
        scores = None
        k_value = None
        for qp, c, (_, size) in zip(q_pieces, cols, pieces, strict=True):
            kp = plgpu.load(kv_ref.at[safe, c],
                            mask=jnp.broadcast_to(valid[:, None], (block_k, size)), other=0)
            if k_value is None:
                k_value = kp
            part = lax.dot_general(qp, kp, dims, preferred_element_type=jnp.float32)
            scores = part if scores is None else scores + part
        scores = jnp.where(valid[None, :], scores * scale2, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(scores, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + lax.dot_general(
            p.astype(k_value.dtype), k_value, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)
        if prefetch_ids:
            return acc, m_new, l_i, ids_next
        return acc, m_new, l_i

    carry = (jnp.zeros((block_h, v_width), jnp.float32),
             jnp.full((block_h,), _M_INIT, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    if prefetch_ids:
        carry = (*carry, load_ids(0))
    acc, m_i, l_i = lax.fori_loop(0, steps, step, carry)[:3]
    out = acc / jnp.maximum(l_i, 1e-30)[:, None]          # all-masked: acc = 0 -> out = 0
    vcols = jnp.arange(v_width, dtype=jnp.int32)[None, :]
    plgpu.store(out_ref.at[t, s, heads, vcols], out.astype(out_ref.dtype))
    lse2 = jnp.where(l_i > 0, m_i + jnp.log2(jnp.maximum(l_i, 1e-30)), -jnp.inf)
    plgpu.store(lse_ref.at[t, s, heads[:, 0]], lse2)


def _attention_splits(programs: int, num_chunks: int, cfg: AttentionTuning) -> int:
    if cfg.num_splits is not None:
        want = cfg.num_splits
    else:
        want = max(1, -(-_TARGET_PROGRAMS // max(programs, 1)))
        want = min(want, max(1, num_chunks // 4))      # >= 4 steps per split
    want = max(1, min(want, num_chunks))
    while num_chunks % want:                            # no all-padding steps
        want -= 1
    return want


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "config"))
def sparse_mla_decode_triton(
    q: jax.Array,
    kv_rows: jax.Array,
    attention_rows: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    config: AttentionTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Kernel entry on validated inputs: q [T, h_q, D] bf16/f16, kv_rows [R, D], rows int32 [T, K].

    Returns out [T, h_q, v_width] in q.dtype and lse float32 [T, h_q] (natural log).
    """
    cfg = config or AttentionTuning()
    num_rows, h_q, width = q.shape
    top_k = attention_rows.shape[1]
    reason = attention_supports(q.dtype, width, v_width, kv_rows.size)
    if reason is not None:
        raise ValueError(reason)
    pieces = _attention_row_pieces(width, v_width)
    block_h = cfg.block_h or min(64, max(16, _pow2_ceil(h_q)))
    num_warps = cfg.num_warps or (8 if block_h >= 64 else 4)
    bk = cfg.block_k
    h_pad = -(-h_q // block_h) * block_h
    head_blocks = h_pad // block_h
    num_chunks = -(-top_k // bk)
    splits = _attention_splits(num_rows * head_blocks, num_chunks, cfg)
    steps = -(-num_chunks // splits)
    k_pad = splits * steps * bk
    rows = attention_rows
    if k_pad != top_k:
        rows = jnp.pad(rows, ((0, 0), (0, k_pad - top_k)), constant_values=-1)
    q_pad = q if h_pad == h_q else jnp.pad(q, ((0, 0), (0, h_pad - h_q), (0, 0)))
    kernel = functools.partial(_attention_kernel, block_h=block_h, block_k=bk, steps=steps,
                               pieces=pieces, scale2=float(sm_scale) * _LOG2E,
                               prefetch_ids=cfg.prefetch_ids)

    def call(q_pad, kv_rows, rows):
        return tuple(pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((num_rows, splits, h_pad, v_width), q.dtype),
                       jax.ShapeDtypeStruct((num_rows, splits, h_pad), jnp.float32)],
            grid=(head_blocks, splits, num_rows),
            in_specs=[_ANY] * 3,
            out_specs=[_ANY] * 2,
            interpret=cfg.interpret,
            compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                                 num_stages=cfg.num_stages),
            name="hisparse_sparse_mla_decode",
        )(q_pad, kv_rows, rows))

    out, lse2 = _compat.quiet_triton_call(call, q_pad, kv_rows, rows)
    out, lse2 = out[:, :, :h_q], lse2[:, :, :h_q]
    if splits == 1:
        return out[:, 0], lse2[:, 0] * _LN2
    return combine_splits(out, lse2, q.dtype)
