"""The consumer warpgroups of the row-copy kernel (`mosaic_gpu_fp8.py`): per tile of 64
selected rows, convert the staging tile into the swizzled bf16 KV tile, then S = Q K^T, the
online softmax and acc += P V over each consumer's 256 value columns; and the launch's static
shape and the CTA's refs, which the producer side shares.

Two schedules (`RowTuning.share_p`):
  * both consumers compute S over all 576 columns and the softmax (the 64 x 512 fp32
    accumulator needs two warpgroups; each keeps its half);
  * fp8 rows with `share_p`: consumer 0 alone computes S and the softmax and hands P (bf16,
    through shared memory) and the rescale factor alpha to consumer 1, which then runs only
    its P V; the tensor cores do Q K^T once per tile instead of twice. Same values: consumer 1
    multiplies by the very P and alpha consumer 0 computed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_format as kvf
from pallas_kernels.sparse_mla_decode.mosaic_gpu import BLOCK_H, _softmax_update
from pallas_kernels.sparse_mla_decode.reference import M_INIT

BKV = 64                  # selected rows per tile (wgmma N of Q K^T, K of P V)
_CHUNK = 64               # bf16 columns per swizzled tile column (128-byte swizzle)
_WIDTH = kvf.ROW_WIDTH    # 576
_V = kvf.LATENT_DIM       # 512
_V_HALF = _V // 2
_ROPE_AT = {1: 528, 2: 640}   # byte of the rope in a staged fp8 row, per `row_copies`


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Static shape of one launch: `tiles` tiles of BKV rows per CTA, rows of `fmt`, the
    staging tile's pitch (bytes), `scale2` = sm_scale * log2(e)."""

    tiles: int
    fmt: str
    pitch: int
    scale2: float
    cfg: Any          # mosaic_gpu_fp8.RowTuning
    interpret: bool

    @property
    def fp8(self) -> bool:
        return self.fmt == kvf.FP8_DS_MLA

    @property
    def row0(self) -> int:
        """The staging tile's first row: fp8 rows keep one row of slack in front, where the
        in-bounds copy of the cache's last row (`RowTuning.in_bounds`) starts 112 bytes
        early."""
        return 1 if self.fp8 else 0

    @property
    def share_p(self) -> bool:
        """Consumer 0 computes S and hands P to consumer 1: fp8 rows with RowTuning.share_p,
        on the GPU; under the interpreter only with one tile per CTA (jax 0.11-0.12's Mosaic
        GPU interpreter hangs on this schedule over several tiles on a two-core machine: one
        consumer's simulated thread never starts; the cause was not found)."""
        return self.fp8 and self.cfg.share_p and (not self.interpret or self.tiles == 1)


class _Cta(NamedTuple):
    """One CTA's grid position and refs (the operands, the outputs, `_scratch_types`).

    q_smem, kv_tile and the staging views carry a leading axis of 1: a consumer indexes them
    with the anchor (`RowTuning.anchor`) inside the tile loop; `_tile_view` returns the
    [64, ...] views a tile works on."""

    hblk: Any
    split: Any
    row: Any
    tile0: Any
    q_ref: Any
    kv_ref: Any
    rows_ref: Any
    out_ref: Any
    lse_ref: Any
    q_smem: Any
    o_smem2: Any
    lse_smem: Any
    kv_tile: Any
    stage: Any        # the staging tile (uint8 [row0 + 64, pitch] fp8, bf16 [64, pitch / 2])
    stage_f32: Any    # fp8 on the GPU: float32 view of the staging tile (else None)
    stage_bf16: Any   # fp8 on the GPU: bfloat16 view of the staging tile (else None)
    stage_flat: Any   # fp8 on the GPU: the staging tile's bytes, flat (else None)
    idx_smem: Any
    anchor: Any       # int32 [2]: consumer w's word, always 0 (`RowTuning.anchor`)
    p_share: Any      # share_p: P of the tile, bf16 [64, 64] swizzled (else None)
    stats: Any        # share_p: float32 [2, 64]: alpha of the tile, then the final l
    p_scratch: Any
    bars: Any


