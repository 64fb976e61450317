"""The program of the Triton sparse MLA kernel (`triton.py`): one (head block, K split, query
row) of the attention, as stages.

Per K step (`_step`): the step's row ids (`_load_ids`), the gather of their rows as one K
tile (`_gather`, through the format's reader of `triton_tiles`), the scores in float32
(`_scores`), the online softmax in base 2 and the value products (`_softmax_update`,
`_accumulate`); after the last step the split's output and base-2 lse (`_store_outputs`).
The running max starts at the finite `M_INIT`, so fully masked tiles stay NaN-free.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sparse_mla_decode.reference import M_INIT
from pallas_kernels.sparse_mla_decode.triton_tiles import columns, masked_load

_QK_DIMS = (((1,), (1,)), ((), ()))     # contract the column dims: q k^T
_PV_DIMS = (((1,), (0,)), ((), ()))     # P [h, k] @ tile [k, v]


def attention_kernel(q_ref, kv_ref, rows_ref, out_ref, lse_ref, *, block_h, block_k, steps,
                     q_pieces, v_pieces, read, scale2, prefetch_ids, prefetch_tiles=False,
                     ids=None):
    """Program (head block hb, split s, query row t): q_ref [T, Hp, D], kv_ref [R, row]
    (row = D values, or 656 bytes), rows_ref [T, Kp] (Kp = splits * steps * block_k, -1
    padded); `read` is `triton_tiles.read_float_rows` or `read_fp8_rows` with its knobs
    bound, q_pieces the (start, size) q columns of its key tiles, v_pieces the (column,
    size) output columns of its value tiles. Writes out_ref [T, S, Hp, v] (normalised
    within the split) and lse_ref [T, S, Hp] (base 2). ids: (hb, s, t) when another kernel
    runs these programs as part of its grid (`triton._with_copies_kernel`).

    prefetch_ids: the loop carries each step's row ids, loaded one step ahead;
    prefetch_tiles: it carries the gathered K tile of the next step and the ids of the one
    after (`triton.AttentionTuning`)."""
    if ids is None:
        ids = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hb, s, t = ids
    heads = (hb * block_h + jnp.arange(block_h, dtype=jnp.int32))[:, None]
    qs = [plgpu.load(q_ref.at[t, heads, columns(start, size)]) for start, size in q_pieces]
    load_ids = functools.partial(_load_ids, rows_ref, s, t, steps=steps, block_k=block_k)
    gather = functools.partial(_gather, kv_ref, read)
    step = functools.partial(_step, qs=qs, load_ids=load_ids, gather=gather, steps=steps,
                             scale2=scale2, prefetch_ids=prefetch_ids,
                             prefetch_tiles=prefetch_tiles)
    carry = (tuple(jnp.zeros((block_h, size), jnp.float32) for _, size in v_pieces),
             jnp.full((block_h,), M_INIT, jnp.float32),
             jnp.zeros((block_h,), jnp.float32))
    if prefetch_tiles:
        carry = (*carry, gather(load_ids(0)), load_ids(jnp.minimum(1, steps - 1)))
    elif prefetch_ids:
        carry = (*carry, load_ids(0))
    accs, m_i, l_i = lax.fori_loop(0, steps, step, carry)[:3]
    _store_outputs(out_ref, lse_ref, s, t, heads, accs, m_i, l_i, v_pieces)


def _load_ids(rows_ref, s, t, i, *, steps, block_k):
    """int32 [block_k]: the row ids of step i of split s of query row t."""
    k = (s * steps + i) * block_k + jnp.arange(block_k, dtype=jnp.int32)
    return plgpu.load(rows_ref.at[t, k])


def _gather(kv_ref, read, ids):
    """(valid [block_k], the reader's (keys, key_scales, values)) for row ids `ids` (-1:
    masked, loads nothing; so is an id outside [0, R), never read past the rows)."""
    valid = (ids >= 0) & (ids < kv_ref.shape[0])
    return valid, read(functools.partial(masked_load, kv_ref,
                                         jnp.where(valid, ids, 0)[:, None], valid))


def _step(i, carry, *, qs, load_ids, gather, steps, scale2, prefetch_ids, prefetch_tiles):
    """K step i: carry (accs, m, l[, the prefetched tile][, prefetched ids]) -> the next."""
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
    scores = _scores(qs, keys, key_scales, valid, scale2)
    accs, m_new, l_i = _softmax_update(accs, m_i, l_i, scores, values)
    if prefetch_tiles:
        return (accs, m_new, l_i, *carry_next)
    if prefetch_ids:
        return accs, m_new, l_i, ids_next
    return accs, m_new, l_i


def _scores(qs, keys, key_scales, valid, scale2):
    """float32 [block_h, block_k]: sum over the pieces of q_j k_j^T (times the piece's
    per-row factor), times scale2 (sm_scale * log2 e); -inf where the entry is masked."""
    scores = None
    for qp, kp, ks in zip(qs, keys, key_scales, strict=True):
        part = lax.dot_general(qp, kp, _QK_DIMS, preferred_element_type=jnp.float32)
        if ks is not None:
            part = part * ks[None, :]
        scores = part if scores is None else scores + part
    return jnp.where(valid[None, :], scores * scale2, -jnp.inf)


def _softmax_update(accs, m_i, l_i, scores, values):
    """One online-softmax step in base 2: the new running max and sum, and the accumulators
    rescaled and given this step's value products. Returns (accs, m_new, l_i)."""
    m_new = jnp.maximum(m_i, jnp.max(scores, axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + jnp.sum(p, axis=1)
    return _accumulate(accs, alpha, p, values), m_new, l_i


def _accumulate(accs, alpha, p, values):
    """acc_i * alpha + (P * factor_i) @ tile_i for each value tile, in float32; P without a
    factor is converted once per operand dtype."""
    p_cast = {}                      # unscaled P, converted once per operand dtype

    def p_for(tile, vs):
        if vs is not None:
            return (p * vs[None, :]).astype(tile.dtype)
        if tile.dtype not in p_cast:
            p_cast[tile.dtype] = p.astype(tile.dtype)
        return p_cast[tile.dtype]

    return tuple(
        acc * alpha[:, None] + lax.dot_general(
            p_for(tile, vs), tile, _PV_DIMS, preferred_element_type=jnp.float32)
        for acc, (tile, vs) in zip(accs, values, strict=True))


def _store_outputs(out_ref, lse_ref, s, t, heads, accs, m_i, l_i, v_pieces):
    """The split's output (normalised within the split) and base-2 lse of its heads."""
    # l_i is 0 exactly when the split has no valid entry (then acc = 0: out 0, lse -inf); a
    # NaN score (NaN query) makes l_i NaN, which both formulas pass on (no max() that might
    # drop a NaN: out NaN, lse NaN).
    empty = l_i == 0.0
    inv = jnp.where(empty, 1.0, l_i)[:, None]
    for acc, (col, size) in zip(accs, v_pieces, strict=True):
        plgpu.store(out_ref.at[t, s, heads, columns(col, size)],
                    (acc / inv).astype(out_ref.dtype))
    lse2 = jnp.where(empty, -jnp.inf, m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
    plgpu.store(lse_ref.at[t, s, heads[:, 0]], lse2)
