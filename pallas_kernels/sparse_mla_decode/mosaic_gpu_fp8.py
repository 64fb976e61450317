"""sparse_mla_decode as a Pallas Mosaic GPU kernel that moves each selected row with ONE bulk
copy: fp8_ds_mla rows (uint8[656]) and bf16 rows; Hopper, jax >= 0.11. Opt-in.

Import this module only where jax has Mosaic GPU Pallas (`mosaic_gpu.py` loads it lazily).
Contract: `reference.sparse_mla_decode` (flat rows, -1 holes anywhere, all-invalid rows give
out = 0 and lse = -inf), restricted to DeepSeek-V3.2's dimensions: D = 576, v_width = 512.

Why a second Mosaic GPU kernel: `mosaic_gpu.py` lands every row straight in the wgmma operand
layout, which takes one TMA box per 128 bytes of the row (the swizzled tile never holds a row
contiguously). Here a row is one contiguous `cp.async.bulk` copy (Mosaic GPU lowers a GMEM ->
SMEM copy of a contiguous, unswizzled slice to the non-tensor bulk copy, whose size is any
multiple of 16 bytes) into a row-major staging tile; the consumer warpgroups then rewrite the
staging tile into the swizzled bf16 tile (fp8: e4m3 -> f16 -> f32, times the row's group
scale, -> bf16; bf16 rows: a plain re-layout) before the matmuls.

Design (one CTA per (query row, block of 64 heads, K split); tiles of 64 selected rows):
  * 3 warpgroups: 2 consumers (compute) and 1 producer. The producer copies the tile's row ids
    to SMEM (one TMA of 64 int32, two slots) and issues one row copy per selected row (fp8:
    768 bytes, `row_copies=1`; or 640 + 128 bytes, `row_copies=2`; bf16: 1152 bytes) into
    the staging tile, from its 4 warps at once (`RowTuning.copy_warps`: a copy is ~25
    instructions with two mbarrier operations, and one warp issuing all 64 of a tile was what
    bounded the kernel). An fp8 copy of 768 bytes reads 112 bytes past its row: for the
    cache's last row it starts 112 bytes early instead, into a row of slack in front of the
    staging tile, so every copy is in bounds (`in_bounds`; without it Mosaic clamps each copy
    at the cache's end and completes the missing bytes on the barrier, one more mbarrier
    operation a copy). Once a tile's copies are issued, the next tile's rows are prefetched
    into L2 (`prefetch`): its copies may start only after this tile is converted.
    Masked entries are redirected to a row the same query row selects
    (`mosaic_gpu.redirect_masked`): an unselected row is never read.
  * SMEM: Q [64, 576] bf16 (72 KiB; reused for the output at the end), ONE swizzled bf16 KV
    tile [64, 576] (72 KiB) and ONE staging tile (fp8: 1 + 64 rows of 784 B, bf16: 64 x
    1168 B; the row pitch is the copy rounded up, plus 16 B so that consecutive rows start 4
    banks apart).
    A second KV tile does not fit next to a staging tile; so per tile the consumers first
    convert (staging -> KV tile, which frees the staging tile for the next tile's copies),
    then compute, and the producer's copies of tile t + 1 overlap the matmuls of tile t.
  * Conversion is split by value half: consumer w writes latent columns [256 w, 256 w + 256)
    (the columns its own P V reads) and consumer 0 also the rope. Before overwriting them for
    tile t + 1 it waits until the Q K^T of tile t that reads them is done (`qk`); its own
    P V of tile t finished in program order. After both converted (`conv`): fp8 rows with
    `RowTuning.share_p` (the default) have consumer 0 compute S = Q K^T over all 576
    columns and the online softmax in base 2 (running max starts at the finite `M_INIT`),
    then hand P (bf16) and the rescale factor to consumer 1 through SMEM; each runs
    acc += P V over its 256 value columns (the 64 x 512 fp32 accumulator does not fit one
    warpgroup). Without share_p (and for bf16 rows, whose SMEM has no room for P) both
    consumers compute S and the softmax. The consumers live in `mosaic_gpu_fp8_consume.py`.
  * Q, the KV tile and the staging tile are addressed inside the tile loop through an index
    read from SMEM (always 0, `RowTuning.anchor`): with constant addresses the compiler
    hoists Q K^T's 72 wgmma descriptors out of the loop, next to the 128-register
    accumulator, and spills them (ptxas).
  * fp8 details: the latent chunk [64 rows, 64 bytes] is loaded in a register layout whose
    rows are WGMMA's (WGMMA itself: 2 bytes a load; `RowTuning.wide_convert`: 8), bitcast to
    float8_e4m3fn and widened (e4m3 -> f16 is exact; f16 -> f32), multiplied by
    the row's float32 scale and rounded to bf16 once. The scales and the rope are read on the
    GPU through typed views of the staging tile (a `RefUnion` of uint8, float32 and bfloat16
    views of the same bytes); under the interpreter (which keeps union members apart) they
    are assembled from the staging bytes with shifts and same-width bitcasts (same values).
  * Lane lowering semantics (explicit layouts; Mosaic's layout inference searched for minutes
    over the staging tile's views). A Lane-semantics GMEM -> SMEM copy must move a multiple of
    128 bytes, hence the 768-byte fp8 copy; its GMEM source is the cache viewed as flat bytes,
    addressed with int32 offsets: at most 2^31 - 768 bytes (`supports`).
  * K splits (flash-decoding) fill the GPU at small N; the splits are merged in float32
    (`reference.merge_splits`). A query row with no valid entry copies row 0 and the wrapper
    writes its out = 0, lse = -inf.

`interpret=True` runs the same kernel in Mosaic GPU interpret mode on the CPU (jax 0.11+). The
differences: the typed staging views (above); the same copies come from the warpgroup (no
`copy_warps`: warp-level code is GPU only here), clamped (no `in_bounds`: the flat
fp8 cache is padded with 112 zero bytes so that the last row's over-reading copy stays in
bounds), and nothing is prefetched; P V reads P from SMEM with a fresh accumulator (the
interpreter has neither `run_state` nor register-A wgmma; with share_p the shared P, else a P
scratch per consumer); share_p only with one tile per CTA (jax's interpreter hung on it
otherwise, and with both P buffers allocated; causes not found).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_format as kvf
from pallas_kernels.sparse_mla_decode.mosaic_gpu import (
    BLOCK_H,
    _choose_splits,
    platform_reason,
    redirect_masked,
)
from pallas_kernels.sparse_mla_decode.mosaic_gpu_fp8_consume import (
    _CHUNK,
    _V,
    _V_HALF,
    _WIDTH,
    BKV,
    _Bars,
    _consume,
    _Cta,
    _Launch,
)
from pallas_kernels.sparse_mla_decode.reference import LOG2E, merge_splits, pad_operands

_SMEM_BYTES = 232448      # opt-in shared memory per block on Hopper (227 KiB)
_FP8_COPY = 768           # bytes of the one-copy fp8 row transfer (6 x 128)
_FP8_PITCH = 784          # staging row pitch, fp8 (16 B of bank skew)
_BF16_PITCH = 584         # staging row pitch, bf16 rows, in bf16 elements (1168 B)
_PREFETCH_BOX = 256       # bytes per L2 prefetch (a TMA box dimension holds <= 256)


@dataclasses.dataclass(frozen=True)
class RowTuning:
    """Knobs of the row-copy kernel; the only bag of its tuning parameters.

    num_splits: K splits per (row, head block); None = about one wave of CTAs.
    row_copies: fp8 rows only: 1 = one 768-byte copy per row (6 x 128 B, over-reading 112 B
      past the row), 2 = a 640-byte and a 128-byte copy (the rope again), both inside the row.
    copy_unroll: row copies issued per producer loop iteration (a divisor of 64).
    auto_barriers: keep Pallas' automatic warpgroup barriers (one per copy and per SMEM
      access); False sets `unsafe_no_auto_barriers` (the kernel never reads and writes one
      SMEM region from the same thread, the condition Pallas documents).
    optimized_loads: ask Mosaic for its bank-conflict-checked SMEM -> register transfers of
      the staging tile (it refuses some views: False is the safe default).
    compute_registers / producer_registers: setmaxnreg targets; 128 * (2 * compute +
      producer) must be <= 65536.
    anchor: address Q, the KV tile and the staging tile through an index read from shared
      memory each tile (always 0) instead of a constant. With constant addresses the
      compiler hoists the 72 wgmma descriptors of Q K^T (64-bit each) and the conversion's
      addresses out of the tile loop, and the consumers, already holding the 64 x 256 fp32
      accumulator, spill them to local memory and reload them every tile; an index the
      compiler cannot fold keeps them inside the loop, recomputed from one base.
    share_p: fp8 rows only (bf16 rows: no shared memory is left for P): consumer 0 alone
      computes S = Q K^T and the softmax and hands P and the rescale factor to consumer 1
      through shared memory, so the tensor cores run Q K^T once per tile, not twice
      (`mosaic_gpu_fp8_consume.py`). Same values either way.
    copy_warps: the producer's 4 warps each issue a quarter of the tile's row copies (warp-
      level lowering), instead of every copy going through the warpgroup's first thread one
      after another. GPU only: the interpreter runs the warpgroup loop (the same copies).
    prefetch: once tile t's copies are issued, the producer asks L2 for the bytes every row
      copy of tile t + 1 reads (fp8: 768, three 256-byte TMA prefetches a row; bf16: 1152,
      four of 256 and one of 128), so those copies, which may start only after tile t is
      converted, read L2 instead of DRAM. GPU only: a prefetch changes no value, and the
      interpreter skips it.
    in_bounds: fp8 rows with `row_copies=1`, on the GPU: every 768-byte copy stays inside
      the cache (the last row's starts 112 bytes before the row, into the row of slack in
      front of its staging row, `_Launch.row0`), so the copies are issued as promised in
      bounds: without the clamp at the cache's end and its completion of the missing bytes
      (one mbarrier operation a copy). The interpreter pads the cache instead.
    wide_convert: the conversion's registers hold 8 consecutive columns of a row per thread
      (Mosaic's WGMMA_UPCAST_4X layout): 8-byte fp8 (16-byte bf16) staging loads and 16-byte
      stores into the KV tile, 4x fewer than with the WGMMA layout's 2 columns. Off: it
      measured slower, fp8 and bf16 rows (`bench/NOTES-sparse_mla.md`).
    """

    num_splits: int | None = None
    row_copies: int = 1
    copy_unroll: int = 8
    auto_barriers: bool = False
    optimized_loads: bool = False
    compute_registers: int = 232
    producer_registers: int = 40
    anchor: bool = True
    share_p: bool = True
    copy_warps: bool = True
    prefetch: bool = True
    in_bounds: bool = True
    wide_convert: bool = False

    def __post_init__(self) -> None:
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"RowTuning.num_splits must be None or >= 1, got {self.num_splits}")
        if self.row_copies not in (1, 2):
            raise ValueError(f"RowTuning.row_copies must be 1 or 2, got {self.row_copies}")
        if self.copy_unroll < 1 or BKV % self.copy_unroll:
            raise ValueError(f"RowTuning.copy_unroll must divide {BKV}, got {self.copy_unroll}")
        if self.copy_warps and (BKV // 4) % self.copy_unroll:
            raise ValueError(f"RowTuning.copy_unroll must divide {BKV // 4} (the rows of one "
                             f"warp) with copy_warps, got {self.copy_unroll}")
        regs = 128 * (2 * self.compute_registers + self.producer_registers)
        if regs > 65536 or min(self.compute_registers, self.producer_registers) < 24:
            raise ValueError(f"RowTuning registers must be >= 24 each and fit the 64K register "
                             f"file: {regs}")


DEFAULT = RowTuning()


def supports(q, kv_rows, attention_rows=None, *, sm_scale: float | None = None,
             v_width: int = 512, kv_format: str = kvf.BF16,
             interpret: bool = False, device_check: bool = True) -> str | None:
    """None when this kernel handles the inputs (arrays or `jax.ShapeDtypeStruct`s with the
    arguments of `sparse_mla_decode`), else the reason: a bfloat16 q of width 576, v_width
    512, rows of `kv_format` ("bf16": bfloat16 [R, 576]; "fp8_ds_mla": uint8 [R, 656] of at
    most 2^31 - 768 bytes in all); a Hopper GPU (unless `device_check` is False: the kernel
    entry, which may lower for CUDA on another host), or with `interpret` a jax with Mosaic
    GPU interpret mode."""
    del attention_rows, sm_scale
    fmt = kvf.check_kv_format(kv_format)
    if jnp.dtype(q.dtype) != jnp.dtype(jnp.bfloat16) or q.shape[-1] != _WIDTH:
        return (f"the mosaic_gpu row-copy kernel needs a bfloat16 q of width {_WIDTH}, got "
                f"{jnp.dtype(q.dtype).name} width {q.shape[-1]}")
    if v_width != _V:
        return f"the mosaic_gpu row-copy kernel needs v_width {_V}, got {v_width}"
    rows = 1
    for d in kv_rows.shape[:-1]:
        rows *= int(d)
    if fmt == kvf.FP8_DS_MLA:
        if kv_rows.shape[-1] != kvf.FP8_ROW_BYTES or jnp.dtype(kv_rows.dtype) != jnp.uint8:
            return (f"the mosaic_gpu row-copy kernel reads {fmt} rows as "
                    f"uint8[{kvf.FP8_ROW_BYTES}], got {jnp.dtype(kv_rows.dtype).name}"
                    f"[{kv_rows.shape[-1]}]")
        if rows * kvf.FP8_ROW_BYTES > 2**31 - _FP8_COPY:
            return (f"the mosaic_gpu row-copy kernel addresses fp8 rows with int32 byte "
                    f"offsets: at most {(2**31 - _FP8_COPY) // kvf.FP8_ROW_BYTES} rows, got "
                    f"{rows}")
    elif jnp.dtype(kv_rows.dtype) != jnp.dtype(jnp.bfloat16) or kv_rows.shape[-1] != _WIDTH:
        return (f"the mosaic_gpu row-copy kernel reads bf16 rows as bfloat16[{_WIDTH}], got "
                f"{jnp.dtype(kv_rows.dtype).name}[{kv_rows.shape[-1]}]")
    return platform_reason(interpret, device_check)


def _body(lay: _Launch, q_ref, kv_ref, rows_ref, out_ref, lse_ref, qo_union, kv_tile,
          stage_union, idx_smem, anchor, *rest):
    """The kernel: warpgroups 0 and 1 convert and compute (`_consume`), 2 copies (`_produce`)."""
    rest = list(rest)
    p_share, stats = (rest.pop(0), rest.pop(0)) if lay.share_p else (None, None)
    p_scratch = rest.pop(0) if lay.interpret and not lay.share_p else None
    bars = rest + [None] * (len(_Bars._fields) - len(rest))
    q_smem, (o_smem2, lse_smem) = qo_union
    if lay.fp8 and not lay.interpret:
        stage, stage_f32, stage_bf16, stage_flat = stage_union
    else:
        stage, stage_f32, stage_bf16, stage_flat = stage_union, None, None, None
    split = lax.axis_index("split")
    cta = _Cta(lax.axis_index("hblk"), split, lax.axis_index("row"), split * lay.tiles,
               q_ref, kv_ref, rows_ref, out_ref, lse_ref, q_smem, o_smem2, lse_smem, kv_tile,
               stage, stage_f32, stage_bf16, stage_flat, idx_smem, anchor, p_share, stats,
               p_scratch,
               _Bars(*bars))
    wg = lax.axis_index("wg")
    for w in range(2):
        pl.when(wg == w)(functools.partial(_consume, lay, cta, w))
    pl.when(wg == 2)(functools.partial(_produce, lay, cta))


# ------------------------------------------------------------------------------ producer

def _produce(lay: _Launch, cta: _Cta) -> None:
    """Row ids of tile t + 1 go to SMEM while tile t's rows are copied; tile t's copies wait
    until both consumers converted tile t - 1 out of the staging tile. The ids of tile t + 1
    are waited for right after tile t's copies are issued (`RowTuning.prefetch` then asks L2
    for its rows), so that each `idx` completion is waited for once."""
    plgpu.set_max_registers(lay.cfg.producer_registers, action="decrease")
    bars = cta.bars
    for t in range(min(2, lay.tiles)):
        _copy_ids(cta, t, t)
    plgpu.barrier_wait(bars.idx.at[0])

    def tile(t, c):
        @pl.when(t > 0)
        def _():
            plgpu.barrier_wait(bars.empty)

            @pl.when(t + 1 < lay.tiles)
            def _():
                _copy_ids(cta, t + 1, lax.rem(t + 1, 2))
        _copy_rows(lay, cta, lax.rem(t, 2))

        @pl.when(t + 1 < lay.tiles)
        def _():
            slot = lax.rem(t + 1, 2)
            plgpu.barrier_wait(bars.idx.at[slot])
            _prefetch_rows(lay, cta, slot)
        return c
    lax.fori_loop(0, lay.tiles, tile, None)
    plgpu.barrier_wait(bars.empty)      # the last conversion: barrier phases balanced


def _copy_ids(cta: _Cta, t, slot) -> None:
    plgpu.copy_gmem_to_smem(cta.rows_ref.at[cta.row, cta.tile0 + t], cta.idx_smem.at[slot],
                            cta.bars.idx.at[slot])


def _source_row(cta: _Cta, slot, j):
    """The cache row entry j of the tile in id slot `slot` copies: a masked entry holds
    -1 - r for a row r its query row selects (`redirect_masked`)."""
    ident = cta.idx_smem[slot, j]
    return jnp.maximum(ident, -1 - ident)


def _per_row(lay: _Launch, fn) -> None:
    """fn(j) for the tile's 64 entries j, `copy_unroll` per loop iteration: from the
    warpgroup, or with `copy_warps` (on the GPU) 16 entries from each of its 4 warps."""
    unroll = lay.cfg.copy_unroll

    def rows(first, count):
        def group(i, c):
            for u in range(unroll):
                fn(first + i * unroll + u)
            return c
        lax.fori_loop(0, count // unroll, group, None)

    if lay.cfg.copy_warps and not lay.interpret:
        plgpu.warp_map(lambda warp: rows(warp * (BKV // 4), BKV // 4))
    else:
        rows(0, BKV)


def _prefetch_rows(lay: _Launch, cta: _Cta, slot) -> None:
    """`RowTuning.prefetch`: the tile's rows (the bytes each row copy reads) into L2: fp8,
    three 256-byte boxes of the flat cache; bf16 (1152 bytes), four of 256 and one of 128."""
    if not lay.cfg.prefetch or lay.interpret:
        return

    def prefetch(j):
        src = _source_row(cta, slot, j)
        if not lay.fp8:
            per_box = _PREFETCH_BOX // 2                   # bf16 elements per 256 bytes
            for k in range(-(-_WIDTH // per_box)):
                width = min(per_box, _WIDTH - k * per_box)
                plgpu.async_prefetch(cta.kv_ref.at[src, pl.ds(k * per_box, width)])
            return
        base = src * kvf.FP8_ROW_BYTES
        for k in range(_FP8_COPY // _PREFETCH_BOX):
            plgpu.async_prefetch(cta.kv_ref.at[pl.ds(base + k * _PREFETCH_BOX, _PREFETCH_BOX)])
    _per_row(lay, prefetch)


def _copy_rows(lay: _Launch, cta: _Cta, slot) -> None:
    """One (or, fp8 with `row_copies=2`, two) bulk copies per row of the tile into the
    staging tile."""
    mode = plgpu.OOBFillMode.UNDEFINED     # the contiguous bulk copy (clamped at the end)

    last = cta.kv_ref.shape[0] // kvf.FP8_ROW_BYTES - 1 if lay.fp8 else None  # the last row
    in_bounds = (lay.fp8 and lay.cfg.in_bounds and lay.cfg.row_copies == 1
                 and not lay.interpret and last >= 1)

    def copy(j):
        src = _source_row(cta, slot, j)
        full = cta.bars.full
        if not lay.fp8:
            plgpu.copy_gmem_to_smem(cta.kv_ref.at[src], cta.stage.at[0, j, pl.ds(0, _WIDTH)],
                                    full, oob_mode=mode)
            return
        base, row = src * kvf.FP8_ROW_BYTES, lay.row0 + j
        if in_bounds:   # the last row's copy ends at the row's end, starting 112 B early
            back = jnp.where(src == last, _FP8_COPY - kvf.FP8_ROW_BYTES, 0)
            plgpu.copy_gmem_to_smem(
                cta.kv_ref.at[pl.ds(base - back, _FP8_COPY)],
                cta.stage_flat.at[pl.ds(row * lay.pitch - back, _FP8_COPY)], full,
                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            return
        if lay.cfg.row_copies == 1:
            plgpu.copy_gmem_to_smem(cta.kv_ref.at[pl.ds(base, _FP8_COPY)],
                                    cta.stage.at[0, row, pl.ds(0, _FP8_COPY)], full,
                                    oob_mode=mode)
            return
        plgpu.copy_gmem_to_smem(cta.kv_ref.at[pl.ds(base, 640)],
                                cta.stage.at[0, row, pl.ds(0, 640)], full, oob_mode=mode)
        plgpu.copy_gmem_to_smem(cta.kv_ref.at[pl.ds(base + kvf.ROPE_OFFSET, 128)],
                                cta.stage.at[0, row, pl.ds(640, 128)], full, oob_mode=mode)
    _per_row(lay, copy)


# ------------------------------------------------------------------------------ consumers

# ------------------------------------------------------------------------------ launch

def _scratch_types(lay: _Launch) -> list:
    """The kernel's SMEM scratch and barriers, in `_body`'s order."""
    tiled = (plgpu.TilingTransform((8, _CHUNK)), plgpu.SwizzleTransform(128))
    if lay.fp8:
        rows = lay.row0 + BKV
        stage = plgpu.SMEM((1, rows, lay.pitch), jnp.uint8)
        if not lay.interpret:
            stage = plgpu.RefUnion(stage, plgpu.SMEM((1, rows, lay.pitch // 4), jnp.float32),
                                   plgpu.SMEM((1, rows, lay.pitch // 2), jnp.bfloat16),
                                   plgpu.SMEM((rows * lay.pitch,), jnp.uint8))
    else:
        stage = plgpu.SMEM((1, BKV, lay.pitch // 2), jnp.bfloat16)
    scratch = [
        plgpu.RefUnion(plgpu.SMEM((1, BLOCK_H, _WIDTH), jnp.bfloat16, transforms=tiled),  # Q,
                       (plgpu.SMEM((2, BLOCK_H, _V_HALF), jnp.bfloat16, transforms=tiled),
                        plgpu.SMEM((BLOCK_H,), jnp.float32))),                  # then O, lse
        plgpu.SMEM((1, BKV, _WIDTH), jnp.bfloat16, transforms=tiled),           # KV tile
        stage,
        plgpu.SMEM((2, BKV), jnp.int32),                                         # row ids
        plgpu.SMEM((2,), jnp.int32),                                             # anchors
    ]
    if lay.share_p:
        scratch += [plgpu.SMEM((BLOCK_H, BKV), jnp.bfloat16, transforms=tiled),  # shared P
                    plgpu.SMEM((2, BLOCK_H), jnp.float32)]                      # alpha, l
    if lay.interpret and not lay.share_p:   # P for the interpreter's SMEM-operand P V
        scratch.append(plgpu.SMEM((2, BLOCK_H, BKV), jnp.bfloat16, transforms=tiled))
    scratch += [
        plgpu.Barrier(),                                         # q
        plgpu.Barrier(num_barriers=2),                           # idx
        plgpu.Barrier(num_arrivals=BKV * (lay.cfg.row_copies if lay.fp8 else 1)),  # full
        plgpu.Barrier(num_arrivals=2),                           # empty
        plgpu.Barrier(num_arrivals=2),                           # conv
        plgpu.Barrier(num_arrivals=1 if lay.share_p else 2),     # qk
        plgpu.Barrier(num_arrivals=2),                           # done
    ]
    if lay.share_p:
        scratch += [plgpu.Barrier(), plgpu.Barrier()]            # pready, pfree
    return scratch


def smem_bytes(kv_format: str, share_p: bool = False) -> int:
    """Shared memory of one CTA (each buffer rounded up to Pallas' 1 KiB alignment), the
    barriers aside: checked against the 227 KiB of a Hopper SM at trace time. `share_p`:
    the shared P and the alpha / l rows (`RowTuning.share_p`)."""
    fp8 = kvf.check_kv_format(kv_format) == kvf.FP8_DS_MLA
    pitch = _FP8_PITCH if fp8 else 2 * _BF16_PITCH
    kib = lambda n: -(-n // 1024) * 1024      # noqa: E731
    shared = kib(BLOCK_H * BKV * 2) + kib(2 * BLOCK_H * 4) if share_p else 0
    rows = BKV + int(fp8)                     # fp8: a row of slack (`_Launch.row0`)
    return (kib(BLOCK_H * _WIDTH * 2) + kib(BKV * _WIDTH * 2) + kib(rows * pitch)
            + kib(2 * BKV * 4) + kib(2 * 4) + shared)


def _kernel_call(q, kv, rows3, *, fmt: str, scale2: float, num_splits: int, cfg: RowTuning,
                 interpret: bool):
    """q [T, Hp, 576] bf16 (Hp % 64 == 0); kv: flat uint8 [R * 656 (+ 112)] (fp8) or
    bfloat16 [R, 576]; rows3 int32 [T, n_tiles, 64] (masked entries redirected).

    Returns out [T, S, Hp, 512] bf16 (normalised within each split) and lse2 [T, S, Hp]
    float32 (base-2 log-sum-exp of scale2 * q.k)."""
    num_rows, h_pad, _ = q.shape
    num_tiles = rows3.shape[1]
    pitch = _FP8_PITCH if fmt == kvf.FP8_DS_MLA else 2 * _BF16_PITCH
    lay = _Launch(tiles=num_tiles // num_splits, fmt=fmt, pitch=pitch, scale2=scale2, cfg=cfg,
                  interpret=interpret)
    need = smem_bytes(fmt, lay.share_p)
    if need > _SMEM_BYTES:
        raise ValueError(f"the row-copy kernel needs {need} B of shared memory; the limit is "
                         f"{_SMEM_BYTES}")

    def sparse_mla_decode_rows(*refs):   # plgpu.kernel names the kernel after its function
        _body(lay, *refs)

    out_type = (jax.ShapeDtypeStruct((num_rows, num_splits, h_pad, _V), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_rows, num_splits, h_pad), jnp.float32))
    kwargs = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    kernel = plgpu.kernel(
        sparse_mla_decode_rows,
        out_type=out_type,
        scratch_types=_scratch_types(lay),
        grid=(h_pad // BLOCK_H, num_splits, num_rows),
        grid_names=("hblk", "split", "row"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
            unsafe_no_auto_barriers=not cfg.auto_barriers, reduction_scratch_bytes=0),
        **kwargs,
    )
    return kernel(q, kv, rows3)


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "kv_format", "interpret",
                                             "tuning"))
def sparse_mla_decode(q: jax.Array, kv_rows: jax.Array, attention_rows: jax.Array, *,
                      sm_scale: float, v_width: int = 512, kv_format: str = kvf.BF16,
                      interpret: bool = False, tuning: RowTuning | None = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Kernel entry on validated inputs: q [T, h_q, 576] bf16, kv_rows [R, 576] bf16 or uint8
    [R, 656] (kv_format "fp8_ds_mla"), attention_rows int32 [T, K] (-1 = masked; an
    entry outside [0, R) is masked too).

    Returns out [T, h_q, 512] bf16 and lse float32 [T, h_q] (natural log).
    Raises ValueError with `supports`' reason for inputs it cannot run.
    """
    cfg = tuning or DEFAULT
    reason = supports(q, kv_rows, v_width=v_width, kv_format=kv_format, interpret=interpret,
                      device_check=False)
    if reason is not None:
        raise ValueError(reason)
    fmt = kvf.check_kv_format(kv_format)
    num_rows, h_q, _ = q.shape
    h_pad = pl.cdiv(h_q, BLOCK_H) * BLOCK_H
    num_tiles = pl.cdiv(attention_rows.shape[1], BKV)
    splits = _choose_splits(num_rows, h_pad // BLOCK_H, num_tiles, cfg)
    # An entry outside [0, R) is masked as -1 is (the contract): never copied.
    attention_rows = jnp.where(attention_rows < kv_rows.shape[0], attention_rows, -1)
    q_pad, rows = pad_operands(q, attention_rows, h_pad, num_tiles * BKV)
    rows3 = redirect_masked(rows).reshape(num_rows, num_tiles, BKV)
    kv = kv_rows
    if fmt == kvf.FP8_DS_MLA:
        kv = kv_rows.reshape(-1)
        if interpret:   # the interpreter does not clamp the last row's over-reading copy
            kv = jnp.pad(kv, (0, _FP8_COPY - kvf.FP8_ROW_BYTES))
    out, lse2 = _kernel_call(q_pad, kv, rows3, fmt=fmt, scale2=float(sm_scale) * LOG2E,
                             num_splits=splits, cfg=cfg, interpret=interpret)
    out, lse = merge_splits(out, lse2, h_q, q.dtype)
    any_valid = jnp.any(attention_rows >= 0, axis=1)
    out = jnp.where(any_valid[:, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(any_valid[:, None], lse, -jnp.inf)
    return out, lse
