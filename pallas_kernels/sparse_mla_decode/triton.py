"""sparse_mla_decode as a Pallas kernel through the Triton lowering.

Contract of `reference.sparse_mla_decode`: q [T, h_q, D], flat rows kv_rows [R, D], row ids
int32 [T, K] with -1 holes anywhere (an id outside [0, R) is a hole too: never read); out
[T, h_q, v_width] in q's dtype, natural-log lse float32 [T, h_q]; a row with no valid entry
gives out = 0 and lse = -inf.

Why Triton: the selected rows are gathered as [block_k, 512] tiles with vector loads; Mosaic
GPU has no vector-index gather on Hopper (`pallas_kernels/_triton.py`,
`sparse_mla_decode/mosaic_gpu.py`).

Design: one program per (block of `block_h` heads, K split, query row); the head block is the
fastest grid axis so that the programs sharing a query row's selected rows run together (the
second read of a row hits L2). Per step it gathers `block_k` selected rows as a [block_k, 512]
latent tile and a [block_k, 64] rope tile (Triton needs power-of-two shapes: the 576-wide row
moves as 512 + 64), computes S = q_nope k_nope^T + q_rope k_rope^T in fp32, an online softmax
in base 2 (running max starts at the finite `M_INIT` so fully masked tiles stay NaN-free), and
acc += P k_nope. A -1 entry loads nothing (masked load: the row it would address is never
read, so a NaN or Inf there cannot reach an output) and scores -inf. A NaN query head gives
NaN out and NaN lse for that head. K splits (flash-decoding) are combined in float32 by the
one-launch kernel of `combine.py` (`AttentionTuning.fused_combine`; else by
`reference.merge_splits`).

fp8 rows (`kv_format="fp8_ds_mla"`, uint8[656], layout in `pallas_kernels/kv_format.py`): the
same program and online softmax; only the K-tile read differs (`triton_tiles.read_fp8_rows`):
the latent arrives as byte tiles converted in registers (float8_e4m3fn -> bf16 is exact), the 4
float32 scales and the 64 bf16 rope values are assembled from their bytes with integer shifts
and same-width bitcasts (the Triton lowering bitcasts only between equal widths; how the bytes
are taken apart: `AttentionTuning.fp8_words`). Where the scales enter is
`AttentionTuning.fp8_scale`: by default ("scores") per row, not per element: group g's partial
score q_g . k_g is multiplied by scale_g (a [block_k] vector broadcast over the heads), and P
times scale_g feeds group g's value product, whose [block_h, 128] accumulator is one of four,
so the bf16 operands are the stored fp8 values exactly and the scales enter in float32.
"tiles" / "tile512" multiply the scales into the tile and round it to bf16 once (as bf16 rows
are rounded), so the dots and the conversion of P are those of bf16 rows.

`sparse_mla_decode_with_copies`: the same attention and, in the same launch, another index
group's copies from host (`gather_compact.triton`'s kernel): the launch's first P programs
loop over the copy plan, the others are the attention's programs in their grid order, so the
copies (bound by PCIe) overlap the attention (bound by HBM and the tensor cores) on the GPU.

This module plans the launch (tuning, K splits, padding) and merges the splits; the program
itself is `triton_body.attention_kernel`, the K-tile readers of each row format are in
`triton_tiles.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat, _triton
from pallas_kernels import kv_format as kvf
from pallas_kernels.gather_compact import triton as gather_triton
from pallas_kernels.sparse_mla_decode import combine
from pallas_kernels.sparse_mla_decode import triton_tiles as tiles
from pallas_kernels.sparse_mla_decode.reference import LOG2E, merge_splits, pad_operands
from pallas_kernels.sparse_mla_decode.triton_body import attention_kernel

FP8_WORDS = ("contiguous", "strided", "split")
FP8_SCALE = ("scores", "tiles", "tile512")


@dataclasses.dataclass(frozen=True)
class AttentionTuning:
    """Knobs of the Triton sparse MLA kernel.

    block_h: heads per program (power of two, 16..64); None = min(64, next power of two of
      h_q, at least 16). 64 heads x 512 fp32 accumulator = 128 registers/thread at 8 warps.
    block_k: selected rows gathered per step (power of two, 16..128).
    num_warps: warps per program (4, 8 or 16); None = 8 for block_h 64, else 4 (16 warps at
      64 heads halve the accumulator's registers per thread).
    num_stages: Triton software-pipelining depth of the K loop (K tiles in flight).
    num_splits: K splits per (row, head block); None = about two waves of programs.
    prefetch_ids: load each step's row ids one step ahead (loop carry), so the K-tile gather's
      addresses are ready at the top of the step and Triton's pipeliner can issue it ahead.
    prefetch_tiles: software pipelining by hand, in registers: step i issues the gather of
      step i + 1's K tile (and the load of step i + 2's ids) before its own dots, and carries
      the tile to the next step; meant with num_stages=1 (Triton's pipeliner off). Implies
      the id prefetch. Same arithmetic in the same order as without.
    fp8_words: how "fp8_ds_mla" rows' scale (float32) and rope (bf16) words are assembled from
      their bytes (`triton_tiles._load_words`): "contiguous" (one 16-byte-aligned load per
      row, reshaped to [block_k, words, bytes] and combined with a sum), "strided" (one
      strided load per byte position, no 3-D reshape) or "split" (the contiguous load, its
      byte pairs taken apart with `lax.unstack` of a trailing size-2 axis, Triton's `split`:
      no reduction; the per-group scales come out of the [block_k, 4] tile the same way, not
      through masked sums). Ignored for "bf16" rows.
    fp8_scale: where "fp8_ds_mla" rows' per-group scales enter (`triton_tiles.read_fp8_rows`):
      "scores" (the bf16 tiles are the stored fp8 values; group g's partial scores and the P
      of its value product are multiplied by scale g: 4 + 4 dots, P converted per group),
      "tiles" (each [block_k, 128] group tile is multiplied by its scale and rounded to bf16
      once: 4 score dots summed unscaled, 4 value dots sharing one bf16 P) or "tile512" (the
      same as one [block_k, 512] tile: one score dot of K = 512 and one value dot of N = 512).
      "tiles" and "tile512" round the dequantized values to bf16, as bf16 rows are.
    fused_combine: merge the K splits with the one-launch Pallas kernel of `combine.py`;
      False runs the jnp `reference.merge_splits` (three XLA fusions on the GPU), kept for
      benchmarking against it. No effect with one split.
    The field defaults are the kernel's default for fp8_ds_mla rows below 64 heads
    (`DEFAULT_FP8`); its default for bf16 rows is `DEFAULT`.
    """

    block_h: int | None = None
    block_k: int = 32
    num_warps: int | None = None
    num_stages: int = 3
    num_splits: int | None = None
    prefetch_ids: bool = True
    prefetch_tiles: bool = False
    fp8_words: str = "contiguous"
    fp8_scale: str = "scores"
    fused_combine: bool = True

    def __post_init__(self) -> None:
        if self.block_h is not None and (not _triton.is_pow2(self.block_h)
                                         or not 16 <= self.block_h <= 64):
            raise ValueError(f"AttentionTuning.block_h must be None or a power of two in "
                             f"[16, 64], got {self.block_h}")
        if not _triton.is_pow2(self.block_k) or not 16 <= self.block_k <= 128:
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
        if self.fp8_words not in FP8_WORDS:
            raise ValueError(f"AttentionTuning.fp8_words must be one of {FP8_WORDS}, "
                             f"got {self.fp8_words!r}")
        if self.fp8_scale not in FP8_SCALE:
            raise ValueError(f"AttentionTuning.fp8_scale must be one of {FP8_SCALE}, "
                             f"got {self.fp8_scale!r}")


# bf16 rows: 64-row K tiles, 2 stages, Triton's own pipelining of the indirect load (no id
# carry): the fastest bf16 configuration, or tied for it, at few and at many heads in the
# sweep recorded in `bench/NOTES-sparse_mla.md`. fp8_ds_mla rows with h_q < 64 keep
# `AttentionTuning()` (32-row tiles, 3 stages, id carry), the choice of their own sweep.
DEFAULT = AttentionTuning(block_k=64, num_stages=2, prefetch_ids=False)
DEFAULT_FP8 = AttentionTuning()
# fp8_ds_mla rows with 64 heads or more per program: scales folded into the tiles and the
# words split from byte pairs (the fastest fp8 candidate of `bench/ops/sparse_mla_decode.py`
# with that many heads; with few heads `DEFAULT_FP8` is faster: `bench/NOTES-sparse_mla.md`).
DEFAULT_FP8_WIDE = AttentionTuning(fp8_words="split", fp8_scale="tiles")


def supports(q, kv_rows, attention_rows=None, *, sm_scale: float | None = None,
             v_width: int = 512, kv_format: str = kvf.BF16,
             interpret: bool = False) -> str | None:
    """None when this kernel handles the inputs (arrays or `jax.ShapeDtypeStruct`s with the
    arguments of `sparse_mla_decode`; kv_rows may be [num_blocks, B, D]), else the reason.

    "bf16" rows: bf16/f16, v_width a power of two >= 16 and the rest of the row power-of-two
    pieces >= 16. "fp8_ds_mla" rows: uint8 [.., 656] rows of 576 values, a bfloat16 q and
    v_width a multiple of 128 up to 512 (whole scale groups). Both: a KV cache of < 2^31
    elements (row ids are int32 offsets).
    """
    del attention_rows, sm_scale, interpret
    width = q.shape[-1]
    kv_elems = math.prod(kv_rows.shape)
    if kv_elems >= 2**31:
        return (f"the triton kernel addresses the KV cache with int32 offsets: at most 2^31 - 1 "
                f"elements, got {kv_elems}")
    if kvf.check_kv_format(kv_format) == kvf.FP8_DS_MLA:
        if jnp.dtype(q.dtype) != jnp.dtype(jnp.bfloat16):
            return f"the triton kernel needs a bfloat16 q for {kv_format} rows, got {q.dtype}"
        if width != kvf.ROW_WIDTH or kv_rows.shape[-1] != kvf.FP8_ROW_BYTES \
                or jnp.dtype(kv_rows.dtype) != jnp.dtype(jnp.uint8):
            return (f"the triton kernel reads {kv_format} rows as uint8[{kvf.FP8_ROW_BYTES}] "
                    f"against a {kvf.ROW_WIDTH}-wide q; got q width {width}, rows "
                    f"{jnp.dtype(kv_rows.dtype).name}[{kv_rows.shape[-1]}]")
        if v_width % kvf.GROUP or not kvf.GROUP <= v_width <= kvf.LATENT_DIM:
            return (f"the triton kernel needs v_width a multiple of {kvf.GROUP} up to "
                    f"{kvf.LATENT_DIM} for {kv_format} rows (whole scale groups), "
                    f"got {v_width}")
        return None
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the triton kernel needs bfloat16 or float16 inputs, got {q.dtype}"
    if tiles.float_pieces(width, v_width) is None:
        return (f"the triton kernel needs v_width a power of two >= 16 and the rest of the row "
                f"(D - v_width = {width - v_width}) made of power-of-two pieces >= 16; "
                f"got D={width}, v_width={v_width}")
    return None


def _fp8_scale_mode(cfg: AttentionTuning, v_width: int) -> str:
    """`cfg.fp8_scale`, except "tile512" with v_width < 512 (a value tile narrower than the
    key tile, possibly not a power of two) runs as "tiles"."""
    if cfg.fp8_scale == "tile512" and v_width != kvf.LATENT_DIM:
        return "tiles"
    return cfg.fp8_scale


def _attention_splits(programs: int, num_chunks: int, cfg: AttentionTuning) -> int:
    """K splits per (row, head block): `cfg.num_splits`, else about two waves of programs
    with at least 4 K steps per split, or down to one step when 4-step splits would still
    leave the grid under a quarter of the SMs (one to two requests decoding: with so few
    programs the time is one program's chain of dependent K steps, which one-step splits
    cut, at the price of more partial rows to combine; `bench/attention_splits.py` measures
    it, `bench/NOTES-sparse_mla.md` has the figures). Always a divisor of the `num_chunks`
    steps (no all-padding step)."""
    if cfg.num_splits is not None:
        want = cfg.num_splits
    else:
        want = max(1, pl.cdiv(_triton.TARGET_PROGRAMS, max(programs, 1)))
        tiny_grid = programs * max(1, num_chunks // 4) < _triton.NUM_SMS // 4
        want = min(want, max(1, num_chunks // (1 if tiny_grid else 4)))
    want = max(1, min(want, num_chunks))
    while num_chunks % want:                            # no all-padding steps
        want -= 1
    return want


def _plan(q, kv_rows, attention_rows, *, sm_scale, v_width, kv_format, tuning):
    """The kernel's launch for validated inputs: (kernel, padded q, padded rows, grid
    (head blocks, splits, rows), the out / lse shapes, compiler params, the tuning used).
    Raises ValueError with `supports`' reason."""
    num_rows, h_q, width = q.shape
    if tuning is not None:
        cfg = tuning
    elif kv_format == kvf.FP8_DS_MLA:
        cfg = DEFAULT_FP8_WIDE if h_q >= 64 else DEFAULT_FP8
    else:
        cfg = DEFAULT
    top_k = attention_rows.shape[1]
    reason = supports(q, kv_rows, v_width=v_width, kv_format=kv_format)
    if reason is not None:
        raise ValueError(reason)
    fp8_scale = _fp8_scale_mode(cfg, v_width)
    if kv_format == kvf.FP8_DS_MLA:
        read = functools.partial(tiles.read_fp8_rows, value_groups=v_width // kvf.GROUP,
                                 words=cfg.fp8_words, scale=fp8_scale)
    else:
        read = functools.partial(tiles.read_float_rows, pieces=tiles.float_pieces(width, v_width))
    block_h = cfg.block_h or min(64, max(16, _triton.pow2_ceil(h_q)))
    num_warps = cfg.num_warps or (8 if block_h >= 64 else 4)
    bk = cfg.block_k
    h_pad = pl.cdiv(h_q, block_h) * block_h
    head_blocks = h_pad // block_h
    num_chunks = pl.cdiv(top_k, bk)
    splits = _attention_splits(num_rows * head_blocks, num_chunks, cfg)
    steps = pl.cdiv(num_chunks, splits)
    q_pad, rows = pad_operands(q, attention_rows, h_pad, splits * steps * bk)
    kernel = functools.partial(attention_kernel, block_h=block_h, block_k=bk, steps=steps,
                               q_pieces=tiles.q_pieces(width, v_width, kv_format, fp8_scale),
                               v_pieces=tiles.value_pieces(v_width, kv_format, fp8_scale),
                               read=read,
                               scale2=float(sm_scale) * LOG2E, prefetch_ids=cfg.prefetch_ids,
                               prefetch_tiles=cfg.prefetch_tiles)
    out_shape = [jax.ShapeDtypeStruct((num_rows, splits, h_pad, v_width), q.dtype),
                 jax.ShapeDtypeStruct((num_rows, splits, h_pad), jnp.float32)]
    return (kernel, q_pad, rows, (head_blocks, splits, num_rows), out_shape,
            _triton.compiler_params(num_warps, cfg.num_stages), cfg)


