"""sparse_mla_decode: every backend against a float64 numpy reference.

CPU: each backend on random inputs (hypothesis), the multi-query-row form and fixed kernel
cases (padded heads, two head blocks, K splits, the id-prefetch off), the Triton kernel in
Pallas interpret mode and the Mosaic GPU kernel in Mosaic GPU interpret mode (where this jax
has it); masked rows are never read (NaN / Inf planted in unselected rows, row 0 among them,
change no bit of the output), a NaN query row gives NaN out and lse for that row only, K
splits included, and all-masked rows stay 0 / -inf, on every backend; argument validation;
the Triton kernel's CUDA lowering for every benchmark variant.
fp8_ds_mla rows (uint8[656], `pallas_kernels/kv_format.py`) on the reference and Triton
backends, the Triton kernel in each of its fp8 modes (FP8_MODES): against a float64 reference
on the dequantized rows (holes, all-masked rows, odd K, K splits, v_width 256, the
multi-query-row form), masked rows never read (fp8 NaN bytes, Inf / NaN scales, NaN rope in
unselected rows, NaN query rows), against bf16 rows of the same values (the error the
format costs, printed), validation, the CUDA lowering at real shapes, and the compiled kernel
at real size on the GPU.
The row-copy Mosaic GPU kernel (`mosaic_gpu_fp8.py`, backend "mosaic_gpu": fp8 rows, and bf16
rows with a RowTuning) in Mosaic GPU interpret mode (jax >= 0.11): fixed cases against float64
(holes, all-masked rows, odd K, K splits, two head blocks, the cache's last row selected, every
knob that changes the program), masked rows never read and NaN query rows (fp8 and bf16), the
knob and input rules, the Pallas -> Mosaic GPU lowering for sm_90 of every benchmark variant
at the benchmark's shapes, and (`gpu`) every variant compiled at real size.
GPU (`pytest -m gpu`): the compiled kernels, every candidate variant of the benchmark at three
shapes (each variant compiles in its own test, so one that fails to build fails only its
own), fresh random inputs with -1 holes anywhere and all-invalid rows, and the poison / NaN
query test at K = 2048.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ops.sparse_mla_decode import (
    ATTENTION_SWEEP_EXTRA,
    ATTENTION_VARIANTS,
    FP8_ATTENTION_VARIANTS,
    FP8_CANDIDATES,
    mosaic_row_bf16_variants,
    mosaic_row_variants,
    mosaic_variants,
)
from hisparse_jax.ops import _registry, sparse_mla_decode
from pallas_kernels import _compat
from pallas_kernels import kv_format as kvf
from pallas_kernels.sparse_mla_decode import reference
from pallas_kernels.sparse_mla_decode import triton as tk
from tests.ops import INTERPRET, backends, lower_for_cuda, np_dequantize_fp8, rerun_isolated, sds

BACKENDS = backends("sparse_mla_decode")
# The inputs of the random test (width 128, v_width 64) are outside the Mosaic GPU kernel's
# (v_width % 128 == 0), and its interpret mode is slow (~25 s a call here): it runs the fixed
# kernel cases; the others run the random test and the multi-query-row form.
RANDOM_BACKENDS = [p for p in BACKENDS if p.values[0] != "mosaic_gpu"]

SM_SCALE = 1.0 / math.sqrt(192.0)


def np_reference(q, kv_rows, rows, sm_scale, v_width):
    """float64 numpy sparse attention; q [T, h, D], kv_rows [R, D], rows [T, K]."""
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv_rows, np.float64)
    rows = np.asarray(rows)
    t_n, h_n, _ = q.shape
    out = np.zeros((t_n, h_n, v_width))
    lse = np.full((t_n, h_n), -np.inf)
    for t in range(t_n):
        sel = rows[t][rows[t] >= 0]
        if sel.size == 0:
            continue
        k = kv[sel]                                   # [k, D]
        s = q[t] @ k.T * sm_scale                     # [h, k]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        denom = p.sum(axis=1, keepdims=True)
        out[t] = (p / denom) @ k[:, :v_width]
        lse[t] = (m + np.log(denom))[:, 0]
    return out, lse


def make_inputs(seed, n, h, top_k, num_rows, *, width=576, dtype=jnp.bfloat16, hole_frac=0.2,
                invalid_rows=(), s_q=None):
    """Fresh random q, kv_cache [num_blocks, 16, width], rows with -1 holes anywhere."""
    rng = np.random.default_rng(seed)
    lead = (n,) if s_q is None else (n, s_q)
    q = jnp.asarray(rng.standard_normal((*lead, h, width)), dtype)
    block = 16
    num_blocks = -(-num_rows // block)
    kv = jnp.asarray(rng.standard_normal((num_blocks, block, width)), dtype)
    rows = rng.integers(0, num_blocks * block, size=(*lead, top_k)).astype(np.int32)
    rows[rng.random(rows.shape) < hole_frac] = -1
    for r in invalid_rows:
        rows.reshape(-1, top_k)[r] = -1
    return q, kv, jnp.asarray(rows)


def assert_close(out, lse, q, kv, rows, *, v_width=512, tol=1e-2):
    width = q.shape[-1]
    ref_out, ref_lse = np_reference(q.reshape(-1, *q.shape[-2:]), kv.reshape(-1, width),
                                    rows.reshape(-1, rows.shape[-1]), SM_SCALE, v_width)
    out = np.asarray(out, np.float64).reshape(ref_out.shape)
    lse = np.asarray(lse, np.float64).reshape(ref_lse.shape)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    err = np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-30)
    assert err < tol, f"relative error {err:.3e} >= {tol}"
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.all(lse[~finite] == -np.inf)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-2)
    dead = ~finite.any(axis=1)                        # all-invalid query rows
    assert np.all(out[dead] == 0.0)
    return err


# ---------------------------------------------------------------- every backend (CPU and GPU)

@pytest.mark.parametrize("backend", RANDOM_BACKENDS)
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data(), hole_frac=st.sampled_from([0.0, 0.3, 0.9]))
def test_matches_float64(backend, seed, data, hole_frac):
    if backend == "reference":
        n = data.draw(st.integers(1, 3), label="n")
        h = data.draw(st.sampled_from([1, 4, 16]), label="h")
        top_k = data.draw(st.integers(1, 40), label="top_k")
    else:   # kernels run in the interpreter off the GPU: one compile per shape
        n = 2
        h = data.draw(st.sampled_from([1, 16]), label="h")
        top_k = data.draw(st.sampled_from([1, 40]), label="top_k")
    q, kv, rows = make_inputs(seed, n, h, top_k, 50, width=128, hole_frac=hole_frac,
                              invalid_rows=(0,) if n > 1 else ())
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, v_width=64, backend=backend)
    assert out.shape == (n, h, 64) and out.dtype == q.dtype
    assert lse.shape == (n, h) and lse.dtype == jnp.float32
    assert_close(out, lse, q, kv, rows, v_width=64)


def test_reference_float32_is_tight():
    """float32 inputs: only the reference takes them."""
    q, kv, rows = make_inputs(1, 3, 8, 64, 200, dtype=jnp.float32, invalid_rows=(1,))
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend="reference")
    assert_close(out, lse, q, kv, rows, tol=1e-5)


def test_default_backend_on_cpu_is_reference():
    if jax.default_backend() == "gpu":
        pytest.skip("CPU dispatch")
    q, kv, rows = make_inputs(2, 2, 16, 32, 100)
    a = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE)
    b = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend="reference")
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


@pytest.mark.parametrize("backend", RANDOM_BACKENDS)
def test_multi_query_row_form_equals_flat_form(backend):
    q, kv, rows = make_inputs(3, 2, 4, 24, 80, s_q=3, invalid_rows=(4,))
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend)
    assert out.shape == (2, 3, 4, 512) and lse.shape == (2, 3, 4)
    flat_out, flat_lse = sparse_mla_decode(q.reshape(6, 4, 576), kv, rows.reshape(6, 24),
                                           sm_scale=SM_SCALE, backend=backend)
    np.testing.assert_array_equal(np.asarray(out).reshape(6, 4, 512), np.asarray(flat_out))
    np.testing.assert_array_equal(np.asarray(lse).reshape(6, 4), np.asarray(flat_lse))
    assert_close(out, lse, q, kv, rows)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, kv, r, kw: (q.astype(jnp.int32), kv, r, kw), TypeError, "q must be"),
    (lambda q, kv, r, kw: (q, kv.astype(jnp.float16), r, kw), TypeError, "kv_cache dtype"),
    (lambda q, kv, r, kw: (q, kv[..., :512], r, kw), ValueError,
     "kv_cache row width 512 != q width 576"),
    (lambda q, kv, r, kw: (q[0], kv, r, kw), ValueError, "q must be"),
    (lambda q, kv, r, kw: (q, kv[0, 0], r, kw), ValueError, "kv_cache must be"),
    (lambda q, kv, r, kw: (q, kv, r.astype(jnp.int16), kw), TypeError,
     "attention_rows must be int32"),
    (lambda q, kv, r, kw: (q, kv, r[:1], kw), ValueError, "attention_rows must be int32"),
    (lambda q, kv, r, kw: (q, kv, r[:, :0], kw), ValueError, "attention_rows"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "v_width": 600}), ValueError, "v_width"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "sm_scale": -1.0}), ValueError, "sm_scale"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "sm_scale": jnp.float32(0.1)}), TypeError,
     "sm_scale"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "backend": "cuda"}), ValueError, "backend"),
    (lambda q, kv, r, kw: (q.astype(jnp.float32), kv.astype(jnp.float32), r,
                           {**kw, "backend": "triton"}), ValueError, "bfloat16 or float16"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "backend": "triton", "v_width": 384}), ValueError,
     "power of two"),
    (lambda q, kv, r, kw: (q.astype(jnp.float32), kv.astype(jnp.float32), r,
                           {**kw, "backend": "mosaic_gpu"}), ValueError, "bfloat16 or float16"),
])
def test_bad_arguments_name_the_argument(mutate, exc, match):
    q, kv, rows = make_inputs(4, 2, 4, 8, 32)
    q, kv, rows, kw = mutate(q, kv, rows, {"sm_scale": SM_SCALE})
    with pytest.raises(exc, match=match):
        sparse_mla_decode(q, kv, rows, **kw)


# ------------------------------------ masked rows are never read; NaN query -> NaN (every backend)

POISON_ROWS = (0, 7, 33, 130)          # flat rows no entry selects, planted with NaN / Inf


def poisoned_inputs(seed, n, h, top_k, num_rows, *, nan_query=False):
    """make_inputs with NaN / Inf planted in rows nobody selects, and the rule cases:

    returns (q, kv_clean, kv_poisoned, rows, dead, nan_rows): row `dead` = n - 1 has no valid
    entry; with `nan_query`, query row 0 is NaN in every head (and selects nothing in the
    second half of its K entries, so a K split of it has no valid entry) and query row 1 has
    one NaN element in head 0 (nan_rows lists the (row, head) pairs that must be NaN).
    """
    q, kv, rows = make_inputs(seed, n, h, top_k, num_rows, invalid_rows=(n - 1,))
    rows = np.asarray(rows).copy()
    rows[np.isin(rows, POISON_ROWS)] = -1
    flat = np.asarray(kv, np.float32).reshape(-1, kv.shape[-1])
    poisoned = flat.copy()
    poisoned[0] = np.nan
    poisoned[7] = np.inf
    poisoned[33, ::3] = -np.inf
    poisoned[130, 5] = np.nan
    poisoned[130, 600 % flat.shape[1]] = np.inf
    kv_clean = kv
    kv_poisoned = jnp.asarray(poisoned.reshape(kv.shape), kv.dtype)
    nan_rows = []
    if nan_query:
        q = np.asarray(q, np.float32).copy()
        q[0] = np.nan
        rows[0, top_k // 2:] = -1
        q[1, 0, 5] = np.nan
        q = jnp.asarray(q, kv.dtype)
        nan_rows = [(0, hh) for hh in range(h)] + [(1, 0)]
    return q, kv_clean, kv_poisoned, jnp.asarray(rows), n - 1, nan_rows


def assert_matches_float64_with_nans(out, lse, q, kv, rows, *, tol=1e-2):
    """Like assert_close, but NaN is allowed exactly where the float64 reference has it (the
    reference of a NaN query row is NaN in out and lse); the rest must be close."""
    width = q.shape[-1]
    ref_out, ref_lse = np_reference(q, np.asarray(kv, np.float64).reshape(-1, width), rows,
                                    SM_SCALE, 512)
    out = np.asarray(out, np.float64)
    lse = np.asarray(lse, np.float64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    ok_out = ~np.isnan(ref_out)
    diff = np.where(ok_out, out - ref_out, 0.0)
    err = np.linalg.norm(diff) / max(np.linalg.norm(np.where(ok_out, ref_out, 0.0)), 1e-30)
    assert err < tol, f"relative error {err:.3e} >= {tol}"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-3, atol=1e-2)
    dead = np.isneginf(ref_lse)                       # no valid entry: out 0
    assert np.all(out[dead] == 0.0)


# Kernel knobs with two K splits at top_k 128 (the combine of a split without valid entry).
POISON_CONFIGS = {"reference": {}, "triton": {"num_splits": 2, "block_k": 16},
                  "mosaic_gpu": {"num_splits": 2}}


def _poison_config(backend):
    kw = POISON_CONFIGS[backend]
    return _tuning(backend, **kw) if backend != "reference" else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_are_never_read(backend):
    """NaN / Inf in rows that no entry selects (row 0 among them: the row a -1 entry used to
    gather) leave every output equal to the float64 reference; the output is bit for bit the
    one of the clean cache; the all-masked row is still 0 / -inf. A NaN query row gives NaN
    out and lse for that row (that head) only, also across K splits."""
    q, kv_clean, kv, rows, dead, nan_rows = poisoned_inputs(31, 4, 16, 128, 300,
                                                            nan_query=True)
    cfg = _poison_config(backend)
    check_poisoned_run(q, kv_clean, kv, rows, dead, nan_rows, backend, cfg,
                       compare_clean=backend != "mosaic_gpu")   # its interpret mode is slow


def check_poisoned_run(q, kv_clean, kv, rows, dead, nan_rows, backend, cfg, *,
                       compare_clean=True, kv_format="bf16"):
    """Runs the op on the poisoned cache and checks the rules (poisoned_inputs' docstring);
    with compare_clean, also that the output is bit for bit that of the clean cache. With
    kv_format "fp8_ds_mla" the caches are uint8 rows and the float64 reference reads the
    dequantized clean rows."""
    n, h = q.shape[:2]
    fmt = {"kv_format": kv_format}
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend, config=cfg,
                                 **fmt)
    assert out.shape == (n, h, 512) and lse.shape == (n, h)
    ref_kv = np_dequantize_fp8(kv_clean) if kv_format == kvf.FP8_DS_MLA else kv_clean
    assert_matches_float64_with_nans(out, lse, q, ref_kv, rows)
    out64, lse64 = np.asarray(out, np.float64), np.asarray(lse)
    assert np.all(out64[dead] == 0.0) and np.all(lse64[dead] == -np.inf)
    nan_mask = np.zeros((n, h), bool)
    for r, hh in nan_rows:
        nan_mask[r, hh] = True
    np.testing.assert_array_equal(np.isnan(lse64), nan_mask)
    np.testing.assert_array_equal(np.isnan(out64).all(axis=-1), nan_mask)
    np.testing.assert_array_equal(np.isnan(out64).any(axis=-1), nan_mask)
    if not compare_clean:
        return
    clean_out, clean_lse = sparse_mla_decode(q, kv_clean, rows, sm_scale=SM_SCALE,
                                             backend=backend, config=cfg, **fmt)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                  np.asarray(clean_out).view(np.uint16))
    np.testing.assert_array_equal(lse64.view(np.uint32), np.asarray(clean_lse).view(np.uint32))


@pytest.mark.parametrize("backend", RANDOM_BACKENDS)
def test_all_masked_and_nan_query_rows_without_splits(backend):
    """One K split: a NaN query row is NaN / NaN; a NaN query row with no valid entry is
    still 0 / -inf (no valid entry wins); the clean rows are untouched."""
    q, kv_clean, kv, rows, dead, _ = poisoned_inputs(32, 3, 4, 24, 200, nan_query=True)
    q = np.asarray(q, np.float32).copy()
    q[dead] = np.nan
    q = jnp.asarray(q, kv.dtype)
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend)
    assert_matches_float64_with_nans(out, lse, q, kv_clean, rows)
    assert np.all(np.asarray(out, np.float32)[dead] == 0.0)
    assert np.all(np.asarray(lse)[dead] == -np.inf)
    assert np.isnan(np.asarray(lse)[0]).all() and not np.isnan(np.asarray(lse)[1, 1:]).any()


def test_combine_splits_keeps_nan_and_empty_apart():
    """The flash-decoding combine: a split without valid entry (-inf) adds nothing, a NaN
    split makes the row NaN, every split -inf gives 0 / -inf."""
    lse2 = jnp.array([[[1.0], [-jnp.inf]], [[jnp.nan], [-jnp.inf]], [[-jnp.inf], [-jnp.inf]],
                      [[2.0], [3.0]]], jnp.float32)               # [T=4, S=2, h=1]
    out = jnp.ones((4, 2, 1, 2), jnp.float32) * jnp.arange(1, 3, dtype=jnp.float32)[:, None,
                                                                                    None]
    comb, lse = reference.combine_splits(out, lse2, jnp.float32)
    comb, lse = np.asarray(comb), np.asarray(lse)
    np.testing.assert_allclose(comb[0], 1.0)
    np.testing.assert_allclose(lse[0], 1.0 * math.log(2.0), rtol=1e-6)
    assert np.isnan(comb[1]).all() and np.isnan(lse[1]).all()
    assert np.all(comb[2] == 0.0) and np.all(lse[2] == -np.inf)
    w = np.array([2.0**2, 2.0**3])
    np.testing.assert_allclose(comb[3], (w @ np.array([1.0, 2.0])) / w.sum(), rtol=1e-6)
    np.testing.assert_allclose(lse[3], math.log(w.sum()), rtol=1e-6)


# ---------------------------------------------------------------- entries past the cache


def _rows_past_the_cache(seed=41, n=2, h=16, top_k=64, num_rows=160):
    """(q, kv with NaN in its last row, rows with entries >= R mixed in, the same rows with
    those entries -1, the first such entry): an entry past the cache must never be read (a
    clipped read of the last row would give NaN)."""
    q, kv, rows = make_inputs(seed, n, h, top_k, num_rows)
    flat = np.asarray(kv, np.float32).reshape(-1, kv.shape[-1])
    r = flat.shape[0]
    rows = np.asarray(rows).copy()
    rows[rows == r - 1] = -1
    flat[r - 1] = np.nan
    past = np.zeros(rows.shape, bool)
    past[0, 3], past[0, 10], past[n - 1, top_k - 1] = True, True, True
    rows[past] = [r, r + 7, 2 ** 30]
    masked = np.where(past, -1, rows)
    return (q, jnp.asarray(flat.reshape(kv.shape), kv.dtype), jnp.asarray(rows),
            jnp.asarray(masked), r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_past_the_cache_raise_outside_jit_and_are_masked_under_jit(backend, request):
    """An entry >= R = num_blocks * B: a concrete call raises (naming the entry, its value
    and R) unless validate=False; under jax.jit it is masked as -1 is, on every backend: the
    output is bit for bit that of the rows with those entries -1, and the cache's last row
    (NaN) is never read."""
    if backend == "mosaic_gpu" and INTERPRET and rerun_isolated(request):
        return  # passed in a process of its own (the interpreter can deadlock: see there)
    q, kv, rows, masked, r = _rows_past_the_cache()
    cfg = _poison_config(backend)
    kw = dict(sm_scale=SM_SCALE, backend=backend, config=cfg)
    with pytest.raises(ValueError, match=rf"attention_rows\[0, 3\] = {r} is not a row of "
                                         rf"kv_cache: entries must be < R = .* = {r}"):
        sparse_mla_decode(q, kv, rows, **kw)
    with pytest.raises(ValueError, match="attention_rows is traced"):
        jax.jit(lambda x: sparse_mla_decode(q, kv, x, validate=True, **kw))(rows)
    want_out, want_lse = sparse_mla_decode(q, kv, masked, **kw)
    assert not np.isnan(np.asarray(want_out, np.float32)).any()
    for out, lse in (jax.jit(lambda x: sparse_mla_decode(q, kv, x, **kw))(rows),
                     sparse_mla_decode(q, kv, rows, validate=False, **kw)):
        np.testing.assert_array_equal(np.asarray(out).view(np.uint16),
                                      np.asarray(want_out).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


# ------------------------------------------------ kernels, fixed cases (interpret off the GPU)

def _tuning(backend, **kw):
    if backend == "triton":
        return tk.AttentionTuning(**kw)
    from pallas_kernels.sparse_mla_decode.mosaic_gpu import TuningConfig

    return TuningConfig(**kw)


KERNEL_CASES = {
    "triton": [
        (2, 16, 128, {}),                                                  # padded heads
        (1, 80, 150, {"num_splits": 2, "block_k": 16}),                    # 2 head blocks, splits
        (2, 16, 100, {"block_k": 16, "prefetch_ids": False, "num_stages": 3}),  # no id prefetch
        (2, 16, 100, {"block_k": 16, "prefetch_tiles": True, "num_stages": 1}),  # tiles ahead
        (1, 80, 150, {"num_splits": 2, "block_k": 16, "prefetch_tiles": True}),  # ... + splits
        (1, 16, 16, {"block_k": 16, "prefetch_tiles": True}),              # one step only
    ],
    "mosaic_gpu": [
        (2, 16, 128, {}),                                                  # padded heads
        (1, 80, 150, {"num_splits": 2, "producer_wgs": 2}),                # 2 head blocks, splits
    ],
}


@pytest.mark.parametrize("backend, n, h, top_k, cfg_kw", [
    pytest.param(p.values[0], *case, marks=p.marks, id=f"{p.values[0]}-{i}")
    for p in BACKENDS for i, case in enumerate(KERNEL_CASES.get(p.values[0], []))])
def test_kernel_cases_match_float64(backend, n, h, top_k, cfg_kw, request):
    if backend == "mosaic_gpu" and INTERPRET and rerun_isolated(request):
        return  # passed in a process of its own (the interpreter can deadlock: see there)
    q, kv, rows = make_inputs(20 + n if backend == "triton" else 10 + n, n, h, top_k, 300,
                              invalid_rows=(0,) if n > 1 else ())
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend,
                                 config=_tuning(backend, **cfg_kw))
    assert out.shape == (n, h, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (n, h) and lse.dtype == jnp.float32
    assert_close(out, lse, q, kv, rows)


def test_mosaic_tuning_rejects_bad_knobs():
    from pallas_kernels.sparse_mla_decode.mosaic_gpu import TuningConfig

    with pytest.raises(ValueError, match="block_kv"):
        TuningConfig(block_kv=32)
    with pytest.raises(ValueError, match="producer_wgs"):
        TuningConfig(producer_wgs=3)
    with pytest.raises(ValueError, match="registers"):
        TuningConfig(compute_registers=240, producer_registers=64)


def test_triton_tuning_rejects_bad_knobs():
    with pytest.raises(ValueError, match="block_k"):
        tk.AttentionTuning(block_k=48)
    with pytest.raises(ValueError, match="block_h"):
        tk.AttentionTuning(block_h=128)
    with pytest.raises(ValueError, match="num_warps"):
        tk.AttentionTuning(num_warps=2)
    with pytest.raises(ValueError, match="fp8_words"):
        tk.AttentionTuning(fp8_words="views")
    with pytest.raises(ValueError, match="fp8_scale"):
        tk.AttentionTuning(fp8_scale="rows")
    tk.AttentionTuning(num_warps=16)                    # 16 warps at 64 heads is a candidate


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_triton_variants_lower_to_triton():
    """Every attention candidate of the benchmark lowers (N=64, K=2048, h_q 128 and 16)."""
    for h in (128, 16):
        for cfg in {**ATTENTION_VARIANTS, **ATTENTION_SWEEP_EXTRA}.values():
            lower_for_cuda(functools.partial(tk.sparse_mla_decode, sm_scale=0.1, tuning=cfg),
                           sds((64, h, 576), jnp.bfloat16), sds((1 << 16, 576), jnp.bfloat16),
                           sds((64, 2048)))


# --------------------------------------------- fp8_ds_mla rows (reference and Triton, CPU and GPU)

FP8 = kvf.FP8_DS_MLA
# The Mosaic GPU kernel reads bf16 rows only (its supports() says why: test below).
FP8_BACKENDS = [p for p in BACKENDS if p.values[0] != "mosaic_gpu"]


def make_fp8_inputs(seed, n, h, top_k, num_rows, **kw):
    """make_inputs, plus the cache quantized to fp8_ds_mla rows: (q, kv bf16, kv8 uint8
    [num_blocks, 16, 656], rows)."""
    q, kv, rows = make_inputs(seed, n, h, top_k, num_rows, **kw)
    return q, kv, kvf.quantize(kv), rows


def assert_close_fp8(out, lse, q, kv8, rows, *, v_width=512, tol=1e-2) -> float:
    """assert_close against the float64 reference on the dequantized rows (numpy decoder of
    `tests/ops`); returns the relative error of out."""
    return assert_close(out, lse, q, np_dequantize_fp8(kv8), rows, v_width=v_width, tol=tol)


FP8_CASES = {   # (n, h, top_k, hole_frac, invalid_rows, triton tuning knobs)
    "holes_odd_k": (3, 16, 37, 0.3, (1,), {}),                             # K % block_k != 0
    "splits": (2, 16, 128, 0.5, (0,), {"num_splits": 2, "block_k": 16}),    # 2 K splits
    "two_head_blocks": (1, 80, 64, 0.0, (), {"block_k": 16, "fp8_words": "strided"}),
}


# The Triton kernel's fp8 modes (`AttentionTuning.fp8_words` / `fp8_scale`) every fp8 test of
# the Triton backend runs: the default, the split word assembly, the scales folded into the
# group tiles and into one 512-wide tile.
FP8_MODES = {
    "default": {},
    "split": {"fp8_words": "split"},
    "tiles": {"fp8_words": "split", "fp8_scale": "tiles"},
    "tile512": {"fp8_words": "split", "fp8_scale": "tile512"},
    "tile512_contiguous": {"fp8_scale": "tile512"},
}


def _fp8_params() -> list:
    """pytest params (backend, mode): the reference once, the Triton kernel per FP8_MODES."""
    params = []
    for p in FP8_BACKENDS:
        name = p.values[0]
        for mode in (FP8_MODES if name == "triton" else ["default"]):
            params.append(pytest.param(name, mode, marks=p.marks, id=f"{name}-{mode}"))
    return params


def _fp8_config(backend, mode, **knobs):
    """The Triton tuning of `mode` plus `knobs`, or None (other backends)."""
    return tk.AttentionTuning(**{**knobs, **FP8_MODES[mode]}) if backend == "triton" else None


@pytest.mark.parametrize("backend, mode", _fp8_params())
@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_matches_float64_on_dequantized_rows(backend, mode, case):
    """fp8 rows against the float64 reference on their dequantized values: relative error of
    out <= 1e-2 (the issue's target), lse to 1e-3; all-masked rows 0 / -inf."""
    n, h, top_k, hole_frac, invalid, knobs = FP8_CASES[case]
    q, _, kv8, rows = make_fp8_inputs(50 + n + top_k, n, h, top_k, 300, hole_frac=hole_frac,
                                      invalid_rows=invalid)
    if mode != "default":
        knobs = {k: v for k, v in knobs.items() if k != "fp8_words"}
    cfg = _fp8_config(backend, mode, **knobs)
    out, lse = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                 backend=backend, config=cfg)
    assert out.shape == (n, h, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (n, h) and lse.dtype == jnp.float32
    err = assert_close_fp8(out, lse, q, kv8, rows)
    print(f"fp8 {backend} {mode} {case}: relative error vs float64 on dequantized rows "
          f"{err:.2e}")
    for r in invalid:
        assert np.all(np.asarray(out, np.float32)[r] == 0.0)
        assert np.all(np.asarray(lse)[r] == -np.inf)


@pytest.mark.parametrize("backend, mode", _fp8_params())
def test_fp8_multi_query_rows_and_v_width(backend, mode):
    """The [N, s_q, h_q, D] form over a paged fp8 cache equals the flat form; v_width 256
    (two scale groups) is the first 256 dequantized latent values."""
    q, _, kv8, rows = make_fp8_inputs(60, 2, 4, 24, 80, s_q=2, invalid_rows=(3,))
    cfg = _fp8_config(backend, mode)
    out, lse = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                 backend=backend, config=cfg)
    assert out.shape == (2, 2, 4, 512) and lse.shape == (2, 2, 4)
    flat_out, flat_lse = sparse_mla_decode(q.reshape(4, 4, 576), kv8.reshape(-1, 656),
                                           rows.reshape(4, 24), sm_scale=SM_SCALE,
                                           kv_format=FP8, backend=backend, config=cfg)
    np.testing.assert_array_equal(np.asarray(out).reshape(4, 4, 512), np.asarray(flat_out))
    np.testing.assert_array_equal(np.asarray(lse).reshape(4, 4), np.asarray(flat_lse))
    assert_close_fp8(out, lse, q, kv8, rows)
    out256, lse256 = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, v_width=256,
                                       kv_format=FP8, backend=backend, config=cfg)
    assert out256.shape == (2, 2, 4, 256)
    assert_close_fp8(out256, lse256, q, kv8, rows, v_width=256)


