"""grouped_matmul: every backend against a float64 numpy loop over the groups.

CPU: the reference and the Triton kernel (Pallas interpret mode) on fixed group layouts
(empty groups among full ones, all rows in the first or the last group, G = 1, a tile
boundary inside a group, more tiles than groups) and random ones (hypothesis), float32 on
the reference; M = 0; the MoE's routed experts through the kernel equal them through the
reference; the kernel's tile table (every row in exactly one tile of its own group, within
the static length); argument validation; the backends' refusals; the kernel's CUDA lowering
at DeepSeek-V3.2's shapes (the rhs past 4 GiB: 64-bit offsets). jax's Mosaic GPU grouped
matmul has no interpret mode: it runs only on a Hopper GPU.
GPU (`pytest -m gpu`): the compiled kernels against the reference on random inputs: G = 256
with skewed sizes and empty groups at decode and prefill row counts, and one DeepSeek-V3.2
gate+up shape (rhs of 15 GB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax import ops
from hisparse_jax.models import dsa_moe
from hisparse_jax.ops import _registry
from pallas_kernels.grouped_matmul import triton as tk
from tests.ops import INTERPRET, examples, lower_for_cuda, sds


def _backends() -> list:
    params = []
    for name in ops.registered_backends("grouped_matmul"):
        marks = ()
        if name == "mosaic_gpu" and INTERPRET:
            marks = pytest.mark.skip(reason="jax's ragged_dot_mgpu runs on a Hopper GPU only "
                                            "(no interpret mode)")
        params.append(pytest.param(name, marks=marks, id=name))
    return params


BACKENDS = _backends()
K, N = 32, 48                      # one compile per backend for every layout below


def np_grouped(lhs, rhs, sizes) -> np.ndarray:
    """float64 [M, N]: the rows of each group times its matrix, group by group."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, n in enumerate(np.asarray(sizes)):
        out[start:start + n] = lhs[start:start + n] @ rhs[g]
        start += n
    assert start == lhs.shape[0]
    return out


def _inputs(rng, sizes, k=K, n=N, dtype=jnp.bfloat16):
    sizes = np.asarray(sizes, np.int32)
    lhs = rng.standard_normal((int(sizes.sum()), k)).astype(np.float32)
    rhs = rng.standard_normal((sizes.shape[0], k, n)).astype(np.float32)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes)


def _skip_unless_runs(backend, lhs, rhs, sizes):
    reason = _registry.unsupported("grouped_matmul", backend, lhs, rhs, sizes)
    if reason is not None:
        pytest.skip(reason)


def _check(backend, lhs, rhs, sizes):
    """The op's output against numpy: float32 accumulation (1e-5 of the row scale), or
    for mosaic_gpu rounded once to lhs's dtype (one bf16 rounding, 2^-8 relative)."""
    _skip_unless_runs(backend, lhs, rhs, sizes)
    got = ops.grouped_matmul(lhs, rhs, sizes, backend=backend)
    assert got.dtype == jnp.float32 and got.shape == (lhs.shape[0], rhs.shape[2])
    want = np_grouped(lhs, rhs, sizes)
    scale = np.sqrt(lhs.shape[1])                  # a product of K unit normals
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5 * scale,
                               rtol=2.0 ** -8 if backend == "mosaic_gpu" else 1e-6)


LAYOUTS = {
    "empty_groups_between": [0, 5, 0, 17, 18, 0],
    "all_rows_last_group": [0, 0, 0, 0, 0, 0, 0, 40],
    "all_rows_first_group": [40, 0, 0, 0, 0, 0],
    "one_group": [40],
    "tile_boundary_inside_groups": [16, 17, 0, 1, 6],          # 16-row tiles: 33 = 2 + 1
    "one_row_each": [1] * 40,                                 # more tiles than M / 16
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_numpy_group_loop(backend, layout):
    rng = np.random.default_rng(len(layout))
    _check(backend, *_inputs(rng, LAYOUTS[layout]))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.3))
@given(seed=st.integers(0, 2**32 - 1), empty=st.floats(0.0, 0.9))
def test_random_group_sizes(backend, seed, empty):
    """40 rows over 24 groups, a share of them empty, the rest of random (skewed) sizes."""
    rng = np.random.default_rng(seed)
    weights = rng.pareto(1.0, 24) * (rng.random(24) >= empty)
    if not weights.any():
        weights[rng.integers(24)] = 1.0
    sizes = np.bincount(rng.choice(24, 40, p=weights / weights.sum()), minlength=24)
    _check(backend, *_inputs(rng, sizes))


