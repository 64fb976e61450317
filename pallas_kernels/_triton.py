"""Helpers shared by the kernels that lower through Pallas' Triton backend.

Why these kernels use the Triton lowering and not Mosaic GPU (the backend JAX develops):
  * the row copies (`gather_compact`, `mirror_rows`) read or write the `pinned_host` pool from
    inside the kernel (zero-copy over PCIe). A Mosaic GPU kernel refuses a host operand ("src
    must be a GMEM reference, got Ref<MemorySpace.Host>"); the Triton lowering takes the host
    buffer's address as it takes any other;
  * `resolve_residency` and `invalidate_written_rows` need vector-index gathers and scatters
    (table lookups, compaction by rank). Mosaic GPU has no vector-index gather on Hopper (only
    row-at-a-time copies with a scalar start), and its atomics return nothing;
  * `sparse_mla_decode` gathers selected rows as [block_k, 512] tiles with vector loads; the
    Mosaic GPU kernel (`sparse_mla_decode/mosaic_gpu.py`) must move each row as 9 separate
    TMA copies (the two kernels are compared in `bench/NOTES-sparse_mla.md`).
When Triton leaves Pallas, the `triton.py` modules are the ones to replace; the jnp
references stay as the fallback behind the same op interface.

Conventions of every Triton kernel here:
  * operands are whole refs (`memory_space=pl.ANY`, `ANY` below), indexed with broadcast
    integer arrays (`ref.at[rows[:, None], cols[None, :]]`), never array-plus-slice: the
    interpreter (CPU tests) cannot discharge a mix of the two;
  * every in-kernel array has a power-of-two size (a Triton rule): a 576-wide MLA row moves
    as 512 + 64 (`row_pieces`), index vectors are padded to a power of two and masked;
  * a masked-off lane gets an out-of-range, non-negative index, so a masked store is dropped
    by the interpreter too (a negative index would wrap to the last row there);
  * each call goes through `_compat.quiet_triton_call`, whose lowering rule is the only place
    the `jax-pallas-triton` deprecation warning is silenced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _compat

ANY = pl.BlockSpec(memory_space=pl.ANY)
NUM_SMS = 132                        # an H200's streaming multiprocessors
TARGET_PROGRAMS = 2 * NUM_SMS        # two waves


def pow2_ceil(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def is_pow2(x: int) -> bool:
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


def compiler_params(num_warps: int, num_stages: int = 1) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def call_in_place(kernel, inputs: Sequence[jax.Array], outputs: Sequence[jax.Array], *,
                  grid: tuple[int, ...], num_warps: int, interpret: bool,
                  name: str) -> tuple[jax.Array, ...]:
    """`kernel(*input_refs, *output_refs)` over every program of `grid`, all refs in ANY memory
    (the kernel indexes them itself), the outputs aliased onto `outputs` (updated in place:
    donate them), through `_compat.quiet_triton_call`. Returns the new outputs."""
    num_in = len(inputs)

    def call(*args):
        aliased = args[num_in:]
        return tuple(pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased],
            grid=grid,
            in_specs=[ANY] * len(args),
            out_specs=[ANY] * len(aliased),
            input_output_aliases={num_in + i: i for i in range(len(aliased))},
            interpret=interpret,
            compiler_params=compiler_params(num_warps),
            name=name,
        )(*args))

    return tuple(_compat.quiet_triton_call(call, *inputs, *outputs))


# --------------------------------------------------------------------------- row copies


@dataclasses.dataclass(frozen=True)
class CopyTuning:
    """Knobs of the row-copy kernels (`gather_compact`, `mirror_rows`).

    rows_per_program: rows one program moves (a power of two); None picks from the size.
    num_warps: warps per program. max_piece: widest power-of-two column piece per load.
    max_programs: None, one program per chunk of rows (the grid covers the plan); an int P,
    at most P programs, each looping over its share of the chunks, so that the copy holds at
    most P programs' places on the GPU and work on another stream gets the rest (a copy
    from pinned host is bound by PCIe, not by the programs moving it).
    """

    rows_per_program: int | None = None
    num_warps: int = 4
    max_piece: int = 512
    max_programs: int | None = None


def rows_per_program(total_rows: int, tuning: CopyTuning) -> int:
    """`tuning.rows_per_program`, or the largest of 16, 8, 4, 2 that still gives about
    `TARGET_PROGRAMS` programs for `total_rows` rows."""
    if tuning.rows_per_program is not None:
        return tuning.rows_per_program
    rows = 16
    while rows > 2 and pl.cdiv(total_rows, rows) < TARGET_PROGRAMS:
        rows //= 2
    return rows


def _row_index(ref_ndim: int, rows: jax.Array, block: int) -> tuple[jax.Array, ...]:
    """Index arrays [R, 1] addressing flat rows of a [rows, W] or [blocks, B, W] ref."""
    rows = rows[:, None]
    if ref_ndim == 2:
        return (rows,)
    return (rows // block, rows % block)


def _unpack(rows: jax.Array, pack: int, width: int) -> tuple[jax.Array, jax.Array | None]:
    """Row ids of a ref whose rows hold `pack` rows of `width` side by side: (the ref's row,
    the first column [R, 1]); (rows, None) when pack is 1."""
    if pack == 1:
        return rows, None
    return rows // pack, ((rows % pack) * width)[:, None]


def copy_rows(src_ref, src_rows, dst_ref, dst_rows, *, load_mask, store_mask, pieces,
              src_block, dst_block, src_pack: int = 1, dst_pack: int = 1) -> None:
    """Inside a kernel: dst rows := src rows, piece by piece; lanes off `load_mask` read 0,
    lanes off `store_mask` write nothing.

    src_ref / dst_ref: [rows, P * W] or [blocks, B, P * W] refs (`src_block` / `dst_block` =
    B, or 1 for 2-D refs; P = `src_pack` / `dst_pack`, the W-wide rows side by side in one
    ref row: a packed host pool); src_rows / dst_rows: int32[R] flat rows of W-wide rows
    (ref row `v // P`, columns `(v % P) * W` on), already out of range (and non-negative)
    where masked; pieces: `row_pieces` of W.
    """
    width = sum(size for _, size in pieces)
    src_rows, src_col = _unpack(src_rows, src_pack, width)
    dst_rows, dst_col = _unpack(dst_rows, dst_pack, width)
    src_idx = _row_index(len(src_ref.shape), src_rows, src_block)
    dst_idx = _row_index(len(dst_ref.shape), dst_rows, dst_block)
    nrows = src_rows.shape[0]
    for start, size in pieces:
        cols = (start + jnp.arange(size, dtype=jnp.int32))[None, :]
        shape = (nrows, size)
        src_cols = cols if src_col is None else cols + src_col
        dst_cols = cols if dst_col is None else cols + dst_col
        vals = plgpu.load(src_ref.at[(*src_idx, src_cols)],
                          mask=jnp.broadcast_to(load_mask[:, None], shape), other=0)
        plgpu.store(dst_ref.at[(*dst_idx, dst_cols)], vals.astype(dst_ref.dtype),
                    mask=jnp.broadcast_to(store_mask[:, None], shape))


def block_of(ref_shape: tuple[int, ...]) -> int:
    """Rows per block of a [rows, W] (1) or [blocks, B, W] (B) array."""
    return ref_shape[1] if len(ref_shape) == 3 else 1
