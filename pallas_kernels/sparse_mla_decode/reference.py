"""sparse_mla_decode, jnp reference: gather the selected rows, softmax in float32.

The contract it defines (and every kernel backend reproduces):

  q:               [T, h_q, D]   query rows (T = number of query rows, D = 576 for DSV3.2)
  kv_cache_rows:   [R, D]        flat device rows (num_blocks * B of them), one latent head (MQA),
                                 of q's dtype (kv_format "bf16"), or uint8 [R, 656] rows of
                                 the "fp8_ds_mla" format (`pallas_kernels/kv_format.py`), D = 576
  attention_rows:  int32 [T, K]  row of `kv_cache_rows` per selected token, -1 = masked
                                 (holes may be anywhere); valid entries are in [0, R), and
                                 an entry outside [0, R) is masked as -1 is (never read)
  sm_scale:        float         softmax scale applied to q . k

  out[t, h] = sum_k softmax_k(sm_scale * q[t, h] . kv[rows[t, k]]) * kv[rows[t, k], :v_width]
  lse[t, h] = log sum_k exp(sm_scale * q[t, h] . kv[rows[t, k]])      (natural log, float32)

With "fp8_ds_mla", kv[r] is the dequantized row (`kv_format.dequantize`, float32): the value
is its first v_width latent values, the score uses all 576.

A row with no valid entry gives out = 0 and lse = -inf. `out` has q's dtype.

Masked entries are never read: whatever a row that no entry of query row t selects holds
(NaN and Inf included) cannot change row t's outputs. A NaN in q[t, h] (or in a selected
row) gives NaN out[t, h] and NaN lse[t, h] wherever row t has a valid entry, so lse = -inf
always means "no valid entry" and never hides a NaN.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import kv_format as kvf
from pallas_kernels.gather_compact import reference as gather_reference

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
M_INIT = -1e30        # the kernels' finite running-max start: fully masked tiles stay NaN-free


@functools.partial(jax.jit, static_argnames=("sm_scale", "v_width", "kv_format"))
def sparse_mla_decode(
    q: jax.Array,
    kv_cache_rows: jax.Array,
    attention_rows: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    kv_format: str = kvf.BF16,
) -> tuple[jax.Array, jax.Array]:
    """Reference sparse MLA decode over flat rows; shapes as in the module docstring.

    Returns (out [T, h_q, v_width] in q.dtype, lse float32 [T, h_q]).
    """
    valid = (attention_rows >= 0) & (attention_rows < kv_cache_rows.shape[0])   # [T, K]
    safe_rows = jnp.where(valid, attention_rows, 0)
    kv = jnp.take(kv_cache_rows, safe_rows, axis=0, mode="clip")   # [T, K, D] (or [T, K, 656])
    if kvf.check_kv_format(kv_format) == kvf.FP8_DS_MLA:
        kv = kvf.dequantize(kv, jnp.float32)                        # [T, K, 576]
    # Masked entries gathered row 0 (any row would do): zero them, so what that row holds
    # (NaN, Inf) never reaches a score or a product (0 * NaN would be NaN).
    kv = jnp.where(valid[..., None], kv.astype(jnp.float32), 0.0)
    qf = q.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("thd,tkd->thk", qf, kv, precision=hi) * jnp.float32(sm_scale)
    scores = jnp.where(valid[:, None, :], scores, -jnp.inf)
    any_valid = jnp.any(valid, axis=-1)[:, None]                    # [T, 1]
    m = jnp.max(scores, axis=-1)                                    # [T, h]; NaN propagates
    m_safe = jnp.where(any_valid, m, 0.0)
    p = jnp.exp(scores - m_safe[..., None])                         # masked -> exp(-inf) = 0
    denom = jnp.sum(p, axis=-1)                                     # [T, h]; >= 1 or NaN
    out = jnp.einsum("thk,tkv->thv", p, kv[..., :v_width], precision=hi)
    out = out / jnp.where(any_valid, denom, 1.0)[..., None]
    lse = jnp.where(any_valid, m_safe + jnp.log(jnp.where(any_valid, denom, 1.0)), -jnp.inf)
    return out.astype(q.dtype), lse.astype(jnp.float32)


def combine_splits(out: jax.Array, lse2: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Flash-decoding combine of K splits, in float32.

    out [T, S, h, v] (each split normalised within itself), lse2 float32 [T, S, h] (base-2
    log-sum-exp of that split, -inf for a split with no valid entry, NaN for a split that saw
    a NaN). Returns out [T, h, v] in `dtype` and the natural-log lse [T, h]; a row with no
    valid entry (every split -inf) gives 0 / -inf, a NaN in any split gives NaN / NaN.
    """
    live = jnp.any(lse2 != -jnp.inf, axis=1)                      # [T, h]; NaN counts as live
    m = jnp.max(lse2, axis=1)                                     # [T, h]; NaN propagates
    m_safe = jnp.where(live, m, 0.0)
    w = jnp.exp2(lse2 - m_safe[:, None])                          # [T, S, h]; -inf -> 0
    total = jnp.sum(w, axis=1)
    # An elementwise product and a sum over the few splits: one float32 fusion. As an einsum
    # it is a dot batched over T * h with a contraction of S (2-16), which XLA may hand to
    # a batched GEMM, on the GPU at its default (TF32) precision for float32 operands.
    comb = jnp.sum(w[..., None] * out.astype(jnp.float32), axis=1)
    comb = comb / jnp.where(live, total, 1.0)[..., None]
    lse = jnp.where(live, (m_safe + jnp.log2(jnp.where(live, total, 1.0))) * LN2, -jnp.inf)
    return comb.astype(dtype), lse.astype(jnp.float32)