POISON_FP8_ROWS = {   # flat row -> what is planted in it (all unselected)
    0: "every latent byte 0x7F (float8_e4m3fn NaN)",
    7: "scale 1 = +Inf",
    33: "every rope value NaN (bf16 0x7FC0)",
    130: "latent bytes 0xFF (NaN) and scale 3 = NaN",
}


def poisoned_fp8_inputs(seed, n, h, top_k, num_rows):
    """poisoned_inputs (NaN query rows, an all-masked row, holes) with the cache quantized
    to fp8 rows and the rows of POISON_FP8_ROWS overwritten with NaN / Inf bytes."""
    q, kv_clean, _, rows, dead, nan_rows = poisoned_inputs(seed, n, h, top_k, num_rows,
                                                           nan_query=True)
    clean = np.asarray(kvf.quantize(kv_clean))
    flat = clean.reshape(-1, 656).copy()
    flat[0, :512] = 0x7F
    flat[7, 516:520] = np.float32([np.inf]).view(np.uint8)
    flat[33, 528:] = np.tile(np.uint16([0x7FC0]).view(np.uint8), 64)
    flat[130, :512] = 0xFF
    flat[130, 524:528] = np.float32([np.nan]).view(np.uint8)
    assert np.isnan(np_dequantize_fp8(flat[[0, 33, 130]])).any(axis=1).all()
    assert np.isinf(np_dequantize_fp8(flat[7])).any()
    return (q, jnp.asarray(clean), jnp.asarray(flat.reshape(clean.shape)), rows, dead,
            nan_rows)


