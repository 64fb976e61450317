"""gather_compact and gather_compact_group: every backend against the numpy oracle (poisoned
caches, odd widths, both pool layouts; 576-wide bf16 rows and 656-byte fp8_ds_mla rows as
uint8), validation, the kernel's CUDA lowering and the GPU-scale runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import hisparse_jax as hs
from hisparse_jax.ops import gather_compact_group, restore_rows
from pallas_kernels import kv_format as kvf
from pallas_kernels._triton import CopyTuning, row_pieces
from pallas_kernels.gather_compact import reference
from pallas_kernels.gather_compact import triton as tk
from tests.ops import (
    INTERPRET,
    backends,
    bits,
    examples,
    lower_for_cuda,
    pack_layers,
    random_bytes,
    random_rows,
    sds,
    to_host,
)
from tests.oracle import oracle_gather

BACKENDS = backends("gather_compact")
W = 16
NAMES = ("attention_rows", "valid_counts", "swap_src", "swap_dst", "swap_counts", "num_hits")


def make_pool(rng, rows, pinned_host, dtype=np.float32):
    data = rng.standard_normal((rows, W)).astype(dtype)
    return data, jax.device_put(data, pinned_host)


def random_plan(rng, n, k, host_rows, cache_rows):
    """A plan with garbage past swap_counts (a correct op must ignore it)."""
    swap_src = np.full((n, k), -1, np.int32)
    swap_dst = np.full((n, k), -1, np.int32)
    counts = rng.integers(0, k + 1, size=n).astype(np.int32)
    dst_all = rng.permutation(cache_rows + 8)[: n * k] - 4        # some out of the cache
    for r in range(n):
        c = counts[r]
        swap_src[r, :c] = rng.integers(-2, host_rows + 3, size=c)  # some < 0, some >= pool
        swap_dst[r, :c] = dst_all[r * k: r * k + c]
        # Past swap_counts: garbage a correct op must ignore.
        swap_src[r, c:] = rng.integers(0, host_rows, size=k - c)
        swap_dst[r, c:] = rng.integers(0, cache_rows, size=k - c)
    return swap_src, swap_dst, counts


def swap_plan(rng, n, k, host_rows, cache_rows):
    """A random plan: distinct destinations (some out of the cache), sources that include
    -1, rows past the pool (zero-filled) and entries past swap_counts."""
    dst = (rng.permutation(cache_rows + 8)[: n * k] - 4).reshape(n, k).astype(np.int32)
    src = rng.integers(-2, host_rows + 6, size=(n, k)).astype(np.int32)
    counts = rng.integers(0, k + 1, size=n).astype(np.int32)
    return src, dst, counts


# --------------------------------------------------------------------------- every backend


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**32 - 1))
def test_matches_numpy(backend, seed, pinned_host):
    rng = np.random.default_rng(seed)
    host_rows, blocks, b = 50, 12, 4
    pool_np, pool = make_pool(rng, host_rows, pinned_host)
    cache_np = rng.standard_normal((blocks, b, W)).astype(np.float32)
    plan = random_plan(rng, 3, 8, host_rows, blocks * b)
    want = oracle_gather(pool_np, cache_np, *plan)
    got = hs.gather_compact(pool, jnp.asarray(cache_np), *map(jnp.asarray, plan),
                            backend=backend)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.sharding.memory_kind == "device"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool_blocks", [False, True], ids=["pool2d", "pool3d"])
@settings(max_examples=examples(0.15))
@given(seed=st.integers(0, 2**32 - 1))
def test_bf16_rows_poisoned_cache(backend, pool_blocks, seed):
    """576-wide bf16 rows into a cache of random rows that must survive bit for bit, the
    same against the oracle and against the reference backend."""
    rng = np.random.default_rng(seed)
    n, k, block, width, num_blocks, host_rows = 3, 8, 4, 576, 8, 48
    pool_np = random_rows(rng, (host_rows, width))
    cache_np = random_rows(rng, (num_blocks, block, width))      # poison: random rows
    src, dst, counts = swap_plan(rng, n, k, host_rows, num_blocks * block)
    want = oracle_gather(pool_np, cache_np, src, dst, counts)
    pool = to_host(pool_np.reshape(host_rows // block, block, width) if pool_blocks else pool_np)
    got = hs.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts), backend=backend)
    np.testing.assert_array_equal(bits(got), bits(want))
    ref = hs.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts), backend="reference")
    np.testing.assert_array_equal(bits(got), bits(ref))


FP8_ROW = kvf.FP8_ROW_BYTES          # 656 bytes: fp8_ds_mla rows move as uint8 rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool_blocks", [False, True], ids=["pool2d", "pool3d"])
def test_fp8_rows_poisoned_cache(backend, pool_blocks):
    """656-byte rows (uint8: fp8_ds_mla's format, random bytes, any pattern) from a pinned
    pool into a cache of random bytes that must survive bit for bit."""
    rng = np.random.default_rng(21 + pool_blocks)
    n, k, block, num_blocks, host_rows = 3, 8, 4, 8, 48
    pool_np = random_bytes(rng, (host_rows, FP8_ROW))
    cache_np = random_bytes(rng, (num_blocks, block, FP8_ROW))
    src, dst, counts = swap_plan(rng, n, k, host_rows, num_blocks * block)
    want = oracle_gather(pool_np, cache_np, src, dst, counts)
    pool = to_host(pool_np.reshape(host_rows // block, block, FP8_ROW) if pool_blocks
                   else pool_np)
    got = hs.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts), backend=backend)
    assert got.dtype == jnp.uint8 and got.shape == cache_np.shape
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_rows_group_gather(backend):
    """One plan into every layer's 656-byte rows (one launch), quantized rows included:
    the copies are exact bytes, so the rows dequantize to the same values."""
    rng = np.random.default_rng(22)
    n, k, block, num_blocks, host_rows, layers = 2, 8, 4, 8, 48, 2
    pools = [np.asarray(kvf.quantize(jnp.asarray(rng.standard_normal((host_rows, 576)),
                                                 jnp.float32))) for _ in range(layers)]
    caches = [random_bytes(rng, (num_blocks, block, FP8_ROW)) for _ in range(layers)]
    src, dst, counts = swap_plan(rng, n, k, host_rows, num_blocks * block)
    got = gather_compact_group([to_host(p) for p in pools], [jnp.asarray(c) for c in caches],
                               jnp.asarray(src), jnp.asarray(dst), jnp.asarray(counts),
                               backend=backend)
    for pool, cache, out in zip(pools, caches, got, strict=True):
        np.testing.assert_array_equal(np.asarray(out),
                                      oracle_gather(pool, cache, src, dst, counts))


@pytest.mark.parametrize("backend", BACKENDS)
def test_accepts_paged_pool_and_zero_fills_past_pool(backend, pinned_host):
    rng = np.random.default_rng(1)
    pool_np = rng.standard_normal((5, 4, W)).astype(np.float32)     # [host_blocks, B, W]
    pool = jax.device_put(pool_np, pinned_host)
    cache = jnp.full((3, 4, W), 7.0, jnp.float32)
    src = jnp.array([[2, 19, 20]], jnp.int32)                        # 20 >= host_rows
    dst = jnp.array([[0, 1, 2]], jnp.int32)
    got = np.asarray(hs.gather_compact(pool, cache, src, dst, jnp.array([3], jnp.int32),
                                       backend=backend))
    flat = got.reshape(-1, W)
    np.testing.assert_array_equal(flat[0], pool_np.reshape(-1, W)[2])
    np.testing.assert_array_equal(flat[1], pool_np.reshape(-1, W)[19])
    np.testing.assert_array_equal(flat[2], 0.0)
    np.testing.assert_array_equal(flat[3:], 7.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", ["f32", "fp8"])
def test_restore_rows_is_one_packed_batch_row(backend, row, pinned_host):
    """restore_rows: live entries packed at the front, -1 padding ignored (float32 rows of
    16, and 656-byte fp8_ds_mla rows of random bytes)."""
    rng = np.random.default_rng(2)
    if row == "fp8":
        width = FP8_ROW
        pool_np = random_bytes(rng, (20, width))
        pool = jax.device_put(pool_np, pinned_host)
        cache_np = random_bytes(rng, (3, 4, width))
    else:
        width = W
        pool_np, pool = make_pool(rng, 20, pinned_host)
        cache_np = rng.standard_normal((3, 4, W)).astype(np.float32)
    host_rows = jnp.array([4, 17, 0, -1, -1], jnp.int32)
    device_rows = jnp.array([11, 2, 5, -1, -1], jnp.int32)
    got = hs.ops.restore_rows(pool, jnp.asarray(cache_np), host_rows, device_rows,
                              backend=backend)
    want = cache_np.reshape(-1, width).copy()
    want[[11, 2, 5]] = pool_np[[4, 17, 0]]
    np.testing.assert_array_equal(np.asarray(got).reshape(-1, width), want)


# A plan whose batch rows 0 and 1 both copy into device row 5 (live entries: before the
# default check the row silently held either copy); not-live repeats are fine (past
# swap_counts, a negative source, a destination outside the 12-row cache).
DUPLICATE_PLAN = ([[1, 2, 3, 4], [6, 7, 8, -1]], [[5, 6, 7, 7], [8, 5, 20, 6]], [3, 2])
LIVE_REPEATS_ONLY_OUTSIDE = ([[1, 2, 3, 4], [6, -1, 8, 9]], [[5, 6, 7, 7], [8, 5, 20, 20]],
                             [3, 4])


def _plan_op(op, backend, pool):
    """fn(cache, src, dst, counts, validate) running `op` on one 12-row cache."""
    if op == "gather_compact":
        return lambda c, s, d, n, v: hs.gather_compact(pool, c, s, d, n, backend=backend,
                                                       validate=v)
    if op == "gather_compact_group":
        return lambda c, s, d, n, v: gather_compact_group((pool,), (c,), s, d, n,
                                                          backend=backend, validate=v)[0]
    # restore_rows: one batch row, its live entries packed at the front.
    return lambda c, s, d, n, v: restore_rows(pool, c, s[0], d[0], backend=backend,
                                              validate=v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["gather_compact", "gather_compact_group", "restore_rows"])
def test_repeated_destinations_raise_by_default_and_under_checkify(backend, op, pinned_host):
    """Two live entries writing one device row: outside jit a ValueError naming both entries
    and the rule (validate=False: unchecked); under jit a checkify error."""
    rng = np.random.default_rng(9)
    _, pool = make_pool(rng, 20, pinned_host)
    run = _plan_op(op, backend, pool)
    cache = lambda: jnp.zeros((3, 4, W), jnp.float32)  # noqa: E731 - donated by each call
    plan = [jnp.asarray(np.array(x, np.int32)) for x in DUPLICATE_PLAN]
    if op == "restore_rows":  # one row: entries 0 and 2 both write device row 5
        plan = [jnp.array([[1, 2, 3, -1]], jnp.int32), jnp.array([[5, 6, 5, -1]], jnp.int32),
                None]
        match = r"swap_dst\[0, 0\] and swap_dst\[0, 2\] both write device row 5"
    else:
        match = r"swap_dst\[0, 0\] and swap_dst\[1, 1\] both write device row 5"
    with pytest.raises(ValueError, match=match + r"; the live entries of a swap plan .* must "
                                                 r"have distinct destinations"):
        run(cache(), *plan, None)
    run(cache(), *plan, False)
    checked = checkify.checkify(jax.jit(lambda c, s, d, n: run(c, s, d, n, None)),
                                errors=checkify.user_checks)
    err, _ = checked(cache(), *plan)
    assert "swap_dst: device row 5 is the destination of two live entries" in (err.get() or "")
    if op != "restore_rows":
        fine = [jnp.asarray(np.array(x, np.int32)) for x in LIVE_REPEATS_ONLY_OUTSIDE]
        run(cache(), *fine, None)
        assert checked(cache(), *fine)[0].get() is None


# --------------------------------------------------------------------------- index group


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [True, False], ids=["one_launch", "per_array"])
@settings(max_examples=examples(0.3), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layout=st.sampled_from([(3, 1), (2, 2), (4, 2), (3, 3)]),
       paged=st.booleans(), width=st.sampled_from([40, 576]))
def test_group_replays_plan_on_every_layer(backend, fused, seed, layout, paged, width):
    """One plan into every layer, from one pool array per layer or a packed pool (G layers
    side by side per array): each layer gets exactly what its own pool gives, for random
    plans (sources past the pool, -1, destinations outside the cache, entries past the
    counts) into random caches."""
    layers, per_array = layout
    rng = np.random.default_rng(seed)
    n, k, block, num_blocks, host_rows = 3, 16, 4, 10, 48
    pools = [random_rows(rng, (host_rows, width)) for _ in range(layers)]
    caches = [random_rows(rng, (num_blocks, block, width)) for _ in range(layers)]
    src, dst, counts = swap_plan(rng, n, k, host_rows, num_blocks * block)
    packed = pack_layers(pools, per_array)
    if paged:
        packed = [p.reshape(host_rows // block, block, -1) for p in packed]
    got = gather_compact_group([to_host(p) for p in packed], [jnp.asarray(c) for c in caches],
                               jnp.asarray(src), jnp.asarray(dst), jnp.asarray(counts),
                               backend=backend, fused=fused)
    assert len(got) == layers
    for pool, cache, out in zip(pools, caches, got, strict=True):
        np.testing.assert_array_equal(bits(out),
                                      bits(oracle_gather(pool, cache, src, dst, counts)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_layer_copies_read_a_packed_pool_by_flat_rows(backend):
    """gather_compact and restore_rows on a packed array take its flat W-wide row ids
    (layer l's row r: r * G + l % G), the ids `HostPool.layer_rows` makes."""
    rng = np.random.default_rng(3)
    per_array, block, width, host_rows, num_blocks = 3, 4, 24, 32, 6
    pools = [random_rows(rng, (host_rows, width)) for _ in range(per_array)]
    (packed,) = pack_layers(pools, per_array)
    cache = random_rows(rng, (num_blocks, block, width))
    src, dst, counts = swap_plan(rng, 2, 12, host_rows, num_blocks * block)
    for slot, pool in enumerate(pools):
        flat = np.where(src >= 0, src * per_array + slot, src).astype(np.int32)
        got = hs.gather_compact(to_host(packed), jnp.asarray(cache), jnp.asarray(flat),
                                jnp.asarray(dst), jnp.asarray(counts), backend=backend)
        np.testing.assert_array_equal(bits(got),
                                      bits(oracle_gather(pool, cache, src, dst, counts)))
    rows = rng.permutation(host_rows)[:10].astype(np.int32)
    dev = rng.permutation(num_blocks * block)[:10].astype(np.int32)
    got = restore_rows(to_host(packed), jnp.asarray(cache), jnp.asarray(rows * 3 + 2),
                          jnp.asarray(dev), backend=backend)
    want = cache.copy().reshape(-1, width)
    want[dev] = pools[2][rows]
    np.testing.assert_array_equal(bits(got), bits(want.reshape(cache.shape)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resolve_then_group_gather_equals_reference_per_layer(backend):
    """The leader's resolve, then its plan replayed on every layer (the index-group decode
    step), equals the reference resolve and the reference gather of each layer."""
    rng = np.random.default_rng(5)
    k, hot, block, width = 8, 12, 4, 64
    cfg = hs.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=2,
                            row_width=width)
    pools_np = [random_rows(rng, (64, width)) for _ in range(2)]
    caches_np = [random_rows(rng, (8, block, width)) for _ in range(2)]
    kw = dict(state_rows=jnp.array([0, -1], jnp.int32),
              hot_block_table=jnp.array([[1, 2, 3], [4, 5, 6]], jnp.int32),
              source_block_table=jnp.array([[3, 4], [5, 6]], jnp.int32),
              block_size=block, host_rows=64)
    topk = jnp.array([[0, 5, 2, 7, -1, 3, 1, 6], [0, 1, 2, 3, 4, 5, 6, 7]], jnp.int32)
    res, _ = hs.resolve_residency(hs.init_hot_state(cfg), topk, backend=backend, **kw)
    caches = gather_compact_group([to_host(p) for p in pools_np],
                                  [jnp.asarray(c) for c in caches_np], res.swap_src,
                                  res.swap_dst, res.swap_counts, backend=backend)
    ref, _ = hs.resolve_residency(hs.init_hot_state(cfg), topk, backend="reference", **kw)
    for name in NAMES:
        np.testing.assert_array_equal(np.asarray(getattr(res, name)),
                                      np.asarray(getattr(ref, name)), name)
    for pool, cache, out in zip(pools_np, caches_np, caches, strict=True):
        want = reference.gather_compact(jnp.asarray(pool), jnp.asarray(cache), ref.swap_src,
                                        ref.swap_dst, ref.swap_counts)
        np.testing.assert_array_equal(bits(out), bits(want))


# --------------------------------------------------------------------------- validation


def test_validation_errors(pinned_host, on_device):
    pool = jax.device_put(np.zeros((8, W), np.float32), pinned_host)
    cache = jnp.zeros((2, 4, W), jnp.float32)
    plan = (jnp.zeros((1, 2), jnp.int32),) * 2 + (jnp.zeros((1,), jnp.int32),)
    with pytest.raises(ValueError, match="must live in pinned_host.*memory_kind=.device."):
        hs.gather_compact(jax.device_put(np.zeros((8, W), np.float32), on_device), cache,
                          *plan)
    unpinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="unpinned_host")
    with pytest.raises(ValueError, match="memory_kind='unpinned_host'"):
        hs.gather_compact(jax.device_put(np.zeros((8, W), np.float32), unpinned), cache, *plan)
    with pytest.raises(ValueError, match="row_width mismatch.*or a multiple of it"):
        hs.gather_compact(jax.device_put(np.zeros((8, W + 8), np.float32), pinned_host),
                          cache, *plan)
    with pytest.raises(TypeError, match="host_pool dtype"):
        hs.gather_compact(jax.device_put(np.zeros((8, W), np.float16), pinned_host), cache,
                          *plan)
    with pytest.raises(TypeError, match="swap_src must be int32"):
        hs.gather_compact(pool, cache, plan[0].astype(jnp.float32), *plan[1:])
    with pytest.raises(ValueError, match="swap_counts has 2 entries"):
        hs.gather_compact(pool, cache, *plan[:2], jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"host_pools\[0\] holds 2 layers side by side.*"
                                          r"rows 16 wide"):
        gather_compact_group([pool], [cache, cache], *plan)
    with pytest.raises(ValueError, match="host_pools has 2 arrays for the 3 layers"):
        gather_compact_group([pool, pool], [cache] * 3, *plan)
    with pytest.raises(ValueError, match="layer 1: row_width mismatch"):
        gather_compact_group([pool, jax.device_put(np.zeros((8, 8), np.float32), pinned_host)],
                             [cache, cache], *plan)
    with pytest.raises(ValueError, match="copy_programs must be >= 1, got 0"):
        gather_compact_group([pool], [cache], *plan, copy_programs=0)
    for bad in (True, 2.0):
        with pytest.raises(TypeError, match="copy_programs must be a static Python int"):
            gather_compact_group([pool], [cache], *plan, copy_programs=bad)
    with pytest.raises(ValueError, match="layer 1: row_width mismatch"):   # one per layer:
        gather_compact_group([pool, jax.device_put(np.zeros((8, 2 * W), np.float32),
                                                   pinned_host)], [cache, cache], *plan)


def test_pinned_host_placement_on_this_device(pinned_host):
    kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
    assert "pinned_host" in kinds
    pool = jax.device_put(np.arange(8, dtype=np.float32).reshape(2, 4), pinned_host)
    assert pool.sharding.memory_kind == "pinned_host"


# --------------------------------------------------------------------------- Triton kernel


def test_row_pieces_are_powers_of_two():
    assert row_pieces(576, 512) == ((0, 512), (512, 64))
    assert row_pieces(656, 512) == ((0, 512), (512, 128), (640, 16))       # fp8_ds_mla rows
    for width in (1, 8, 100, 576, 2048, 4097):
        pieces = row_pieces(width, 512)
        assert sum(size for _, size in pieces) == width
        assert all(size & (size - 1) == 0 and size <= 512 for _, size in pieces)


def test_kernel_odd_width_and_many_programs():
    rng = np.random.default_rng(7)
    n, k, block, width, num_blocks, host_rows = 2, 40, 2, 100, 64, 90   # W=64+32+4
    pool_np = rng.standard_normal((host_rows, width)).astype(np.float32)
    cache_np = rng.standard_normal((num_blocks, block, width)).astype(np.float32)
    src, dst, counts = swap_plan(rng, n, k, host_rows, num_blocks * block)
    counts[:] = k
    got = tk.gather_compact(to_host(pool_np), jnp.asarray(cache_np), jnp.asarray(src),
                            jnp.asarray(dst), jnp.asarray(counts), interpret=INTERPRET,
                            tuning=CopyTuning(rows_per_program=4, max_piece=64))
    np.testing.assert_array_equal(np.asarray(got),
                                  oracle_gather(pool_np, cache_np, src, dst, counts))


@settings(max_examples=examples(0.3), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layers=st.sampled_from([1, 2]),
       rows=st.sampled_from([2, 4, 8]), programs=st.sampled_from([None, 1, 3, 7, 64]))
def test_kernel_sparse_plan_matches_numpy(seed, layers, rows, programs):
    """A plan like a decode step's (rows with no misses, a full row, entries past the counts,
    sources past the pool and destinations outside the cache), on one layer and on two, at
    several rows per program, with a program per chunk or a few looping programs (64: no
    fewer than the chunks, the grid's way): the kernel copies what the plan says."""
    rng = np.random.default_rng(seed)
    n, k, block, width, num_blocks, host_rows = 5, 24, 2, 64, 80, 90
    pools = [rng.standard_normal((host_rows, width)).astype(np.float32) for _ in range(layers)]
    caches = [rng.standard_normal((num_blocks, block, width)).astype(np.float32)
              for _ in range(layers)]
    src, dst, counts = swap_plan(rng, n, k, host_rows, num_blocks * block)
    counts[rng.random(n) < 0.3] = 0
    counts[rng.integers(n)] = k
    got = tk.gather_compact_group(
        [to_host(p) for p in pools], [jnp.asarray(c) for c in caches], jnp.asarray(src),
        jnp.asarray(dst), jnp.asarray(counts), interpret=INTERPRET,
        tuning=CopyTuning(rows_per_program=rows, max_programs=programs))
    for g, pool, cache in zip(got, pools, caches, strict=True):
        np.testing.assert_array_equal(np.asarray(g), oracle_gather(pool, cache, src, dst, counts))


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("pool_shape, cache_shape, dtype", [
    ((1 << 14, 576), (512, 64, 576), jnp.bfloat16),
    ((1 << 12, 4, 576), (512, 64, 576), jnp.bfloat16),
    ((1 << 16, 656), (1024, 64, 656), jnp.uint8),       # fp8_ds_mla rows: 512 + 128 + 16 B
    ((1 << 12, 64, 656), (1024, 64, 656), jnp.uint8),
], ids=["bf16-pool2d", "bf16-pool3d", "fp8-pool2d", "fp8-pool3d"])
def test_kernel_lowers_to_triton(pool_shape, cache_shape, dtype):
    pool, cache = sds(pool_shape, dtype), sds(cache_shape, dtype)
    text = lower_for_cuda(tk.gather_compact, pool, cache, sds((64, 2048)), sds((64, 2048)),
                          sds((64,)))
    assert "output_operand_aliases" in text
    lower_for_cuda(lambda p, c, s, d, n: tk.gather_compact_group((p, p), (c, c), s, d, n),
                   pool, cache, sds((8, 256)), sds((8, 256)), sds((8,)))
    packed = sds((*pool_shape[:-1], 2 * pool_shape[-1]), dtype)        # 2 layers side by side
    lower_for_cuda(lambda p, c, s, d, n: tk.gather_compact_group((p,), (c, c), s, d, n),
                   packed, cache, sds((8, 256)), sds((8, 256)), sds((8,)))
    lower_for_cuda(tk.gather_compact, packed, cache, sds((8, 256)), sds((8, 256)), sds((8,)))
    looping = CopyTuning(max_programs=16)     # a few programs, each looping over its chunks
    lower_for_cuda(lambda p, c, s, d, n: tk.gather_compact_group((p, p), (c, c), s, d, n,
                                                                 tuning=looping),
                   pool, cache, sds((64, 2048)), sds((64, 2048)), sds((64,)))


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2048, 16384])
@pytest.mark.parametrize("row", ["bf16", "fp8"])
def test_gpu_gather_from_pinned_pool(rows, row):
    """bf16 rows (576 wide) or fp8_ds_mla rows (656 random bytes) from a pinned pool of
    131,072 rows, default backend (triton), exact; for fp8 rows also the same plan through
    the 8-layer group gather (one launch)."""
    rng = np.random.default_rng(rows)
    width, make_rows = {"bf16": (576, random_rows), "fp8": (FP8_ROW, random_bytes)}[row]
    block, num_blocks, host_rows = 64, 1024, 1 << 17
    pool_np = make_rows(rng, (host_rows // block, block, width))
    cache_np = make_rows(rng, (num_blocks, block, width))
    n = rows // 2048
    src = rng.choice(host_rows + 64, size=(n, 2048), replace=False).astype(np.int32)
    dst = rng.permutation(num_blocks * block)[: n * 2048].reshape(n, 2048).astype(np.int32)
    counts = rng.integers(1, 2049, size=n).astype(np.int32)
    want = oracle_gather(pool_np, cache_np, src, dst, counts)
    pool = to_host(pool_np)
    got = hs.gather_compact(pool, jnp.asarray(cache_np), jnp.asarray(src), jnp.asarray(dst),
                            jnp.asarray(counts))                 # default backend: triton
    np.testing.assert_array_equal(bits(got), bits(want))
    if row == "fp8":
        group = gather_compact_group([pool] * 8, [jnp.asarray(cache_np) for _ in range(8)],
                                     jnp.asarray(src), jnp.asarray(dst), jnp.asarray(counts))
        for out in group:
            np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", None])
def test_gpu_copies_with_bf16_rows(backend, pinned_host):
    """The reference (compute_on host gather) and the default backend on the GPU, 576-wide:
    gather, then mirror back into the pool."""
    rng = np.random.default_rng(11)
    width, host_rows, blocks, b = 576, 4096, 64, 64
    pool_np = rng.standard_normal((host_rows, width)).astype(jnp.bfloat16)
    pool = jax.device_put(pool_np, pinned_host)
    cache_np = rng.standard_normal((blocks, b, width)).astype(jnp.bfloat16)
    plan = random_plan(rng, 8, 256, host_rows, blocks * b)
    got = hs.gather_compact(pool, jnp.asarray(cache_np), *map(jnp.asarray, plan),
                            backend=backend)
    np.testing.assert_array_equal(np.asarray(got), oracle_gather(pool_np, cache_np, *plan))
    dev = rng.permutation(blocks * b)[:300].astype(np.int32)
    dst = rng.permutation(host_rows)[:300].astype(np.int32)
    want = pool_np.copy()
    want[dst] = np.asarray(got).reshape(-1, width)[dev]
    new_pool = hs.mirror_rows(got, pool, jnp.asarray(dev), jnp.asarray(dst), backend=backend)
    assert new_pool.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(new_pool), want)


@pytest.mark.gpu
@pytest.mark.parametrize("layers, per_array", [(1, 1), (4, 1), (2, 2), (4, 2)],
                         ids=["1-layer", "4-pools", "2-packed", "4-in-2-packed"])
def test_gpu_step_shaped_plan_from_pinned_pool(layers, per_array):
    """A plan of a decode step's shape (256 batch rows of 2048, most rows with a few misses,
    some with none, one full) from a pinned pool of 131,072 rows, one launch for every
    layer, one pool array per layer or packed (`per_array` layers side by side): exact
    against numpy on every layer."""
    rng = np.random.default_rng(layers + 10 * per_array)
    width, block, num_blocks, host_rows, n, k = 576, 64, 8192, 1 << 17, 256, 2048
    pools_np = [random_rows(rng, (host_rows, width)) for _ in range(layers)]
    cache_np = random_rows(rng, (num_blocks, block, width))
    src = rng.integers(0, host_rows + 64, size=(n, k)).astype(np.int32)
    dst = rng.permutation(num_blocks * block)[: n * k].reshape(n, k).astype(np.int32)
    counts = rng.integers(0, 200, size=n).astype(np.int32)
    counts[rng.random(n) < 0.2] = 0
    counts[7] = k
    got = tk.gather_compact_group([to_host(p) for p in pack_layers(pools_np, per_array)],
                                  [jnp.asarray(cache_np) for _ in pools_np],
                                  jnp.asarray(src), jnp.asarray(dst), jnp.asarray(counts))
    for out, pool in zip(got, pools_np, strict=True):
        np.testing.assert_array_equal(bits(out), bits(oracle_gather(pool, cache_np, src, dst,
                                                                    counts)))
