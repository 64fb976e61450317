"""mirror_rows: every backend against numpy (pool kept in pinned_host memory, donated, both
layouts, random rows that must survive; bf16 rows and 656-byte fp8_ds_mla rows as uint8),
validation, the kernel's CUDA lowering and the GPU-scale runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import hisparse_jax as hs
from pallas_kernels.mirror_rows import triton as tk
from tests.ops import (
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

BACKENDS = backends("mirror_rows")
W = 16


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**32 - 1))
def test_matches_numpy(backend, seed, pinned_host):
    rng = np.random.default_rng(seed)
    host_rows, blocks, b = 40, 6, 4
    pool_np = rng.standard_normal((host_rows, W)).astype(np.float32)
    pool = jax.device_put(pool_np, pinned_host)
    cache_np = rng.standard_normal((blocks, b, W)).astype(np.float32)
    r = 10
    dev = rng.integers(-2, blocks * b + 2, size=r).astype(np.int32)
    dst = (rng.permutation(host_rows + 6)[:r] - 3).astype(np.int32)   # distinct, some outside
    want = pool_np.copy()
    for d, h in zip(dev, dst, strict=True):
        if 0 <= d < blocks * b and 0 <= h < host_rows:
            want[h] = cache_np.reshape(-1, W)[d]
    got = hs.mirror_rows(jnp.asarray(cache_np), pool, jnp.asarray(dev), jnp.asarray(dst),
                         backend=backend)
    assert got.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(got), want)


ROWS = {"bf16": (576, random_rows), "fp8": (656, random_bytes)}   # fp8_ds_mla rows: uint8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool_blocks", [False, True], ids=["pool2d", "pool3d"])
@pytest.mark.parametrize("row", list(ROWS))
@settings(max_examples=examples(0.15))
@given(seed=st.integers(0, 2**32 - 1))
def test_rows_both_pool_layouts(backend, pool_blocks, row, seed):
    """576-wide bf16 rows and 656-byte fp8_ds_mla rows (random bytes) into a pinned pool of
    random rows that must survive bit for bit; the pool stays pinned_host and is donated."""
    rng = np.random.default_rng(seed)
    width, make_rows = ROWS[row]
    block, num_blocks, host_rows, r = 4, 8, 48, 12
    pool_np = make_rows(rng, (host_rows, width))
    cache_np = make_rows(rng, (num_blocks, block, width))
    device_rows = rng.integers(-2, num_blocks * block + 3, size=r).astype(np.int32)
    dest = (rng.permutation(host_rows + 6)[:r] - 3).astype(np.int32)
    want = pool_np.copy()
    flat = cache_np.reshape(-1, width)
    for d, h in zip(device_rows, dest, strict=True):
        if 0 <= d < flat.shape[0] and 0 <= h < host_rows:
            want[h] = flat[d]
    shape = (host_rows // block, block, width) if pool_blocks else (host_rows, width)
    pool = to_host(pool_np.reshape(shape))
    got = hs.mirror_rows(jnp.asarray(cache_np), pool, jnp.asarray(device_rows),
                         jnp.asarray(dest), backend=backend)
    assert pool.is_deleted(), "the pool was not donated"
    assert got.sharding.memory_kind == "pinned_host"
    assert got.shape == shape and got.dtype == pool_np.dtype
    np.testing.assert_array_equal(bits(got).reshape(-1, width), bits(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_donates_the_pool(backend, pinned_host):
    pool = jax.device_put(np.zeros((8, W), np.float32), pinned_host)
    cache = jnp.ones((2, 4, W), jnp.float32)
    new = hs.mirror_rows(cache, pool, jnp.array([0], jnp.int32), jnp.array([3], jnp.int32),
                         backend=backend)
    assert pool.is_deleted()
    np.testing.assert_array_equal(np.asarray(new)[3], 1.0)



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [False, True], ids=["mirror_rows", "mirror_rows_group"])
def test_repeated_destinations_raise_by_default_and_under_checkify(backend, group,
                                                                  pinned_host):
    """Two kept entries writing one host row (before the default check the row silently held
    either): outside jit a ValueError naming both entries and the rule (validate=False:
    unchecked); under jit a checkify error. Skipped entries may repeat."""
    pool = lambda: jax.device_put(np.zeros((8, W), np.float32), pinned_host)  # noqa: E731
    cache = jnp.ones((2, 4, W), jnp.float32)

    def run(p, dev, host, validate):
        if group:
            return hs.mirror_rows_group((cache,), (p,), dev, host, backend=backend,
                                        validate=validate)[0]
        return hs.mirror_rows(cache, p, dev, host, backend=backend, validate=validate)

    dev = jnp.array([0, 1, 2, -1, 9], jnp.int32)
    host = jnp.array([3, 5, 3, 5, 5], jnp.int32)        # entries 3, 4 skipped (device row)
    with pytest.raises(ValueError, match=r"host_rows\[0\] and host_rows\[2\] both write host "
                                         r"row 3; the kept entries .* must have distinct "
                                         r"destinations"):
        run(pool(), dev, host, None)
    run(pool(), dev, host, False)
    run(pool(), dev, jnp.array([3, 5, 4, 5, 5], jnp.int32), None)  # kept ones distinct
    checked = checkify.checkify(jax.jit(lambda p, d, h: run(p, d, h, None)),
                                errors=checkify.user_checks)
    err, _ = checked(pool(), dev, host)
    assert "host_rows: host row 3 is the destination of two kept entries" in (err.get() or "")

def test_validation_errors(pinned_host):
    pool = jax.device_put(np.zeros((8, W), np.float32), pinned_host)
    cache = jnp.zeros((2, 4, W), jnp.float32)
    with pytest.raises(ValueError, match="kv_cache must have rank 3"):
        hs.mirror_rows(cache[0], pool, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="same length"):
        hs.mirror_rows(cache, pool, jnp.zeros(1, jnp.int32), jnp.zeros(2, jnp.int32))


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("pool_shape, dtype", [
    ((1 << 14, 576), jnp.bfloat16), ((1 << 12, 4, 576), jnp.bfloat16),
    ((1 << 16, 656), jnp.uint8), ((1 << 12, 64, 656), jnp.uint8),        # fp8_ds_mla rows
], ids=["bf16-pool2d", "bf16-pool3d", "fp8-pool2d", "fp8-pool3d"])
def test_kernel_lowers_to_triton(pool_shape, dtype):
    pool, cache = sds(pool_shape, dtype), sds((512, 64, pool_shape[-1]), dtype)
    lower_for_cuda(tk.mirror_rows, cache, pool, sds((3000,)), sds((3000,)))
    packed = sds((*pool_shape[:-1], 3 * pool_shape[-1]), dtype)       # 3 layers side by side
    lower_for_cuda(tk.mirror_rows, cache, packed, sds((3000,)), sds((3000,)))


@pytest.mark.gpu
@pytest.mark.parametrize("row", list(ROWS))
def test_gpu_mirror_into_pinned_pool_in_place(row):
    """4,096 rows (bf16 576-wide, or fp8_ds_mla 656 bytes) into a pinned pool of 131,072,
    default backend (triton), in place."""
    rng = np.random.default_rng(2)
    width, make_rows = ROWS[row]
    block, num_blocks, host_blocks = 64, 256, 2048
    pool_np = make_rows(rng, (host_blocks, block, width))
    cache_np = make_rows(rng, (num_blocks, block, width))
    device_rows = rng.permutation(num_blocks * block)[:4096].astype(np.int32)
    dest = rng.permutation(host_blocks * block)[:4096].astype(np.int32)
    pool = to_host(pool_np)
    got = hs.mirror_rows(jnp.asarray(cache_np), pool, jnp.asarray(device_rows),
                         jnp.asarray(dest))                      # default backend: triton
    assert pool.is_deleted(), "the pool was not donated"
    assert got.sharding.memory_kind == "pinned_host"
    want = pool_np.reshape(-1, width).copy()
    want[dest] = cache_np.reshape(-1, width)[device_rows]
    np.testing.assert_array_equal(bits(got).reshape(-1, width), bits(want))


def _group_case(rng, row, layers, block, num_blocks, host_blocks, r):
    width, make_rows = ROWS[row]
    pools = [make_rows(rng, (host_blocks, block, width)) for _ in range(layers)]
    caches = [make_rows(rng, (num_blocks, block, width)) for _ in range(layers)]
    device_rows = rng.permutation(num_blocks * block)[:r].astype(np.int32)
    dest = rng.permutation(host_blocks * block)[:r].astype(np.int32)
    device_rows[::5] = -1  # skipped entries (the transfer worker's padding)
    want = [p.reshape(-1, width).copy() for p in pools]
    for w, c in zip(want, caches, strict=True):
        keep = device_rows >= 0
        w[dest[keep]] = c.reshape(-1, width)[device_rows[keep]]
    return pools, caches, device_rows, dest, want, width


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", list(ROWS))
@settings(max_examples=examples(0.15))
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 3))
def test_group_equals_one_mirror_per_layer(backend, row, seed, layers):
    """`mirror_rows_group`: one call writes each layer's rows into that layer's pool, the
    pools stay pinned_host and are donated, every other row survives."""
    rng = np.random.default_rng(seed)
    pools, caches, device_rows, dest, want, width = _group_case(rng, row, layers, 4, 6, 10, 9)
    pools = [to_host(p) for p in pools]
    got = hs.mirror_rows_group([jnp.asarray(c) for c in caches], pools,
                               jnp.asarray(device_rows), jnp.asarray(dest), backend=backend)
    assert len(got) == layers and all(p.is_deleted() for p in pools)
    for g, w in zip(got, want, strict=True):
        assert g.sharding.memory_kind == "pinned_host"
        np.testing.assert_array_equal(bits(g).reshape(-1, width), bits(w))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.15))
@given(seed=st.integers(0, 2**32 - 1), layout=st.sampled_from([(2, 2), (4, 2), (3, 3)]))
def test_group_into_packed_pool(backend, seed, layout):
    """`mirror_rows_group` into a packed pool (G layers side by side per array) writes each
    layer's rows into its columns, and a one-layer `mirror_rows` with flat row ids
    (r * G + slot) does the same for one layer; every other byte survives."""
    layers, per_array = layout
    rng = np.random.default_rng(seed)
    pools, caches, device_rows, dest, want, width = _group_case(
        rng, "bf16", layers, 4, 6, 10, 9)
    packed = [np.concatenate(pools[a:a + per_array], axis=-1)
              for a in range(0, layers, per_array)]
    got = hs.mirror_rows_group([jnp.asarray(c) for c in caches], [to_host(p) for p in packed],
                               jnp.asarray(device_rows), jnp.asarray(dest), backend=backend)
    assert len(got) == layers // per_array
    for a, g in enumerate(got):
        assert g.sharding.memory_kind == "pinned_host"
        wide = bits(g).reshape(-1, per_array * width)
        for slot in range(per_array):
            np.testing.assert_array_equal(wide[:, slot * width:(slot + 1) * width],
                                          bits(want[a * per_array + slot]))
    slot = per_array - 1
    flat = np.where(dest >= 0, dest * per_array + slot, dest).astype(np.int32)
    one = hs.mirror_rows(jnp.asarray(caches[slot]), to_host(packed[0]),
                         jnp.asarray(device_rows), jnp.asarray(flat), backend=backend)
    wide = bits(one).reshape(-1, per_array * width)
    np.testing.assert_array_equal(wide[:, slot * width:], bits(want[slot]))
    np.testing.assert_array_equal(wide[:, :slot * width],
                                  bits(packed[0]).reshape(-1, per_array * width)[:, :slot * width])


def test_group_validation(pinned_host):
    pool = jax.device_put(np.zeros((8, W), np.float32), pinned_host)
    cache = jnp.zeros((2, 4, W), jnp.float32)
    rows = jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match=r"host_pools\[0\] holds 2 layers side by side"):
        hs.mirror_rows_group([cache, cache], [pool], rows, rows)
    with pytest.raises(ValueError, match="host_pools has 2 arrays for the 3 layers"):
        hs.mirror_rows_group([cache] * 3, [pool, pool], rows, rows)
    with pytest.raises(ValueError, match="same length"):
        hs.mirror_rows_group([cache], [pool], rows, jnp.zeros(2, jnp.int32))
    assert hs.mirror_rows_group([], [], rows, rows) == ()


@pytest.mark.gpu
@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("per_array", [1, 2], ids=["pool-per-layer", "packed"])
def test_gpu_group_mirror_into_pinned_pools_in_place(row, per_array):
    """4,096 rows into two layers' pinned pools of 131,072 rows (one array per layer, or
    both side by side in one), default backend, one call."""
    rng = np.random.default_rng(3)
    pools, caches, device_rows, dest, want, width = _group_case(rng, row, 2, 64, 256, 2048,
                                                                4096)
    pools = [to_host(p) for p in pack_layers(pools, per_array)]
    got = hs.mirror_rows_group([jnp.asarray(c) for c in caches], pools,
                               jnp.asarray(device_rows), jnp.asarray(dest))
    assert all(p.is_deleted() for p in pools), "the pools were not donated"
    assert len(got) == 2 // per_array
    for layer, w in enumerate(want):
        g = got[layer // per_array]
        assert g.sharding.memory_kind == "pinned_host"
        slot = layer % per_array
        np.testing.assert_array_equal(
            bits(g).reshape(-1, per_array * width)[:, slot * width:(slot + 1) * width],
            bits(w))
