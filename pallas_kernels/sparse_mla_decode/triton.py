"""sparse_mla_decode as a Pallas kernel through the Triton lowering.

Contract of `reference.sparse_mla_decode`: q [T, h_q, D], flat rows kv_rows [R, D], row ids
int32 [T, K] with -1 holes anywhere; out [T, h_q, v_width] in q's dtype, natural-log lse
float32 [T, h_q]; a row with no valid entry gives out = 0 and lse = -inf.

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
same program and online softmax; only the K-tile read differs (`_read_fp8_rows`): the latent
arrives as byte tiles converted in registers (float8_e4m3fn -> bf16 is exact), the 4 float32
scales and the 64 bf16 rope values are assembled from their bytes with integer shifts and
same-width bitcasts (the Triton lowering bitcasts only between equal widths; how the bytes are
taken apart: `AttentionTuning.fp8_words`). Where the scales enter is
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

from pallas_kernels import _compat, _triton
from pallas_kernels import kv_format as kvf
from pallas_kernels.gather_compact import triton as gather_triton
from pallas_kernels.sparse_mla_decode import combine
from pallas_kernels.sparse_mla_decode.reference import LOG2E, M_INIT, merge_splits, pad_operands

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
      their bytes (`_load_words`): "contiguous" (one 16-byte-aligned load per row, reshaped
      to [block_k, words, bytes] and combined with a sum), "strided" (one strided load per
      byte position, no 3-D reshape) or "split" (the contiguous load, its byte pairs taken
      apart with `lax.unstack` of a trailing size-2 axis, Triton's `split`: no reduction;
      the per-group scales come out of the [block_k, 4] tile the same way, not through
      masked sums). Ignored for "bf16" rows.
    fp8_scale: where "fp8_ds_mla" rows' per-group scales enter (`_read_fp8_rows`): "scores"
      (the bf16 tiles are the stored fp8 values; group g's partial scores and the P of its
      value product are multiplied by scale g: 4 + 4 dots, P converted per group), "tiles"
      (each [block_k, 128] group tile is multiplied by its scale and rounded to bf16 once:
      4 score dots summed unscaled, 4 value dots sharing one bf16 P) or "tile512" (the same
      as one [block_k, 512] tile: one score dot of K = 512 and one value dot of N = 512).
      "tiles" and "tile512" round the dequantized values to bf16, as bf16 rows are.
    fused_combine: merge the K splits with the one-launch Pallas kernel of `combine.py`;
      False runs the jnp `reference.merge_splits` (three XLA fusions on the GPU), kept for
      benchmarking against it. No effect with one split.
    The field defaults are the fp8 sweep's choice below 64 heads; the kernel's default for
    bf16 rows is `DEFAULT` (`bench/NOTES-sparse_mla.md`).
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
# carry): in both sweeps of 2026-12-02 the fastest at h_q = 16 and the fastest or tied at
# h_q = 128 (`bench/NOTES-sparse_mla.md`). fp8_ds_mla rows with h_q < 64 keep
# `AttentionTuning()` (32-row tiles, 3 stages, id carry), their sweep's choice.
DEFAULT = AttentionTuning(block_k=64, num_stages=2, prefetch_ids=False)
DEFAULT_FP8 = AttentionTuning()
# fp8_ds_mla rows with 64 heads or more per program: scales folded into the tiles and the
# words split from byte pairs (the fastest fp8 candidate of bench/ops/sparse_mla_decode.py at
# h_q = 128; at h_q = 16 the default measured faster).
DEFAULT_FP8_WIDE = AttentionTuning(fp8_words="split", fp8_scale="tiles")


def _row_pieces(width: int, v_width: int) -> tuple[tuple[int, int], ...] | None:
    """(start, size) power-of-two column pieces of a row whose first piece is the value
    (0, v_width); None when the row cannot be cut so (576, 512 -> (0, 512), (512, 64))."""
    if not _triton.is_pow2(v_width) or v_width < 16:
        return None
    pieces, start = [(0, v_width)], v_width
    while start < width:
        size = 1 << ((width - start).bit_length() - 1)
        if size < 16:          # a dot needs K >= 16
            return None
        pieces.append((start, size))
        start += size
    return tuple(pieces)


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
    if _row_pieces(width, v_width) is None:
        return (f"the triton kernel needs v_width a power of two >= 16 and the rest of the row "
                f"(D - v_width = {width - v_width}) made of power-of-two pieces >= 16; "
                f"got D={width}, v_width={v_width}")
    return None


# ----------------------------------------------------------------- reading one K tile of rows
#
# A reader gets `load(cols)`, which returns columns `cols` [1, w] of the selected rows of one
# K step as a [block_k, w] tile (`_masked_load` with the step's rows bound), and returns
# (keys, key_scales, values):
#   keys[j]        [block_k, size_j] tile in q's dtype, contracted with q's piece j
#                  (`_q_pieces`: the same column pieces, in order);
#   key_scales[j]  float32 [block_k] per-row factor of that piece's scores, or None;
#   values[i]      (tile [block_k, size_i], float32 [block_k] per-row factor or None):
#                  acc_i += (P * factor) @ tile, stored at the output columns of
#                  `_value_pieces(...)[i]`.
# Masked lanes (valid False) load zeros: a row no entry selects is never read.


def _masked_load(kv_ref, safe, valid, cols):
    """[block_k, len(cols)] of kv_ref at rows `safe` [block_k, 1], columns `cols` [1, w];
    zeros where `valid` [block_k] is False."""
    shape = (safe.shape[0], cols.shape[1])
    return plgpu.load(kv_ref.at[safe, cols], mask=jnp.broadcast_to(valid[:, None], shape),
                      other=0)


def _cols(start: int, size: int):
    """int32 [1, size]: columns start .. start + size - 1."""
    return (start + jnp.arange(size, dtype=jnp.int32))[None, :]


def _read_float_rows(load, *, pieces):
    """"bf16" rows: the row's power-of-two pieces as they are; the value is piece 0."""
    keys = [load(_cols(start, size)) for start, size in pieces]
    return keys, [None] * len(keys), [(keys[0], None)]