@pytest.mark.parametrize("backend, mode", _fp8_params())
def test_fp8_masked_rows_are_never_read(backend, mode):
    """fp8 rows holding NaN / Inf bytes (POISON_FP8_ROWS, row 0 among them) that no entry
    selects change no bit of the output; the all-masked row is 0 / -inf; a NaN query row
    (head) gives NaN out and lse for that row (head) only, across K splits too."""
    cfg = _fp8_config(backend, mode, num_splits=2, block_k=16)
    check_poisoned_run(*poisoned_fp8_inputs(31, 4, 16, 128, 300), backend, cfg,
                       kv_format=FP8)


@pytest.mark.parametrize("backend", FP8_BACKENDS)
def test_fp8_against_bf16_rows_of_the_same_values(backend):
    """What the format costs: attention over fp8 rows against attention over the bf16 rows
    they were quantized from (the reference backend, float32 math). Gaussian rows lose
    ~2.6% (RMS) of their latent values to e4m3 rounding (`docs/kv_format.md`); the outputs
    differ by a few percent (printed), well inside the loose bound asserted here."""
    q, kv, kv8, rows = make_fp8_inputs(70, 3, 16, 64, 300, hole_frac=0.2)
    out8, lse8 = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                   backend=backend)
    out16, lse16 = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend="reference")
    a, b = np.asarray(out8, np.float64), np.asarray(out16, np.float64)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    lse_err = float(np.max(np.abs(np.asarray(lse8) - np.asarray(lse16))))
    print(f"fp8 {backend} vs bf16 rows: relative error of out {err:.2e}, "
          f"max |lse difference| {lse_err:.2e}")
    assert err < 0.1 and lse_err < 0.1


