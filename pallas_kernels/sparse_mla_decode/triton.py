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
NaN out and NaN lse for that head. K splits (flash-decoding) are combined in float32 by
`reference.combine_splits`.
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
from pallas_kernels.sparse_mla_decode.reference import LOG2E, M_INIT, merge_splits, pad_operands


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
    The defaults are the sweep's choice (`bench/NOTES-sparse_mla.md`).
    """

    block_h: int | None = None
    block_k: int = 32
    num_warps: int | None = None
    num_stages: int = 3
    num_splits: int | None = None
    prefetch_ids: bool = True

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


DEFAULT = AttentionTuning()


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
             v_width: int = 512, interpret: bool = False) -> str | None:
    """None when this kernel handles the inputs (arrays or `jax.ShapeDtypeStruct`s with the
    arguments of `sparse_mla_decode`; kv_rows may be [num_blocks, B, D]), else the reason.

    Needs bf16/f16, v_width a power of two >= 16 and the rest of the row power-of-two pieces
    >= 16, and a KV cache of < 2^31 elements (row ids are int32 offsets).
    """
    del attention_rows, sm_scale, interpret
    width = q.shape[-1]
    kv_elems = math.prod(kv_rows.shape)
    if kv_elems >= 2**31:
        return (f"the triton kernel addresses the KV cache with int32 offsets: at most 2^31 - 1 "
                f"elements, got {kv_elems}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the triton kernel needs bfloat16 or float16 inputs, got {q.dtype}"
    if _row_pieces(width, v_width) is None:
        return (f"the triton kernel needs v_width a power of two >= 16 and the rest of the row "
                f"(D - v_width = {width - v_width}) made of power-of-two pieces >= 16; "
                f"got D={width}, v_width={v_width}")
    return None


def _attention_kernel(q_ref, kv_ref, rows_ref, out_ref, lse_ref, *, block_h, block_k, steps,
                      pieces, scale2, prefetch_ids):
    """Program (head block hb, split s, query row t): q_ref [T, Hp, D], kv_ref [R, D],
    rows_ref [T, Kp] (Kp = splits * steps * block_k, -1 padded); writes out_ref
    [T, S, Hp, v] (normalised within the split) and lse_ref [T, S, Hp] (base 2)."""
    hb, s, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    heads = (hb * block_h + jnp.arange(block_h, dtype=jnp.int32))[:, None]
    cols = [(start + jnp.arange(size, dtype=jnp.int32))[None, :] for start, size in pieces]
    q_pieces = [plgpu.load(q_ref.at[t, heads, c]) for c in cols]
    v_width = pieces[0][1]
    dims = (((1,), (1,)), ((), ()))          # contract the column dims: q k^T

    def load_ids(i):
        k0 = (s * steps + i) * block_k
        return plgpu.load(rows_ref.at[t, k0 + jnp.arange(block_k, dtype=jnp.int32)])

    def step(i, carry):
        if prefetch_ids:
            # The ids of step i came with step i - 1 (loop carry): the K-tile gather's
            # addresses are ready at the top of the step, and the load of the next step's ids
            # is issued before it (the last step reloads its own ids, harmlessly).
            acc, m_i, l_i, ids = carry
            ids_next = load_ids(jnp.minimum(i + 1, steps - 1))
        else:
            acc, m_i, l_i = carry
            ids = load_ids(i)
        valid = ids >= 0
        safe = jnp.where(valid, ids, 0)[:, None]
        scores = None
        k_value = None
        for qp, c, (_, size) in zip(q_pieces, cols, pieces, strict=True):
            kp = plgpu.load(kv_ref.at[safe, c],
                            mask=jnp.broadcast_to(valid[:, None], (block_k, size)), other=0)
            if k_value is None:
                k_value = kp
            part = lax.dot_general(qp, kp, dims, preferred_element_type=jnp.float32)
            scores = part if scores is None else scores + part
        scores = jnp.where(valid[None, :], scores * scale2, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(scores, axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + lax.dot_general(
            p.astype(k_value.dtype), k_value, (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32)
        if prefetch_ids:
            return acc, m_new, l_i, ids_next
        return acc, m_new, l_i

    carry = (jnp.zeros((block_h, v_width), jnp.float32),
             jnp.full((block_h,), M_INIT, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    if prefetch_ids:
        carry = (*carry, load_ids(0))
    acc, m_i, l_i = lax.fori_loop(0, steps, step, carry)[:3]
    # l_i is 0 exactly when the split has no valid entry (then acc = 0: out 0, lse -inf); a
    # NaN score (NaN query) makes l_i NaN, which both formulas pass on (no max() that might
    # drop a NaN: out NaN, lse NaN).
    empty = l_i == 0.0
    out = acc / jnp.where(empty, 1.0, l_i)[:, None]
    vcols = jnp.arange(v_width, dtype=jnp.int32)[None, :]
    plgpu.store(out_ref.at[t, s, heads, vcols], out.astype(out_ref.dtype))
    lse2 = jnp.where(empty, -jnp.inf, m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
    plgpu.store(lse_ref.at[t, s, heads[:, 0]], lse2)


def _attention_splits(programs: int, num_chunks: int, cfg: AttentionTuning) -> int:
    if cfg.num_splits is not None:
        want = cfg.num_splits
    else:
        want = max(1, pl.cdiv(_triton.TARGET_PROGRAMS, max(programs, 1)))
        want = min(want, max(1, num_chunks // 4))      # >= 4 steps per split
    want = max(1, min(want, num_chunks))
    while num_chunks % want:                            # no all-padding steps
        want -= 1
    return want



@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "interpret", "tuning"))
def sparse_mla_decode(
    q: jax.Array,
    kv_rows: jax.Array,
    attention_rows: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    interpret: bool = False,
    tuning: AttentionTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Kernel entry on validated inputs: q [T, h_q, D] bf16/f16, kv_rows [R, D] of q's dtype,
    attention_rows int32 [T, K] (-1 = masked).

    Returns out [T, h_q, v_width] in q.dtype and lse float32 [T, h_q] (natural log).
    Raises ValueError with `supports`' reason for inputs it cannot run.
    """
    cfg = tuning or DEFAULT
    num_rows, h_q, width = q.shape
    top_k = attention_rows.shape[1]
    reason = supports(q, kv_rows, v_width=v_width)
    if reason is not None:
        raise ValueError(reason)
    pieces = _row_pieces(width, v_width)
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
                               pieces=pieces, scale2=float(sm_scale) * LOG2E,
                               prefetch_ids=cfg.prefetch_ids)

    def call(q_pad, kv_rows, rows):
        return tuple(pl.pallas_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((num_rows, splits, h_pad, v_width), q.dtype),
                       jax.ShapeDtypeStruct((num_rows, splits, h_pad), jnp.float32)],
            grid=(head_blocks, splits, num_rows),
            in_specs=[_triton.ANY] * 3,
            out_specs=[_triton.ANY] * 2,
            interpret=interpret,
            compiler_params=_triton.compiler_params(num_warps, cfg.num_stages),
            name="hisparse_sparse_mla_decode",
        )(q_pad, kv_rows, rows))

    out, lse2 = _compat.quiet_triton_call(call, q_pad, kv_rows, rows)
    return merge_splits(out, lse2, h_q, q.dtype)