def _halves(x):
    """x [..., 2n] -> (x[..., 0::2], x[..., 1::2]), each [..., n]: a reshape to [..., n, 2]
    and `lax.unstack` of the trailing pair (Triton's `split`, no reduction)."""
    return lax.unstack(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), axis=-1)


def _load_words(load, start: int, count: int, nbytes: int, dtype, how: str):
    """unsigned `dtype` [block_k, count]: the little-endian words of `nbytes` bytes each at
    bytes [start, start + count * nbytes) of the selected rows (zeros where masked).

    "contiguous": one [block_k, count * nbytes] load (a 16-byte-aligned run per row, so it
    vectorises), reshaped to [block_k, count, nbytes], widened, each byte shifted into place
    and the disjoint bytes summed. "strided": one [block_k, count] load per byte position b
    (columns start + nbytes * j + b), widened, shifted and OR-ed: no 3-D reshape, but byte
    loads. "split": the contiguous load, its bytes taken apart by position with `_halves`
    (nbytes 2 or 4), widened, shifted and OR-ed: no reduction. The caller bitcasts the words
    to their float type (the Triton lowering bitcasts only between equal widths).
    """
    if how == "split":
        tile = load(_cols(start, count * nbytes))
        # parts[j] holds the bytes at positions = j (mod len(parts)) of each word: halving
        # every part doubles the modulus, ending at parts[b] = byte b of every word.
        parts = [tile]
        while len(parts) < nbytes:
            halves = [_halves(p) for p in parts]
            parts = [h[0] for h in halves] + [h[1] for h in halves]
        word = None
        for b, part in enumerate(parts):
            shifted = part.astype(dtype) << dtype(8 * b)
            word = shifted if word is None else word | shifted
        return word
    if how == "contiguous":
        tile = load(_cols(start, count * nbytes))
        parts = tile.reshape(tile.shape[0], count, nbytes).astype(dtype)
        shifts = (8 * jnp.arange(nbytes, dtype=jnp.int32)).astype(dtype)[None, None, :]
        return jnp.sum(parts << shifts, axis=2, dtype=dtype)
    word = None
    for b in range(nbytes):
        cols = (start + b + nbytes * jnp.arange(count, dtype=jnp.int32))[None, :]
        part = load(cols).astype(dtype) << dtype(8 * b)
        word = part if word is None else word | part
    return word


