"""grouped_matmul through jax's Hopper grouped matmul, `jax.experimental.pallas.ops.gpu.
ragged_dot_mgpu.ragged_dot` (Pallas Mosaic GPU, wgmma; in jax 0.10.2 and 0.11.x).

Import this module only where jax has Mosaic GPU Pallas (`hisparse_jax.ops` loads it lazily);
the library itself is imported on the first call. Contract: `reference.grouped_matmul`, for
bf16 / f16 inputs on a Hopper GPU (compute capability 9.x: wgmma), K a multiple of
`block_k` and N of `block_n`. No interpret mode: the library's kernel takes no such flag.

What the library does (read before choosing it): a persistent kernel (one CTA per SM) walks
(cdiv(M, block_m) + G - 1) * (N / block_n) output tiles, each a full K loop of wgmma over
`block_m` rows of lhs against one group's [K, block_n] weight block. A tile holds the rows
one group owns within one block_m-aligned row block; a group that starts inside a row block
(any group after the first, when groups are smaller than block_m) takes a tile of its own
even when it is empty, and the tile ids past the real ones still run (on group 0's weights)
and store nothing. So every one of the cdiv(M, block_m) + G - 1 tiles costs a full pass over
a [K, block_n] weight block: at DeepSeek's G = 256 and decode batches (M = 8 T < block_m *
G) that is about G passes, the bytes of all the experts' weights whatever the tokens chose,
as XLA's dense lowering of `ragged_dot` reads them; it does work in proportion to M only
when M / block_m dominates G (prefill). The G group boundaries are an unrolled loop in every
tile (correct for G = 256; compile time grows with G).

Wrapper: lhs gets zero rows up to a multiple of `block_m` (each TMA box of lhs then lies
inside the array; the extra rows belong to no group and are never stored); the library's
output, in lhs's dtype, is cut back to M rows and widened to float32. Its values are the
float32 wgmma accumulators rounded once to lhs's dtype, where the reference returns the
accumulators themselves: the MoE (`hisparse_jax.models.dsa_moe.routed_experts`) rounds each
expert's output to the compute dtype anyway, so there the two differ only by the order of
the float32 accumulation (results equal except where that order moves a value across a
rounding boundary of the compute dtype).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compat

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SMEM_BYTES = 232448  # opt-in shared memory per block on Hopper (227 KiB)


@dataclasses.dataclass(frozen=True)
class MosaicGroupedTuning:
    """The library kernel's knobs (its keyword arguments); the only bag of tuning parameters.

    block_m: rows per tile (wgmma M: a multiple of 64). block_n: output columns per tile (a
    multiple of 64; N % block_n == 0). block_k: K step (a multiple of 64; K % block_k == 0).
    max_concurrent_steps: K steps in flight (the SMEM ring depth). grid_block_n: column
    tiles walked together before moving to the next row tile (L2 locality of lhs).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 64 or value % 64:
                raise ValueError(f"MosaicGroupedTuning.{name} must be a positive multiple of "
                                 f"64, got {value}")
        for name in ("max_concurrent_steps", "grid_block_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"MosaicGroupedTuning.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.smem_bytes(2) > _SMEM_BYTES:
            raise ValueError(f"MosaicGroupedTuning needs {self.smem_bytes(2)} B of shared "
                             f"memory for 2-byte inputs, more than Hopper's {_SMEM_BYTES}")

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory of one CTA: the lhs and rhs rings and the output tile."""
        ring = (self.block_m + self.block_n) * self.block_k * self.max_concurrent_steps
        return (ring + self.block_m * self.block_n) * itemsize


DEFAULT = MosaicGroupedTuning()


def _library():
    """jax's module, imported now (it loads Mosaic GPU and jax's test utilities)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu


def supports(lhs, rhs, group_sizes=None, *, interpret: bool = False) -> str | None:
    """None when the library kernel runs these inputs (arrays or `jax.ShapeDtypeStruct`s with
    the arguments of `grouped_matmul`) with the `DEFAULT` tuning, else the reason: a Hopper
    GPU (no interpret mode), a jax that has the module, bf16 or f16 inputs of one dtype, K a
    multiple of block_k and N of block_n."""
    del group_sizes
    if interpret:
        return ("the mosaic_gpu grouped matmul (jax's ragged_dot_mgpu) has no interpret mode: "
                "it runs on a Hopper GPU only")
    other = _compat.not_hopper()
    if other is not None:
        return f"the mosaic_gpu grouped matmul needs a Hopper GPU (wgmma), got {other}"
    try:
        _library()
    except ImportError as e:
        return f"this jax ({jax.__version__}) has no ragged_dot_mgpu: {e}"
    if jnp.dtype(lhs.dtype) not in _DTYPES or jnp.dtype(rhs.dtype) != jnp.dtype(lhs.dtype):
        return (f"the mosaic_gpu grouped matmul needs bfloat16 or float16 lhs and rhs of one "
                f"dtype, got {jnp.dtype(lhs.dtype).name} and {jnp.dtype(rhs.dtype).name}")
    return _shape_reason(rhs.shape[1], rhs.shape[2], DEFAULT)


def _shape_reason(k: int, n: int, tuning: MosaicGroupedTuning) -> str | None:
    if k % tuning.block_k or n % tuning.block_n:
        return (f"the mosaic_gpu grouped matmul needs K a multiple of block_k={tuning.block_k} "
                f"and N of block_n={tuning.block_n}, got K={k}, N={n}")
    return None


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   interpret: bool = False, tuning: MosaicGroupedTuning | None = None
                   ) -> jax.Array:
    """float32[M, N]: rows of group g of lhs [M, K] times rhs[g] [K, N] through the library
    kernel (values rounded once to lhs's dtype: module docstring); group_sizes int32[G]
    sums to M.

    Raises:
      ValueError: interpret is set, or K / N are not multiples of the tuning's blocks.
    """
    if interpret:
        raise ValueError(supports(lhs, rhs, interpret=True))
    tuning = DEFAULT if tuning is None else tuning
    m, k = lhs.shape
    reason = _shape_reason(k, rhs.shape[2], tuning)
    if reason is not None:
        raise ValueError(reason)
    padded = -(-m // tuning.block_m) * tuning.block_m
    if padded != m:
        lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
    out = _library().ragged_dot(
        lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), block_m=tuning.block_m,
        block_n=tuning.block_n, block_k=tuning.block_k,
        max_concurrent_steps=tuning.max_concurrent_steps, grid_block_n=tuning.grid_block_n)
    return out[:m].astype(jnp.float32)
