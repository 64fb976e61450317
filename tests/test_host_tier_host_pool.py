"""HostPool: pinned allocation, sizing from a byte budget, RAM check, memory-limit env, release."""

import gc

import jax
import numpy as np
import pytest

from host_tier.worker import host_pool as hp
from host_tier.worker.host_pool import (
    HOST_MEMORY_LIMIT_ENV,
    HostPool,
    check_available_ram,
    ensure_host_memory_limit,
)

GIB = 1 << 30


def test_pool_lives_in_pinned_host_memory_one_array_per_layer():
    with HostPool(num_layers=3, block_size=4, row_width=8, dtype=np.float32, num_blocks=5) as pool:
        assert len(pool.arrays) == 3
        for array in pool.arrays:
            assert array.shape == (5, 4, 8) and array.dtype == np.float32
            assert array.sharding.memory_kind == "pinned_host"
        assert pool.nbytes == 3 * 5 * 4 * 8 * 4
        assert not np.any(pool.read_rows(2, np.arange(20)))


def test_packed_pool_keeps_g_layers_side_by_side_per_array():
    """layers_per_array=G: L / G arrays G times wider, the same bytes and blocks; each layer
    reads its own columns (read_rows, layer_rows), and bad packings are refused."""
    budget = 6 * 5 * 4 * 8 * 4 / GIB
    with HostPool(num_layers=6, block_size=4, row_width=8, dtype=np.float32,
                  host_pool_gib=budget, layers_per_array=3) as pool, \
            HostPool(num_layers=6, block_size=4, row_width=8, dtype=np.float32,
                     host_pool_gib=budget) as flat:
        assert pool.num_blocks == flat.num_blocks == 5 and pool.nbytes == flat.nbytes
        assert len(pool.arrays) == pool.num_arrays == 2 and len(flat.arrays) == 6
        assert all(a.shape == (5, 4, 24) for a in pool.arrays) and pool.shape == (5, 4, 24)
        assert pool.layer(4) is pool.arrays[1] and pool.array_index(2) == 0
        rows = np.array([0, 7, -1, 19], np.int32)
        np.testing.assert_array_equal(pool.layer_rows(4, rows), [1, 22, -1, 58])
        np.testing.assert_array_equal(flat.layer_rows(4, rows), rows)
        values = np.arange(5 * 4 * 24, dtype=np.float32).reshape(5, 4, 24)
        pool.replace_layer(5, jax.device_put(values, pool.sharding))
        for layer in (3, 4, 5):
            slot = layer % 3
            np.testing.assert_array_equal(pool.read_rows(layer, [0, 13]),
                                          values.reshape(20, 24)[[0, 13],
                                                                 slot * 8:(slot + 1) * 8])
        assert "3 layers per array" in repr(pool)
        with pytest.raises(ValueError, match=r"layer index must be in \[0, 6\), got 6"):
            pool.layer_rows(6, rows)
        with pytest.raises(ValueError, match=r"array index must be in \[0, 2\), got 2"):
            pool.replace_array(2, pool.arrays[0])
    with pytest.raises(ValueError, match="layers_per_array=4 must divide num_layers=6"):
        HostPool(num_layers=6, block_size=4, row_width=8, dtype=np.float32, num_blocks=5,
                 layers_per_array=4)
    with pytest.raises(ValueError, match="layers_per_array"):
        HostPool(num_layers=6, block_size=4, row_width=8, dtype=np.float32, num_blocks=5,
                 layers_per_array=0)


def test_block_count_comes_from_the_byte_budget():
    block_bytes = 2 * 16 * 576 * 2  # 2 layers, B=16, W=576, bf16
    budget_gib = (10 * block_bytes + 100) / GIB
    with HostPool(num_layers=2, block_size=16, row_width=576, dtype=jax.numpy.bfloat16,
                  host_pool_gib=budget_gib) as pool:
        assert pool.block_bytes == block_bytes
        assert pool.num_blocks == 10
        assert pool.nbytes <= budget_gib * GIB


def test_sizing_errors_name_the_argument():
    kwargs = dict(num_layers=1, block_size=4, row_width=8, dtype=np.float32)
    with pytest.raises(ValueError, match="exactly one of host_pool_gib and num_blocks"):
        HostPool(**kwargs)
    with pytest.raises(ValueError, match="exactly one of host_pool_gib and num_blocks"):
        HostPool(**kwargs, host_pool_gib=1.0, num_blocks=4)
    with pytest.raises(ValueError, match="host_pool_gib=1e-09 holds 0 blocks"):
        HostPool(**kwargs, host_pool_gib=1e-9)
    with pytest.raises(ValueError, match="host_pool_gib must be a positive number"):
        HostPool(**kwargs, host_pool_gib=-1)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        HostPool(**kwargs, num_blocks=1)
    with pytest.raises(ValueError, match="HostPool.block_size must be a positive int"):
        HostPool(num_layers=1, block_size=0, row_width=8, dtype=np.float32, num_blocks=4)
    with pytest.raises(ValueError, match="memory_kind='hbm'"):
        HostPool(**kwargs, num_blocks=4, memory_kind="hbm")


