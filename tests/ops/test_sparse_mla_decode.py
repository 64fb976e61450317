"""sparse_mla_decode: every backend against a float64 numpy reference.

CPU: each backend on random inputs (hypothesis), the multi-query-row form and fixed kernel
cases (padded heads, two head blocks, K splits, the id-prefetch off), the Triton kernel in
Pallas interpret mode and the Mosaic GPU kernel in Mosaic GPU interpret mode (where this jax
has it); masked rows are never read (NaN / Inf planted in unselected rows, row 0 among them,
change no bit of the output), a NaN query row gives NaN out and lse for that row only, K
splits included, and all-masked rows stay 0 / -inf, on every backend; argument validation;
the Triton kernel's CUDA lowering for every benchmark variant.
GPU (`pytest -m gpu`): the compiled kernels, every candidate variant of the benchmark at three
shapes (each variant compiles in its own test, so one that fails to build fails only its
own), fresh random inputs with -1 holes anywhere and all-invalid rows, and the poison / NaN
query test at K = 2048.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ops.sparse_mla_decode import ATTENTION_SWEEP_EXTRA, ATTENTION_VARIANTS, mosaic_variants
from hisparse_jax.ops import sparse_mla_decode
from pallas_kernels.sparse_mla_decode import reference
from pallas_kernels.sparse_mla_decode import triton as tk
from tests.ops import backends, lower_for_cuda, sds

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
                       compare_clean=True):
    """Runs the op on the poisoned cache and checks the rules (poisoned_inputs' docstring);
    with compare_clean, also that the output is bit for bit that of the clean cache."""
    n, h = q.shape[:2]
    out, lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend, config=cfg)
    assert out.shape == (n, h, 512) and lse.shape == (n, h)
    assert_matches_float64_with_nans(out, lse, q, kv_clean, rows)
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
                                             backend=backend, config=cfg)
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
    ],
    "mosaic_gpu": [
        (2, 16, 128, {}),                                                  # padded heads
        (1, 80, 150, {"num_splits": 2, "producer_wgs": 2}),                # 2 head blocks, splits
    ],
}


@pytest.mark.parametrize("backend, n, h, top_k, cfg_kw", [
    pytest.param(p.values[0], *case, marks=p.marks, id=f"{p.values[0]}-{i}")
    for p in BACKENDS for i, case in enumerate(KERNEL_CASES.get(p.values[0], []))])
def test_kernel_cases_match_float64(backend, n, h, top_k, cfg_kw):
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
    tk.AttentionTuning(num_warps=16)                    # 16 warps at 64 heads is a candidate


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_triton_variants_lower_to_triton():
    """Every attention candidate of the benchmark lowers (N=64, K=2048, h_q 128 and 16)."""
    for h in (128, 16):
        for cfg in {**ATTENTION_VARIANTS, **ATTENTION_SWEEP_EXTRA}.values():
            lower_for_cuda(functools.partial(tk.sparse_mla_decode, sm_scale=0.1, tuning=cfg),
                           sds((64, h, 576), jnp.bfloat16), sds((1 << 16, 576), jnp.bfloat16),
                           sds((64, 2048)))


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