def _scale_columns(scale_tile, how: str):
    """float32 [block_k, 4] -> the 4 per-group scales, each float32 [block_k]: `_halves`
    twice ("split") or a masked row sum per group (the other word modes)."""
    if how == "split":
        even, odd = _halves(scale_tile)                  # groups (0, 2) and (1, 3)
        (s0, s2), (s1, s3) = _halves(even), _halves(odd)
        return [s0[:, 0], s1[:, 0], s2[:, 0], s3[:, 0]]
    group = jnp.arange(kvf.NUM_GROUPS, dtype=jnp.int32)[None, :]
    return [jnp.sum(jnp.where(group == g, scale_tile, 0.0), axis=1)
            for g in range(kvf.NUM_GROUPS)]


def _read_fp8_rows(load, *, value_groups, words, scale):
    """"fp8_ds_mla" rows (uint8[656], `pallas_kernels/kv_format.py`), decoded in registers:

    * latent: bytes [0, 512), bitcast to float8_e4m3fn;
    * scales: bytes [512, 528) as 4 uint32 words per row (`_load_words`), bitcast to float32
      ([block_k, 4]; per group a [block_k] vector, `_scale_columns`);
    * rope: bytes [528, 656) as 64 uint16 words per row, bitcast to bfloat16.
    The latent loads are contiguous runs at 16-byte-aligned offsets (656 = 16 * 41), so they
    vectorise. `scale` (`AttentionTuning.fp8_scale`):
    "scores": four [block_k, 128] group tiles converted to bfloat16 (exact: every e4m3 value
      is a bf16 value), never multiplied: group g's scores and the P fed to group g's value
      product are scaled per row instead (`_attention_kernel`);
    "tiles": each group tile times its scale in float32, rounded to bfloat16 once: four key
      tiles without factors, the same four as values;
    "tile512": one [block_k, 512] byte tile, scaled as [block_k, 4, 128] by the [block_k, 4]
      scales, rounded to bfloat16: one latent key tile, also the value (v_width 512 only:
      `_fp8_scale_mode` picks "tiles" for narrower values).
    """
    scale_tile = lax.bitcast_convert_type(
        _load_words(load, kvf.SCALE_OFFSET, kvf.NUM_GROUPS, 4, jnp.uint32,
                    words), jnp.float32)                                 # [block_k, 4]
    rope = lax.bitcast_convert_type(
        _load_words(load, kvf.ROPE_OFFSET, kvf.ROPE_DIM, 2, jnp.uint16, words),
        jnp.bfloat16)                                                    # [block_k, 64]
    if scale == "tile512":
        fp8 = lax.bitcast_convert_type(
            load(_cols(0, kvf.LATENT_DIM)), jnp.float8_e4m3fn)
        bk = fp8.shape[0]
        latent = (fp8.astype(jnp.float32).reshape(bk, kvf.NUM_GROUPS, kvf.GROUP)
                  * scale_tile[:, :, None]).reshape(bk, kvf.LATENT_DIM).astype(jnp.bfloat16)
        return [latent, rope], [None, None], [(latent, None)]
    fp8 = [lax.bitcast_convert_type(
        load(_cols(g * kvf.GROUP, kvf.GROUP)),
        jnp.float8_e4m3fn) for g in range(kvf.NUM_GROUPS)]
    scales = _scale_columns(scale_tile, words)
    if scale == "tiles":
        latent = [(fp8[g].astype(jnp.float32) * scales[g][:, None]).astype(jnp.bfloat16)
                  for g in range(kvf.NUM_GROUPS)]
        values = [(latent[g], None) for g in range(value_groups)]
        return [*latent, rope], [None] * (kvf.NUM_GROUPS + 1), values
    latent = [f.astype(jnp.bfloat16) for f in fp8]
    values = [(latent[g], scales[g]) for g in range(value_groups)]
    return [*latent, rope], [*scales, None], values