def _merge(out, lse2, h_q, dtype, splits, cfg, interpret):
    """The kernel's per-split outputs merged: (out [T, h_q, v] in dtype, natural-log lse)."""
    if splits == 1 or not cfg.fused_combine:
        return merge_splits(out, lse2, h_q, dtype)
    return combine.combine_splits(out, lse2, h_q, dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "kv_format", "interpret",
                                             "tuning"))
def sparse_mla_decode(
    q: jax.Array,
    kv_rows: jax.Array,
    attention_rows: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    kv_format: str = kvf.BF16,
    interpret: bool = False,
    tuning: AttentionTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Kernel entry on validated inputs: q [T, h_q, D] bf16/f16, kv_rows [R, D] of q's dtype
    ("bf16") or q [T, h_q, 576] bf16 with kv_rows uint8 [R, 656] ("fp8_ds_mla"),
    attention_rows int32 [T, K] (-1 = masked).

    Returns out [T, h_q, v_width] in q.dtype and lse float32 [T, h_q] (natural log).
    Raises ValueError with `supports`' reason for inputs it cannot run.
    """
    kernel, q_pad, rows, grid, out_shape, params, cfg = _plan(
        q, kv_rows, attention_rows, sm_scale=sm_scale, v_width=v_width, kv_format=kv_format,
        tuning=tuning)

    def call(q_pad, kv_rows, rows):
        return tuple(pl.pallas_call(
            kernel, out_shape=out_shape, grid=grid,
            in_specs=[_triton.ANY] * 3, out_specs=[_triton.ANY] * 2,
            interpret=interpret, compiler_params=params,
            name="hisparse_sparse_mla_decode",
        )(q_pad, kv_rows, rows))

    out, lse2 = _compat.quiet_triton_call(call, q_pad, kv_rows, rows)
    return _merge(out, lse2, q.shape[1], q.dtype, grid[1], cfg, interpret)


def _with_copies_kernel(*refs, attention, copy, programs, copy_inputs, head_blocks, splits):
    """Programs [0, programs) run the copy (`gather_compact.triton._gather_kernel`, each
    looping over its share), the rest the attention, program programs + a being the
    attention's (head block a % HB, split a // HB % S, row a // (HB * S)): the order of its
    own grid. refs: q, kv, rows, the copy's inputs and aliased caches, out, lse, the caches'
    outputs."""
    att_in, rest = refs[:3], refs[3:]
    copy_in, (out_ref, lse_ref), caches_out = (rest[:copy_inputs], rest[copy_inputs:
                                               copy_inputs + 2], rest[copy_inputs + 2:])
    pid = pl.program_id(0)

    @pl.when(pid < programs)
    def _():
        copy(*copy_in, *caches_out, pid=pid)

    @pl.when(pid >= programs)
    def _():
        a = pid - programs
        attention(*att_in, out_ref, lse_ref,
                  ids=(a % head_blocks, a // head_blocks % splits, a // (head_blocks * splits)))


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "kv_format",
                                             "copy_programs", "interpret", "tuning"))
def sparse_mla_decode_with_copies(
    q: jax.Array,
    kv_rows: jax.Array,
    attention_rows: jax.Array,
    host_pools: tuple[jax.Array, ...],
    kv_caches: tuple[jax.Array, ...],
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    kv_format: str = kvf.BF16,
    copy_programs: int = 32,
    interpret: bool = False,
    tuning: AttentionTuning | None = None,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """`sparse_mla_decode` of (q, kv_rows, attention_rows) and, in the same launch,
    `gather_compact_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts)` run by
    `copy_programs` looping programs beside the attention's: other layers' copies from host
    (bound by PCIe) overlap this layer's attention (bound by HBM and the tensor cores) inside
    one kernel, whatever XLA's scheduling of separate kernels. kv_caches must not include
    kv_rows' buffer. Returns (out, lse, the updated kv_caches: aliased, in place where the
    caller donates them)."""
    kv_caches = tuple(kv_caches)
    if gather_triton.nothing_to_copy(kv_caches, swap_src):
        out, lse = sparse_mla_decode(q, kv_rows, attention_rows, sm_scale=sm_scale,
                                     v_width=v_width, kv_format=kv_format,
                                     interpret=interpret, tuning=tuning)
        return out, lse, kv_caches
    kernel, q_pad, rows, grid, out_shape, params, cfg = _plan(
        q, kv_rows, attention_rows, sm_scale=sm_scale, v_width=v_width, kv_format=kv_format,
        tuning=tuning)
    copy, copy_in, _ = gather_triton.copy_launch(
        tuple(host_pools), kv_caches, swap_src, swap_dst, swap_counts, interpret=interpret,
        tuning=gather_triton.DEFAULT, programs=copy_programs, fixed_programs=True)
    head_blocks, splits, num_rows = grid
    combined = functools.partial(
        _with_copies_kernel, attention=kernel, copy=copy, programs=copy_programs,
        copy_inputs=len(copy_in) + len(kv_caches), head_blocks=head_blocks, splits=splits)
    first_cache = 3 + len(copy_in)

    def call(*args):
        return tuple(pl.pallas_call(
            combined,
            out_shape=[*out_shape, *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in kv_caches)],
            grid=(copy_programs + head_blocks * splits * num_rows,),
            in_specs=[_triton.ANY] * len(args), out_specs=[_triton.ANY] * (2 + len(kv_caches)),
            input_output_aliases={first_cache + i: 2 + i for i in range(len(kv_caches))},
            interpret=interpret, compiler_params=params,
            name="hisparse_sparse_mla_decode_copies",
        )(*args))

    out, lse2, *caches = _compat.quiet_triton_call(call, q_pad, kv_rows, rows, *copy_in,
                                                   *kv_caches)
    return (*_merge(out, lse2, q.shape[1], q.dtype, splits, cfg, interpret), tuple(caches))
