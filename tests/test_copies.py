"""gather_compact, mirror_rows and invalidate_written_rows (reference backend) against numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hisparse_jax as hs
from tests.oracle import oracle_gather, oracle_invalidate

W = 16


def make_pool(rng, rows, pinned_host, dtype=np.float32):
    data = rng.standard_normal((rows, W)).astype(dtype)
    return data, jax.device_put(data, pinned_host)


def random_plan(rng, n, k, host_rows, cache_rows):
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


@given(seed=st.integers(0, 2**32 - 1))
def test_gather_compact_matches_numpy(seed, pinned_host):
    rng = np.random.default_rng(seed)
    host_rows, blocks, b = 50, 12, 4
    pool_np, pool = make_pool(rng, host_rows, pinned_host)
    cache_np = rng.standard_normal((blocks, b, W)).astype(np.float32)
    plan = random_plan(rng, 3, 8, host_rows, blocks * b)
    want = oracle_gather(pool_np, cache_np, *plan)
    got = hs.gather_compact(pool, jnp.asarray(cache_np), *map(jnp.asarray, plan))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.sharding.memory_kind == "device"


def test_gather_accepts_paged_pool_and_zero_fills_past_pool(pinned_host):
    rng = np.random.default_rng(1)
    pool_np = rng.standard_normal((5, 4, W)).astype(np.float32)     # [host_blocks, B, W]
    pool = jax.device_put(pool_np, pinned_host)
    cache = jnp.full((3, 4, W), 7.0, jnp.float32)
    src = jnp.array([[2, 19, 20]], jnp.int32)                        # 20 >= host_rows
    dst = jnp.array([[0, 1, 2]], jnp.int32)
    got = np.asarray(hs.gather_compact(pool, cache, src, dst, jnp.array([3], jnp.int32)))
    flat = got.reshape(-1, W)
    np.testing.assert_array_equal(flat[0], pool_np.reshape(-1, W)[2])
    np.testing.assert_array_equal(flat[1], pool_np.reshape(-1, W)[19])
    np.testing.assert_array_equal(flat[2], 0.0)
    np.testing.assert_array_equal(flat[3:], 7.0)


@given(seed=st.integers(0, 2**32 - 1))
def test_mirror_rows_matches_numpy(seed, pinned_host):
    rng = np.random.default_rng(seed)
    host_rows, blocks, b = 40, 6, 4
    pool_np, pool = make_pool(rng, host_rows, pinned_host)
    cache_np = rng.standard_normal((blocks, b, W)).astype(np.float32)
    r = 10
    dev = rng.integers(-2, blocks * b + 2, size=r).astype(np.int32)
    dst = (rng.permutation(host_rows + 6)[:r] - 3).astype(np.int32)   # distinct, some outside
    want = pool_np.copy()
    for d, h in zip(dev, dst, strict=True):
        if 0 <= d < blocks * b and 0 <= h < host_rows:
            want[h] = cache_np.reshape(-1, W)[d]
    got = hs.mirror_rows(jnp.asarray(cache_np), pool, jnp.asarray(dev), jnp.asarray(dst))
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(got), want)


def test_mirror_donates_the_pool(pinned_host):
    pool = jax.device_put(np.zeros((8, W), np.float32), pinned_host)
    cache = jnp.ones((2, 4, W), jnp.float32)
    new = hs.mirror_rows(cache, pool, jnp.array([0], jnp.int32), jnp.array([3], jnp.int32))
    assert pool.is_deleted()
    np.testing.assert_array_equal(np.asarray(new)[3], 1.0)


@given(seed=st.integers(0, 2**32 - 1))
def test_invalidate_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    s, h, t = 4, 16, 12
    slot_rows = rng.integers(-1, 30, size=(s, h)).astype(np.int32)
    lru = np.stack([rng.permutation(h) for _ in range(s)]).astype(np.int16)
    tok_state = rng.integers(-1, s + 1, size=t).astype(np.int32)
    written = rng.integers(-1, 30, size=t).astype(np.int32)
    state = hs.HotState(jnp.asarray(slot_rows), jnp.asarray(lru))
    got = hs.invalidate_written_rows(state, jnp.asarray(tok_state), jnp.asarray(written))
    np.testing.assert_array_equal(np.asarray(got.slot_rows),
                                  oracle_invalidate(slot_rows, tok_state, written))
    np.testing.assert_array_equal(np.asarray(got.lru), lru)


def test_invalidate_then_resolve_refetches_rewritten_row():
    """A rewritten host row is a miss again on the next resolve, never a stale hit."""
    cfg = hs.HiSparseConfig(top_k=4, hot_size=8, block_size=4, max_num_reqs=1, row_width=8,
                            kv_dtype="float32")
    kw = dict(state_rows=jnp.array([0], jnp.int32), hot_block_table=jnp.array([[3, 4]]),
              source_block_table=jnp.array([[1, 2]], jnp.int32), block_size=4, host_rows=12)
    topk = jnp.arange(4, dtype=jnp.int32)[None]
    _, state = hs.resolve_residency(hs.init_hot_state(cfg), topk, **kw)
    state = hs.invalidate_written_rows(state, jnp.array([0], jnp.int32),
                                       jnp.array([6], jnp.int32))       # host row of t=2
    res, _ = hs.resolve_residency(state, topk, **kw)
    assert int(res.swap_counts[0]) == 1 and int(res.swap_src[0, 0]) == 6
    assert int(res.num_hits[0]) == 3


def test_copy_validation_errors(pinned_host, on_device):
    pool = jax.device_put(np.zeros((8, W), np.float32), pinned_host)
    cache = jnp.zeros((2, 4, W), jnp.float32)
    plan = (jnp.zeros((1, 2), jnp.int32),) * 2 + (jnp.zeros((1,), jnp.int32),)
    with pytest.raises(ValueError, match="must live in pinned_host.*memory_kind=.device."):
        hs.gather_compact(jax.device_put(np.zeros((8, W), np.float32), on_device), cache,
                          *plan)
    unpinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="unpinned_host")
    with pytest.raises(ValueError, match="memory_kind='unpinned_host'"):
        hs.gather_compact(jax.device_put(np.zeros((8, W), np.float32), unpinned), cache, *plan)
    with pytest.raises(ValueError, match="row_width mismatch"):
        hs.gather_compact(jax.device_put(np.zeros((8, 8), np.float32), pinned_host), cache,
                          *plan)
    with pytest.raises(TypeError, match="host_pool dtype"):
        hs.gather_compact(jax.device_put(np.zeros((8, W), np.float16), pinned_host), cache,
                          *plan)
    with pytest.raises(TypeError, match="swap_src must be int32"):
        hs.gather_compact(pool, cache, plan[0].astype(jnp.float32), *plan[1:])
    with pytest.raises(ValueError, match="swap_counts has 2 entries"):
        hs.gather_compact(pool, cache, *plan[:2], jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="kv_cache must have rank 3"):
        hs.mirror_rows(cache[0], pool, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="same length"):
        hs.mirror_rows(cache, pool, jnp.zeros(1, jnp.int32), jnp.zeros(2, jnp.int32))


def test_pinned_host_placement_on_this_device(pinned_host):
    kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
    assert "pinned_host" in kinds
    pool = jax.device_put(np.arange(8, dtype=np.float32).reshape(2, 4), pinned_host)
    assert pool.sharding.memory_kind == "pinned_host"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", None])
def test_copies_on_gpu_with_bf16_rows(backend, pinned_host):
    """The reference (compute_on host gather) and the default backend on the GPU, 576-wide."""
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
