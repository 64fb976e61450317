"""stage_prefill_rows: every backend against the loop oracle (`tests/oracle.py`, written from
`docs/prefill_staging.md`) on random cases (holes, pages with neither copy, resident-vs-host
precedence, block ids past their arrays, odd widths, float32 / bf16 / uint8 rows, several
layers) into poisoned staging buffers, the kernel against the reference, validation, the
kernel's CUDA lowering and a GPU-scale run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.ops import StagedRows, stage_prefill_rows
from pallas_kernels import kv_format as kvf
from pallas_kernels._triton import CopyTuning
from pallas_kernels.stage_prefill_rows import reference
from pallas_kernels.stage_prefill_rows import triton as tk
from tests.ops import (
    INTERPRET,
    backends,
    bits,
    examples,
    lower_for_cuda,
    random_bytes,
    random_rows,
    sds,
    to_host,
)
from tests.oracle import oracle_stage_prefill

BACKENDS = backends("stage_prefill_rows")
FP8_ROW = kvf.FP8_ROW_BYTES          # 656 bytes: fp8_ds_mla rows move as uint8 rows


def rows_of(rng, shape, dtype) -> np.ndarray:
    if dtype == "uint8":
        return random_bytes(rng, shape)
    return random_rows(rng, shape, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)


def poison(shape, dtype) -> np.ndarray:
    """A staging buffer no copy produces by chance: NaN rows (0xFF bytes for uint8)."""
    if dtype == "uint8":
        return np.full(shape, 0xFF, np.uint8)
    return np.full(shape, np.nan, np.float32).astype(
        jnp.bfloat16 if dtype == "bfloat16" else np.float32)


def run(backend, pools, caches, staging, positions, source, resident, block):
    """The public op on numpy inputs (pools to pinned_host); numpy staging, counts."""
    out = stage_prefill_rows([to_host(p) for p in pools], [jnp.asarray(c) for c in caches],
                             [jnp.asarray(s) for s in staging], jnp.asarray(positions),
                             jnp.asarray(source), jnp.asarray(resident), block_size=block,
                             backend=backend)
    assert isinstance(out, StagedRows)
    assert all(s.sharding.memory_kind == "device" for s in out.staging)
    return ([np.asarray(s) for s in out.staging], int(out.rows_from_device),
            int(out.rows_from_host))


def assert_same(got, want):
    (got_rows, got_dev, got_host), (want_rows, want_dev, want_host) = got, want
    assert (got_dev, got_host) == (want_dev, want_host)
    assert len(got_rows) == len(want_rows)
    for layer, (g, w) in enumerate(zip(got_rows, want_rows, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, layer
        np.testing.assert_array_equal(bits(g), bits(w), f"layer {layer}")


@st.composite
def cases(draw, layers=None, same_width=False):
    """A random instance: sizes, per-layer widths (one for all: same_width), one dtype;
    contents from a seed."""
    layers = layers or draw(st.integers(1, 3))
    block = draw(st.sampled_from([1, 2, 3, 4, 8]))
    pages = draw(st.integers(0, 6))
    m = draw(st.integers(0, 24))
    host_blocks = draw(st.integers(0, 8))
    num_blocks = draw(st.integers(0, 6))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "uint8"]))
    widths = draw(st.lists(st.sampled_from([1, 5, 16, 37, 100, 576, FP8_ROW]),
                           min_size=layers, max_size=layers))
    if same_width:
        widths = [widths[0]] * layers
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pools = [rows_of(rng, (host_blocks, block, w), dtype) for w in widths]
    caches = [rows_of(rng, (num_blocks, block, w), dtype) for w in widths]
    staging = [poison((m, w), dtype) for w in widths]
    # Positions: holes (< 0), some past the tables, repeats allowed.
    positions = rng.integers(-3, (pages + 1) * block + 2, size=m).astype(np.int32)
    positions[rng.random(m) < 0.15] = -1
    # Host blocks: null (0, negative), valid, and past the pool.
    source = rng.integers(-2, host_blocks + 3, size=pages).astype(np.int32)
    # Resident blocks: about half the pages, some past the cache, some negative.
    resident = rng.integers(-1, num_blocks + 3, size=pages).astype(np.int32)
    resident[rng.random(pages) < 0.5] = 0
    return pools, caches, staging, positions, source, resident, block


# --------------------------------------------------------------------------- every backend


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.5))
@given(case=cases())
def test_matches_oracle(backend, case):
    """Every written row equals the oracle's, every other row keeps its poison bit for bit,
    and the counts agree; the kernel also equals the reference backend."""
    want = oracle_stage_prefill(*case)
    got = run(backend, *case)
    assert_same(got, want)
    if backend != "reference":
        assert_same(got, run("reference", *case))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers, per_array", [(2, 2), (4, 2), (3, 3)])
@settings(max_examples=examples(0.3))
@given(data=st.data())
def test_packed_pool_equals_per_layer_pools(backend, layers, per_array, data):
    """Pools packed G layers side by side per array stage exactly what one pool per layer
    stages (the oracle's per-layer answer), counts included."""
    pools, *rest = data.draw(cases(layers=layers, same_width=True))
    packed = [np.concatenate(pools[a:a + per_array], axis=-1)
              for a in range(0, layers, per_array)]
    assert_same(run(backend, packed, *rest), oracle_stage_prefill(pools, *rest))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_copy_wins_and_the_rest_stays(backend):
    """Hand-made: 576-wide bf16 rows, 2 layers, B = 4. Pages 0 and 3 are both resident and
    on the host (the device copy is taken), page 1 on the host only, page 2 on neither,
    page 4 resident past the cache (neither: no fall-back to its valid host block), page 5
    on a host block past the pool; positions -1 and past the tables stay poisoned."""
    rng = np.random.default_rng(3)
    block, width, layers = 4, 576, 2
    pools = [random_rows(rng, (8, block, width)) for _ in range(layers)]
    caches = [random_rows(rng, (5, block, width)) for _ in range(layers)]
    staging = [poison((9, width), "bfloat16") for _ in range(layers)]
    source = np.array([1, 2, 0, 7, 5, 8], np.int32)
    resident = np.array([3, 0, -2, 4, 5, 0], np.int32)
    positions = np.array([0, 5, -1, 9, 13, 30, 2, 17, 21], np.int32)
    rows, from_device, from_host = run(backend, pools, caches, staging, positions, source,
                                       resident, block)
    assert (from_device, from_host) == (3, 1)
    for layer in range(layers):
        got, pool, cache = bits(rows[layer]), bits(pools[layer]), bits(caches[layer])
        np.testing.assert_array_equal(got[0], cache[3, 0])      # resident wins over host 1
        np.testing.assert_array_equal(got[1], pool[2, 1])       # host only
        np.testing.assert_array_equal(got[4], cache[4, 1])      # resident wins over host 7
        np.testing.assert_array_equal(got[6], cache[3, 2])
        untouched = bits(poison((width,), "bfloat16"))
        for m in (2, 3, 5, 7, 8):          # -1, neither, past P, resident past cache, host
            np.testing.assert_array_equal(got[m], untouched, f"row {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_rows_every_layer(backend):
    """656-byte rows (uint8: fp8_ds_mla's format, any byte pattern) into 0xFF-poisoned
    staging buffers of 3 layers, quantized rows included: exact bytes, counts per call."""
    rng = np.random.default_rng(22)
    block, pages, m, layers = 4, 6, 20, 3
    pools = [np.asarray(kvf.quantize(jnp.asarray(rng.standard_normal((8 * block, 576)),
                                                 jnp.float32))).reshape(8, block, FP8_ROW)]
    pools += [random_bytes(rng, (8, block, FP8_ROW)) for _ in range(layers - 1)]
    caches = [random_bytes(rng, (6, block, FP8_ROW)) for _ in range(layers)]
    staging = [poison((m, FP8_ROW), "uint8") for _ in range(layers)]
    positions = rng.integers(-1, pages * block, size=m).astype(np.int32)
    source = rng.integers(0, 8, size=pages).astype(np.int32)
    resident = np.where(rng.random(pages) < 0.5, rng.integers(1, 6, size=pages), 0)
    case = (pools, caches, staging, positions, source, resident.astype(np.int32), block)
    want = oracle_stage_prefill(*case)
    assert want[1] > 0 and want[2] > 0                  # both sources are exercised
    assert_same(run(backend, *case), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_a_user_jit(backend):
    """Traced arguments (validation on shapes only) and a StagedRows out of the jit; the
    byte figures count every layer's row width."""
    rng = np.random.default_rng(5)
    block, layers, m = 2, 2, 12
    pools = [random_rows(rng, (6, block, 64)) for _ in range(layers)]
    caches = [random_rows(rng, (4, block, 64)) for _ in range(layers)]
    staging = [poison((m, 64), "bfloat16") for _ in range(layers)]
    positions = rng.integers(-1, 12, size=m).astype(np.int32)
    source = np.array([1, 2, 3, 0, 5, 4], np.int32)
    resident = np.array([0, 3, 0, 0, 1, 0], np.int32)
    want = oracle_stage_prefill(pools, caches, staging, positions, source, resident, block)

    @jax.jit
    def step(p, c, s, pos, src, res):
        return stage_prefill_rows(p, c, s, pos, src, res, block_size=block, backend=backend)

    out = step([to_host(p) for p in pools], [jnp.asarray(c) for c in caches],
               [jnp.asarray(s) for s in staging], jnp.asarray(positions), jnp.asarray(source),
               jnp.asarray(resident))
    assert_same(([np.asarray(s) for s in out.staging], int(out.rows_from_device),
                 int(out.rows_from_host)), want)
    assert out.row_bytes == layers * 64 * 2
    assert out.host_bytes() == want[2] * layers * 128
    assert out.device_bytes() == want[1] * layers * 128


def test_staged_rows_is_a_pytree():
    out = StagedRows((jnp.zeros((2, 3)), jnp.zeros((2, 5), jnp.uint8)), jnp.int32(1),
                     jnp.int32(2))
    leaves, tree = jax.tree_util.tree_flatten(out)
    assert len(leaves) == 4
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert again.row_bytes == 3 * 4 + 5 and again.host_bytes() == 34


# --------------------------------------------------------------------------- validation


def _args(pinned_host, *, layers=2, m=4, pages=3, block=2, width=8, dtype=jnp.float32):
    pools = [jax.device_put(np.zeros((5, block, width), dtype), pinned_host)
             for _ in range(layers)]
    caches = [jnp.zeros((4, block, width), dtype) for _ in range(layers)]
    staging = [jnp.zeros((m, width), dtype) for _ in range(layers)]
    return dict(host_pools=pools, caches=caches, staging=staging,
                positions=jnp.zeros((m,), jnp.int32), source_blocks=jnp.ones((pages,), jnp.int32),
                resident_blocks=jnp.zeros((pages,), jnp.int32), block_size=block)


def _bad(pinned_host, on_device, name):
    """Valid arguments with one broken as `name` says."""
    a = _args(pinned_host)
    f32 = jnp.float32
    put = lambda x, where=pinned_host: jax.device_put(np.asarray(x), where)  # noqa: E731
    breaks = {
        "pools_not_a_sequence": lambda: a.update(host_pools=a["host_pools"][0]),
        "caches_count": lambda: a.update(caches=a["caches"][:1]),
        "pools_count": lambda: a["host_pools"].append(a["host_pools"][0]),
        "packed_width": lambda: a.update(host_pools=a["host_pools"][:1]),
        "packed_dtype": lambda: a.update(host_pools=[put(np.zeros((5, 2, 16), np.float16))]),
        "no_layers": lambda: a.update(host_pools=[], caches=[], staging=[]),
        "block_size_float": lambda: a.update(block_size=2.0),
        "block_size_zero": lambda: a.update(block_size=0),
        "positions_dtype": lambda: a.update(positions=jnp.zeros((4,), f32)),
        "positions_rank": lambda: a.update(positions=jnp.zeros((4, 1), jnp.int32)),
        "tables_length": lambda: a.update(resident_blocks=jnp.zeros((2,), jnp.int32)),
        "source_dtype": lambda: a.update(source_blocks=jnp.zeros((3,), jnp.int16)),
        "pool_rank": lambda: a["host_pools"].__setitem__(1, put(np.zeros((10, 8), f32))),
        "pool_on_device": lambda: a["host_pools"].__setitem__(
            0, put(np.zeros((5, 2, 8), f32), on_device)),
        "cache_on_host": lambda: a["caches"].__setitem__(0, put(np.zeros((4, 2, 8), f32))),
        "staging_on_host": lambda: a["staging"].__setitem__(1, put(np.zeros((4, 8), f32))),
        "cache_block": lambda: a["caches"].__setitem__(1, jnp.zeros((2, 4, 8), f32)),
        "staging_rows": lambda: a["staging"].__setitem__(0, jnp.zeros((5, 8), f32)),
        "cache_width": lambda: a["caches"].__setitem__(1, jnp.zeros((4, 2, 9), f32)),
        "pool_dtype": lambda: a["host_pools"].__setitem__(
            0, put(np.zeros((5, 2, 8), np.float16))),
        "zero_width": lambda: a.update(
            host_pools=[put(np.zeros((5, 2, 0), f32))] * 2, staging=[jnp.zeros((4, 0), f32)] * 2,
            caches=[jnp.zeros((4, 2, 0), f32)] * 2),
        "cache_blocks_differ": lambda: a["caches"].__setitem__(1, jnp.zeros((3, 2, 8), f32)),
    }
    breaks[name]()
    return a


VALIDATION = [
    ("pools_not_a_sequence", TypeError, "host_pools must be a sequence"),
    ("caches_count", ValueError, "one array per layer, got 1 and 2 layers"),
    ("pools_count", ValueError, "host_pools has 3 arrays for the 2 layers of staging"),
    ("packed_width", ValueError, r"host_pools\[0\] holds 2 layers side by side, so its rows "
                                 r"must be 2 x the layers' common width; got rows 8 wide"),
    ("packed_dtype", TypeError, r"host_pools\[0\] dtype float16 must equal staging\[0\]"),
    ("no_layers", ValueError, "at least one layer"),
    ("block_size_float", TypeError, "block_size must be a static Python int"),
    ("block_size_zero", ValueError, "block_size must be >= 1"),
    ("positions_dtype", TypeError, "positions must be int32"),
    ("positions_rank", ValueError, "positions must have rank 1"),
    ("tables_length", ValueError, r"source_blocks \(3,\) and resident_blocks \(2,\)"),
    ("source_dtype", TypeError, "source_blocks must be int32"),
    ("pool_rank", ValueError, r"host_pools\[1\] must have rank 3"),
    ("pool_on_device", ValueError, r"host_pools\[0\] must live in pinned_host"),
    ("cache_on_host", ValueError, r"caches\[0\] must live in device memory"),
    ("staging_on_host", ValueError, r"staging\[1\] must live in device memory"),
    ("cache_block", ValueError, r"caches\[1\] must be \[blocks, block_size=2, W\]"),
    ("staging_rows", ValueError, r"staging\[0\] has 5 rows but positions has M=4"),
    ("cache_width", ValueError, r"row_width mismatch: caches\[1\] rows are 9 wide"),
    ("pool_dtype", TypeError, r"host_pools\[0\] dtype float16 must equal staging\[0\] dtype"),
    ("zero_width", ValueError, r"staging\[0\] rows must be at least 1 wide"),
    ("cache_blocks_differ", ValueError, r"caches\[1\] has 3 blocks but layer 0 has 4"),
]


@pytest.mark.parametrize("name, error, match", VALIDATION, ids=[v[0] for v in VALIDATION])
def test_validation_errors(name, error, match, pinned_host, on_device):
    """Each broken argument is named with its rule, before any work: the staging buffers
    (donated on success) are still alive after the error."""
    args = _bad(pinned_host, on_device, name)
    with pytest.raises(error, match=match):
        stage_prefill_rows(**args, backend="reference")
    assert not any(s.is_deleted() for s in args["staging"])


# --------------------------------------------------------------------------- Triton kernel


def test_kernel_odd_width_and_many_programs():
    """The kernel called directly: 3 layers of 100-wide rows (64 + 32 + 4 with max_piece
    64), 90 staging rows over 4-row programs (a partial last program), both sources."""
    rng = np.random.default_rng(7)
    block, pages, m, width, layers = 2, 40, 90, 100, 3
    pools = [random_rows(rng, (50, block, width), jnp.float32) for _ in range(layers)]
    caches = [random_rows(rng, (30, block, width), jnp.float32) for _ in range(layers)]
    staging = [poison((m, width), "float32") for _ in range(layers)]
    positions = rng.integers(-2, pages * block + 4, size=m).astype(np.int32)
    source = rng.integers(-1, 52, size=pages).astype(np.int32)
    resident = np.where(rng.random(pages) < 0.5, rng.integers(0, 32, size=pages), 0)
    case = (pools, caches, staging, positions, source, resident.astype(np.int32), block)
    out, from_device, from_host = tk.stage_prefill_rows(
        [to_host(p) for p in pools], [jnp.asarray(c) for c in caches],
        [jnp.asarray(s) for s in staging], jnp.asarray(positions), jnp.asarray(source),
        jnp.asarray(case[5]), block_size=block, interpret=INTERPRET,
        tuning=CopyTuning(rows_per_program=4, max_piece=64))
    assert_same(([np.asarray(s) for s in out], int(from_device), int(from_host)),
                oracle_stage_prefill(*case))


def test_plan_takes_one_source_per_row():
    """`staging_plan`: never both a device and a host row; a resident block past the cache
    gives neither."""
    positions = jnp.array([0, 2, 4, 6, -1, 9], jnp.int32)
    source = jnp.array([1, 2, 3, 9], jnp.int32)
    resident = jnp.array([5, 1, 0, 0], jnp.int32)
    dev, host = reference.staging_plan(positions, source, resident, block_size=2,
                                       host_blocks=4, num_blocks=3)
    np.testing.assert_array_equal(np.asarray(dev), [-1, 2, -1, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(host), [-1, -1, 6, -1, -1, -1])


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("width, dtype", [(576, jnp.bfloat16), (FP8_ROW, jnp.uint8)],
                         ids=["bf16", "fp8"])
@pytest.mark.parametrize("layers", [1, 2])
def test_kernel_lowers_to_triton(width, dtype, layers):
    pools = [sds((1 << 12, 64, width), dtype)] * layers
    caches = [sds((512, 64, width), dtype)] * layers
    staging = [sds((16384, width), dtype)] * layers

    def fn(p, c, s, pos, src, res):
        out, _, _ = tk.stage_prefill_rows(p, c, s, pos, src, res, block_size=64)
        return out

    text = lower_for_cuda(fn, pools, caches, staging, sds((16384,)), sds((2048,)),
                          sds((2048,)))
    assert "output_operand_aliases" in text


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("row", ["bf16", "fp8"])
@pytest.mark.parametrize("per_array", [1, 2], ids=["pool-per-layer", "packed"])
def test_gpu_stage_from_pinned_pool(row, per_array):
    """16384 staging rows of 576 bf16 (or 656 random bytes), 2 layers, half the pages
    resident, from pinned pools of 131,072 rows (one per layer, or both layers side by side
    in one), default backend (triton), exact."""
    rng = np.random.default_rng(16)
    width, dtype = (576, "bfloat16") if row == "bf16" else (FP8_ROW, "uint8")
    block, m, layers, pages = 64, 16384, 2, 512
    pools = [rows_of(rng, (2048, block, width), dtype) for _ in range(layers)]
    caches = [rows_of(rng, (1024, block, width), dtype) for _ in range(layers)]
    staging = [poison((m, width), dtype) for _ in range(layers)]
    positions = rng.choice(pages * block + 64, size=m, replace=False).astype(np.int32)
    source = rng.choice(np.arange(1, 2048), size=pages, replace=False).astype(np.int32)
    resident = np.where(rng.random(pages) < 0.5,
                        rng.choice(np.arange(1, 1024), size=pages, replace=False), 0)
    case = (pools, caches, staging, positions, source, resident.astype(np.int32), block)
    packed = [np.concatenate(pools[a:a + per_array], axis=-1)
              for a in range(0, layers, per_array)]
    assert_same(run(None, packed, *case[1:]), oracle_stage_prefill(*case))