def test_a_pool_larger_than_95_percent_of_ram_is_refused_before_allocating(monkeypatch):
    allocated = []
    monkeypatch.setattr(hp.jax, "device_put", lambda *a, **k: allocated.append(1))
    ram = hp.available_ram_bytes()
    assert ram > 0
    too_big = 0.96 * ram / GIB
    with pytest.raises(ValueError, match=r"host_pool_gib asks for .* GiB .* more than 95% of the"):
        HostPool(num_layers=1, block_size=64, row_width=576, dtype=np.float32,
                 host_pool_gib=too_big)
    assert allocated == []


def test_ram_check_threshold_is_95_percent():
    check_available_ram(95 * GIB, available=100 * GIB)
    with pytest.raises(ValueError, match="lower host_pool_gib"):
        check_available_ram(95 * GIB + 1, available=100 * GIB)


def test_memory_limit_env_is_set_only_when_needed_and_never_lowered():
    env = {}
    assert ensure_host_memory_limit(10 * GIB, environ=env, backends_initialized=False) \
        == "not needed"
    assert env == {}
    assert ensure_host_memory_limit(100 * GIB, environ=env, backends_initialized=False) == "set"
    assert int(env[HOST_MEMORY_LIMIT_ENV]) >= 100 * 1.05
    env = {HOST_MEMORY_LIMIT_ENV: "500"}
    assert ensure_host_memory_limit(100 * GIB, environ=env, backends_initialized=False) \
        == "already sufficient"
    assert env[HOST_MEMORY_LIMIT_ENV] == "500"
    env = {HOST_MEMORY_LIMIT_ENV: "8"}  # explicitly too small for even a small pool: raised
    assert ensure_host_memory_limit(10 * GIB, environ=env, backends_initialized=False) == "set"
    assert int(env[HOST_MEMORY_LIMIT_ENV]) >= 11


def test_memory_limit_after_backend_init_errors_on_gpu_and_warns_elsewhere():
    env = {}
    with pytest.raises(ValueError, match=f"set {HOST_MEMORY_LIMIT_ENV}=\\d+ before JAX"):
        ensure_host_memory_limit(100 * GIB, environ=env, backends_initialized=True,
                                 platform="gpu")
    with pytest.warns(UserWarning, match="ignored on the cpu backend"):
        assert ensure_host_memory_limit(100 * GIB, environ=env, backends_initialized=True,
                                        platform="cpu") == "too small"
    assert env == {}  # too late to set: left alone
    with pytest.raises(ValueError, match="is not a number"):
        ensure_host_memory_limit(GIB, environ={HOST_MEMORY_LIMIT_ENV: "lots"})


def test_close_deletes_arrays_deterministically_and_is_idempotent():
    pool = HostPool(num_layers=2, block_size=4, row_width=8, dtype=np.float32, num_blocks=4)
    arrays = pool.arrays
    pool.close()
    assert pool.closed and all(a.is_deleted() for a in arrays)
    pool.close()
    with pytest.raises(ValueError, match="HostPool is closed"):
        pool.layer(0)
    with HostPool(num_layers=1, block_size=4, row_width=8, dtype=np.float32,
                  num_blocks=4) as pool2:
        inner = pool2.arrays
    assert all(a.is_deleted() for a in inner)
    with pytest.raises(RuntimeError, match="boom"):
        with HostPool(num_layers=1, block_size=4, row_width=8, dtype=np.float32,
                      num_blocks=4) as pool3:
            raise RuntimeError("boom")
    assert pool3.closed


def test_a_pool_has_one_live_owner_until_it_releases_it():
    class Owner:
        pass

    a, b = Owner(), Owner()
    with HostPool(num_layers=1, block_size=4, row_width=8, dtype=np.float32,
                  num_blocks=4) as pool:
        assert pool.owner is None
        pool.claim(a)
        pool.claim(a)  # its owner may claim it again
        assert pool.owner is a
        with pytest.raises(ValueError, match=r"HostPool is in use by a live Owner; the rule: one "
                                             r"owner at a time, until it releases the pool"):
            pool.claim(b)
        pool.release(b)  # not the owner: nothing changes
        assert pool.owner is a
        pool.release(a)
        pool.claim(b)
        assert pool.owner is b
        del b  # an owner that is gone holds nothing
        gc.collect()
        assert pool.owner is None
        pool.claim(a)
    with pytest.raises(ValueError, match="HostPool is closed"):
        pool.claim(a)


