"""invalidate_written_rows as a Pallas kernel (Triton lowering: it scatters -1 at
vector-computed slot indices, see `pallas_kernels/_triton.py`). One program per (token,
chunk of the H slots): a masked vector load of the token's slot row, a masked store of -1
where it holds the written row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _triton


@dataclasses.dataclass(frozen=True)
class InvalidateTuning:
    """Knobs of the invalidate kernel: slots per program (a power of two; one program per
    (token, chunk)) and warps per program."""

    chunk: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        if not _triton.is_pow2(self.chunk):
            raise ValueError(f"InvalidateTuning.chunk must be a power of two, got {self.chunk}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"InvalidateTuning.num_warps must be 1..16 (a power of two), "
                             f"got {self.num_warps}")


DEFAULT = InvalidateTuning()


def supports(*args: Any, **kwargs: Any) -> str | None:
    """None (takes the arguments of `invalidate_written_rows`): the kernel runs every input
    the validated op accepts."""
    del args, kwargs
    return None


def _invalidate_kernel(state_ref, written_ref, _slots_in, slots_ref, *, chunk, hot,
                       num_state_rows):
    t = pl.program_id(0)
    c0 = pl.program_id(1) * chunk          # program ids outside pl.when (the interpreter)
    s = state_ref[t]
    w = written_ref[t]

    @pl.when((s >= 0) & (s < num_state_rows) & (w >= 0))
    def _():
        cols = c0 + jnp.arange(chunk, dtype=jnp.int32)
        in_row = cols < hot
        cols = jnp.where(in_row, cols, hot)
        held = plgpu.load(slots_ref.at[s, cols], mask=in_row, other=-1)
        stale = in_row & (held == w)
        # Several tokens may clear slots of one row at once: each stores only its own -1s.
        plgpu.store(slots_ref.at[s, jnp.where(stale, cols, hot)],
                    jnp.full((chunk,), -1, jnp.int32), mask=stale)


def invalidate_written_rows(slot_rows: jax.Array, state_rows_per_token: jax.Array,
                            written_rows: jax.Array, *, interpret: bool = False,
                            tuning: InvalidateTuning | None = None,
                            chunk: int | None = None) -> jax.Array:
    """slot_rows[s, j] := -1 where it equals a token's written row (contract of
    `reference.invalidate_written_rows`, exactly).

    slot_rows: int32[S, H] (aliased onto the output); state_rows_per_token, written_rows:
    int32[T]. `chunk` overrides `tuning.chunk` (capped at H rounded up to a power of two).
    """
    tuning = tuning or DEFAULT
    num_state_rows, hot = slot_rows.shape
    tokens = written_rows.shape[0]
    if tokens == 0 or slot_rows.size == 0:
        return slot_rows
    chunk = min(chunk or tuning.chunk, _triton.pow2_ceil(hot))
    kernel = functools.partial(_invalidate_kernel, chunk=chunk, hot=hot,
                               num_state_rows=num_state_rows)

    (out,) = _triton.call_in_place(
        kernel, (state_rows_per_token, written_rows), (slot_rows,),
        grid=(tokens, pl.cdiv(hot, chunk)), num_warps=tuning.num_warps, interpret=interpret,
        name="hisparse_invalidate_written_rows")
    return out
