"""Reading one K tile of selected rows for the Triton sparse MLA kernel (`triton.py`), per
KV row format, and the column pieces q and the output are cut into to match.

A reader gets `load(cols)`, which returns columns `cols` [1, w] of the selected rows of one
K step as a [block_k, w] tile (`masked_load` with the step's rows bound), and returns
(keys, key_scales, values):
  keys[j]        [block_k, size_j] tile in q's dtype, contracted with q's piece j
                 (`q_pieces`: the same column pieces, in order);
  key_scales[j]  float32 [block_k] per-row factor of that piece's scores, or None;
  values[i]      (tile [block_k, size_i], float32 [block_k] per-row factor or None):
                 acc_i += (P * factor) @ tile, stored at the output columns of
                 `value_pieces(...)[i]`.
Masked lanes (valid False) load zeros: a row no entry selects is never read.

Every in-kernel array has a power-of-two shape (a Triton rule): a 576-wide "bf16" row moves
as 512 + 64 (`float_pieces`); an "fp8_ds_mla" row (uint8[656], `pallas_kernels/kv_format.py`)
as its latent byte groups, scale words and rope words (`read_fp8_rows`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _triton
from pallas_kernels import kv_format as kvf


def float_pieces(width: int, v_width: int) -> tuple[tuple[int, int], ...] | None:
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


def masked_load(kv_ref, safe, valid, cols):
    """[block_k, len(cols)] of kv_ref at rows `safe` [block_k, 1], columns `cols` [1, w];
    zeros where `valid` [block_k] is False."""
    shape = (safe.shape[0], cols.shape[1])
    return plgpu.load(kv_ref.at[safe, cols], mask=jnp.broadcast_to(valid[:, None], shape),
                      other=0)


def columns(start: int, size: int):
    """int32 [1, size]: columns start .. start + size - 1."""
    return (start + jnp.arange(size, dtype=jnp.int32))[None, :]


def read_float_rows(load, *, pieces):
    """"bf16" rows: the row's power-of-two pieces as they are; the value is piece 0."""
    keys = [load(columns(start, size)) for start, size in pieces]
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
        tile = load(columns(start, count * nbytes))
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
        tile = load(columns(start, count * nbytes))
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


def read_fp8_rows(load, *, value_groups, words, scale):
    """"fp8_ds_mla" rows (uint8[656], `pallas_kernels/kv_format.py`), decoded in registers:

    * latent: bytes [0, 512), bitcast to float8_e4m3fn;
    * scales: bytes [512, 528) as 4 uint32 words per row (`_load_words`), bitcast to float32
      ([block_k, 4]; per group a [block_k] vector, `_scale_columns`);
    * rope: bytes [528, 656) as 64 uint16 words per row, bitcast to bfloat16.
    The latent loads are contiguous runs at 16-byte-aligned offsets (656 = 16 * 41), so they
    vectorise. `scale` (`triton.AttentionTuning.fp8_scale`):
    "scores": four [block_k, 128] group tiles converted to bfloat16 (exact: every e4m3 value
      is a bf16 value), never multiplied: group g's scores and the P fed to group g's value
      product are scaled per row instead (`triton_body.attention_kernel`);
    "tiles": each group tile times its scale in float32, rounded to bfloat16 once: four key
      tiles without factors, the same four as values;
    "tile512": one [block_k, 512] byte tile, scaled as [block_k, 4, 128] by the [block_k, 4]
      scales, rounded to bfloat16: one latent key tile, also the value (v_width 512 only:
      `triton._fp8_scale_mode` picks "tiles" for narrower values).
    """
    scale_tile = lax.bitcast_convert_type(
        _load_words(load, kvf.SCALE_OFFSET, kvf.NUM_GROUPS, 4, jnp.uint32,
                    words), jnp.float32)                                 # [block_k, 4]
    rope = lax.bitcast_convert_type(
        _load_words(load, kvf.ROPE_OFFSET, kvf.ROPE_DIM, 2, jnp.uint16, words),
        jnp.bfloat16)                                                    # [block_k, 64]
    if scale == "tile512":
        fp8 = lax.bitcast_convert_type(
            load(columns(0, kvf.LATENT_DIM)), jnp.float8_e4m3fn)
        bk = fp8.shape[0]
        latent = (fp8.astype(jnp.float32).reshape(bk, kvf.NUM_GROUPS, kvf.GROUP)
                  * scale_tile[:, :, None]).reshape(bk, kvf.LATENT_DIM).astype(jnp.bfloat16)
        return [latent, rope], [None, None], [(latent, None)]
    fp8 = [lax.bitcast_convert_type(
        load(columns(g * kvf.GROUP, kvf.GROUP)),
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


def q_pieces(width: int, v_width: int, kv_format: str,
              fp8_scale: str = "scores") -> tuple[tuple[int, int], ...]:
    """(start, size) column pieces of q, one per key tile of the format's reader."""
    if kv_format == kvf.FP8_DS_MLA:
        if fp8_scale == "tile512":
            return ((0, kvf.LATENT_DIM), (kvf.LATENT_DIM, kvf.ROPE_DIM))
        return (*((g * kvf.GROUP, kvf.GROUP) for g in range(kvf.NUM_GROUPS)),
                (kvf.LATENT_DIM, kvf.ROPE_DIM))
    return float_pieces(width, v_width)


def value_pieces(v_width: int, kv_format: str,
                  fp8_scale: str = "scores") -> tuple[tuple[int, int], ...]:
    """(output column, size) of each value tile of the format's reader."""
    if kv_format == kvf.FP8_DS_MLA and fp8_scale != "tile512":
        return tuple((g * kvf.GROUP, kvf.GROUP) for g in range(v_width // kvf.GROUP))
    return ((0, v_width),)