def test_fp8_mosaic_gpu_takes_deepseek_rows_and_says_why_not_others():
    """The mosaic_gpu backend runs fp8 rows with its row-copy kernel (bf16 q of width 576,
    v_width 512, a Hopper GPU) and names the rule it cannot meet otherwise."""
    supports = pytest.importorskip("pallas_kernels.sparse_mla_decode.mosaic_gpu").supports
    args = (sds((2, 16, 576), jnp.bfloat16), sds((64, 656), jnp.uint8), sds((2, 8)))
    if _compat.has_gpu():                 # the GPU machine is a Hopper
        assert supports(*args, kv_format=FP8) is None
    else:
        assert "needs a Hopper GPU (wgmma), got a cpu device" in supports(*args, kv_format=FP8)
        assert supports(*args, kv_format=FP8, device_check=False) is None
    assert "v_width 512" in supports(*args, kv_format=FP8, v_width=256)
    f16 = (sds((2, 16, 576), jnp.float16), *args[1:])
    assert "bfloat16 q of width 576" in supports(*f16, kv_format=FP8)
    huge = (args[0], sds((4_000_000, 656), jnp.uint8), args[2])
    assert "int32 byte offsets" in supports(*huge, kv_format=FP8)
    with pytest.raises(ValueError, match="mosaic_gpu.*v_width 512, got 256"):
        _registry.select("sparse_mla_decode", "mosaic_gpu", *args, kv_format=FP8, v_width=256)
    assert _registry.select("sparse_mla_decode", "triton", *args, kv_format=FP8) == "triton"


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda q, kv, r, kw: (q, kv.view(jnp.int8), r, kw), TypeError, "kv_cache must be uint8"),
    (lambda q, kv, r, kw: (q, kv[..., :576], r, kw), ValueError, "rows must be 656 bytes"),
    (lambda q, kv, r, kw: (q[..., :512], kv, r, kw), ValueError, "q must be 576 wide"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "v_width": 576}), ValueError,
     r"v_width must be an int in \[1, 512\]"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "kv_format": "fp8"}), ValueError,
     "kv_format must be one of"),
    (lambda q, kv, r, kw: (q.astype(jnp.float16), kv, r, {**kw, "backend": "triton"}),
     ValueError, "bfloat16 q"),
    (lambda q, kv, r, kw: (q, kv, r, {**kw, "backend": "triton", "v_width": 200}), ValueError,
     "multiple of 128"),
])
def test_fp8_bad_arguments_name_the_argument(mutate, exc, match):
    q, _, kv8, rows = make_fp8_inputs(4, 2, 4, 8, 32)
    q, kv8, rows, kw = mutate(q, kv8, rows, {"sm_scale": SM_SCALE, "kv_format": FP8})
    with pytest.raises(exc, match=match):
        sparse_mla_decode(q, kv8, rows, **kw)