class _Bars(NamedTuple):
    q: Any           # Q landed
    idx: Any         # [2]: the row ids of a tile landed
    full: Any        # the staging tile's row copies landed
    empty: Any       # both consumers converted the staging tile (2 arrivals)
    conv: Any        # both consumers wrote their part of the KV tile (2 arrivals)
    qk: Any          # Q K^T of the KV tile finished (2 arrivals; share_p: consumer 0's)
    done: Any        # both consumers are done with Q (its SMEM then holds O) (2 arrivals)
    pready: Any      # share_p: P and alpha of the tile are in shared memory
    pfree: Any       # share_p: consumer 1's P V of the tile read them


def _consume(lay: _Launch, cta: _Cta, w: int) -> None:
    """Consumer w: per tile, convert its part of the staging tile, then S, softmax, P V_w."""
    plgpu.set_max_registers(lay.cfg.compute_registers, action="increase")
    bars = cta.bars

    @pl.when(w == 0)
    def _():
        plgpu.copy_gmem_to_smem(cta.q_ref.at[cta.row, pl.ds(cta.hblk * BLOCK_H, BLOCK_H)],
                                cta.q_smem.at[0], bars.q)
    if lay.cfg.anchor:
        cta.anchor[w] = jnp.int32(0)
        plgpu.commit_smem()
    plgpu.barrier_wait(bars.q)
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), M_INIT, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.full((BLOCK_H, _V_HALF), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    body = _tile_shared if lay.share_p else _tile_both
    acc, m_i, l_i = lax.fori_loop(0, lay.tiles, functools.partial(body, lay, cta, w),
                                  (acc, m_i, l_i))
    # The last completions of the barriers this consumer waits on: phases balanced.
    plgpu.barrier_wait(bars.pfree if lay.share_p and w == 0 else bars.qk)
    _write_output(lay, cta, w, acc, m_i, l_i)


def _tile_both(lay: _Launch, cta: _Cta, w: int, t, carry):
    """One tile, both consumers computing S and the softmax: convert, S, softmax, P V_w."""
    acc, m_i, l_i = carry
    bars = cta.bars
    c = _tile_view(lay, cta, w)
    slot = lax.rem(t, 2)
    plgpu.barrier_wait(bars.idx.at[slot])
    plgpu.barrier_wait(bars.full)
    bias = _bias(cta, slot)

    @pl.when(t > 0)
    def _():
        plgpu.barrier_wait(bars.qk)        # the other consumer's Q K^T of tile t - 1
    _convert_tile(lay, c, w)
    s = _scores(lay, c, bias)
    plgpu.barrier_arrive(bars.qk)
    p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc)
    acc = _accumulate_pv(lay, c, w, p, acc)
    return acc, m_new, l_i


def _tile_shared(lay: _Launch, cta: _Cta, w: int, t, carry):
    """One tile with `share_p`: consumer 0 converts its columns, computes S, the softmax and
    its P V, handing P and alpha over; consumer 1 converts its columns and runs P V with them.
    Consumer 0 writes P (t) only after consumer 1's P V (t - 1) read P (t - 1) (`pfree`);
    consumer 1 overwrites its columns only after consumer 0's Q K^T (t - 1) read them (`qk`);
    consumer 1 keeps no running max (acc is rescaled by consumer 0's alpha)."""
    acc, m_i, l_i = carry
    bars = cta.bars
    c = _tile_view(lay, cta, w)
    plgpu.barrier_wait(bars.full)
    if w == 1:
        @pl.when(t > 0)
        def _():
            plgpu.barrier_wait(bars.qk)
        _convert_tile(lay, c, w)
        plgpu.barrier_wait(bars.pready)
        alpha = plgpu.load(cta.stats.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = _accumulate_pv(lay, c, w, None, acc, p_smem=cta.p_share)
        plgpu.barrier_arrive(bars.pfree)
        return acc, m_i, l_i
    slot = lax.rem(t, 2)
    plgpu.barrier_wait(bars.idx.at[slot])
    bias = _bias(cta, slot)
    _convert_tile(lay, c, w)
    s = _scores(lay, c, bias)
    plgpu.barrier_arrive(bars.qk)
    p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc)
    alpha = jnp.exp2(m_i - m_new)          # as _softmax_update computes it

    @pl.when(t > 0)
    def _():
        plgpu.barrier_wait(bars.pfree)
    p16 = p.astype(jnp.bfloat16)
    cta.p_share[...] = p16
    cta.stats[0] = alpha
    plgpu.commit_smem()                    # generic writes -> consumer 1 and its wgmma
    plgpu.barrier_arrive(bars.pready)
    acc = _accumulate_pv(lay, c, w, p16, acc, p_smem=cta.p_share if lay.interpret else None)
    return acc, m_new, l_i


