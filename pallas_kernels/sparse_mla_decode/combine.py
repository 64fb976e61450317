"""Flash-decoding split-K combine of the sparse MLA kernel, as one Pallas (Triton) kernel.

The attention kernel (`triton.py`) cuts each query row's K range into S splits and writes,
per split, an output normalised within the split and its base-2 log-sum-exp. Merging them
with `reference.merge_splits` (slice to h_q heads, then `combine_splits`) costs three XLA
fusions on the GPU, which at one or two requests (many one-step splits) take nearly as long
as the attention kernel itself (`bench/NOTES-sparse_mla.md`). This kernel does the same
merge in one launch, reading the h_pad-wide per-split arrays directly (no slice copy).

Contract (that of `reference.merge_splits` for S > 1):

  out   [T, S, h, v]   bf16 / f16 / f32, each split normalised within itself
  lse2  float32 [T, S, h]   base-2 lse per split: -inf = no valid entry, NaN = saw a NaN
  ->    (combined [T, h_q, v] in `dtype`, natural-log lse float32 [T, h_q]), h_q <= h

Per (t, head): m = max_s lse2_s, w_s = exp2(lse2_s - m), combined = sum_s w_s out_s /
sum_s w_s in float32, lse = (m + log2 sum_s w_s) ln 2. A head whose splits are all -inf gives
0 / -inf; a NaN in any split gives NaN / NaN for that head (its weight is NaN, whatever the
max does with it: the Triton lowering's max drops NaN, the interpreter's keeps it).

Design: grid (T, head blocks of `block_h`, column blocks of `block_v`); a program loads its
heads' lse2 of every split as one [S', block_h] tile (S' = S rounded up to a power of two, the
missing splits read as -inf: weight 0) and their outputs as one [S', block_h, block_v] tile,
then reduces over the split axis: the same operations as the jnp reference (only the order of
the sums over S may differ), with no chain of dependent loads (a version that looped over the
splits, one [block_h, block_v] load each, was slower than the XLA fusions: each program waited
on S loads in turn; `bench/NOTES-sparse_mla.md`). The tile holds at most `TILE` values; the
column blocks are narrowed until about `_triton.TARGET_PROGRAMS` programs share the
(memory-bound) read of T * S * h * v values, so one or two query rows still use many SMs.
Every program recomputes its heads' weights and the first column block writes the lse. Masked
lanes load from index 0 and store to an out-of-range, non-negative index (the `_triton.py`
convention), both dropped by their masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _compat, _triton
from pallas_kernels.sparse_mla_decode.reference import LN2

TILE = 8192  # values of the [splits, heads, columns] tile one program loads at once


def _combine_kernel(out_ref, lse2_ref, comb_ref, lse_ref, *, splits: int, h_q: int,
                    width: int, block_s: int, block_h: int, block_v: int):
    """Program (t, head block, column block): out_ref [T, S, h, v], lse2_ref [T, S, h] in;
    comb_ref [T, h_q, v], lse_ref [T, h_q] out. Every split is read in one load (a
    [block_s, block_h, block_v] tile, block_s >= S): no loop of dependent loads."""
    t, hb, cb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s = jnp.arange(block_s, dtype=jnp.int32)
    heads = hb * block_h + jnp.arange(block_h, dtype=jnp.int32)
    cols = cb * block_v + jnp.arange(block_v, dtype=jnp.int32)
    head_ok = heads < h_q
    lse_ok = (s < splits)[:, None] & head_ok[None, :]
    # Masked lanes read -inf (a split that is not there weighs 0) at in-range indices.
    lse2 = plgpu.load(lse2_ref.at[t, jnp.where(lse_ok, s[:, None], 0),
                                  jnp.where(lse_ok, heads[None, :], 0)],
                      mask=lse_ok, other=-jnp.inf)                     # [S', bh]
    # `== -inf` is false for NaN: a NaN split keeps its head live (as in the reference),
    # and its weight is NaN whatever the max made of it.
    dead = jnp.min(jnp.where(lse2 == -jnp.inf, 1, 0), axis=0) == 1     # [bh]
    m = jnp.where(dead, 0.0, jnp.max(lse2, axis=0))
    w = jnp.exp2(lse2 - m[None, :])                                    # [S', bh]
    total = jnp.where(dead, 1.0, jnp.sum(w, axis=0))
    tile_ok = lse_ok[:, :, None] & (cols < width)[None, None, :]
    x = plgpu.load(out_ref.at[t, jnp.where(tile_ok, s[:, None, None], 0),
                              jnp.where(tile_ok, heads[None, :, None], 0),
                              jnp.where(tile_ok, cols[None, None, :], 0)],
                   mask=tile_ok, other=0)
    acc = jnp.sum(w[:, :, None] * x.astype(jnp.float32), axis=0)      # [bh, bv]
    out_ok = head_ok[:, None] & (cols < width)[None, :]
    plgpu.store(comb_ref.at[t, jnp.where(out_ok, heads[:, None], h_q),
                            jnp.where(out_ok, cols[None, :], 0)],
                (acc / total[:, None]).astype(comb_ref.dtype), mask=out_ok)
    lse = jnp.where(dead, -jnp.inf, (m + jnp.log2(total)) * LN2)
    first = cb == 0
    plgpu.store(lse_ref.at[t, jnp.where(first & head_ok, heads, h_q)], lse,
                mask=head_ok & first)


def _tile(num_rows: int, splits: int, h_q: int, width: int) -> tuple[int, int, int]:
    """(block_s, block_h, block_v): every split in one tile of at most `TILE` values, heads
    then columns narrowed until the grid has about `_triton.TARGET_PROGRAMS` programs."""
    block_s = _triton.pow2_ceil(splits)
    block_h = min(16, _triton.pow2_ceil(h_q))
    block_v = min(512, _triton.pow2_ceil(width))
    while block_s * block_h * block_v > TILE and block_v > 16:
        block_v //= 2
    while block_s * block_h * block_v > TILE and block_h > 1:
        block_h //= 2

    def programs(bh: int, bv: int) -> int:
        return num_rows * pl.cdiv(h_q, bh) * pl.cdiv(width, bv)

    while programs(block_h, block_v) < _triton.TARGET_PROGRAMS and block_v > 16:
        block_v //= 2
    return block_s, block_h, block_v


@functools.partial(jax.jit, static_argnames=("h_q", "dtype", "interpret", "block_h",
                                             "block_v", "num_warps"))
def combine_splits(out: jax.Array, lse2: jax.Array, h_q: int, dtype, *,
                   interpret: bool = False, block_h: int | None = None,
                   block_v: int | None = None, num_warps: int = 4
                   ) -> tuple[jax.Array, jax.Array]:
    """Merge S per-split results out [T, S, h, v], lse2 float32 [T, S, h] (base 2) into
    (out [T, h_q, v] in `dtype`, natural-log lse float32 [T, h_q]); contract in the module
    docstring. S == 1 needs no kernel: the split's out and lse2 * ln 2, cut to h_q heads.

    block_h, block_v: heads and value columns per program (powers of two; None: `_tile`'s
    choice). num_warps: warps per program.
    """
    num_rows, splits, h, width = out.shape
    if lse2.shape != (num_rows, splits, h) or lse2.dtype != jnp.float32:
        raise ValueError(f"lse2 must be float32 {(num_rows, splits, h)}, got "
                         f"{lse2.dtype} {lse2.shape}")
    if not 1 <= h_q <= h:
        raise ValueError(f"h_q must be in [1, {h}], got {h_q}")
    if splits == 1:
        return out[:, 0, :h_q].astype(dtype), lse2[:, 0, :h_q] * LN2
    for name, size in (("block_h", block_h), ("block_v", block_v)):
        if size is not None and not _triton.is_pow2(size):
            raise ValueError(f"{name} must be a power of two, got {size}")
    block_s, auto_h, auto_v = _tile(num_rows, splits, h_q, width)
    block_h, block_v = block_h or auto_h, block_v or auto_v
    kernel = functools.partial(_combine_kernel, splits=splits, h_q=h_q, width=width,
                               block_s=block_s, block_h=block_h, block_v=block_v)

    def call(out, lse2):
        return tuple(pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((num_rows, h_q, width), dtype),
                       jax.ShapeDtypeStruct((num_rows, h_q), jnp.float32)],
            grid=(num_rows, pl.cdiv(h_q, block_h), pl.cdiv(width, block_v)),
            in_specs=[_triton.ANY] * 2,
            out_specs=[_triton.ANY] * 2,
            interpret=interpret,
            compiler_params=_triton.compiler_params(num_warps),
            name="hisparse_sparse_mla_combine",
        )(out, lse2))

    return _compat.quiet_triton_call(call, out, lse2)