def test_fp8_reference_takes_float32_q():
    q, _, kv8, rows = make_fp8_inputs(5, 2, 8, 32, 100, dtype=jnp.float32, invalid_rows=(1,))
    out, lse = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                 backend="reference")
    assert out.dtype == jnp.float32
    assert_close_fp8(out, lse, q, kv8, rows, tol=1e-5)


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_fp8_triton_variants_lower_to_triton():
    """Every fp8 candidate of the benchmark lowers at real shapes: N=64, K=2048, h_q 128 and
    16, 65,536 rows of 656 bytes (and N=1, odd K, v_width 256)."""
    for h in (128, 16):
        for cfg in FP8_CANDIDATES.values():
            lower_for_cuda(functools.partial(tk.sparse_mla_decode, sm_scale=0.1, kv_format=FP8,
                                             tuning=cfg),
                           sds((64, h, 576), jnp.bfloat16), sds((1 << 16, 656), jnp.uint8),
                           sds((64, 2048)))
    for knobs in FP8_MODES.values():
        lower_for_cuda(functools.partial(tk.sparse_mla_decode, sm_scale=0.1, kv_format=FP8,
                                         v_width=256, tuning=tk.AttentionTuning(**knobs)),
                       sds((1, 16, 576), jnp.bfloat16), sds((1 << 16, 656), jnp.uint8),
                       sds((1, 1999)))


