"""The Pallas kernels (`backend="pallas"`) against their jnp references, exactly.

Off the GPU every kernel runs in the Pallas interpreter (small shapes, few distinct shapes
so that each compiles once); on the GPU the same tests run compiled, and the `gpu`-marked
ones add realistic sizes (K=2048, H=4096, 576-wide bf16 rows, pinned_host pools). Outputs
are poisoned before each run so an entry a kernel forgets to write shows: fresh outputs
start at a poison value, in-place outputs (caches, pools, slot tables) start as random data
whose untouched rows must survive bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse_jax as hj
from hisparse_jax.index_group import gather_compact_group, resolve_and_gather
from pallas_kernels import _compat, dispatch
from pallas_kernels import triton_kernels as tk
from pallas_kernels.host_copy_ref import gather_compact_ref
from pallas_kernels.resolve_ref import resolve_residency_ref
from tests.oracle import oracle_gather, oracle_invalidate, oracle_resolve, random_case

INTERPRET = not _compat.has_gpu()
POISON = -77_777
NAMES = ("attention_rows", "valid_counts", "swap_src", "swap_dst", "swap_counts", "num_hits",
         "slot_rows", "lru")


def _examples(share: float) -> int:
    """A share of the active hypothesis profile's examples (ci: 60, long: 2000)."""
    return max(3, int(settings.default.max_examples * share))


def _host(x):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                               memory_kind="pinned_host"))


def _bits(x) -> np.ndarray:
    """Array contents as integers, so bf16 compares bit for bit (NaN poison included)."""
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x


def _random_rows(rng, shape, dtype=jnp.bfloat16):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def test_dispatch_contract():
    assert set(dispatch.KERNELS) == {"resolve_residency", "gather_compact", "mirror_rows",
                                     "invalidate_written_rows"}
    assert hj.ops._pick("gather_compact", "pallas") == "pallas"


def test_row_pieces_are_powers_of_two():
    assert tk.row_pieces(576, 512) == ((0, 512), (512, 64))
    for width in (1, 8, 100, 576, 2048, 4097):
        pieces = tk.row_pieces(width, 512)
        assert sum(size for _, size in pieces) == width
        assert all(size & (size - 1) == 0 and size <= 512 for _, size in pieces)


# --------------------------------------------------------------------------- gather_compact


def _swap_plan(rng, n, k, host_rows, cache_rows):
    """A random plan: distinct destinations (some out of the cache), sources that include
    -1, rows past the pool (zero-filled) and entries past swap_counts."""
    dst = (rng.permutation(cache_rows + 8)[: n * k] - 4).reshape(n, k).astype(np.int32)
    src = rng.integers(-2, host_rows + 6, size=(n, k)).astype(np.int32)
    counts = rng.integers(0, k + 1, size=n).astype(np.int32)
    return src, dst, counts


@pytest.mark.parametrize("pool_blocks", [False, True], ids=["pool2d", "pool3d"])
@settings(max_examples=_examples(0.15))
@given(seed=st.integers(0, 2**32 - 1))
def test_gather_compact_matches_reference(pool_blocks, seed):
    rng = np.random.default_rng(seed)
    n, k, block, width, num_blocks, host_rows = 3, 8, 4, 576, 8, 48
    pool_np = _random_rows(rng, (host_rows, width))
    cache_np = _random_rows(rng, (num_blocks, block, width))      # poison: random rows
    src, dst, counts = _swap_plan(rng, n, k, host_rows, num_blocks * block)
    want = oracle_gather(pool_np, cache_np, src, dst, counts)
    pool = _host(pool_np.reshape(host_rows // block, block, width) if pool_blocks else pool_np)
    got = hj.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts), backend="pallas")
    np.testing.assert_array_equal(_bits(got), _bits(want))
    ref = hj.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts), backend="reference")
    np.testing.assert_array_equal(_bits(got), _bits(ref))


