"""KV row formats: how one token's 576-value MLA latent row is stored in a KV cache and pool.

Two formats (`KV_FORMATS`):

  "bf16"        the row as `width` values of a float dtype (bfloat16 when serving; the ops
                also take float16 / float32 rows of q's dtype): 2 * 576 = 1,152 bytes.
  "fp8_ds_mla"  DeepSeek-V3.2's serving format (upstream name `fp8_ds_mla`), one row as
                uint8[656] (`FP8_ROW_BYTES`), little-endian throughout:

                  bytes [0, 512)    the 512 latent values as float8_e4m3fn, value i at byte i
                  bytes [512, 528)  4 float32 scales; scale g (bytes 512 + 4g .. 512 + 4g + 3)
                                    belongs to latent values [128g, 128g + 128)
                  bytes [528, 656)  the 64 rope values as bfloat16, value j at bytes
                                    528 + 2j (low byte) and 529 + 2j (high byte)

                Latent value i of a row is `float(fp8[i]) * scale[i // 128]`; the rope values
                are stored as they are (bf16). 656 = 16 * 41: every row starts 16-byte aligned
                when the cache does, and the row copies move it as 512 + 128 + 16 bytes.

Quantization (`quantize`, where rows are written): per group of 128 latent values,
scale = amax / 448 (448 = the largest finite float8_e4m3fn; computed as
amax * float32(1/448), within one float32 rounding of the quotient), each value x stored as
x / scale rounded to nearest-even in float8_e4m3fn; a group of zeros gets scale 0 and zero
bytes (no NaN). Dequantization (`dequantize`, inside attention) multiplies back in float32.
The error bounds are in `docs/kv_format.md`. Non-finite inputs give non-finite rows (a NaN
or Inf in a group makes its scale NaN or Inf).

Bytes are assembled arithmetically (shifts of the float32 / bfloat16 bit patterns), so the
layout does not depend on the host's byte order. This module imports jax and numpy only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BF16 = "bf16"
FP8_DS_MLA = "fp8_ds_mla"
KV_FORMATS: tuple[str, ...] = (BF16, FP8_DS_MLA)

LATENT_DIM = 512              # latent values per row (the value of attention)
ROPE_DIM = 64                 # rope values per row
ROW_WIDTH = LATENT_DIM + ROPE_DIM   # 576 values: the logical row of both formats
GROUP = 128                   # latent values per scale
NUM_GROUPS = LATENT_DIM // GROUP    # 4
FP8_MAX = 448.0               # largest finite float8_e4m3fn
# scale = amax * float32(1 / 448): one IEEE multiply, so every backend stores the same bits
# (XLA rewrites a division by a constant into this multiply on some backends and not others).
INV_FP8_MAX = np.float32(1.0 / FP8_MAX)
SCALE_OFFSET = LATENT_DIM                      # byte 512: the 4 float32 scales
ROPE_OFFSET = SCALE_OFFSET + 4 * NUM_GROUPS    # byte 528: the 64 bfloat16 rope values
FP8_ROW_BYTES = ROPE_OFFSET + 2 * ROPE_DIM     # 656


def check_kv_format(kv_format: object) -> str:
    """`kv_format` if it names a format of `KV_FORMATS`, else ValueError listing them."""
    if not isinstance(kv_format, str) or kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    return kv_format


def _check_fp8_width(width: int) -> None:
    if width != ROW_WIDTH:
        raise ValueError(f"the {FP8_DS_MLA} format stores {ROW_WIDTH}-value rows "
                         f"({LATENT_DIM} latent + {ROPE_DIM} rope), got width {width}")


def storage_width(kv_format: str, width: int = ROW_WIDTH) -> int:
    """Last dim of a cache / pool holding `width`-value rows: `width` ("bf16") or 656 bytes
    ("fp8_ds_mla", which needs width 576)."""
    if check_kv_format(kv_format) == BF16:
        return int(width)
    _check_fp8_width(width)
    return FP8_ROW_BYTES


def storage_dtype(kv_format: str, dtype=jnp.bfloat16) -> jnp.dtype:
    """Element dtype of a cache / pool: `dtype` ("bf16": the rows' float dtype) or uint8
    ("fp8_ds_mla")."""
    if check_kv_format(kv_format) == BF16:
        return jnp.dtype(dtype)
    return jnp.dtype(jnp.uint8)


def row_bytes(kv_format: str, width: int = ROW_WIDTH, dtype=jnp.bfloat16) -> int:
    """Bytes of one stored row: width * itemsize ("bf16": 1,152 at 576 bf16 values) or 656
    ("fp8_ds_mla")."""
    return storage_width(kv_format, width) * storage_dtype(kv_format, dtype).itemsize


def _bytes_of(words: jax.Array, nbytes: int) -> jax.Array:
    """uint32 words [...] -> uint8 [..., nbytes], least significant byte first."""
    shifts = jnp.arange(nbytes, dtype=jnp.uint32) * 8
    return ((words[..., None] >> shifts) & 0xFF).astype(jnp.uint8)


def _word_of(b: jax.Array) -> jax.Array:
    """uint8 [..., n] (least significant first, n <= 4) -> uint32 [...]."""
    word = b[..., 0].astype(jnp.uint32)
    for i in range(1, b.shape[-1]):
        word = word | (b[..., i].astype(jnp.uint32) << jnp.uint32(8 * i))
    return word


def quantize(rows: jax.Array) -> jax.Array:
    """Float rows [..., 576] -> fp8_ds_mla rows uint8 [..., 656] (layout: module docstring).

    Per group of 128 latent values: scale = amax * float32(1/448), value x -> x / scale
    rounded to float8_e4m3fn (clipped to +-448 first, so rounding never overflows to NaN); a
    zero group stores scale 0 and zeros. The rope values are cast to bfloat16.
    """
    _check_fp8_width(rows.shape[-1])
    lead = rows.shape[:-1]
    x = rows.astype(jnp.float32)
    latent = x[..., :LATENT_DIM].reshape(*lead, NUM_GROUPS, GROUP)
    amax = jnp.max(jnp.abs(latent), axis=-1)                        # [..., 4]
    scale = amax * INV_FP8_MAX
    safe = jnp.where(scale > 0, scale, jnp.float32(1.0))            # zero group: 0 / 1 = 0
    q = jnp.clip(latent / safe[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    fp8_bytes = lax.bitcast_convert_type(q, jnp.uint8).reshape(*lead, LATENT_DIM)
    scale_bytes = _bytes_of(lax.bitcast_convert_type(scale, jnp.uint32), 4)
    rope = lax.bitcast_convert_type(x[..., LATENT_DIM:].astype(jnp.bfloat16), jnp.uint16)
    rope_bytes = _bytes_of(rope.astype(jnp.uint32), 2)
    return jnp.concatenate([fp8_bytes, scale_bytes.reshape(*lead, 4 * NUM_GROUPS),
                            rope_bytes.reshape(*lead, 2 * ROPE_DIM)], axis=-1)


def scales(rows: jax.Array) -> jax.Array:
    """The float32 scales [..., 4] of fp8_ds_mla rows uint8 [..., 656]."""
    b = rows[..., SCALE_OFFSET:ROPE_OFFSET].reshape(*rows.shape[:-1], NUM_GROUPS, 4)
    return lax.bitcast_convert_type(_word_of(b), jnp.float32)


def dequantize(rows: jax.Array, dtype=jnp.float32) -> jax.Array:
    """fp8_ds_mla rows uint8 [..., 656] -> [..., 576] in `dtype`: latent value i is
    float8 value i times scale i // 128 (in float32), then the 64 bf16 rope values."""
    if rows.shape[-1] != FP8_ROW_BYTES or jnp.dtype(rows.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"{FP8_DS_MLA} rows are uint8[..., {FP8_ROW_BYTES}], got "
                         f"{jnp.dtype(rows.dtype).name}{list(rows.shape)}")
    lead = rows.shape[:-1]
    fp8 = lax.bitcast_convert_type(rows[..., :LATENT_DIM], jnp.float8_e4m3fn)
    latent = fp8.astype(jnp.float32).reshape(*lead, NUM_GROUPS, GROUP)
    latent = (latent * scales(rows)[..., None]).reshape(*lead, LATENT_DIM)
    rope_b = rows[..., ROPE_OFFSET:].reshape(*lead, ROPE_DIM, 2)
    rope = lax.bitcast_convert_type(_word_of(rope_b).astype(jnp.uint16), jnp.bfloat16)
    return jnp.concatenate([latent, rope.astype(jnp.float32)], axis=-1).astype(dtype)