# ------------------------------------------------------------------ compiled kernel (GPU)

def _gpu_candidates() -> list[str]:
    """Names `backend:variant` of every candidate the benchmark compares."""
    return ([f"mosaic_gpu:{v}" for v in mosaic_variants()]
            + [f"triton:{v}" for v in ATTENTION_VARIANTS])


def _candidate_config(name: str):
    backend, variant = name.split(":")
    variants = ATTENTION_VARIANTS if backend == "triton" else mosaic_variants()
    return backend, variants[variant]


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", _gpu_candidates())
@pytest.mark.parametrize("n, h, top_k", [(1, 16, 2048), (4, 128, 2048), (3, 64, 1000)])
def test_kernel_gpu_matches_float64(candidate, n, h, top_k):
    backend, cfg = _candidate_config(candidate)
    q, kv, rows = make_inputs(100 + n * h + top_k, n, h, top_k, 50_000,
                              invalid_rows=(n - 1,) if n > 1 else ())
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend, config=cfg)
    assert_close(out, lse, q, kv, rows)
    # Fresh inputs through the same compiled kernel: a stale or unwritten output shows here.
    q2, kv2, rows2 = make_inputs(7 + n, n, h, top_k, 50_000)
    out2, lse2 = sparse_mla_decode(q2, kv2, rows2, sm_scale=SM_SCALE, backend=backend,
                                   config=cfg)
    assert_close(out2, lse2, q2, kv2, rows2)


def test_split_rule_fills_small_grids_and_divides_the_steps():
    """The default K split count: about two waves of programs at >= 4 steps per split, but
    one-step splits when 4-step ones leave the grid under a quarter of the SMs; always a
    divisor of the steps; `num_splits` as given (down to a divisor)."""
    rule, cfg = tk._attention_splits, tk.DEFAULT
    assert rule(2, 32, cfg) == 32          # N=1, h_q=128, K=2048: 64 programs of 1 step
    assert rule(1, 32, cfg) == 32          # N=1, h_q=16
    assert rule(8, 32, cfg) == 8           # N=4, h_q=128: 64 programs of 4 steps already
    assert rule(128, 32, cfg) == 2 and rule(512, 32, cfg) == 1
    assert rule(2, 32, dataclasses.replace(cfg, num_splits=5)) == 4
    for programs in (1, 2, 3, 5, 8, 33, 130, 264, 1000):
        for steps in range(1, 70):
            splits = rule(programs, steps, cfg)
            assert 1 <= splits <= steps and steps % splits == 0, (programs, steps, splits)
            if programs * max(1, steps // 4) >= 33:
                assert steps // splits >= min(4, steps) or splits == 1, (programs, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [16, 32])
@pytest.mark.parametrize("n, h", [(1, 128), (1, 16), (4, 128)])
def test_kernel_gpu_as_many_k_splits_as_steps(splits, n, h):
    """Small batches with 16 or 32 K splits of K = 2048 (2 steps of 64 rows, or one: the
    grids of `bench/attention_splits.py`) against float64, fresh inputs through the same
    kernel, and the poisoned run (NaN / Inf in unselected rows change nothing)."""
    cfg = dataclasses.replace(tk.DEFAULT, num_splits=splits)
    q, kv, rows = make_inputs(300 + n * h + splits, n, h, 2048, 50_000,
                              invalid_rows=(n - 1,) if n > 1 else ())
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend="triton", config=cfg)
    assert_close(out, lse, q, kv, rows)
    q2, kv2, rows2 = make_inputs(11 + n, n, h, 2048, 50_000)
    out2, lse2 = sparse_mla_decode(q2, kv2, rows2, sm_scale=SM_SCALE, backend="triton",
                                   config=cfg)
    assert_close(out2, lse2, q2, kv2, rows2)
    check_poisoned_run(*poisoned_inputs(43 + n, n, h, 2048, 50_000, nan_query=n > 1),
                       "triton", cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton"])
def test_kernel_gpu_all_holes_and_multi_query_rows(backend):
    q, kv, rows = make_inputs(5, 2, 128, 256, 10_000, s_q=2, hole_frac=0.6, invalid_rows=(1, 2))
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend)
    assert out.shape == (2, 2, 128, 512)
    assert_close(out, lse, q, kv, rows)
    ref = reference.sparse_mla_decode(q.reshape(4, 128, 576), kv.reshape(-1, 576),
                                      rows.reshape(4, 256), sm_scale=SM_SCALE)
    err = np.linalg.norm(np.asarray(out, np.float32).reshape(4, 128, 512)
                         - np.asarray(ref[0], np.float32)) / np.linalg.norm(
                             np.asarray(ref[0], np.float32))
    assert err < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("candidate", _gpu_candidates())
def test_kernel_gpu_masked_rows_are_never_read(candidate):
    """The compiled kernels at a real shape: NaN / Inf in rows nobody selects (row 0 among
    them) change no bit of any output, the all-masked row is 0 / -inf, and a NaN query row
    (head) is NaN in out and lse for that row (head) only, across K splits too."""
    backend, cfg = _candidate_config(candidate)
    check_poisoned_run(*poisoned_inputs(41, 4, 128, 2048, 50_000, nan_query=True), backend,
                       cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(FP8_ATTENTION_VARIANTS))