def test_gather_compact_odd_width_and_many_programs():
    rng = np.random.default_rng(7)
    n, k, block, width, num_blocks, host_rows = 2, 40, 2, 100, 64, 90   # W=64+32+4
    pool_np = rng.standard_normal((host_rows, width)).astype(np.float32)
    cache_np = rng.standard_normal((num_blocks, block, width)).astype(np.float32)
    src, dst, counts = _swap_plan(rng, n, k, host_rows, num_blocks * block)
    counts[:] = k
    got = tk.gather_rows_into_cache(_host(pool_np), jnp.asarray(cache_np), jnp.asarray(src),
                                    jnp.asarray(dst), jnp.asarray(counts), interpret=INTERPRET,
                                    tuning=tk.CopyTuning(rows_per_program=4, max_piece=64))
    np.testing.assert_array_equal(np.asarray(got),
                                  oracle_gather(pool_np, cache_np, src, dst, counts))


# --------------------------------------------------------------------------- mirror_rows


@pytest.mark.parametrize("pool_blocks", [False, True], ids=["pool2d", "pool3d"])
@settings(max_examples=_examples(0.15))
@given(seed=st.integers(0, 2**32 - 1))
def test_mirror_rows_matches_reference(pool_blocks, seed):
    rng = np.random.default_rng(seed)
    block, width, num_blocks, host_rows, r = 4, 576, 8, 48, 12
    pool_np = _random_rows(rng, (host_rows, width))               # poison: random rows
    cache_np = _random_rows(rng, (num_blocks, block, width))
    device_rows = rng.integers(-2, num_blocks * block + 3, size=r).astype(np.int32)
    dest = (rng.permutation(host_rows + 6)[:r] - 3).astype(np.int32)
    want = pool_np.copy()
    flat = cache_np.reshape(-1, width)
    for d, h in zip(device_rows, dest, strict=True):
        if 0 <= d < flat.shape[0] and 0 <= h < host_rows:
            want[h] = flat[d]
    shape = (host_rows // block, block, width) if pool_blocks else (host_rows, width)
    pool = _host(pool_np.reshape(shape))
    got = hj.mirror_rows(jnp.asarray(cache_np), pool, jnp.asarray(device_rows),
                         jnp.asarray(dest), backend="pallas")
    assert got.sharding.memory_kind == "pinned_host"
    assert got.shape == shape
    np.testing.assert_array_equal(_bits(got).reshape(-1, width), _bits(want))


# --------------------------------------------------------------------------- invalidate


@settings(max_examples=_examples(0.15))
@given(seed=st.integers(0, 2**32 - 1))
def test_invalidate_matches_reference(seed):
    rng = np.random.default_rng(seed)
    num_state, hot, tokens = 5, 37, 20
    slot_rows = rng.integers(-1, 30, size=(num_state, hot)).astype(np.int32)
    state_rows = rng.integers(-2, num_state + 2, size=tokens).astype(np.int32)
    written = rng.integers(-2, 30, size=tokens).astype(np.int32)
    state = hj.HotState(jnp.asarray(slot_rows), jnp.zeros((num_state, hot), jnp.int16))
    got = hj.invalidate_written_rows(state, jnp.asarray(state_rows), jnp.asarray(written),
                                     backend="pallas")
    want = oracle_invalidate(slot_rows, state_rows, written)
    np.testing.assert_array_equal(np.asarray(got.slot_rows), want)
    # 16-slot chunks: 3 programs per token, the last one partial.
    got = _invalidate_chunked(jnp.asarray(slot_rows), jnp.asarray(state_rows),
                              jnp.asarray(written))
    np.testing.assert_array_equal(np.asarray(got), want)


_invalidate_chunked = jax.jit(functools.partial(
    tk.invalidate_rows, interpret=INTERPRET, tuning=tk.InvalidateTuning(chunk=16, num_warps=2)))


# --------------------------------------------------------------------------- resolve


@functools.partial(jax.jit, static_argnames=("block_size", "tuning"))
def _resolve_kernel(*args, block_size, host_rows, tuning):
    return tk.resolve_rows(*args, block_size=block_size, host_rows=host_rows,
                           interpret=INTERPRET, tuning=tuning, poison=POISON)


_ref = jax.jit(resolve_residency_ref, static_argnames=("block_size",))

# (n, k, hot, block_size, src_blocks, resident_share, tuning): few shapes, each compiled
# once; a share of None runs without a resident table.
RESOLVE_SHAPES = {
    "resident": (4, 8, 12, 4, 4, 0.4, tk.ResolveTuning()),
    # A sparse (8 * Kp) table, the whole LRU in one chunk (walk and reorder fused).
    "no_resident_odd_k": (3, 7, 9, 2, 5, None, tk.ResolveTuning(table_factor=8)),
    # 4-slot chunks: the walk carries ranks across 4 chunks; a 2*Kp table collides often.
    "chunked_walk": (2, 6, 16, 4, 3, 0.3, tk.ResolveTuning(chunk=4, table_factor=2,
                                                           cached_loads=True)),
}


def _case(rng, shape, corrupt=False):
    n, k, hot, block, src_blocks, share, _ = RESOLVE_SHAPES[shape]
    case = random_case(rng, n=n, k=k, hot=hot, block_size=block, src_blocks=src_blocks,
                       resident_share=share or 0.0, corrupt_lru=corrupt)
    if share is None:
        case.res_table = None
    # One hot-table width per shape (one compile); host_rows is a traced scalar.
    case.hot_table = case.hot_table[:, : -(-hot // block)]
    return case


def _check_resolve(case, tuning):
    host_rows = case.host_rows
    args = [None if a is None else jnp.asarray(a) for a in case.args()]
    got = _resolve_kernel(*args, block_size=case.block_size, host_rows=host_rows,
                          tuning=tuning)
    ref = _ref(*args, block_size=case.block_size, host_rows=host_rows)
    for name, g, r in zip(NAMES, got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
    return got


@pytest.mark.parametrize("shape", list(RESOLVE_SHAPES))
@settings(max_examples=_examples(0.2))
@given(seed=st.integers(0, 2**32 - 1), corrupt=st.booleans())
def test_resolve_matches_reference(shape, seed, corrupt):
    _check_resolve(_case(np.random.default_rng(seed), shape, corrupt),
                   RESOLVE_SHAPES[shape][-1])


def test_resolve_matches_loop_oracle():
    case = _case(np.random.default_rng(3), "resident")
    got = _check_resolve(case, RESOLVE_SHAPES["resident"][-1])
    want, slot_rows, lru = oracle_resolve(*case.args(), case.block_size, case.host_rows)
    for name in NAMES[:6]:
        np.testing.assert_array_equal(np.asarray(got[NAMES.index(name)]), want[name], name)
    np.testing.assert_array_equal(np.asarray(got[6]), slot_rows)
    np.testing.assert_array_equal(np.asarray(got[7]), lru)


def test_resolve_cold_start_then_replay_is_fixed_point():
    k, hot, block = 8, 12, 4
    cfg = hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=2)
    state = hj.init_hot_state(cfg)
    topk = jnp.arange(k, dtype=jnp.int32)[None]
    kw = dict(state_rows=jnp.array([1], jnp.int32),
              hot_block_table=jnp.array([[5, 6, 7]], jnp.int32),
              source_block_table=jnp.array([[3, 4]], jnp.int32),
              block_size=block, host_rows=64, backend="pallas")
    res, state = hj.resolve_residency(state, topk, **kw)
    g = np.array([3 * 4 + i for i in range(4)] + [4 * 4 + i for i in range(4)])
    np.testing.assert_array_equal(np.asarray(res.swap_src)[0], g)
    np.testing.assert_array_equal(np.asarray(res.attention_rows)[0],
                                  [20, 21, 22, 23, 24, 25, 26, 27])      # slot i -> row
    np.testing.assert_array_equal(np.asarray(state.lru)[1], np.roll(np.arange(hot), -k))
    res2, state2 = hj.resolve_residency(state, topk, **kw)
    assert int(res2.swap_counts[0]) == 0 and int(res2.num_hits[0]) == k
    np.testing.assert_array_equal(np.asarray(res2.attention_rows), np.asarray(res.attention_rows))
    np.testing.assert_array_equal(np.asarray(state2.slot_rows), np.asarray(state.slot_rows))
    np.testing.assert_array_equal(np.asarray(state2.lru), np.asarray(state.lru))


# --------------------------------------------------------------------------- index group


@pytest.mark.parametrize("fused", [True, False], ids=["one_launch", "per_layer"])
def test_gather_group_replays_plan_on_every_layer(fused):
    rng = np.random.default_rng(11)
    n, k, block, width, num_blocks, host_rows, layers = 2, 8, 4, 576, 8, 48, 3
    pools = [_random_rows(rng, (host_rows, width)) for _ in range(layers)]
    caches = [_random_rows(rng, (num_blocks, block, width)) for _ in range(layers)]
    src, dst, counts = _swap_plan(rng, n, k, host_rows, num_blocks * block)
    got = gather_compact_group([_host(p) for p in pools], [jnp.asarray(c) for c in caches],
                               jnp.asarray(src), jnp.asarray(dst), jnp.asarray(counts),
                               backend="pallas", fused=fused)
    assert len(got) == layers
    for pool, cache, out in zip(pools, caches, got, strict=True):
        np.testing.assert_array_equal(_bits(out),
                                      _bits(oracle_gather(pool, cache, src, dst, counts)))


def test_resolve_and_gather_matches_two_step_reference():
    rng = np.random.default_rng(5)
    k, hot, block, width = 8, 12, 4, 64
    cfg = hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=2,
                            row_width=width)
    pools_np = [_random_rows(rng, (64, width)) for _ in range(2)]
    caches_np = [_random_rows(rng, (8, block, width)) for _ in range(2)]
    kw = dict(state_rows=jnp.array([0, -1], jnp.int32),
              hot_block_table=jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32),
              source_block_table=jnp.array([[3, 4], [5, 6]], jnp.int32),
              block_size=block, host_rows=64)
    topk = jnp.array([[0, 5, 2, 7, -1, 3, 1, 6], [0, 1, 2, 3, 4, 5, 6, 7]], jnp.int32)
    res, _, caches = resolve_and_gather(
        hj.init_hot_state(cfg), topk, [_host(p) for p in pools_np],
        [jnp.asarray(c) for c in caches_np], backend="pallas", **kw)
    ref, _ = hj.resolve_residency(hj.init_hot_state(cfg), topk, backend="reference", **kw)
    for name in NAMES[:6]:
        np.testing.assert_array_equal(np.asarray(getattr(res, name)),
                                      np.asarray(getattr(ref, name)), name)
    for pool, cache, out in zip(pools_np, caches_np, caches, strict=True):
        want = gather_compact_ref(jnp.asarray(pool), jnp.asarray(cache), ref.swap_src,
                                  ref.swap_dst, ref.swap_counts)
        np.testing.assert_array_equal(_bits(out), _bits(want))


# --------------------------------------------------------------------------- Triton lowering


@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lowers for CUDA on a machine without one (jax internals: skipped if they moved).

    Runs the whole Pallas -> Triton IR lowering, so a non-power-of-two shape or a primitive
    the Triton backend lacks fails here, in CI, rather than on the GPU machine."""
    if _compat.has_gpu():
        pytest.skip("the GPU tests compile for real")
    try:
        from jax._src.pallas.triton import gpu_info
        from jax._src.pallas.triton import pallas_call_registration as reg
    except ImportError:
        gpu_info = None
        from jax._src.pallas.triton import pallas_call_registration as reg
    if gpu_info is not None and hasattr(reg, "gpu_info_lib"):
        info = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
        monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: info)

    def lower(fn, *args):
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
                "__gpu$xla.gpu.triton")])(*args)
        text = exported.mlir_module()
        assert "__gpu$xla.gpu.triton" in text
        return text
    return lower


def _sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("n,k,hot,block,resident", [(64, 2048, 4096, 64, True),
                                                     (3, 10, 37, 4, False)])
def test_resolve_lowers_to_triton(cuda_lowering, n, k, hot, block, resident):
    fn = functools.partial(tk.resolve_rows, block_size=block, host_rows=1 << 20)
    args = [_sds((n + 2, hot)), _sds((n + 2, hot), jnp.int16), _sds((n, k)), _sds((n,)),
            _sds((n, -(-hot // block))), _sds((n, 100))]
    if resident:
        cuda_lowering(fn, *args, _sds((n, 100)))
    else:
        cuda_lowering(lambda *a: fn(*a, None), *args)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("name", list(tk.RESOLVE_VARIANTS))
def test_resolve_sweep_variants_lower_to_triton(cuda_lowering, name):
    """Every candidate of the benchmark's resolve sweep lowers at the benchmark's size."""
    n, k, hot, block = 64, 2048, 4096, 64
    fn = functools.partial(tk.resolve_rows, block_size=block, host_rows=1 << 20,
                           tuning=tk.RESOLVE_VARIANTS[name])
    cuda_lowering(fn, _sds((n, hot)), _sds((n, hot), jnp.int16), _sds((n, k)), _sds((n,)),
                  _sds((n, hot // block)), _sds((n, 96)), _sds((n, 96)))


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_sweep_variants_lower_to_triton(cuda_lowering):
    """Every invalidate and attention candidate of the benchmarks lowers (N=64, K=2048)."""
    for tuning in tk.INVALIDATE_VARIANTS.values():
        cuda_lowering(functools.partial(tk.invalidate_rows, tuning=tuning),
                      _sds((256, 4096)), _sds((256,)), _sds((256,)))
    variants = {**tk.ATTENTION_VARIANTS, **tk.ATTENTION_SWEEP_EXTRA}
    for h in (128, 16):
        for cfg in variants.values():
            cuda_lowering(functools.partial(tk.sparse_mla_decode_triton, sm_scale=0.1,
                                            config=cfg),
                          _sds((64, h, 576), jnp.bfloat16), _sds((1 << 16, 576), jnp.bfloat16),
                          _sds((64, 2048)))


def test_tuning_knobs_are_validated():
    with pytest.raises(ValueError, match="chunk"):
        tk.ResolveTuning(chunk=1000)
    with pytest.raises(ValueError, match="table_factor"):
        tk.ResolveTuning(table_factor=3)
    with pytest.raises(ValueError, match="chunk"):
        tk.InvalidateTuning(chunk=100)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("pool_shape", [(1 << 14, 576), (1 << 12, 4, 576)])
def test_copy_kernels_lower_to_triton(cuda_lowering, pool_shape):
    pool, cache = _sds(pool_shape, jnp.bfloat16), _sds((512, 64, 576), jnp.bfloat16)
    text = cuda_lowering(tk.gather_rows_into_cache, pool, cache, _sds((64, 2048)),
                         _sds((64, 2048)), _sds((64,)))
    assert "output_operand_aliases" in text
    cuda_lowering(lambda p, c, s, d, n: tk.gather_rows_into_caches((p, p), (c, c), s, d, n),
                  pool, cache, _sds((8, 256)), _sds((8, 256)), _sds((8,)))
    cuda_lowering(tk.scatter_rows_into_pool, cache, pool, _sds((3000,)), _sds((3000,)))
    cuda_lowering(tk.invalidate_rows, _sds((256, 4096)), _sds((256,)), _sds((256,)))


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_gpu_resolve_realistic(n):
    rng = np.random.default_rng(n)
    k, hot, block = 2048, 4096, 64
    case = random_case(rng, n=n, k=k, hot=hot, block_size=block, src_blocks=48,
                       resident_share=0.3, corrupt_lru=True)
    _check_resolve(case, tk.ResolveTuning())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(tk.RESOLVE_VARIANTS))
def test_gpu_resolve_sweep_variants(name):
    """Each tuning the benchmark may pick, compiled, at the real K and H."""
    case = random_case(np.random.default_rng(11), n=4, k=2048, hot=4096, block_size=64,
                       src_blocks=48, resident_share=0.3, corrupt_lru=True)
    _check_resolve(case, tk.RESOLVE_VARIANTS[name])


@pytest.mark.gpu
def test_gpu_resolve_sequence_via_public_op():
    """Several decode steps through the public op (compiled kernel) vs the reference."""
    rng = np.random.default_rng(1)
    n, k, hot, block = 8, 256, 512, 16
    cfg = hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=n)
    state_p = state_r = hj.init_hot_state(cfg)
    src_table = jnp.asarray(1 + rng.permutation(n * 64).reshape(n, 64).astype(np.int32))
    hot_table = jnp.asarray(1 + rng.permutation(n * 32).reshape(n, 32).astype(np.int32))
    kw = dict(state_rows=jnp.arange(n, dtype=jnp.int32), hot_block_table=hot_table,
              source_block_table=src_table, block_size=block, host_rows=(n * 64 + 1) * block)
    for _ in range(5):
        topk = jnp.asarray(np.stack([rng.choice(64 * block, k, replace=False)
                                     for _ in range(n)]).astype(np.int32))
        res_p, state_p = hj.resolve_residency(state_p, topk, backend="pallas", **kw)
        res_r, state_r = hj.resolve_residency(state_r, topk, backend="reference", **kw)
        for name in NAMES[:6]:
            np.testing.assert_array_equal(np.asarray(getattr(res_p, name)),
                                          np.asarray(getattr(res_r, name)), name)
        np.testing.assert_array_equal(np.asarray(state_p.lru), np.asarray(state_r.lru))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2048, 16384])
def test_gpu_gather_from_pinned_pool(rows):
    rng = np.random.default_rng(rows)
    width, block, num_blocks, host_rows = 576, 64, 1024, 1 << 17
    pool_np = _random_rows(rng, (host_rows // block, block, width))
    cache_np = _random_rows(rng, (num_blocks, block, width))
    n = rows // 2048
    src = rng.choice(host_rows + 64, size=(n, 2048), replace=False).astype(np.int32)
    dst = rng.permutation(num_blocks * block)[: n * 2048].reshape(n, 2048).astype(np.int32)
    counts = rng.integers(1, 2049, size=n).astype(np.int32)
    want = oracle_gather(pool_np, cache_np, src, dst, counts)
    pool = _host(pool_np)
    got = hj.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts))                 # default backend: pallas
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.gpu
def test_gpu_mirror_into_pinned_pool_in_place():
    rng = np.random.default_rng(2)
    width, block, num_blocks, host_blocks = 576, 64, 256, 2048
    pool_np = _random_rows(rng, (host_blocks, block, width))
    cache_np = _random_rows(rng, (num_blocks, block, width))
    device_rows = rng.permutation(num_blocks * block)[:4096].astype(np.int32)
    dest = rng.permutation(host_blocks * block)[:4096].astype(np.int32)
    pool = _host(pool_np)
    got = hj.mirror_rows(jnp.asarray(cache_np), pool, jnp.asarray(device_rows),
                         jnp.asarray(dest))                      # default backend: pallas
    assert pool.is_deleted(), "the pool was not donated"
    assert got.sharding.memory_kind == "pinned_host"
    want = pool_np.reshape(-1, width).copy()
    want[dest] = cache_np.reshape(-1, width)[device_rows]
    np.testing.assert_array_equal(_bits(got).reshape(-1, width), _bits(want))


@pytest.mark.gpu
def test_gpu_invalidate_realistic():
    rng = np.random.default_rng(4)
    num_state, hot, tokens = 256, 4096, 256
    slot_rows = rng.integers(-1, 5000, size=(num_state, hot)).astype(np.int32)
    state_rows = rng.integers(-1, num_state, size=tokens).astype(np.int32)
    written = rng.integers(-1, 5000, size=tokens).astype(np.int32)
    state = hj.HotState(jnp.asarray(slot_rows), jnp.zeros((num_state, hot), jnp.int16))
    got = hj.invalidate_written_rows(state, jnp.asarray(state_rows), jnp.asarray(written))
    want = oracle_invalidate(slot_rows, state_rows, written)
    np.testing.assert_array_equal(np.asarray(got.slot_rows), want)
    for tuning in tk.INVALIDATE_VARIANTS.values():          # every candidate of the sweep
        got = tk.invalidate_rows(jnp.asarray(slot_rows), jnp.asarray(state_rows),
                                 jnp.asarray(written), tuning=tuning)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=repr(tuning))