def test_replace_layer_checks_shape_dtype_and_memory_kind():
    with HostPool(num_layers=1, block_size=4, row_width=8, dtype=np.float32, num_blocks=4) as pool:
        old = pool.layer(0)
        new = jax.device_put(np.ones((4, 4, 8), np.float32), pool.sharding)
        pool.replace_layer(0, new)
        assert old.is_deleted() and pool.layer(0) is new
        with pytest.raises(ValueError, match="in 'pinned_host' memory"):
            pool.replace_layer(0, jax.device_put(np.ones((4, 4, 8), np.float32)))
        with pytest.raises(ValueError, match=r"float32\[4, 4, 8\]"):
            pool.replace_layer(0, jax.device_put(np.ones((4, 4, 4), np.float32), pool.sharding))
        with pytest.raises(ValueError, match=r"layer index must be in \[0, 1\)"):
            pool.replace_layer(1, new)


def test_read_rows_returns_copies_so_the_pool_stays_donatable():
    from host_tier.testing import mirror_rows_reference

    with HostPool(num_layers=1, block_size=2, row_width=4, dtype=np.float32, num_blocks=4) as pool:
        kv = jax.numpy.arange(16, dtype=np.float32).reshape(2, 2, 4)
        rows = pool.read_rows(0, [2, 3])  # must not pin the array with a numpy view
        before = pool.layer(0)
        out = mirror_rows_reference(kv, before, jax.numpy.array([1, 3, -1], np.int32),
                                    jax.numpy.array([2, 7, 5], np.int32))
        assert before.is_deleted(), "donation was blocked: a numpy view of the pool is alive"
        pool.replace_layer(0, out)
        got = pool.read_rows(0, [2, 7, 5])
        np.testing.assert_array_equal(got, [[4, 5, 6, 7], [12, 13, 14, 15], [0, 0, 0, 0]])
        assert not rows.any()
        with pytest.raises(ValueError, match=r"rows must be in \[0, 8\)"):
            pool.read_rows(0, [8])


def test_a_pool_array_written_by_a_jit_is_typed_as_host_memory():
    # A kernel that writes the pool in place returns it through a jit whose out_shardings is
    # the pool's sharding. Its output must be typed as host memory, or the next jit that
    # takes the pool (the decode step) sees a device operand (GPU: the Pallas kernel's output
    # is a device-typed value placed in pinned memory by out_shardings alone).
    from pallas_kernels import _compat

    with HostPool(num_layers=1, block_size=4, row_width=8, dtype="float32",
                  num_blocks=4) as pool:
        fresh = jax.device_put(np.ones(pool.shape, np.float32), jax.devices()[0])
        out = jax.jit(lambda x: x * 2, out_shardings=pool.sharding)(fresh)
        assert out.sharding.memory_kind == "pinned_host"
        assert _compat.in_host_memory(out)
        seen = []
        jax.jit(lambda p: seen.append(_compat.in_host_memory(p)) or p.shape[0])(out)
        assert seen == [True]
        pool.replace_layer(0, out)


def test_from_config_reads_block_size_row_width_kv_dtype_and_num_host_blocks():
    import types

    config = types.SimpleNamespace(block_size=4, row_width=8, kv_dtype=np.dtype("float32"),
                                   num_host_blocks=5, hot_blocks=None, max_model_len=None)
    with HostPool.from_config(config, num_layers=2) as pool:
        assert (pool.num_layers, pool.block_size, pool.row_width) == (2, 4, 8)
        assert pool.num_blocks == 5 and pool.dtype == np.float32
        assert pool.sharding.memory_kind == "pinned_host"
    # A byte budget replaces num_host_blocks (which is then not read).
    budget = 3 * 2 * 4 * 8 * 4 / GIB
    with HostPool.from_config(types.SimpleNamespace(**{**vars(config), "num_host_blocks": None}),
                              num_layers=2, host_pool_gib=budget) as pool:
        assert pool.num_blocks == 3
    with pytest.raises(ValueError, match="HostPool.from_config: config.num_host_blocks is None"):
        HostPool.from_config(types.SimpleNamespace(**{**vars(config), "num_host_blocks": None}),
                             num_layers=2)
    with pytest.raises(ValueError, match="HostPool.from_config: config.row_width is None"):
        HostPool.from_config(types.SimpleNamespace(block_size=4), num_layers=1)