@pytest.mark.parametrize("n, h, top_k", [(1, 16, 2048), (4, 128, 2048), (3, 64, 1000)])
def test_fp8_kernel_gpu_matches_float64(variant, n, h, top_k):
    """The compiled fp8 kernel at real size (K = 2048, 50,000 rows of 656 bytes) against the
    float64 reference on the dequantized rows, then fresh inputs through the same kernel."""
    cfg = FP8_ATTENTION_VARIANTS[variant]
    q, _, kv8, rows = make_fp8_inputs(200 + n * h + top_k, n, h, top_k, 50_000,
                                      invalid_rows=(n - 1,) if n > 1 else ())
    out, lse = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                 backend="triton", config=cfg)
    err = assert_close_fp8(out, lse, q, kv8, rows)
    print(f"fp8 gpu {variant} N={n} h={h} K={top_k}: relative error {err:.2e}")
    q2, _, kv82, rows2 = make_fp8_inputs(9 + n, n, h, top_k, 50_000)
    out2, lse2 = sparse_mla_decode(q2, kv82, rows2, sm_scale=SM_SCALE, kv_format=FP8,
                                   backend="triton", config=cfg)
    assert_close_fp8(out2, lse2, q2, kv82, rows2)


@pytest.mark.gpu
@pytest.mark.parametrize("n, h", [(1, 128), (4, 16)])
def test_fp8_kernel_gpu_as_many_k_splits_as_steps(n, h):
    """The fp8 kernel's default tuning with 32 K splits of K = 2048 (one step each)
    against float64 on the dequantized rows."""
    base = tk.DEFAULT_FP8_WIDE if h >= 64 else tk.DEFAULT_FP8
    cfg = dataclasses.replace(base, num_splits=2048 // base.block_k)
    q, _, kv8, rows = make_fp8_inputs(500 + n * h, n, h, 2048, 50_000,
                                      invalid_rows=(n - 1,) if n > 1 else ())
    out, lse = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                 backend="triton", config=cfg)
    assert_close_fp8(out, lse, q, kv8, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(FP8_ATTENTION_VARIANTS))
def test_fp8_kernel_gpu_masked_rows_are_never_read(variant):
    """test_fp8_masked_rows_are_never_read compiled, at N=4, h_q=128, K=2048."""
    check_poisoned_run(*poisoned_fp8_inputs(41, 4, 128, 2048, 50_000), "triton",
                       FP8_ATTENTION_VARIANTS[variant], kv_format=FP8)


@pytest.mark.gpu
def test_fp8_gpu_default_backend_and_bf16_comparison():
    """backend=None picks the Triton kernel for fp8 rows on the GPU; at N=64, h_q=128,
    K=2048 its output against the bf16 kernel over the rows the fp8 ones were quantized
    from (printed; loose bound), and against the fp8 reference backend."""
    assert _registry.select("sparse_mla_decode", None, sds((64, 128, 576), jnp.bfloat16),
                            sds((1 << 16, 656), jnp.uint8), sds((64, 2048)),
                            kv_format=FP8) == "triton"
    q, kv, kv8, rows = make_fp8_inputs(77, 64, 128, 2048, 1 << 16)
    out8, lse8 = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8)
    out16, lse16 = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE)
    ref8, _ = sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                                backend="reference")
    a, b = np.asarray(out8, np.float64), np.asarray(out16, np.float64)
    err = np.linalg.norm(a - b) / np.linalg.norm(b)
    err_ref = np.linalg.norm(a - np.asarray(ref8, np.float64)) / np.linalg.norm(
        np.asarray(ref8, np.float64))
    print(f"fp8 vs bf16 at N=64 h=128 K=2048: {err:.2e}; vs fp8 reference {err_ref:.2e}")
    assert err < 0.1 and err_ref < 1e-2
    assert float(np.max(np.abs(np.asarray(lse8) - np.asarray(lse16)))) < 0.1


# ------------------------------- the row-copy Mosaic GPU kernel (mosaic_gpu_fp8.py): fp8 and bf16

# Backend "mosaic_gpu" runs fp8 rows with the row-copy kernel, and bf16 rows when the config is
# a RowTuning. Off the GPU it runs in Mosaic GPU interpret mode (jax >= 0.11), each case in a
# process of its own (`rerun_isolated`: the interpreter can deadlock on few cores).
ROW_MARKS = [m for p in BACKENDS if p.values[0] == "mosaic_gpu" for m in p.marks]


def _row_tuning(**knobs):
    from pallas_kernels.sparse_mla_decode.mosaic_gpu_fp8 import RowTuning

    return RowTuning(**knobs)


ROW_CASES = {   # (kv_format, n, h, top_k, hole_frac, invalid_rows, RowTuning knobs)
    "fp8_holes_odd_k": (FP8, 3, 16, 37, 0.3, (1,), {}),
    "fp8_two_head_blocks_splits_two_copies": (FP8, 2, 128, 150, 0.5, (0,),
                                              {"num_splits": 2, "row_copies": 2}),
    "fp8_odd_heads_unroll1_barriers_wide": (FP8, 1, 80, 64, 0.0, (),
                                            {"copy_unroll": 1, "auto_barriers": True,
                                             "wide_convert": True}),
    # The shared-P schedule runs under the interpreter with one tile per CTA only
    # (`mosaic_gpu_fp8_consume._Launch.share_p`): 2 tiles, 2 splits.
    "fp8_shared_p_splits_no_anchor": (FP8, 3, 128, 128, 0.4, (1,),
                                      {"share_p": True, "num_splits": 2, "anchor": False}),
    "fp8_shared_p_one_tile": (FP8, 2, 16, 50, 0.2, (), {"share_p": True}),
    "bf16_rows": ("bf16", 2, 16, 128, 0.3, (0,), {}),
    "bf16_two_head_blocks_splits_wide": ("bf16", 1, 128, 100, 0.2, (),
                                         {"num_splits": 2, "copy_unroll": 4,
                                          "wide_convert": True}),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=ROW_MARKS) for c in ROW_CASES])