def _q_pieces(width: int, v_width: int, kv_format: str,
              fp8_scale: str = "scores") -> tuple[tuple[int, int], ...]:
    """(start, size) column pieces of q, one per key tile of the format's reader."""
    if kv_format == kvf.FP8_DS_MLA:
        if fp8_scale == "tile512":
            return ((0, kvf.LATENT_DIM), (kvf.LATENT_DIM, kvf.ROPE_DIM))
        return (*((g * kvf.GROUP, kvf.GROUP) for g in range(kvf.NUM_GROUPS)),
                (kvf.LATENT_DIM, kvf.ROPE_DIM))
    return _row_pieces(width, v_width)


def _value_pieces(v_width: int, kv_format: str,
                  fp8_scale: str = "scores") -> tuple[tuple[int, int], ...]:
    """(output column, size) of each value tile of the format's reader."""
    if kv_format == kvf.FP8_DS_MLA and fp8_scale != "tile512":
        return tuple((g * kvf.GROUP, kvf.GROUP) for g in range(v_width // kvf.GROUP))
    return ((0, v_width),)


def _attention_kernel(q_ref, kv_ref, rows_ref, out_ref, lse_ref, *, block_h, block_k, steps,
                      q_pieces, v_pieces, read, scale2, prefetch_ids, prefetch_tiles=False,
                      ids=None):
    """Program (head block hb, split s, query row t): q_ref [T, Hp, D], kv_ref [R, row]
    (row = D values, or 656 bytes), rows_ref [T, Kp] (Kp = splits * steps * block_k, -1
    padded); `read` is `_read_float_rows` or `_read_fp8_rows` with its knobs bound, q_pieces
    the (start, size) q columns of its key tiles, v_pieces the (column, size) output columns
    of its value tiles. Writes out_ref [T, S, Hp, v] (normalised within the split) and
    lse_ref [T, S, Hp] (base 2). ids: (hb, s, t) when another kernel runs these programs as
    part of its grid (`_with_copies_kernel`)."""
    if ids is None:
        ids = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hb, s, t = ids
    heads = (hb * block_h + jnp.arange(block_h, dtype=jnp.int32))[:, None]
    qs = [plgpu.load(q_ref.at[t, heads, _cols(start, size)]) for start, size in q_pieces]
    dims = (((1,), (1,)), ((), ()))          # contract the column dims: q k^T

    def load_ids(i):
        k = (s * steps + i) * block_k + jnp.arange(block_k, dtype=jnp.int32)
        return plgpu.load(rows_ref.at[t, k])

    def gather(ids):
        valid = ids >= 0
        return valid, read(functools.partial(_masked_load, kv_ref,
                                             jnp.where(valid, ids, 0)[:, None], valid))

    def step(i, carry):
        if prefetch_tiles:
            # Step i's tile was gathered during step i - 1 (loop carry); the gather of step
            # i + 1's tile and the load of step i + 2's ids are issued before this step's
            # dots, so their latency overlaps them (the last steps reload, harmlessly).
            accs, m_i, l_i, (valid, tiles), ids_next = carry
            carry_next = (gather(ids_next), load_ids(jnp.minimum(i + 2, steps - 1)))
        elif prefetch_ids:
            # The ids of step i came with step i - 1 (loop carry): the K-tile gather's
            # addresses are ready at the top of the step, and the load of the next step's ids
            # is issued before it (the last step reloads its own ids, harmlessly).
            accs, m_i, l_i, ids = carry
            ids_next = load_ids(jnp.minimum(i + 1, steps - 1))
            valid, tiles = gather(ids)
        else:
            accs, m_i, l_i = carry
            valid, tiles = gather(load_ids(i))
        keys, key_scales, values = tiles
        scores = None
        for qp, kp, ks in zip(qs, keys, key_scales, strict=True):
            part = lax.dot_general(qp, kp, dims, preferred_element_type=jnp.float32)
            if ks is not None:
                part = part * ks[None, :]
            scores = part if scores is None else scores + part
        scores = jnp.where(valid[None, :], scores * scale2, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(scores, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        p_cast = {}                      # unscaled P, converted once per operand dtype

        def p_for(tile, vs):
            if vs is not None:
                return (p * vs[None, :]).astype(tile.dtype)
            if tile.dtype not in p_cast:
                p_cast[tile.dtype] = p.astype(tile.dtype)
            return p_cast[tile.dtype]

        accs = tuple(
            acc * alpha[:, None] + lax.dot_general(
                p_for(tile, vs), tile, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32)
            for acc, (tile, vs) in zip(accs, values, strict=True))
        if prefetch_tiles:
            return (accs, m_new, l_i, *carry_next)
        if prefetch_ids:
            return accs, m_new, l_i, ids_next
        return accs, m_new, l_i

    carry = (tuple(jnp.zeros((block_h, size), jnp.float32) for _, size in v_pieces),
             jnp.full((block_h,), M_INIT, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    if prefetch_tiles:
        carry = (*carry, gather(load_ids(0)), load_ids(jnp.minimum(1, steps - 1)))
    elif prefetch_ids:
        carry = (*carry, load_ids(0))
    accs, m_i, l_i = lax.fori_loop(0, steps, step, carry)[:3]
    # l_i is 0 exactly when the split has no valid entry (then acc = 0: out 0, lse -inf); a
    # NaN score (NaN query) makes l_i NaN, which both formulas pass on (no max() that might
    # drop a NaN: out NaN, lse NaN).
    empty = l_i == 0.0
    inv = jnp.where(empty, 1.0, l_i)[:, None]
    for acc, (col, size) in zip(accs, v_pieces, strict=True):
        plgpu.store(out_ref.at[t, s, heads, _cols(col, size)], (acc / inv).astype(out_ref.dtype))
    lse2 = jnp.where(empty, -jnp.inf, m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
    plgpu.store(lse_ref.at[t, s, heads[:, 0]], lse2)


def _fp8_scale_mode(cfg: AttentionTuning, v_width: int) -> str:
    """`cfg.fp8_scale`, except "tile512" with v_width < 512 (a value tile narrower than the
    key tile, possibly not a power of two) runs as "tiles"."""
    if cfg.fp8_scale == "tile512" and v_width != kvf.LATENT_DIM:
        return "tiles"
    return cfg.fp8_scale


def _attention_splits(programs: int, num_chunks: int, cfg: AttentionTuning) -> int:
    """K splits per (row, head block): `cfg.num_splits`, else about two waves of programs
    with at least 4 K steps per split, or down to one step when 4-step splits would still
    leave the grid under a quarter of the SMs (one to two requests decoding: at N=1,
    h_q=128, K=2048 on the H200 32 splits of one step take 16.0 us of device time with the
    combine, the 8 four-step splits 26.5 us; `bench/attention_splits.py`). Always a divisor
    of the `num_chunks` steps (no all-padding step)."""
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
        read = functools.partial(_read_fp8_rows, value_groups=v_width // kvf.GROUP,
                                 words=cfg.fp8_words, scale=fp8_scale)
    else:
        read = functools.partial(_read_float_rows, pieces=_row_pieces(width, v_width))
    block_h = cfg.block_h or min(64, max(16, _triton.pow2_ceil(h_q)))
    num_warps = cfg.num_warps or (8 if block_h >= 64 else 4)
    bk = cfg.block_k
    h_pad = pl.cdiv(h_q, block_h) * block_h
    head_blocks = h_pad // block_h
    num_chunks = pl.cdiv(top_k, bk)
    splits = _attention_splits(num_rows * head_blocks, num_chunks, cfg)
    steps = pl.cdiv(num_chunks, splits)
    q_pad, rows = pad_operands(q, attention_rows, h_pad, splits * steps * bk)
    kernel = functools.partial(_attention_kernel, block_h=block_h, block_k=bk, steps=steps,
                               q_pieces=_q_pieces(width, v_width, kv_format, fp8_scale),
                               v_pieces=_value_pieces(v_width, kv_format, fp8_scale),
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
