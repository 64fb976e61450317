"""The fused split-K combine (`pallas_kernels/sparse_mla_decode/combine.py`) against the jnp
`reference.merge_splits` it replaces.

CPU (the kernel in Pallas interpret mode, whose fresh outputs start as NaN, so an entry the
kernel forgets to write shows): random row counts, split counts (1..40), padded head counts,
value widths and dtypes, with -inf splits, heads whose splits are all -inf and whole rows of
them; a NaN split gives NaN out and lse for its head only; the attention kernel gives the
same results with the fused combine as with `merge_splits`; the kernel lowers to Triton at
real shapes; argument checks.
GPU (`pytest -m gpu`): the compiled kernel at one request with 32 splits and 128 heads, and
at 4 rows, 7 splits and 100 heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import _triton
from pallas_kernels.sparse_mla_decode import combine, reference
from pallas_kernels.sparse_mla_decode import triton as tk
from tests.ops import INTERPRET, lower_for_cuda, sds

# Value widths the attention kernel produces: 512 and 64 (bf16 rows), 384 (fp8 rows: whole
# 128-wide scale groups, not a power of two), 16 (the narrowest bf16 value).
V_WIDTHS = (512, 384, 64, 16)


def random_splits(seed, num_rows, splits, h, v, dtype, *, dead_frac=0.3, dead_heads=(),
                  dead_rows=()):
    """Per-split out [T, S, h, v] in `dtype` and lse2 float32 [T, S, h]: lse2 spread over a
    wide range, each split -inf with probability `dead_frac`, every split -inf for the heads
    `dead_heads` (of every row) and for every head of the rows `dead_rows`. A -inf split's out
    is 0, as the attention kernel writes it."""
    rng = np.random.default_rng(seed)
    lse2 = (rng.standard_normal((num_rows, splits, h)) * 4
            + rng.uniform(-40, 40, size=(num_rows, 1, h))).astype(np.float32)
    lse2[rng.random(lse2.shape) < dead_frac] = -np.inf
    lse2[:, :, list(dead_heads)] = -np.inf
    lse2[list(dead_rows)] = -np.inf
    out = rng.standard_normal((num_rows, splits, h, v)).astype(np.float32)
    out[np.isneginf(lse2)] = 0.0
    return jnp.asarray(out, dtype), jnp.asarray(lse2)


def bf16_ulp(x) -> np.ndarray:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    _, exp = np.frexp(np.abs(np.asarray(x, np.float32)))
    return np.ldexp(np.float32(1.0), exp - 8)


def assert_matches(got, want):
    """(out, lse) of the kernel against those of `reference.merge_splits`: NaN, -inf and 0
    exactly where the reference has them; float32 values to 2e-6 (the sums over the splits
    may run in another order), bfloat16 / float16 values within one ulp."""
    (out, lse), (ref_out, ref_lse) = got, want
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == jnp.float32
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(out[ref_out == 0.0], 0.0)
    if got[0].dtype == jnp.float32:
        np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=2e-6)
    else:
        ok = np.isnan(ref_out) | (np.abs(out - ref_out) <= bf16_ulp(ref_out) + 2e-6)
        assert ok.all(), (f"{(~ok).sum()} values off by more than a bf16 ulp, e.g. "
                          f"{out[~ok][:4]} vs {ref_out[~ok][:4]}")


# The jnp reference jitted once: one compile per example's shapes rather than one per op of
# it run eagerly (a dozen small compiles an example).
_merge_splits = jax.jit(reference.merge_splits, static_argnums=(2, 3))


def run_both(out, lse2, h_q, dtype, **kw):
    got = combine.combine_splits(out, lse2, h_q, dtype, interpret=INTERPRET, **kw)
    return got, _merge_splits(out, lse2, h_q, dtype)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_matches_merge_splits(seed, data):
    num_rows = data.draw(st.integers(1, 3), label="T")
    splits = data.draw(st.one_of(st.integers(1, 40), st.sampled_from([2, 7, 32])),
                       label="S")
    h = data.draw(st.sampled_from([16, 32, 128]), label="h_pad")
    h_q = data.draw(st.integers(1, h), label="h_q")
    v = data.draw(st.sampled_from(V_WIDTHS), label="v")
    dtype = data.draw(st.sampled_from([jnp.bfloat16, jnp.float32]), label="dtype")
    dead_frac = data.draw(st.sampled_from([0.0, 0.3, 0.9]), label="dead_frac")
    block_v = data.draw(st.sampled_from([None, 64, 512]), label="block_v")
    out, lse2 = random_splits(seed, num_rows, splits, h, v, dtype, dead_frac=dead_frac,
                              dead_heads=(h_q // 2,), dead_rows=(1,) if num_rows > 1 else ())
    got, want = run_both(out, lse2, h_q, dtype, block_v=block_v)
    assert got[0].shape == (num_rows, h_q, v) and got[1].shape == (num_rows, h_q)
    assert_matches(got, want)
    # The dead head (and the dead row) are 0 / -inf.
    assert np.all(np.asarray(got[0], np.float32)[:, h_q // 2] == 0.0)
    assert np.all(np.asarray(got[1])[:, h_q // 2] == -np.inf)
    if num_rows > 1:
        assert np.all(np.asarray(got[1])[1] == -np.inf)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_float32_result_of_low_precision_splits(dtype):
    """bf16 / f16 splits combined into a float32 result: the float32 values before any cast
    agree to float32 rounding; the splits' own dtype result within one ulp."""
    out, lse2 = random_splits(3, 2, 9, 32, 384, dtype, dead_heads=(5,))
    assert_matches(*run_both(out, lse2, 30, jnp.float32))
    if dtype != jnp.float32:
        assert_matches(*run_both(out, lse2, 30, dtype))