def _bias(cta: _Cta, slot):
    """0 where the tile's row id is >= 0, -inf where it is masked: float32 [64], the WGMMA
    column layout."""
    ids = plgpu.load(cta.idx_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    return jnp.where(ids >= 0, 0.0, -jnp.inf).astype(jnp.float32)


def _convert_tile(lay: _Launch, c: _Cta, w: int) -> None:
    """Consumer w's columns of the KV tile from the landed staging tile, then the hand-over:
    the staging tile is free (`empty`) and, once both converted (`conv`), the KV tile is
    whole."""
    bars = c.bars
    # A warpgroup barrier (and proxy fence): every warp of this warpgroup is past its wait
    # for P V of tile t - 1 before any overwrites the columns that P V read.
    plgpu.commit_smem()
    _convert(lay, c, w)
    plgpu.commit_smem()                    # generic-proxy writes -> wgmma (async proxy)
    plgpu.barrier_arrive(bars.empty)
    plgpu.barrier_arrive(bars.conv)
    plgpu.barrier_wait(bars.conv)


def _tile_view(lay: _Launch, cta: _Cta, w: int) -> _Cta:
    """cta with Q, the KV tile and the staging views indexed at consumer w's anchor (a
    shared-memory word the compiler cannot fold; `RowTuning.anchor`) or at 0."""
    z = cta.anchor[w] if lay.cfg.anchor else 0
    at = lambda ref: None if ref is None else ref.at[z]     # noqa: E731
    rows = lambda ref: (None if ref is None                 # noqa: E731
                        else ref.at[z, pl.ds(lay.row0, BKV)] if lay.row0 else ref.at[z])
    return cta._replace(q_smem=at(cta.q_smem), kv_tile=at(cta.kv_tile), stage=rows(cta.stage),
                        stage_f32=rows(cta.stage_f32), stage_bf16=rows(cta.stage_bf16))


def _load(lay: _Launch, ref, layout=None):
    return plgpu.load(ref, layout=layout or plgpu.Layout.WGMMA,
                      optimized=lay.cfg.optimized_loads)


def _convert_layout(lay: _Launch):
    """The register layout of the conversion (`RowTuning.wide_convert`): WGMMA_UPCAST_4X
    gives each thread 8 consecutive columns of a row (8-byte fp8 / 16-byte bf16 staging loads,
    16-byte stores), WGMMA 2 (2-byte fp8 / 4-byte bf16 loads). Its rows are WGMMA's, so the
    row scales broadcast from the same row layout."""
    return plgpu.Layout.WGMMA_UPCAST_4X if lay.cfg.wide_convert else plgpu.Layout.WGMMA


def _convert(lay: _Launch, cta: _Cta, w: int) -> None:
    """Consumer w's columns of the KV tile from the staging tile: latent columns
    [256 w, 256 w + 256) (4 chunks of 64) and, for w = 0, the 64 rope columns."""
    chunks = range(4 * w, 4 * w + 4)
    layout = _convert_layout(lay)
    if not lay.fp8:
        for c in [*chunks, *([8] if w == 0 else [])]:
            cta.kv_tile[:, pl.ds(c * _CHUNK, _CHUNK)] = _load(
                lay, cta.stage.at[:, pl.ds(c * _CHUNK, _CHUNK)], layout)
        return
    scales = _fp8_scales(lay, cta, (2 * w, 2 * w + 1))
    for c in chunks:
        raw = _load(lay, cta.stage.at[:, pl.ds(c * _CHUNK, _CHUNK)], layout)   # uint8 [64, 64]
        x = lax.bitcast_convert_type(raw, jnp.float8_e4m3fn)
        x = x.astype(jnp.float16).astype(jnp.float32)                      # exact
        scale = lax.broadcast_in_dim(scales[c // 2 - 2 * w], x.shape, [0])
        x = x * plgpu.layout_cast(scale, layout)
        cta.kv_tile[:, pl.ds(c * _CHUNK, _CHUNK)] = x.astype(jnp.bfloat16)
    if w == 0:
        cta.kv_tile[:, pl.ds(_V, _CHUNK)] = _fp8_rope(lay, cta)


def _fp8_scales(lay: _Launch, cta: _Cta, groups) -> list:
    """The float32 scales of `groups` of the tile's 64 rows, each [64] in the WGMMA row
    layout."""
    if lay.interpret:
        b = _load(lay, cta.stage.at[:, pl.ds(kvf.SCALE_OFFSET, 16)]).astype(jnp.uint32)
        return [lax.bitcast_convert_type(b[:, 4 * g] | (b[:, 4 * g + 1] << 8)
                                         | (b[:, 4 * g + 2] << 16) | (b[:, 4 * g + 3] << 24),
                                         jnp.float32) for g in groups]
    words = _load(lay, cta.stage_f32.at[:, pl.ds(kvf.SCALE_OFFSET // 4, 8)])   # [64, 8] f32
    col = plgpu.broadcasted_iota(jnp.int32, words.shape, 1, layout=plgpu.Layout.WGMMA)
    # The 4 other words of the slice are rope bytes read as float32 (maybe NaN): `where`
    # keeps them out of the sums.
    return [jnp.sum(jnp.where(col == g, words, 0.0), axis=1) for g in groups]


def _fp8_rope(lay: _Launch, cta: _Cta):
    """The tile's 64 rope values per row, bfloat16 [64, 64] in the WGMMA layout."""
    at = _ROPE_AT[lay.cfg.row_copies]
    if lay.interpret:
        b = _load(lay, cta.stage.at[:, pl.ds(at, 2 * kvf.ROPE_DIM)])
        return lax.bitcast_convert_type(b.reshape(BKV, kvf.ROPE_DIM, 2), jnp.bfloat16)
    return _load(lay, cta.stage_bf16.at[:, pl.ds(at // 2, kvf.ROPE_DIM)], _convert_layout(lay))


def _scores(lay: _Launch, cta: _Cta, bias):
    """S = scale2 * Q K^T of the KV tile ([64, 64] fp32, all 576 columns), -inf where the
    row id is < 0 (`bias`)."""
    def qk(acc_ref):
        plgpu.wgmma(acc_ref, cta.q_smem, cta.kv_tile.transpose((1, 0)))
        return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BKV), jnp.float32))
    return s * lay.scale2 + lax.broadcast_in_dim(bias, s.shape, [1])


def _accumulate_pv(lay: _Launch, cta: _Cta, w: int, p, acc, p_smem=None):
    """acc + P V_w: P [64, 64] in bf16 (registers `p`, or shared memory `p_smem` already
    written and fenced) times value columns [256 w, 256 w + 256)."""
    v_ref = cta.kv_tile.at[:, pl.ds(w * _V_HALF, _V_HALF)]
    if p_smem is None and lay.interpret:   # the interpreter has no register-A wgmma
        p_smem = cta.p_scratch.at[w]
        p_smem[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()
    if lay.interpret:                      # nor run_state: a fresh accumulator, added
        def pv_fresh(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(pv_fresh, plgpu.ACC((BLOCK_H, _V_HALF), jnp.float32))
    a = p.astype(jnp.bfloat16) if p_smem is None else p_smem

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, a, v_ref)
    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _write_output(lay: _Launch, cta: _Cta, w: int, acc, m_i, l_i) -> None:
    """Consumer w's normalised output columns (and from consumer 0 the base-2 lse) to GMEM
    through the SMEM that held Q; with share_p consumer 1 takes consumer 0's l."""
    if lay.share_p and w == 0:
        cta.stats[1] = l_i
        plgpu.commit_smem()
    plgpu.barrier_arrive(cta.bars.done)
    plgpu.barrier_wait(cta.bars.done)
    if lay.share_p and w == 1:
        l_i = plgpu.load(cta.stats.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
    inv_l = 1.0 / jnp.maximum(l_i, 1e-30)     # all-masked: acc = 0, l = 0 -> out 0
    o_smem = cta.o_smem2.at[w]
    o_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(jnp.bfloat16)
    if w == 0:
        cta.lse_smem[...] = m_i + jnp.log2(l_i)
    plgpu.commit_smem()
    heads = pl.ds(cta.hblk * BLOCK_H, BLOCK_H)
    plgpu.copy_smem_to_gmem(o_smem, cta.out_ref.at[cta.row, cta.split, heads,
                                                   pl.ds(w * _V_HALF, _V_HALF)])
    if w == 0:
        plgpu.copy_smem_to_gmem(cta.lse_smem, cta.lse_ref.at[cta.row, cta.split, heads])
    plgpu.wait_smem_to_gmem(0)
