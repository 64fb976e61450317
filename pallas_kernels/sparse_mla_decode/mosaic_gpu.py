"""sparse_mla_decode as a Pallas Mosaic GPU kernel (Hopper, wgmma); jax >= 0.11.

Import this module only where jax has Mosaic GPU Pallas (`hisparse_jax.ops` loads it lazily).
Contract: `reference.sparse_mla_decode` (flat rows, -1 holes anywhere, ids outside [0, R)
holes too, all-invalid rows give out = 0 and lse = -inf). The Triton kernel (`triton.py`) is
the default on the GPU: this one must copy each selected row as D/64 separate TMA boxes
(figures in `bench/NOTES-sparse_mla.md`).

The "mosaic_gpu" backend has a second kernel, `mosaic_gpu_fp8.py`, which moves each row with one
bulk copy and rewrites it into the wgmma layout in SMEM: it runs fp8_ds_mla rows (always) and
bf16 rows when the config is a `mosaic_gpu_fp8.RowTuning` (`sparse_mla_decode` dispatches).

Design (one CTA per (query row, block of 64 heads, K split)):
  * 2 compute warpgroups + `producer_wgs` copy warpgroups (warp specialisation, as in
    jax's attention_mgpu.py). Q [64, D] sits in SMEM for the whole CTA; KV rows stream
    through a `num_stages`-deep SMEM ring of [block_kv, D] tiles.
  * Gather: the producer reads the tile's row ids from SMEM (one TMA of block_kv int32) and
    copies each selected row as D/64 TMA boxes of [1, 64] (128 B, swizzle 128) straight into
    the wgmma layout. Pallas can't slice one row out of an (8, 64)-tiled SMEM ref, so the ring
    is a `RefUnion` of the tiled view (read by wgmma) and its physical view
    [stage, block_kv/8, D/64, 8, 64] (written by the row copies); the hardware swizzles by
    SMEM address, so a lone 128-B line lands where a full-tile copy would put it.
    A masked entry must still fill its SMEM row (the tile is one wgmma operand), but it never
    copies a row nobody selected: the wrapper encodes it as `-1 - r`, r a row that the same
    query row selects (`redirect_masked`), the producer copies row max(id, -1 - id) and the
    consumer masks every id < 0 to -inf. So the tile holds only rows the query row selects:
    a NaN / Inf in an unselected row cannot reach P V (P = 0 times a NaN row would be NaN).
    A query row with no valid entry copies row 0 (garbage allowed); the wrapper writes its
    out = 0 and lse = -inf after the kernel.
  * Compute: S = Q K^T ([64, block_kv], fp32, contraction over all D) is computed by *both*
    compute warpgroups (identical results), online softmax in base 2, then warpgroup w
    accumulates O[:, w*v/2:(w+1)*v/2] += P V_w: a 64 x 512 fp32 accumulator needs 256
    registers per thread, more than one warpgroup has, so the value columns are split and
    the (cheaper, 53% of the flops) QK product is duplicated.
  * K splits (flash-decoding) fill the GPU when N * head_blocks is small; the wrapper
    combines the per-split (out, lse) in float32.
  * h_q < 64 is padded to 64 heads (wgmma M = 64): memory-bound there anyway.
The kernel (`_body`) as stages: the producers' row copies (`_produce`, `_load_tile`); per
tile the compute warpgroups' scores (`_scores`), online-softmax update (`_softmax_update`)
and value product (`_accumulate_pv`); then the output (`_write_output`).

`interpret=True` runs the same kernel under Mosaic GPU interpret mode on the CPU (jax 0.11+):
the only difference is that row copies target the tiled view directly (the interpreter
models refs logically, not by address), so everything but the physical-view aliasing and
the hardware swizzle is checked on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _compat
from pallas_kernels import kv_format as kvf
from pallas_kernels.sparse_mla_decode.reference import LOG2E, M_INIT, merge_splits, pad_operands

BLOCK_H = 64          # heads per CTA: the wgmma M of one warpgroup
_CHUNK = 64           # 128-byte swizzle: 64 bf16 columns per tile column
_NUM_SMS = 132        # H100/H200 SXM; only used to choose the number of K splits
_SMEM_BYTES = 232448  # opt-in shared memory per block on Hopper (227 KiB)


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Knobs of the kernel; the only bag of tuning parameters.

    block_kv: KV rows per pipeline step (wgmma N of Q K^T, K of P V); multiple of 64.
    num_stages: depth of the KV SMEM ring (Q 72 KiB + num_stages * block_kv * D * 2 B <= 227 KiB;
      1 = no overlap of gather and compute, the simple variant).
    producer_wgs: warpgroups that issue the row copies (1 or 2; more issuing threads).
    num_splits: K splits per (row, head block); None = enough CTAs to fill the GPU.
    compute_registers / producer_registers: setmaxnreg targets; 128 * (2 * compute +
      producer_wgs * producer) must be <= 65536 (None: the most that fits, at most 40).
    """

    block_kv: int = 64
    num_stages: int = 2
    producer_wgs: int = 1
    num_splits: int | None = None
    compute_registers: int = 232
    producer_registers: int | None = None

    def __post_init__(self) -> None:
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            # P V contracts over block_kv with a 128-byte-swizzled V: K % 64 == 0.
            raise ValueError(f"TuningConfig.block_kv must be a multiple of 64 in [64, 256], "
                             f"got {self.block_kv}")
        if self.num_stages < 1:
            raise ValueError(f"TuningConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.producer_wgs not in (1, 2):
            raise ValueError(f"TuningConfig.producer_wgs must be 1 or 2, got {self.producer_wgs}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"TuningConfig.num_splits must be None or >= 1, got {self.num_splits}")
        if self.producer_registers is None:
            spare = (512 - 2 * self.compute_registers) // self.producer_wgs
            object.__setattr__(self, "producer_registers", max(24, min(40, spare // 8 * 8)))
        regs = 128 * (2 * self.compute_registers + self.producer_wgs * self.producer_registers)
        if regs > 65536:
            raise ValueError(f"TuningConfig registers exceed the 64K register file: {regs}")


DEFAULT = TuningConfig()


def supports(q, kv_rows, attention_rows=None, *, sm_scale: float | None = None,
             v_width: int = 512, kv_format: str = kvf.BF16,
             interpret: bool = False, device_check: bool = True) -> str | None:
    """None when this backend handles the inputs (arrays or `jax.ShapeDtypeStruct`s with the
    arguments of `sparse_mla_decode`), else the reason. "bf16" rows: bf16/f16, D % 64 == 0,
    v_width a multiple of 128 and <= 512; "fp8_ds_mla" rows: the row-copy kernel's rules
    (`mosaic_gpu_fp8.supports`); a Hopper GPU (unless `device_check` is False: the kernel
    entries, which may lower for CUDA on another host), or with `interpret` a jax with Mosaic
    GPU interpret mode."""
    if kvf.check_kv_format(kv_format) != kvf.BF16:
        from pallas_kernels.sparse_mla_decode import mosaic_gpu_fp8

        return mosaic_gpu_fp8.supports(q, kv_rows, attention_rows, sm_scale=sm_scale,
                                       v_width=v_width, kv_format=kv_format,
                                       interpret=interpret, device_check=device_check)
    del kv_rows, attention_rows, sm_scale
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the mosaic_gpu kernel needs bfloat16 or float16 inputs, got {q.dtype}"
    width = q.shape[-1]
    if width % _CHUNK:
        return f"the mosaic_gpu kernel needs the row width to be a multiple of 64, got {width}"
    if v_width % 128 or v_width > min(512, width):
        return f"the mosaic_gpu kernel needs v_width a multiple of 128 and <= 512, got {v_width}"
    return platform_reason(interpret, device_check)


def platform_reason(interpret: bool, device_check: bool = True) -> str | None:
    """Where the Mosaic GPU kernels run: a Hopper GPU (checked when `device_check`), or
    interpret mode (jax >= 0.11)."""
    if interpret:
        if not _compat.mosaic_gpu_interpret_available():
            return (f"the mosaic_gpu kernel runs off the GPU only in Mosaic GPU interpret "
                    f"mode, which jax {jax.__version__} lacks (jax >= 0.11 has it)")
        return None
    other = _compat.not_hopper() if device_check else None
    if other is not None:
        return f"the mosaic_gpu kernel needs a Hopper GPU (wgmma), got {other}"
    return None


def _choose_splits(num_rows: int, head_blocks: int, num_tiles: int, cfg: TuningConfig) -> int:
    """Largest useful K split count: about one wave of CTAs, >= 2 tiles per split."""
    if cfg.num_splits is not None:
        want = cfg.num_splits
    else:
        ctas = num_rows * head_blocks
        want = max(1, _NUM_SMS // max(ctas, 1))
        want = min(want, max(1, num_tiles // 2))
    want = max(1, min(want, num_tiles))
    while num_tiles % want:
        want -= 1
    return want


@dataclasses.dataclass(frozen=True)
class _Launch:
    """The static shape of one launch: KV tiles of `bkv` rows, `tiles_per_split` of them per
    CTA through a `stages`-deep SMEM ring; rows `width` wide (`n_chunks` TMA boxes of
    `_CHUNK` columns); each compute warpgroup accumulates `v_half` value columns; `n_prod`
    producer warpgroups copy the rows; `scale2` = sm_scale * log2(e)."""

    tiles_per_split: int
    stages: int
    bkv: int
    width: int
    n_chunks: int
    v_half: int
    dtype: Any
    n_prod: int
    scale2: float
    cfg: TuningConfig
    interpret: bool

    @property
    def rows_per_producer(self) -> int:
        return self.bkv // self.n_prod


class _Cta(NamedTuple):
    """One CTA's grid position (head block, K split, query row; its first KV tile `tile0`)
    and refs: the operands and outputs in GMEM, then the scratch (`_scratch_types`): Q, then
    O ([2, 64, v/2], one half per compute warpgroup) in one SMEM union; the KV ring as the
    tiled view wgmma reads and (on the GPU) the physical view the row copies write; each
    tile's row ids; the lse staging; the barriers; P's SMEM under the interpreter."""

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
    kv_tiled: Any
    kv_phys: Any
    idx_smem: Any
    lse_smem: Any
    q_bar: Any
    idx_bar: Any
    kv_bar: Any
    consumed_bar: Any
    done_bar: Any
    p_scratch: Any


def _body(lay: _Launch, q_ref, kv_ref, rows_ref, out_ref, lse_ref, qo_union, kv_union,
          idx_smem, lse_smem, q_bar, idx_bar, kv_bar, consumed_bar, done_bar, p_scratch=None):
    """The kernel: warpgroups 0 and 1 compute (`_compute`), the rest copy rows
    (`_produce`)."""
    hblk = lax.axis_index("hblk")
    split = lax.axis_index("split")
    row = lax.axis_index("row")
    wg = lax.axis_index("wg")
    q_smem, o_smem2 = qo_union
    if lay.interpret:
        kv_tiled = kv_union
        kv_phys = None
    else:
        kv_tiled, kv_phys = kv_union
    tile0 = split * lay.tiles_per_split
    cta = _Cta(hblk, split, row, tile0, q_ref, kv_ref, rows_ref, out_ref, lse_ref, q_smem,
               o_smem2, kv_tiled, kv_phys, idx_smem, lse_smem, q_bar, idx_bar, kv_bar,
               consumed_bar, done_bar, p_scratch)
    for w in range(2):
        pl.when(wg == w)(functools.partial(_compute, lay, cta, w))
    for pw in range(lay.n_prod):
        pl.when(wg == 2 + pw)(functools.partial(_produce, lay, cta, pw))


def _compute(lay: _Launch, cta: _Cta, w: int) -> None:
    """Compute warpgroup w: full S, value columns [w * v_half, (w + 1) * v_half)."""
    plgpu.set_max_registers(lay.cfg.compute_registers, action="increase")

    @pl.when(w == 0)
    def _():
        plgpu.copy_gmem_to_smem(cta.q_ref.at[cta.row, pl.ds(cta.hblk * BLOCK_H, BLOCK_H)],
                                cta.q_smem, cta.q_bar)
    plgpu.barrier_wait(cta.q_bar)

    m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), M_INIT, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.full((BLOCK_H, lay.v_half), 0.0, jnp.float32),
                            plgpu.Layout.WGMMA)

    def step(t, carry):
        acc, m_i, l_i = carry
        slot = lax.rem(t, lay.stages)
        plgpu.barrier_wait(cta.idx_bar.at[slot])
        plgpu.barrier_wait(cta.kv_bar.at[slot])
        s = _scores(lay, cta, slot)
        p, m_new, l_i, acc = _softmax_update(s, m_i, l_i, acc)
        acc = _accumulate_pv(lay, cta, w, slot, p, acc)
        plgpu.barrier_arrive(cta.consumed_bar.at[slot])
        return acc, m_new, l_i

    acc, m_i, l_i = lax.fori_loop(0, lay.tiles_per_split, step, (acc, m_i, l_i))
    _write_output(lay, cta, w, acc, m_i, l_i)


def _scores(lay: _Launch, cta: _Cta, slot) -> jax.Array:
    """S = scale2 * Q K^T of ring slot `slot` ([64, bkv] fp32, contraction over all D), -inf
    at the masked entries (row id < 0)."""
    def qk(acc_ref):
        plgpu.wgmma(acc_ref, cta.q_smem, cta.kv_tiled.at[slot].transpose((1, 0)))
        return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, lay.bkv), jnp.float32))
    ids = plgpu.load(cta.idx_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
    bias = jnp.where(ids >= 0, 0.0, -jnp.inf).astype(jnp.float32)
    return s * lay.scale2 + lax.broadcast_in_dim(bias, s.shape, [1])


def _softmax_update(s, m_i, l_i, acc):
    """One online-softmax step in base 2: (P, the new running max and sum, acc rescaled)."""
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, m_new, l_i, acc


def _accumulate_pv(lay: _Launch, cta: _Cta, w: int, slot, p, acc):
    """acc + P V_w: P [64, bkv] in the input dtype times warpgroup w's value columns of the
    ring slot."""
    v_ref = cta.kv_tiled.at[slot, :, pl.ds(w * lay.v_half, lay.v_half)]
    p16 = p.astype(lay.dtype)
    if lay.interpret:
        # The interpreter has neither run_state nor register-A wgmma: P goes
        # through SMEM and the product is added in registers (same math).
        p_smem = cta.p_scratch.at[w]
        p_smem[...] = p16
        plgpu.commit_smem()

        def pv_fresh(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_ref)
            return acc_ref[...]
        return acc + pl.run_scoped(pv_fresh, plgpu.ACC((BLOCK_H, lay.v_half), jnp.float32))

    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_ref)
    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _write_output(lay: _Launch, cta: _Cta, w: int, acc, m_i, l_i) -> None:
    """Warpgroup w's normalised output columns (and, from warpgroup 0, the base-2 lse) to
    GMEM through SMEM."""
    # Both warpgroups are done with Q before Q's SMEM (aliased by o_smem2) holds O.
    plgpu.barrier_arrive(cta.done_bar)
    plgpu.barrier_wait(cta.done_bar)
    inv_l = 1.0 / jnp.maximum(l_i, 1e-30)   # all-masked row: acc = 0, l = 0 -> out 0
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    o_smem = cta.o_smem2.at[w]
    o_smem[...] = out.astype(lay.dtype)
    if w == 0:
        cta.lse_smem[...] = m_i + jnp.log2(l_i)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        o_smem, cta.out_ref.at[cta.row, cta.split, pl.ds(cta.hblk * BLOCK_H, BLOCK_H),
                               pl.ds(w * lay.v_half, lay.v_half)])
    if w == 0:
        plgpu.copy_smem_to_gmem(cta.lse_smem, cta.lse_ref.at[cta.row, cta.split,
                                                             pl.ds(cta.hblk * BLOCK_H, BLOCK_H)])
    plgpu.wait_smem_to_gmem(0)


def _produce(lay: _Launch, cta: _Cta, pw: int) -> None:
    """Producer warpgroup pw: rows pw, pw + n_prod, ... of every tile."""
    plgpu.set_max_registers(lay.cfg.producer_registers, action="decrease")
    stages, tiles_per_split = lay.stages, lay.tiles_per_split
    for t in range(stages):
        _load_tile(lay, cta, pw, t, t)

    def refill(t, c):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(cta.consumed_bar.at[slot])
        _load_tile(lay, cta, pw, t, slot)
        return c
    lax.fori_loop(stages, tiles_per_split, refill, None)
    # Observe the last consumption of every slot before exiting (barrier phases are
    # then balanced; the interpreter checks this, the hardware does not need it).
    for t in range(max(tiles_per_split - stages, 0), tiles_per_split):
        plgpu.barrier_wait(cta.consumed_bar.at[t % stages])


def _load_tile(lay: _Launch, cta: _Cta, pw: int, t, slot) -> None:
    """Producer pw's rows of the CTA's tile t into ring slot `slot`: producer 0 first copies
    the tile's row ids to SMEM; each row moves as `n_chunks` [1, 64] TMA boxes."""
    if pw == 0:
        plgpu.copy_gmem_to_smem(cta.rows_ref.at[cta.row, cta.tile0 + t], cta.idx_smem.at[slot],
                                cta.idx_bar.at[slot])
    plgpu.barrier_wait(cta.idx_bar.at[slot])

    def copy_row(i, c):
        j = i * lay.n_prod + pw
        ident = cta.idx_smem[slot, j]
        src_row = jnp.maximum(ident, -1 - ident)   # masked -1 - r -> r (selected)
        for ch in range(lay.n_chunks):
            src = cta.kv_ref.at[pl.ds(src_row, 1), pl.ds(ch * _CHUNK, _CHUNK)]
            if cta.kv_phys is None:
                dst = cta.kv_tiled.at[slot, pl.ds(j, 1), pl.ds(ch * _CHUNK, _CHUNK)]
            else:
                dst = cta.kv_phys.at[slot, j // 8, ch, pl.ds(j % 8, 1)]
            plgpu.copy_gmem_to_smem(src, dst, cta.kv_bar.at[slot])
        return c
    lax.fori_loop(0, lay.rows_per_producer, copy_row, None)


def _scratch_types(lay: _Launch) -> list:
    """The kernel's SMEM scratch and barriers, in `_body`'s order."""
    stages, bkv, width, dtype = lay.stages, lay.bkv, lay.width, lay.dtype
    swz = plgpu.SwizzleTransform(128)
    tiled = (plgpu.TilingTransform((8, _CHUNK)), swz)
    kv_tiled_t = plgpu.SMEM((stages, bkv, width), dtype, transforms=tiled)
    if lay.interpret:
        kv_scratch = kv_tiled_t
    else:
        kv_phys_t = plgpu.SMEM((stages, bkv // 8, lay.n_chunks, 8, _CHUNK), dtype,
                               transforms=(swz,))
        kv_scratch = plgpu.RefUnion(kv_tiled_t, kv_phys_t)
    scratch = [
        plgpu.RefUnion(plgpu.SMEM((BLOCK_H, width), dtype, transforms=tiled),        # Q,
                       plgpu.SMEM((2, BLOCK_H, lay.v_half), dtype, transforms=tiled)),  # then O
        kv_scratch,
        plgpu.SMEM((stages, bkv), jnp.int32),                           # row ids of each tile
        plgpu.SMEM((BLOCK_H,), jnp.float32),                            # lse staging
        plgpu.Barrier(),                                                # Q landed
        plgpu.Barrier(num_barriers=stages),                             # row ids landed
        plgpu.Barrier(num_arrivals=bkv * lay.n_chunks, num_barriers=stages),  # KV tile landed
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),             # KV tile consumed
        plgpu.Barrier(num_arrivals=2),                                  # compute done
    ]
    if lay.interpret:
        scratch.append(plgpu.SMEM((2, BLOCK_H, bkv), dtype, transforms=(
            plgpu.TilingTransform((8, min(bkv, _CHUNK))), plgpu.SwizzleTransform(
                min(bkv, _CHUNK) * 2))))
    return scratch


def _kernel_call(q, kv_rows, rows3, *, scale2: float, v_width: int, num_splits: int,
                 cfg: TuningConfig, interpret: bool):
    """q [T, Hp, D] (Hp % 64 == 0), kv_rows [R, D], rows3 int32 [T, n_tiles, block_kv].

    Returns out [T, S, Hp, v_width] (q.dtype, normalised within each split) and
    lse2 [T, S, Hp] float32 (base-2 log-sum-exp of scale2 * q.k).
    """
    num_rows, h_pad, width = q.shape
    _, num_tiles, bkv = rows3.shape
    head_blocks = h_pad // BLOCK_H
    tiles_per_split = num_tiles // num_splits
    stages = min(cfg.num_stages, tiles_per_split)
    smem_bytes = (BLOCK_H * width + stages * bkv * width) * q.dtype.itemsize + 4096
    if smem_bytes > _SMEM_BYTES:
        raise ValueError(f"TuningConfig(block_kv={bkv}, num_stages={stages}) needs about "
                         f"{smem_bytes} B of shared memory at D={width}; the limit is "
                         f"{_SMEM_BYTES}")
    lay = _Launch(tiles_per_split=tiles_per_split, stages=stages, bkv=bkv, width=width,
                  n_chunks=width // _CHUNK, v_half=v_width // 2, dtype=q.dtype,
                  n_prod=cfg.producer_wgs, scale2=scale2, cfg=cfg, interpret=interpret)

    def body(*refs):                   # plgpu.kernel names the kernel after its function
        _body(lay, *refs)

    out_type = (
        jax.ShapeDtypeStruct((num_rows, num_splits, h_pad, v_width), q.dtype),
        jax.ShapeDtypeStruct((num_rows, num_splits, h_pad), jnp.float32),
    )
    kwargs = {}
    if interpret:
        kwargs["interpret"] = plgpu.InterpretGPUParams()
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=_scratch_types(lay),
        grid=(head_blocks, num_splits, num_rows),
        grid_names=("hblk", "split", "row"),
        num_threads=2 + lay.n_prod,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kwargs,
    )
    return kernel(q, kv_rows, rows3)


def sparse_mla_decode(q: jax.Array, kv_rows: jax.Array, attention_rows: jax.Array, *,
                      sm_scale: float, v_width: int = 512, kv_format: str = kvf.BF16,
                      interpret: bool = False, tuning: Any = None
                      ) -> tuple[jax.Array, jax.Array]:
    """Backend entry on validated inputs: fp8_ds_mla rows, or a `mosaic_gpu_fp8.RowTuning`
    config, run the row-copy kernel (`mosaic_gpu_fp8.sparse_mla_decode`); bf16 rows with a
    `TuningConfig` (or None) the TMA-box kernel of this module (`_tma_kernel_decode`).
    Arguments and results as in those."""
    from pallas_kernels.sparse_mla_decode import mosaic_gpu_fp8

    if kvf.check_kv_format(kv_format) != kvf.BF16 or isinstance(tuning, mosaic_gpu_fp8.RowTuning):
        if tuning is not None and not isinstance(tuning, mosaic_gpu_fp8.RowTuning):
            raise ValueError(f"the mosaic_gpu backend reads {kv_format} rows with its row-copy "
                             f"kernel, whose config is a mosaic_gpu_fp8.RowTuning, got "
                             f"{type(tuning).__name__}")
        return mosaic_gpu_fp8.sparse_mla_decode(q, kv_rows, attention_rows, sm_scale=sm_scale,
                                                v_width=v_width, kv_format=kv_format,
                                                interpret=interpret, tuning=tuning)
    return _tma_kernel_decode(q, kv_rows, attention_rows, sm_scale=sm_scale, v_width=v_width,
                              interpret=interpret, tuning=tuning)


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "interpret", "tuning"))
def _tma_kernel_decode(q: jax.Array, kv_rows: jax.Array, attention_rows: jax.Array, *,
                       sm_scale: float, v_width: int = 512, interpret: bool = False,
                       tuning: TuningConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """This module's kernel on validated inputs: q [T, h_q, D] bf16/f16, kv_rows [R, D] of q's
    dtype, attention_rows int32 [T, K] (-1 = masked).

    Returns out [T, h_q, v_width] in q.dtype and lse float32 [T, h_q] (natural log).
    Raises ValueError with `supports`' reason for inputs it cannot run.
    """
    cfg = tuning or DEFAULT
    num_rows, h_q, width = q.shape
    top_k = attention_rows.shape[1]
    reason = supports(q, kv_rows, v_width=v_width, interpret=interpret, device_check=False)
    if reason is not None:
        raise ValueError(reason)
    bkv = cfg.block_kv
    h_pad = pl.cdiv(h_q, BLOCK_H) * BLOCK_H
    num_tiles = pl.cdiv(top_k, bkv)
    splits = _choose_splits(num_rows, h_pad // BLOCK_H, num_tiles, cfg)
    # An entry outside [0, R) is masked as -1 is (the contract): never gathered.
    attention_rows = jnp.where(attention_rows < kv_rows.shape[0], attention_rows, -1)
    q_pad, rows = pad_operands(q, attention_rows, h_pad, num_tiles * bkv)
    rows3 = redirect_masked(rows).reshape(num_rows, num_tiles, bkv)
    out, lse2 = _kernel_call(q_pad, kv_rows, rows3, scale2=float(sm_scale) * LOG2E,
                             v_width=v_width, num_splits=splits, cfg=cfg, interpret=interpret)
    out, lse = merge_splits(out, lse2, h_q, q.dtype)
    # A query row with no valid entry copied row 0 for its tiles: whatever the kernel made of
    # it, the contract is out 0 and lse -inf.
    any_valid = jnp.any(attention_rows >= 0, axis=1)
    out = jnp.where(any_valid[:, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(any_valid[:, None], lse, -jnp.inf)
    return out, lse


def redirect_masked(rows: jax.Array) -> jax.Array:
    """The kernel's row ids: rows int32 [T, K] (-1 = masked) with each masked entry of query
    row t replaced by `-1 - r`, r = the first valid entry of row t (0 when row t has none).

    Still < 0 where masked (the score mask); `max(id, -1 - id)` is the row to copy: the
    entry's own row, or r, a row that query row t selects anyway.
    """
    valid = rows >= 0
    first = jnp.take_along_axis(rows, jnp.argmax(valid, axis=1)[:, None], axis=1)
    first = jnp.maximum(first, 0)            # no valid entry: row 0 (the wrapper zeroes out)
    return jnp.where(valid, rows, -1 - first)