def pad_operands(q: jax.Array, attention_rows: jax.Array, h_pad: int, k_pad: int
                 ) -> tuple[jax.Array, jax.Array]:
    """q [T, h_q, D] padded with zero heads to h_pad, attention_rows [T, K] padded with -1
    (masked) entries to k_pad: the kernels' tile-aligned operands."""
    h_q, top_k = q.shape[1], attention_rows.shape[1]
    if k_pad != top_k:
        attention_rows = jnp.pad(attention_rows, ((0, 0), (0, k_pad - top_k)),
                                 constant_values=-1)
    if h_pad != h_q:
        q = jnp.pad(q, ((0, 0), (0, h_pad - h_q), (0, 0)))
    return q, attention_rows


def merge_splits(out: jax.Array, lse2: jax.Array, h_q: int, dtype
                 ) -> tuple[jax.Array, jax.Array]:
    """The kernels' per-split results [T, S, h_pad, v] / [T, S, h_pad] (base-2 lse) cut to
    h_q heads and merged: (out [T, h_q, v] in `dtype`, natural-log lse float32 [T, h_q])."""
    out, lse2 = out[:, :, :h_q], lse2[:, :, :h_q]
    if out.shape[1] == 1:
        return out[:, 0], lse2[:, 0] * LN2
    return combine_splits(out, lse2, dtype)


def sparse_mla_decode_with_copies(q, kv_cache_rows, attention_rows, host_pools, kv_caches,
                                  swap_src, swap_dst, swap_counts, *, sm_scale: float,
                                  v_width: int = 512, kv_format: str = kvf.BF16):
    """`gather_compact_group(host_pools, kv_caches, swap_src, swap_dst, swap_counts)` (other
    layers' copies) and `sparse_mla_decode(q, kv_cache_rows, attention_rows)`: independent
    (kv_caches never include kv_cache_rows' buffer), here one after the other. Returns
    (out, lse, the updated kv_caches)."""
    caches = gather_reference.gather_compact_group(host_pools, kv_caches, swap_src, swap_dst,
                                                   swap_counts)
    out, lse = sparse_mla_decode(q, kv_cache_rows, attention_rows, sm_scale=sm_scale,
                                 v_width=v_width, kv_format=kv_format)
    return out, lse, caches