def test_reference_takes_float32():
    rng = np.random.default_rng(3)
    lhs, rhs, sizes = _inputs(rng, [7, 0, 33], dtype=jnp.float32)
    with jax.default_matmul_precision("float32"):           # no TF32 on a GPU
        got = ops.grouped_matmul(lhs, rhs, sizes, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np_grouped(lhs, rhs, sizes), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows(backend):
    lhs = jnp.zeros((0, 64), jnp.bfloat16)
    rhs = jnp.ones((3, 64, 128), jnp.bfloat16)
    _skip_unless_runs(backend, lhs, rhs, jnp.zeros(3, jnp.int32))
    got = ops.grouped_matmul(lhs, rhs, jnp.zeros(3, jnp.int32), backend=backend)
    assert got.shape == (0, 128) and got.dtype == jnp.float32


def test_moe_routed_experts_through_the_kernel():
    """`dsa_moe.routed_experts` (its grouped matmuls through the op) gives the same tokens
    with the Triton kernel as with the reference: both accumulate in float32 and round each
    expert's output to bf16 once."""
    rng = np.random.default_rng(5)
    t, h, width, e, top = 6, 32, 16, 8, 3
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    experts = jnp.asarray(np.stack([rng.permutation(e)[:top] for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.random((t, top)), jnp.float32)
    w_gate_up = jnp.asarray(rng.standard_normal((e, h, 2 * width)) / np.sqrt(h), jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((e, width, h)) / np.sqrt(width), jnp.bfloat16)
    args = (x, weights, experts, w_gate_up, w_down)
    want = dsa_moe.routed_experts(*args, backend="reference")
    got = dsa_moe.routed_experts(*args, backend="triton")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2.0 ** -7, atol=2.0 ** -7)


_tile_table = jax.jit(tk.tile_table, static_argnums=(1, 2))


@settings(max_examples=examples(0.5))
@given(seed=st.integers(0, 2**32 - 1), block_m=st.sampled_from([16, 32]),
       groups=st.sampled_from([1, 7, 40]), m=st.sampled_from([1, 37, 99]))
def test_tile_table_covers_each_row_once_within_its_group(seed, block_m, groups, m):
    rng = np.random.default_rng(seed)
    sizes = np.bincount(rng.integers(0, groups, m) if rng.random() < 0.5
                        else np.minimum(rng.geometric(0.3, m) - 1, groups - 1),
                        minlength=groups).astype(np.int32)
    group, start, rows = map(np.asarray, _tile_table(jnp.asarray(sizes), m, block_m))
    assert group.shape == (tk.table_length(m, groups, block_m),)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    owner = np.full(m, -1)
    for g, s, r in zip(group, start, rows, strict=True):
        assert 0 <= r <= block_m
        if r == 0:
            continue
        assert bounds[g] <= s and s + r <= bounds[g + 1], (g, s, r)   # inside its group
        assert (owner[s:s + r] == -1).all()
        owner[s:s + r] = g
    np.testing.assert_array_equal(owner, np.repeat(np.arange(groups), sizes))
    assert (rows > 0).sum() == sum(-(-int(n) // block_m) for n in sizes)


def _bad(**override):
    args = {"lhs": jnp.zeros((4, K), jnp.bfloat16), "rhs": jnp.zeros((2, K, N), jnp.bfloat16),
            "group_sizes": jnp.array([1, 3], jnp.int32)}
    args.update(override)
    return args


@pytest.mark.parametrize("override,error,match", [
    ({"lhs": np.zeros((4, K), np.float32).tolist()}, TypeError, "lhs must be an array"),
    ({"lhs": jnp.zeros((4,), jnp.bfloat16)}, ValueError, "lhs must have rank 2"),
    ({"rhs": jnp.zeros((K, N), jnp.bfloat16)}, ValueError, "rhs must have rank 3"),
    ({"lhs": jnp.zeros((4, K), jnp.int32)}, TypeError, "lhs must be bfloat16, float16 or"),
    ({"rhs": jnp.zeros((2, K, N), jnp.float32)}, TypeError, "rhs dtype must equal lhs's"),
    ({"rhs": jnp.zeros((2, K + 1, N), jnp.bfloat16)}, ValueError, "rhs must be .G, K=32, N."),
    ({"rhs": jnp.zeros((2, K, 0), jnp.bfloat16)}, ValueError, "G, K, N >= 1"),
    ({"group_sizes": jnp.array([1, 3], jnp.int16)}, TypeError, "group_sizes must be int32"),
    ({"group_sizes": jnp.array([4], jnp.int32)}, ValueError, "one size per group of rhs .G=2"),
    ({"group_sizes": jnp.array([5, -1], jnp.int32)}, ValueError, "group_sizes must be >= 0"),
    ({"group_sizes": jnp.array([1, 2], jnp.int32)}, ValueError, "must sum to M=4"),
])
def test_validation_errors(override, error, match):
    with pytest.raises(error, match=match):
        ops.grouped_matmul(**_bad(**override))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.grouped_matmul(**_bad(), backend="cuda")


def test_backends_refuse_what_they_cannot_run():
    f32 = (sds((8, 64), jnp.float32), sds((4, 64, 128), jnp.float32), sds((4,)))
    with pytest.raises(ValueError, match="triton.*bfloat16 or float16"):
        _registry.select("grouped_matmul", "triton", *f32)
    odd = (sds((8, 40), jnp.bfloat16), sds((4, 40, 128), jnp.bfloat16), sds((4,)))
    with pytest.raises(ValueError, match="multiples of 16, got K=40"):
        _registry.select("grouped_matmul", "triton", *odd)
    bf16 = (sds((8, 64), jnp.bfloat16), sds((4, 64, 128), jnp.bfloat16), sds((4,)))
    if INTERPRET:
        assert _registry.select("grouped_matmul", None, *bf16) == "reference"
        with pytest.raises(ValueError, match="Hopper GPU only"):
            _registry.select("grouped_matmul", "mosaic_gpu", *bf16)
    else:
        assert _registry.select("grouped_matmul", None, *bf16) == "triton"
        assert _registry.select("grouped_matmul", None, *f32) == "reference"


def test_tunings_reject_bad_knobs():
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        tk.GroupedTuning(block_n=24)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        tk.GroupedTuning(num_stages=0)


@pytest.mark.parametrize("m,k,n", [(8, 7168, 4096), (2048, 2048, 7168), (32768, 7168, 4096)])
def test_kernel_lowers_to_triton_at_deepseek_shapes(m, k, n):
    """Decode (T = 1) gate+up, T = 256 down, a 4096-token prefill; rhs [256, K, N] bf16."""
    lower_for_cuda(tk.grouped_matmul, sds((m, k), jnp.bfloat16),
                   sds((256, k, n), jnp.bfloat16), sds((256,)))


# --------------------------------------------------------------------------- GPU


def _skewed_sizes(rng, m, groups=256, empty=0.5):
    """m rows over `groups` groups: about `empty` of them empty, the rest Pareto-skewed
    (a few groups hold most rows)."""
    weights = rng.pareto(1.0, groups) * (rng.random(groups) >= empty)
    weights[rng.integers(groups)] += 1.0
    return np.bincount(rng.choice(groups, m, p=weights / weights.sum()), minlength=groups)


def _against_reference(backend, lhs, rhs, sizes):
    _skip_unless_runs(backend, lhs, rhs, sizes)
    got = np.asarray(ops.grouped_matmul(lhs, rhs, sizes, backend=backend), np.float64)
    want = np.asarray(ops.grouped_matmul(lhs, rhs, sizes, backend="reference"), np.float64)
    scale = np.sqrt(lhs.shape[1])
    if backend == "mosaic_gpu":
        np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-2 * scale)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("m", [8, 512, 2048, 8192])
def test_gpu_256_groups_skewed_and_empty(backend, m):
    rng = np.random.default_rng(m)
    sizes = _skewed_sizes(rng, m)
    key = jax.random.key(m)
    lhs = jax.random.normal(key, (m, 1024), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.fold_in(key, 1), (256, 1024, 512), jnp.bfloat16)
    _against_reference(backend, lhs, rhs, jnp.asarray(sizes, jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("sizes", ["one_group_last", "first_and_last"])
def test_gpu_256_groups_edge_layouts(backend, sizes):
    sizes_np = np.zeros(256, np.int32)
    if sizes == "one_group_last":
        sizes_np[-1] = 300
    else:
        sizes_np[[0, 255]] = (100, 200)
    key = jax.random.key(7)
    lhs = jax.random.normal(key, (300, 256), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.fold_in(key, 1), (256, 256, 256), jnp.bfloat16)
    _against_reference(backend, lhs, rhs, jnp.asarray(sizes_np))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
def test_gpu_deepseek_gate_up_shape(backend):
    """T = 64 decode tokens, top-8 of 256 experts: M = 512 rows against [256, 7168, 4096]
    bf16 weights (15 GB: the kernel addresses them with 64-bit offsets)."""
    rng = np.random.default_rng(64)
    experts = np.stack([rng.permutation(256)[:8] for _ in range(64)])
    sizes = np.bincount(experts.ravel(), minlength=256).astype(np.int32)
    key = jax.random.key(64)
    lhs = jax.random.normal(key, (512, 7168), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.fold_in(key, 1), (256, 7168, 4096), jnp.bfloat16)
    _against_reference(backend, lhs, rhs, jnp.asarray(sizes))