def test_row_kernel_cases_match_float64(case, request):
    """The row-copy kernel against float64 (fp8: on the dequantized rows): holes, all-masked
    rows (0 / -inf), odd K, K splits, 1 and 2 head blocks, the last row of the cache
    selected, every knob that changes the program (two copies per fp8 row, copy unroll,
    Pallas' automatic barriers, the wide conversion layout)."""
    if INTERPRET and rerun_isolated(request):
        return
    fmt, n, h, top_k, hole_frac, invalid, knobs = ROW_CASES[case]
    q, kv, kv8, rows = make_fp8_inputs(80 + n + top_k, n, h, top_k, 300, hole_frac=hole_frac,
                                       invalid_rows=invalid)
    rows = np.asarray(rows).copy()
    last = kv.shape[0] * kv.shape[1] - 1
    rows[[t for t in range(n) if t not in invalid], 0] = last
    rows = jnp.asarray(rows)
    cache = kv8 if fmt == FP8 else kv
    out, lse = sparse_mla_decode(q, cache, rows, sm_scale=SM_SCALE, kv_format=fmt,
                                 backend="mosaic_gpu", config=_row_tuning(**knobs))
    assert out.shape == (n, h, 512) and out.dtype == jnp.bfloat16
    assert lse.shape == (n, h) and lse.dtype == jnp.float32
    err = (assert_close_fp8(out, lse, q, kv8, rows) if fmt == FP8
           else assert_close(out, lse, q, kv, rows))
    print(f"row-copy kernel {case}: relative error vs float64 {err:.2e}")
    for r in invalid:
        assert np.all(np.asarray(out, np.float32)[r] == 0.0)
        assert np.all(np.asarray(lse)[r] == -np.inf)


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=ROW_MARKS) for f in (FP8, "bf16")])
def test_row_kernel_masked_rows_are_never_read(fmt, request):
    """NaN / Inf in rows no entry selects (row 0 among them; fp8: NaN bytes, Inf and NaN
    scales, NaN rope) change no bit of the output; the all-masked row is 0 / -inf; a NaN
    query row (head) gives NaN out and lse for that row (head) only, across 2 K splits."""
    if INTERPRET and rerun_isolated(request):
        return
    inputs = (poisoned_fp8_inputs(31, 4, 16, 128, 300) if fmt == FP8
              else poisoned_inputs(31, 4, 16, 128, 300, nan_query=True))
    check_poisoned_run(*inputs, "mosaic_gpu", _row_tuning(num_splits=2, share_p=fmt == FP8),
                       kv_format=fmt)


@pytest.mark.parametrize("knobs, match", [
    ({"row_copies": 3}, "row_copies"), ({"copy_unroll": 5}, "copy_unroll"),
    ({"num_splits": 0}, "num_splits"), ({"compute_registers": 240, "producer_registers": 64},
                                        "registers"),
    ({"copy_warps": True, "copy_unroll": 32}, "copy_unroll"),
])
def test_row_tuning_rejects_bad_knobs(knobs, match):
    pytest.importorskip("pallas_kernels.sparse_mla_decode.mosaic_gpu_fp8")
    with pytest.raises(ValueError, match=match):
        _row_tuning(**knobs)


def test_row_kernel_bf16_rows_say_why_not():
    """bf16 rows with a RowTuning: the row-copy kernel's rules, named."""
    pytest.importorskip("pallas_kernels.sparse_mla_decode.mosaic_gpu_fp8")
    if not _compat.mosaic_gpu_interpret_available() and INTERPRET:
        pytest.skip("Mosaic GPU interpret mode needs jax >= 0.11")
    q, kv, rows = make_inputs(4, 2, 4, 8, 32, width=128)
    with pytest.raises(ValueError, match="bfloat16 q of width 576"):
        sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, v_width=128, backend="mosaic_gpu",
                          config=_row_tuning())
    q, _, kv8, rows = make_fp8_inputs(4, 2, 4, 8, 32)
    with pytest.raises(ValueError, match="RowTuning"):
        from pallas_kernels.sparse_mla_decode.mosaic_gpu import TuningConfig

        sparse_mla_decode(q, kv8, rows, sm_scale=SM_SCALE, kv_format=FP8,
                          backend="mosaic_gpu", config=TuningConfig())


def _row_candidates() -> list[tuple[str, str, object]]:
    """(kv_format, variant, RowTuning) of every row-copy candidate of the benchmark."""
    return ([(FP8, v, cfg) for v, cfg in mosaic_row_variants().items()]
            + [("bf16", v, cfg) for v, cfg in mosaic_row_bf16_variants().items()])


def _lower_for_cuda_mosaic(fn, *args) -> str:
    """The StableHLO of `jit(fn)(*args)` lowered for CUDA on this CPU machine: the whole Pallas
    -> Mosaic GPU lowering (layouts, copy kinds, transforms), not ptxas."""
    if _compat.has_gpu():
        pytest.skip("the GPU tests compile for real")
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


@pytest.mark.parametrize("fmt, variant", [pytest.param(f, v, id=f"{f}-{v}", marks=ROW_MARKS)
                                          for f, v, _ in _row_candidates()])
def test_row_kernel_variants_lower_for_cuda(fmt, variant):
    """Every row-copy candidate of the benchmark lowers for sm_90 at the benchmark's shapes:
    (N, h_q, K) = (64, 128, 2048), (256, 128, 2048), (64, 16, 2048) and (1, 128, 1999) (odd K,
    16 K splits), over the benchmark's pool of 2^19 rows."""
    from pallas_kernels.sparse_mla_decode import mosaic_gpu_fp8 as rk

    cfg = dict((v, c) for f, v, c in _row_candidates() if f == fmt)[variant]
    kv = sds((1 << 19, 656), jnp.uint8) if fmt == FP8 else sds((1 << 19, 576), jnp.bfloat16)
    for n, h, top_k in ((64, 128, 2048), (256, 128, 2048), (64, 16, 2048), (1, 128, 1999)):
        _lower_for_cuda_mosaic(functools.partial(rk.sparse_mla_decode, sm_scale=0.1,
                                                 kv_format=fmt, tuning=cfg),
                               sds((n, h, 576), jnp.bfloat16), kv, sds((n, top_k)))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, variant", [pytest.param(f, v, id=f"{f}-{v}")
                                          for f, v, _ in _row_candidates()])
@pytest.mark.parametrize("n, h, top_k", [(1, 16, 2048), (4, 128, 2048), (3, 64, 1000)])
def test_row_kernel_gpu_matches_float64(fmt, variant, n, h, top_k):
    """The compiled row-copy kernel at real size (50,000 rows, the last one selected) against
    float64, then fresh inputs through the same kernel."""
    cfg = dict((v, c) for f, v, c in _row_candidates() if f == fmt)[variant]
    for seed in (600 + n * h + top_k, 13 + n):
        q, kv, kv8, rows = make_fp8_inputs(seed, n, h, top_k, 50_000,
                                           invalid_rows=(n - 1,) if n > 1 else ())
        rows = np.asarray(rows).copy()
        rows[0, 0] = 50_000 - 1
        rows = jnp.asarray(rows)
        out, lse = sparse_mla_decode(q, kv8 if fmt == FP8 else kv, rows, sm_scale=SM_SCALE,
                                     kv_format=fmt, backend="mosaic_gpu", config=cfg)
        err = (assert_close_fp8(out, lse, q, kv8, rows) if fmt == FP8
               else assert_close(out, lse, q, kv, rows))
        print(f"row-copy gpu {fmt} {variant} N={n} h={h} K={top_k}: relative error {err:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, variant", [pytest.param(f, v, id=f"{f}-{v}")
                                          for f, v, _ in _row_candidates()])
def test_row_kernel_gpu_masked_rows_are_never_read(fmt, variant):
    """test_row_kernel_masked_rows_are_never_read compiled, at N=4, h_q=128, K=2048."""
    cfg = dict((v, c) for f, v, c in _row_candidates() if f == fmt)[variant]
    inputs = (poisoned_fp8_inputs(41, 4, 128, 2048, 50_000) if fmt == FP8
              else poisoned_inputs(41, 4, 128, 2048, 50_000, nan_query=True))
    check_poisoned_run(*inputs, "mosaic_gpu", cfg, kv_format=fmt)