def test_one_split_is_merge_splits_without_a_kernel():
    out, lse2 = random_splits(4, 3, 1, 32, 64, jnp.bfloat16, dead_heads=(2,))
    (got_out, got_lse), (ref_out, ref_lse) = run_both(out, lse2, 20, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got_out).view(np.uint16),
                                  np.asarray(ref_out).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got_lse), np.asarray(ref_lse))


@pytest.mark.parametrize("others", ["live", "dead"])
@pytest.mark.parametrize("nan_split", [0, 4])
def test_nan_split_poisons_its_head_only(others, nan_split):
    """A NaN lse2 in one split of one head: that head's out and lse are NaN (also when its
    other splits are all -inf, and whatever the position of the NaN among the splits); every
    other head, the all -inf heads included, is as the reference."""
    out, lse2 = random_splits(5, 2, 5, 32, 64, jnp.bfloat16, dead_heads=(7,))
    lse2 = np.asarray(lse2).copy()
    if others == "dead":
        lse2[1, :, 3] = -np.inf
    lse2[1, nan_split, 3] = np.nan
    got, want = run_both(out, jnp.asarray(lse2), 20, jnp.bfloat16)
    assert_matches(got, want)
    nan_head = np.zeros((2, 20), bool)
    nan_head[1, 3] = True
    out64, lse64 = np.asarray(got[0], np.float32), np.asarray(got[1])
    np.testing.assert_array_equal(np.isnan(lse64), nan_head)
    np.testing.assert_array_equal(np.isnan(out64).all(axis=-1), nan_head)
    np.testing.assert_array_equal(np.isnan(out64).any(axis=-1), nan_head)
    assert np.all(out64[:, 7] == 0.0) and np.all(lse64[:, 7] == -np.inf)


@pytest.mark.parametrize("kw, exc, match", [
    ({"h_q": 0}, ValueError, "h_q"),
    ({"h_q": 33}, ValueError, "h_q"),
    ({"block_h": 12}, ValueError, "block_h"),
    ({"block_v": 96}, ValueError, "block_v"),
    ({"lse2_dtype": jnp.bfloat16}, ValueError, "lse2"),
])
def test_bad_arguments(kw, exc, match):
    out, lse2 = random_splits(6, 1, 3, 32, 64, jnp.bfloat16)
    lse2 = lse2.astype(kw.pop("lse2_dtype", jnp.float32))
    h_q = kw.pop("h_q", 32)
    with pytest.raises(exc, match=match):
        combine.combine_splits(out, lse2, h_q, jnp.bfloat16, interpret=True, **kw)


