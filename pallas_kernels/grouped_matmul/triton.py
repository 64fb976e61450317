"""grouped_matmul as a Pallas kernel (Triton lowering): one program per (tile, column block).

Contract: `reference.grouped_matmul` (float32 output, float32 accumulation), for bf16 / f16
inputs whose K and N are multiples of 16.

Schedule. Each group's rows are cut into tiles of `block_m` rows starting at the group's own
first row, so a tile never mixes groups: group g has ceil(n_g / block_m) tiles and an empty
group none. The tile table (`tile_table`: group, first row and row count of every tile,
computed with O(G * tiles) jnp work outside the kernel) has a static length, the most tiles
any group sizes summing to M can need: M // block_m + min(G, M) (a group of n rows has at most
n // block_m + 1 tiles, and at most min(G, M) groups are non-empty); the entries past the
last real tile have 0 rows. The grid is (table length, N / block_n); a program whose tile
has rows streams rhs[g][:, its column block] through K steps of `block_k`, multiplies the
tile's rows into a float32 [block_m, block_n] accumulator and stores the rows it owns; a
program whose tile has 0 rows returns at once. So the work is one pass over each non-empty
group's matrix per tile of its rows: the weights of the groups that have rows are read
(DeepSeek decode: the experts the tokens chose), never those of empty groups, and the
rows' products cost M / block_m + (non-empty groups) tiles.

Rows of a tile past its row count are other groups' rows (or, past M, the last row again):
they are multiplied but never stored. The tile axis is the grid's fastest: consecutive
programs are consecutive tiles of one column block, so the tiles of one group read the same
weight block while it is in L2.

`block_m` defaults to the rows a group has on average (M / G, a power of two in [16, 128]):
16-row tiles at decode (about M / G <= 16 rows per expert, where the weight read dominates),
larger tiles, fewer passes over each expert's weights, at prefill. The rhs of a DeepSeek
layer is larger than 4 GiB: the Triton lowering then addresses it with 64-bit offsets.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _compat, _triton

_DOT = (((1,), (0,)), ((), ()))          # [rows, k] @ [k, cols]
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class GroupedTuning:
    """Knobs of the kernel; the only bag of tuning parameters.

    block_m: rows per tile, a power of two >= 16; None: M / G rounded up to a power of two,
      clamped to [16, 128].
    block_n / block_k: the widest column block / K step, powers of two >= 16; the kernel
      uses the largest power of two up to them that divides N / K.
    num_warps, num_stages: Triton's warps per program and software-pipelining depth of the
      K loop's loads.
    """

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k") + (("block_m",) if self.block_m is not None else ()):
            value = getattr(self, name)
            if not _triton.is_pow2(value) or value < 16:
                raise ValueError(f"GroupedTuning.{name} must be a power of two >= 16, "
                                 f"got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GroupedTuning.num_warps must be 1, 2, 4, 8 or 16, got "
                             f"{self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"GroupedTuning.num_stages must be >= 1, got {self.num_stages}")


DEFAULT = GroupedTuning()


def supports(lhs, rhs, group_sizes=None, *, interpret: bool = False) -> str | None:
    """None when this kernel handles the inputs (arrays or `jax.ShapeDtypeStruct`s with the
    arguments of `grouped_matmul`), else the reason: bf16 or f16 inputs (float32 ones would
    be multiplied in TF32 by Triton's dot: the reference runs them), K and N multiples of
    16 (Triton's smallest dot)."""
    del group_sizes, interpret
    if jnp.dtype(lhs.dtype) not in _DTYPES or jnp.dtype(rhs.dtype) != jnp.dtype(lhs.dtype):
        return (f"the triton kernel needs bfloat16 or float16 lhs and rhs of one dtype, got "
                f"{jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}")
    k, n = rhs.shape[1:]
    if k % 16 or n % 16:
        return f"the triton kernel needs K and N multiples of 16, got K={k}, N={n}"
    return None


def _divisor_block(size: int, widest: int) -> int:
    """The largest power of two <= widest that divides size (size a multiple of 16)."""
    block = widest
    while size % block:
        block //= 2
    return block


def choose_block_m(m: int, groups: int, tuning: GroupedTuning = DEFAULT) -> int:
    """`tuning.block_m`, or the average rows per group as a power of two in [16, 128]."""
    if tuning.block_m is not None:
        return tuning.block_m
    return min(128, max(16, _triton.pow2_ceil(pl.cdiv(m, groups))))


def table_length(m: int, groups: int, block_m: int) -> int:
    """The most tiles of `block_m` rows that G groups of sizes summing to m can need."""
    return m // block_m + min(groups, m)


def tile_table(group_sizes: jax.Array, m: int, block_m: int
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(group, first row, rows) int32[table_length(m, G, block_m)] of every tile: group g's
    rows cut into tiles of block_m from its first row, groups in order; entries past the
    last tile have rows 0 (and group G - 1, first row 0)."""
    groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    tiles = (sizes + block_m - 1) // block_m
    tiles_end = jnp.cumsum(tiles)                                  # tiles of groups <= g
    rows_start = jnp.cumsum(sizes) - sizes
    t = jnp.arange(table_length(m, groups, block_m), dtype=jnp.int32)
    # The group of tile t: how many groups' tiles end at or before t (O(G) per tile, one
    # fusion; a binary search would be a loop of launches on the GPU).
    group = jnp.minimum(jnp.sum(tiles_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32),
                        groups - 1)
    j = t - (tiles_end[group] - tiles[group])                      # tile's index in its group
    start = rows_start[group] + j * block_m
    rows = jnp.clip(sizes[group] - j * block_m, 0, block_m)
    rows = jnp.where(t < tiles_end[-1], rows, 0)
    return group, jnp.where(rows > 0, start, 0), rows


def _kernel(group_ref, start_ref, rows_ref, lhs_ref, rhs_ref, out_ref, *, m, block_m,
            block_n, block_k, steps):
    """Program (tile t, column block c): out[tile's rows, c's columns] = lhs[tile's rows] @
    rhs[tile's group][:, c's columns], float32; nothing when the tile has no rows."""
    t, c = pl.program_id(0), pl.program_id(1)
    rows = rows_ref[t]

    @pl.when(rows > 0)
    def _():
        group, start = group_ref[t], start_ref[t]
        r = jnp.arange(block_m, dtype=jnp.int32)
        load_rows = jnp.minimum(start + r, m - 1)[:, None]     # rows past M: the last again
        cols = (c * block_n + jnp.arange(block_n, dtype=jnp.int32))[None, :]

        def step(i, acc):
            ks = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
            a = plgpu.load(lhs_ref.at[load_rows, ks[None, :]])
            b = plgpu.load(rhs_ref.at[group, ks[:, None], cols])
            return acc + lax.dot_general(a, b, _DOT, preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
        keep = r < rows
        # A dropped lane gets the out-of-range, non-negative row m (`_triton` conventions).
        store_rows = jnp.where(keep, start + r, m)[:, None]
        plgpu.store(out_ref.at[store_rows, cols], acc,
                    mask=jnp.broadcast_to(keep[:, None], acc.shape))


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   interpret: bool = False, tuning: GroupedTuning | None = None) -> jax.Array:
    """float32[M, N]: rows of group g of lhs [M, K] times rhs[g] [K, N]; group_sizes
    int32[G] sums to M (module docstring; contract of `reference.grouped_matmul`)."""
    tuning = DEFAULT if tuning is None else tuning
    m, k = lhs.shape
    groups, _, n = rhs.shape
    block_m = choose_block_m(m, groups, tuning)
    block_n, block_k = _divisor_block(n, tuning.block_n), _divisor_block(k, tuning.block_k)
    table = tile_table(group_sizes, m, block_m)
    kernel = functools.partial(_kernel, m=m, block_m=block_m, block_n=block_n,
                               block_k=block_k, steps=k // block_k)

    def call(group, start, rows, lhs, rhs):
        return (pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
            grid=(table[0].shape[0], n // block_n),
            in_specs=[_triton.ANY] * 5, out_specs=_triton.ANY,
            interpret=interpret,
            compiler_params=_triton.compiler_params(tuning.num_warps, tuning.num_stages),
            name="hisparse_grouped_matmul",
        )(group, start, rows, lhs, rhs),)

    (out,) = _compat.quiet_triton_call(call, *table, lhs, rhs)
    return out