def test_attention_fused_combine_equals_merge_splits():
    """The Triton attention kernel with 4 K splits: its default fused combine against
    `fused_combine=False` (the jnp `merge_splits`), with an all-masked query row."""
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, 16, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((300, 576)), jnp.bfloat16)
    rows = rng.integers(0, 300, size=(2, 256)).astype(np.int32)
    rows[rng.random(rows.shape) < 0.2] = -1
    rows[0, 64:128] = -1                      # one split of row 0 has no valid entry
    rows[1] = -1                              # row 1 has none at all
    run = functools.partial(tk.sparse_mla_decode, q, kv, jnp.asarray(rows), sm_scale=0.07,
                            interpret=INTERPRET)
    fused = run(tuning=tk.AttentionTuning(num_splits=4))
    merged = run(tuning=tk.AttentionTuning(num_splits=4, fused_combine=False))
    assert_matches(fused, merged)
    assert np.all(np.asarray(fused[0], np.float32)[1] == 0.0)
    assert np.all(np.asarray(fused[1])[1] == -np.inf)
    assert np.isfinite(np.asarray(fused[1])[0]).all()


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("num_rows, splits, h, h_q, v, dtype", [
    (1, 32, 128, 128, 512, jnp.bfloat16),
    (4, 7, 128, 100, 512, jnp.bfloat16),
    (64, 2, 64, 64, 384, jnp.bfloat16),
    (3, 5, 16, 9, 64, jnp.float32),
])
def test_lowers_to_triton(num_rows, splits, h, h_q, v, dtype):
    lower_for_cuda(functools.partial(combine.combine_splits, h_q=h_q, dtype=dtype),
                   sds((num_rows, splits, h, v), dtype), sds((num_rows, splits, h), jnp.float32))


def test_tile_holds_every_split_and_spreads_small_grids():
    """Every split in one tile of at most TILE values (heads, then columns narrowed for
    many splits); columns narrowed further (down to 16) while the grid is under two waves;
    never wider than the row."""
    for rows, splits, h_q, width in [(1, 32, 128, 512), (1, 40, 100, 512), (2, 7, 20, 512),
                                     (64, 2, 128, 512), (256, 8, 128, 512), (3, 3, 16, 64),
                                     (1, 128, 128, 512), (2, 2, 5, 40)]:
        block_s, block_h, block_v = combine._tile(rows, splits, h_q, width)
        assert block_s == _triton.pow2_ceil(splits) >= splits
        assert block_s * block_h * block_v <= combine.TILE
        assert block_v <= _triton.pow2_ceil(width) and block_h <= 16
        programs = rows * -(-h_q // block_h) * -(-width // block_v)
        assert programs >= _triton.TARGET_PROGRAMS or block_v == 16 or block_v == width
    assert combine._tile(1, 32, 128, 512) == (32, 16, 16)      # 256 programs at one request
    assert combine._tile(256, 8, 128, 512) == (8, 16, 64)      # the tile cap, not the grid


# ------------------------------------------------------------------ compiled kernel (GPU)

@pytest.mark.gpu
@pytest.mark.parametrize("num_rows, splits, h, h_q", [(1, 32, 128, 128), (4, 7, 128, 100)])
def test_gpu_matches_merge_splits(num_rows, splits, h, h_q):
    """The compiled kernel against `merge_splits` (compiled by XLA), then fresh inputs through
    the same compiled kernel (an entry left unwritten would keep the old value)."""
    for seed in (11, 12):
        out, lse2 = random_splits(seed + splits, num_rows, splits, h, 512, jnp.bfloat16,
                                  dead_heads=(h_q - 1,), dead_rows=(1,) if num_rows > 1 else ())
        got = combine.combine_splits(out, lse2, h_q, jnp.bfloat16)
        want = reference.merge_splits(out, lse2, h_q, jnp.bfloat16)
        assert_matches(got, want)
